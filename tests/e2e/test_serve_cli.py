"""`mstar serve MODEL` the way `vllm serve` takes it, through real processes: a Hub id from
the local cache (HF_HOME, HF_HUB_OFFLINE=1; nothing downloaded) served under its id or
under --served-model-name, a checkpoint whose chat template is the list-of-named-templates
form, --chat-template FILE; and refusals (a Hub id not in the cache, an unsupported
architecture, a missing template file) as one line before any child starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from tokenizers import Tokenizer

from services.api.chat_template import ChatTemplate
from services.launcher import build_parser
from tests.checkpoints import CHAT_TEMPLATE, make_checkpoint, with_architecture
from tests.servers import MstarServer, serve_until_exit
from tests.unit.test_hub import COMMIT, make_hub_cache

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
TOOL_USE = "{{ raise_exception('the tool_use template was picked') }}"
OVERRIDE = "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}[ASSISTANT]"
REFUSAL_S = 60.0  # generous on a loaded 2-core box; a refusal takes a few seconds (one torch import)


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """HF_HOME with `org/name` cached: a tiny llama whose tokenizer_config.json has the
    list form of chat templates (default + tool_use)."""
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama")
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": TOOL_USE}, {"name": "default", "template": CHAT_TEMPLATE}]
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    home = tmp_path_factory.mktemp("hf_home")
    make_hub_cache(home, "org/name", ckpt)
    return home


def hub_env(home) -> dict[str, str]:
    # HF_ENDPOINT points at a closed port: any attempt to reach the Hub would fail loudly.
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9",
            "HF_HUB_CACHE": str(home / "hub")}


def serve(home, log_path, *argv: str) -> MstarServer:
    """`mstar serve <argv>` (MODEL positional, not --model) with the hand-made cache."""
    server = MstarServer("", log_path, env=hub_env(home))
    server.argv = [sys.executable, "-m", "services.launcher", "serve", *argv, "--port", str(server.port),
                   "--num-kv-pages", "64", "--page-size", "4"]
    return server.start()


def snapshot(home):
    return home / "hub" / "models--org--name" / "snapshots" / COMMIT


def prompt_tokens(home, template: str) -> int:
    tok = Tokenizer.from_file(str(snapshot(home) / "tokenizer.json"))
    return len(tok.encode(ChatTemplate(template).render(MESSAGES), add_special_tokens=False).ids)


def chat(server, model: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0})


@pytest.fixture(scope="module")
def hub_server(hub_home, tmp_path_factory):
    server = serve(hub_home, tmp_path_factory.mktemp("logs") / "hub.log", "org/name")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def renamed_server(hub_home, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("renamed")
    (tmp / "override.jinja").write_text(OVERRIDE)
    server = serve(hub_home, tmp / "renamed.log", "org/name", "--served-model-name", "my-model",
                   "--chat-template", str(tmp / "override.jinja"))
    yield server
    server.stop()


def test_hub_id_positional(hub_server, hub_home):
    models = httpx.get(hub_server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["org/name"]
    # The list form of chat templates serves chat, with the one named "default".
    r = chat(hub_server, "org/name")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "org/name"
    assert body["usage"]["prompt_tokens"] == prompt_tokens(hub_home, CHAT_TEMPLATE)


def test_served_model_name_and_chat_template_file(renamed_server, hub_home):
    models = httpx.get(renamed_server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["my-model"]
    r = chat(renamed_server, "org/name")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = httpx.post(renamed_server.url + "/v1/completions", json={"model": "org/name", "prompt": "Hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 404, r.text
    r = chat(renamed_server, "my-model")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "my-model"
    # --chat-template FILE replaced the checkpoint's template.
    assert (r.json()["usage"]["prompt_tokens"] == prompt_tokens(hub_home, OVERRIDE)
            != prompt_tokens(hub_home, CHAT_TEMPLATE))


def refused(argv: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    """`mstar serve <argv>` that must not start: its exit and how long it took."""
    started = time.monotonic()
    out = serve_until_exit(*argv, env=env, timeout=REFUSAL_S * 2)
    return out, time.monotonic() - started


def one_line(out: subprocess.CompletedProcess) -> str:
    """All the launcher said: one line on stderr, nothing from any child (their log lines
    name the service, e.g. `conductor[pid]`), nothing on stdout."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and not out.stdout.strip(), (out.stdout, out.stderr)
    return lines[0]


