"""The deployment settings are written once (the `Deployment` struct and its help table):
every field is a flag of every service, an env var and a key of `--deployment`, and what
the launcher hands its children parses back to the same `Deployment`."""

from __future__ import annotations

import argparse
import importlib

import msgspec
import pytest

from shared.config import (
    DEPLOYMENT_HELP,
    Deployment,
    add_deployment_flags,
    deployment_argv,
    deployment_from_args,
    field_env,
    field_flag,
)

#: a valid value different from the default, for every field
OTHER = {
    "model": "/models/some-model",
    "page_size": 32,
    "num_kv_pages": 123,
    "kv_memory_fraction": 0.25,
    "max_seq_len": 777,
    "max_num_seqs": 7,
    "max_batch_tokens": 96,
    "dtype": "bfloat16",
    "kv_cache_dtype": "float16",
    "prefill_dtype": "quantized",
    "admission": "max-seq-len",
    "prefix_cache": False,
    "speculative_k": 4,
    "speculative_ngram_max": 5,
    "speculative_ngram_min": 1,
    "itl_target_ms": 12.5,
    "queue_timeout_s": 7.5,
    "task": "embed",
    "tensor_parallel_size": 2,
}
SERVICES = ("conductor", "gpu_worker", "data_worker")


@pytest.fixture(autouse=True)
def _no_deployment_env(monkeypatch):
    for f in msgspec.structs.fields(Deployment):
        monkeypatch.delenv(field_env(f.name), raising=False)
    monkeypatch.delenv("MSTAR_DEPLOYMENT", raising=False)


def _parse(argv: list[str], service: str = "conductor") -> Deployment:
    parser = importlib.import_module(f"services.{service}.__main__").build_parser()
    return deployment_from_args(parser.parse_args(argv))


def test_every_field_is_described_and_the_table_names_no_other():
    assert set(OTHER) == {f.name for f in msgspec.structs.fields(Deployment)} == set(DEPLOYMENT_HELP)
    assert all(OTHER[f.name] != f.default for f in msgspec.structs.fields(Deployment))


@pytest.mark.parametrize("service", SERVICES)
def test_argv_round_trips_every_field(service):
    d = Deployment(**OTHER)
    assert _parse(deployment_argv(d), service) == d
    assert _parse(deployment_argv(Deployment()), service) == Deployment()


@pytest.mark.parametrize("name", sorted(OTHER))
def test_each_flag_alone_sets_its_field(name):
    value = OTHER[name]
    if isinstance(value, bool):
        argv = [("--" if value else "--no-") + name.replace("_", "-")]
    else:
        argv = [field_flag(name), str(value)]
    assert getattr(_parse(argv), name) == value
    # ...and its env var too, when no flag is given
    raw = ("1" if value else "0") if isinstance(value, bool) else str(value)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(field_env(name), raw)
        assert getattr(_parse([]), name) == value


def test_precedence_flag_over_deployment_over_env(monkeypatch):
    monkeypatch.setenv("MSTAR_PAGE_SIZE", "64")
    monkeypatch.setenv("MSTAR_MAX_NUM_SEQS", "3")
    assert _parse([]).page_size == 64
    # the one value the launcher hands a child wins over the child's inherited env vars...
    d = _parse(["--deployment", '{"page_size": 8}'])
    assert (d.page_size, d.max_num_seqs) == (8, 3)
    # ...and a flag given with it wins over both
    assert _parse(["--deployment", '{"page_size": 8}', "--page-size", "128"]).page_size == 128
    monkeypatch.setenv("MSTAR_DEPLOYMENT", '{"page_size": 4, "max_num_seqs": 9}')
    d = _parse([])
    assert (d.page_size, d.max_num_seqs) == (4, 9)
    assert _parse(["--deployment", '{"max_num_seqs": 2}']).max_num_seqs == 2  # the flag over the env


@pytest.mark.parametrize("argv, message", [
    (["--deployment", '{"page_sise": 8}'], "unknown field"),
    (["--deployment", "[1]"], "JSON object"),
    (["--deployment", "{"], "not valid JSON"),
    (["--deployment", '{"page_size": "8"}'], "Expected `int`"),
    (["--page-size", "3"], "power of two"),
])
def test_a_bad_deployment_exits_with_its_reason(argv, message):
    with pytest.raises(SystemExit) as info:
        _parse(argv)
    assert message in str(info.value) and str(info.value).startswith("invalid deployment")


def test_a_bad_env_value_exits_with_its_reason(monkeypatch):
    monkeypatch.setenv("MSTAR_PREFIX_CACHE", "maybe")
    with pytest.raises(SystemExit, match="MSTAR_PREFIX_CACHE='maybe' is not a boolean"):
        _parse([])


def test_every_flag_help_shows_its_default_and_env_var():
    parser = argparse.ArgumentParser()
    add_deployment_flags(parser)
    by_dest = {a.dest: a for a in parser._actions}
    for f in msgspec.structs.fields(Deployment):
        help_text = by_dest[f.name].help
        shown = str(f.default).lower() if isinstance(f.default, bool) else ('""' if f.default == "" else f.default)
        assert f"default: {shown};" in help_text and f"env {field_env(f.name)})" in help_text, help_text
    assert "env MSTAR_DEPLOYMENT" in by_dest["deployment"].help


def test_the_api_takes_its_model_from_the_deployment():
    parser = importlib.import_module("services.api.__main__").build_parser()
    d = Deployment(**OTHER)
    assert deployment_from_args(parser.parse_args(deployment_argv(d))).model == d.model
    assert deployment_from_args(parser.parse_args(["--model", "x"])).model == "x"


def test_the_launcher_hands_every_child_the_same_deployment():
    from services.launcher import build_parser, plan_children

    args = build_parser().parse_args(["serve", "/m", "--page-size", "32", "--no-prefix-cache"])
    d = deployment_from_args(args)
    assert (d.model, d.page_size, d.prefix_cache) == ("/m", 32, False)
    for child in plan_children(d, "/run", "127.0.0.1", 8000, 2, []):
        service = child.argv[2].removeprefix("services.")
        parser = importlib.import_module(f"services.{service}.__main__").build_parser()
        got = deployment_from_args(parser.parse_args(child.argv[3:]))
        assert got == d if service != "api" else got.model == d.model
