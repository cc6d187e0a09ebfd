"""Hub ids (`org/name`) resolve from the local Hugging Face cache only, never a download:
a cache built by hand under HF_HOME, read in a subprocess (huggingface_hub reads HF_HOME
at import), online and with HF_HUB_OFFLINE=1 alike."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from shared.hub import is_hub_id
from tests.checkpoints import make_checkpoint
from tests.servers import REPO, service_env

COMMIT = "0123456789abcdef0123456789abcdef01234567"

# Prints, per model name given, ModelSource's kind / path / served name or its error.
PROBE = """
import json, sys
from shared.model_source import ModelSource
out = {}
for name in sys.argv[1:]:
    try:
        src = ModelSource(name)
        out[name] = {"kind": src.kind, "path": str(src.path), "name": src.name}
    except Exception as exc:
        out[name] = {"error": type(exc).__name__, "message": str(exc)}
print(json.dumps(out))
"""


def make_hub_cache(home, repo_id: str, src) -> object:
    """`<home>/hub/models--org--name/{refs/main, snapshots/<commit>/...}`, as
    `huggingface-cli download` leaves it (real files rather than blob links)."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(src, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama")
    home = tmp_path_factory.mktemp("hf_home")
    make_hub_cache(home, "org/name", ckpt)
    return home


def probe(home, *names: str, offline: str, cwd=REPO) -> dict:
    # HF_ENDPOINT points at a closed port: any attempt to reach the Hub would fail loudly.
    env = service_env(HF_HOME=str(home), HF_HUB_OFFLINE=offline, HF_ENDPOINT="http://127.0.0.1:9")
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", PROBE, *names], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_is_hub_id(tmp_path):
    assert is_hub_id("org/name") and is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("gpt2")
    for not_id in ("", "./x", "/abs/folder", "~/x", "a/b/c", "org/na me", "model.gguf", "org/model.gguf",
                   str(tmp_path)):
        assert not is_hub_id(not_id), not_id


@pytest.mark.parametrize("offline", ["0", "1"])
def test_hub_id_resolves_from_the_cache(hub_home, offline):
    got = probe(hub_home, "org/name", offline=offline)["org/name"]
    snapshot = hub_home / "hub" / "models--org--name" / "snapshots" / COMMIT
    assert got == {"kind": "hf", "path": str(snapshot), "name": "org/name"}


@pytest.mark.parametrize("offline", ["0", "1"])
def test_missing_hub_id_names_the_cache_and_the_command(hub_home, offline):
    got = probe(hub_home, "missing/model", offline=offline)["missing/model"]
    assert got["error"] == "DeploymentError", got
    msg = got["message"]
    assert "\n" not in msg
    assert str(hub_home / "hub") in msg
    assert "huggingface-cli download missing/model" in msg


def test_local_path_wins_over_a_hub_id(hub_home, tmp_path):
    """`org/name` that exists relative to the working folder is that folder (as vLLM)."""
    snapshot = hub_home / "hub" / "models--org--name" / "snapshots" / COMMIT
    shutil.copytree(snapshot, tmp_path / "org" / "name")
    got = probe(hub_home, "org/name", "./nope", offline="1", cwd=tmp_path)
    assert got["org/name"] == {"kind": "hf", "path": "org/name", "name": "name"}
    assert got["./nope"]["error"] == "DeploymentError" and "no such local folder" in got["./nope"]["message"]