def test_missing_hub_id_is_refused_naming_the_cache(hub_home):
    out, took = refused(["missing/model"], hub_env(hub_home))
    line = one_line(out)
    assert out.returncode == 2 and took < REFUSAL_S, (out.returncode, took)
    assert line.startswith("mstar: deployment refused: ")
    assert str(hub_home / "hub") in line and "huggingface-cli download missing/model" in line


def test_unsupported_architecture_is_refused_before_any_child(hub_home, tmp_path):
    foo = with_architecture(snapshot(hub_home), tmp_path / "foo", "FooForCausalLM")
    out, took = refused(["--model", str(foo)], hub_env(hub_home))
    line = one_line(out)
    assert out.returncode == 2 and took < REFUSAL_S, (out.returncode, took)
    assert line.startswith("mstar: deployment refused: ") and "FooForCausalLM" in line


@pytest.mark.parametrize(("field", "value", "named"), [
    ("rope_scaling", {"rope_type": "mrope", "factor": 2.0}, "config.json rope_type='mrope'"),
    ("hidden_act", "relu2", "config.json hidden_act='relu2'"),
    ("partial_rotary_factor", 0.5, "config.json partial_rotary_factor=0.5"),
])
def test_unsupported_config_field_is_refused_before_any_child(hub_home, tmp_path, field, value, named):
    """A checkpoint whose config asks for math mstar does not implement never reaches a
    worker: one line naming the field and its value, exit 2, no weights loaded."""
    import json
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(snapshot(hub_home), ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[field] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out, took = refused([str(ckpt)], hub_env(hub_home))
    line = one_line(out)
    assert out.returncode == 2 and took < REFUSAL_S, (out.returncode, took)
    assert line.startswith("mstar: deployment refused: ") and named in line, line


def test_missing_chat_template_file_is_refused(hub_home, tmp_path):
    out, _ = refused(["org/name", "--chat-template", str(tmp_path / "nope.jinja")], hub_env(hub_home))
    assert out.returncode == 2
    assert one_line(out) == (f"mstar: deployment refused: chat template file {tmp_path / 'nope.jinja'}: "
                             "No such file or directory")


def test_model_positional_and_flag(monkeypatch, capsys):
    parser = build_parser()
    assert parser.parse_args(["serve", "org/name"]).model == "org/name"
    assert parser.parse_args(["serve", "--port", "1", "org/name"]).model == "org/name"
    assert parser.parse_args(["serve", "--model", "org/name"]).model == "org/name"
    assert parser.parse_args(["serve", "--model", "a/b", "a/b"]).model == "a/b"  # the same twice is fine
    assert parser.parse_args(["serve"]).model is None  # main() then takes MSTAR_MODEL, else the default
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["serve", "--model", "a/b", "c/d"])
    assert info.value.code == 2 and "give MODEL or --model, not both" in capsys.readouterr().err


def test_the_preflight_check_runs_in_a_child_and_reports_its_crash(monkeypatch, capsys):
    """The check runs in a forked child (its imports stay out of the supervising launcher):
    a refusal comes back as the reason, a crash of the check itself as one line (its
    traceback on stderr), and the launcher never imports what the check needs."""
    from services import launcher
    from shared.config import Deployment

    monkeypatch.setattr(launcher, "_check", lambda d, t: "config.json hidden_act='relu2' is not supported")
    assert launcher.preflight(Deployment(model="m"), None) == "config.json hidden_act='relu2' is not supported"
    monkeypatch.setattr(launcher, "_check", lambda d, t: None)
    assert launcher.preflight(Deployment(model="m"), None) is None

    def crash(d, t):
        raise RuntimeError("boom")

    monkeypatch.setattr(launcher, "_check", crash)
    assert launcher.preflight(Deployment(model="m"), None) == \
        "the deployment check itself failed (its traceback is above)"
    out = subprocess.run([sys.executable, "-c", "import sys\nfrom services import launcher\n"
                          "from shared.config import Deployment\n"
                          "launcher.preflight(Deployment(model=''), None)\n"
                          "print(sorted(m for m in ('numpy', 'tokenizers') if m in sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
