"""CLI hygiene: every flag of every service's parser and of `mstar serve` / `mstar check`
says in its help what its default is and which MSTAR_* env var sets it, and that env var is
one the code reads."""

from __future__ import annotations

import argparse
import re

import pytest

from tests.deploy_checks import parser_for, settings_read

MODULES = ["services.api", "services.data_worker", "services.conductor", "services.gpu_worker"]


def _parsers() -> dict[str, argparse.ArgumentParser]:
    found = {m: parser_for(m) for m in MODULES}
    launcher = parser_for("services.launcher")
    sub = next(a for a in launcher._actions if isinstance(a, argparse._SubParsersAction))
    found.update({f"mstar {name}": p for name, p in sub.choices.items()})
    return found


@pytest.mark.parametrize("name", [*MODULES, "mstar serve", "mstar check"])
def test_every_flag_shows_its_default_and_env_var(name):
    parser = _parsers()[name]
    read = settings_read()
    missing = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        text = " ".join((action.help or "").split())
        envs = re.findall(r"\benv (MSTAR_[A-Z0-9_]+)", text)
        label = "/".join(action.option_strings) or action.dest
        if "default" not in text.lower() or not envs:
            missing.append(f"{label}: {text!r}")
        missing += [f"{label}: {env} is not read by the code" for env in envs if env not in read]
    assert not missing, "\n".join(missing)


def test_serve_honours_api_host_and_port(monkeypatch):
    monkeypatch.setenv("MSTAR_API_HOST", "0.0.0.0")
    monkeypatch.setenv("MSTAR_API_PORT", "9123")
    args = parser_for("services.launcher").parse_args(["serve"])
    assert (args.host, args.port) == ("0.0.0.0", 9123)
    assert parser_for("services.launcher").parse_args(["serve", "--port", "80"]).port == 80
