"""Several models behind one `mstar serve --models-dir` (issue 57, llama-server's router
mode): a tiny text model, a tiny embedding model and a tiny Whisper from one folder.

- three models, all loaded: interleaved concurrent requests each equal their own model's
  reference (transformers' greedy tokens, its normalized last hidden state, its greedy
  Whisper tokens); `/v1/models` lists every model with its task; an unknown model is a 404
  `model_not_found` (a WebSocket's handshake too); pages back to zero, every process gone at the end;
- two models under `--models-max 1`, the text model there as a .gguf file (named by its
  stem; the same weights, written as llama.cpp's converter writes them): interleaved
  concurrent requests swap the models under load (the least recently used one's gpu worker
  stops) and none is lost, the GGUF file's greedy tokens equal to transformers' on the
  folder it was written from; `POST /models/unload` and `/models/load` as llama-server's router.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets
import websockets.sync.client

from tests.checkpoints import make_checkpoint
from tests.gguf_files import write_gguf
from tests.reference import hf_greedy
from tests.servers import MstarServer
from tests.whisper_checkpoints import make_whisper_checkpoint, sine_sweep, wav_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_TOKENS = 6
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 3, 9], [7, 7, 7, 7, 7]]
EMBED_INPUTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3]]


def make_embedder(folder: Path) -> Path:
    """A Qwen3-Embedding-shaped folder: the bare model's weights and sentence-transformers'
    modules (last-token pooling, normalized), as tests/unit/test_pooling_engine.py makes it."""
    from safetensors.torch import load_file, save_file

    make_checkpoint(folder, "qwen3", seed=1)
    state = load_file(str(folder / "model.safetensors"))
    save_file({k.removeprefix("model."): v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
              str(folder / "model.safetensors"))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    return folder


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    make_checkpoint(root / "chat", "llama")
    make_embedder(root / "embed")
    make_whisper_checkpoint(root / "whisper")
    (root / "notes.txt").write_text("not a model")  # skipped
    return root


@pytest.fixture(scope="module")
def pair_dir(models_dir, tmp_path_factory) -> Path:
    """The text model as a GGUF file and the embedding model (a link to its folder)."""
    root = tmp_path_factory.mktemp("pair")
    write_gguf(models_dir / "chat", root / "chat-gguf.gguf", "llama", "gpt2")
    (root / "embed").symlink_to(models_dir / "embed")
    return root


@pytest.fixture(scope="module")
def servers(models_dir, pair_dir, tmp_path_factory):
    """Both servers start together (their start-ups overlap), torn down together."""
    logs = tmp_path_factory.mktemp("logs")
    env = {"MSTAR_KV_DEBUG_ASSERTS": "1"}
    three = MstarServer("", logs / "three.log", "--num-kv-pages", "64", env=env)
    three.argv[three.argv.index("--model"):three.argv.index("--model") + 2] = ["--models-dir", str(models_dir)]
    one = MstarServer("", logs / "one.log", "--num-kv-pages", "64", "--models-max", "1", "--queue-timeout-s", "120",
                      env=env)
    one.argv[one.argv.index("--model"):one.argv.index("--model") + 2] = ["--models-dir", str(pair_dir)]
    three.launch()
    one.launch()
    try:
        yield three.wait_ready(), one.wait_ready()
    finally:
        for srv in (three, one):
            srv.stop()


@pytest.fixture(scope="module")
def refs(models_dir) -> dict:
    """Every request's reference, computed once (while the servers start)."""
    from tests.e2e.test_audio import Reference

    embedder = transformers.AutoModel.from_pretrained(models_dir / "embed").eval()
    with torch.no_grad():
        vecs = [torch.nn.functional.normalize(embedder(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1).numpy()
                for ids in EMBED_INPUTS]
    clip = wav_bytes(sine_sweep(2.0, sr=16000, f0=300.0), 16000, "WAV")
    return {"text": [hf_greedy(models_dir / "chat", p, MAX_TOKENS) for p in PROMPTS], "embed": vecs,
            "clip": clip, "whisper": Reference(models_dir / "whisper").tokens(clip, MAX_TOKENS)}


def complete(url: str, i: int) -> list[int]:
    """/generate names no model: the default one (the first by name: `chat`, or the pair's
    `chat-gguf`)."""
    r = httpx.post(url + "/generate", json={"input_ids": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0,
                                            "ignore_eos": True}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def embed(url: str, i: int) -> np.ndarray:
    r = httpx.post(url + "/v1/embeddings", json={"model": "embed", "input": EMBED_INPUTS[i],
                                                "encoding_format": "float"}, timeout=180)
    assert r.status_code == 200, r.text
    return np.array(r.json()["data"][0]["embedding"], dtype=np.float32)


def transcribe(url: str, clip: bytes) -> list[int]:
    r = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("clip.wav", clip)},
                   data={"model": "whisper", "response_format": "verbose_json", "max_tokens": str(MAX_TOKENS)},
                   timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["segments"][0]["tokens"]


def check_all(url: str, refs: dict, kinds: tuple[str, ...], rounds: int = 1) -> None:
    """Every kind's requests at once, interleaved, each equal to its own model's reference."""
    jobs = []
    for _ in range(rounds):
        for i in range(max(len(PROMPTS), len(EMBED_INPUTS))):
            if "text" in kinds and i < len(PROMPTS):
                jobs.append(("text", i))
            if "embed" in kinds and i < len(EMBED_INPUTS):
                jobs.append(("embed", i))
            if "whisper" in kinds and i == 0:
                jobs.append(("whisper", 0))

    def run(job):
        kind, i = job
        if kind == "text":
            return complete(url, i)
        return embed(url, i) if kind == "embed" else transcribe(url, refs["clip"])

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (kind, i), got in zip(jobs, results):
        if kind == "embed":
            np.testing.assert_allclose(got, refs["embed"][i], rtol=1e-5, atol=1e-6)
        else:
            want = refs["text"][i] if kind == "text" else refs["whisper"]
            assert got == want, (kind, i)


def models(url: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(url + "/models", timeout=10).json()["data"]}


def wait_status(url: str, name: str, want: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while models(url)[name]["status"]["value"] != want:
        assert time.monotonic() < deadline, models(url)
        time.sleep(0.2)


def gpu_workers(srv: MstarServer) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "-P", str(srv.proc.pid), "services.gpu_worker"], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def test_three_models_interleaved_equal_their_references(servers, refs):
    three, _ = servers
    check_all(three.url, refs, ("text", "embed", "whisper"))
    assert three.wait_pages_free() == 0
    # metrics per model: each series carries its model's name
    assert three.metric("mstar_requests_total", '{model_name="embed",status="ok"}') == len(EMBED_INPUTS)
    assert three.metric("mstar_requests_total", '{model_name="chat",status="ok"}') == len(PROMPTS)
    for name in ("chat", "embed", "whisper"):
        assert three.metric("mstar_kv_pages_total", f'{{model_name="{name}"}}') > 0
        assert three.metric("mstar_ready_workers", f'{{model_name="{name}"}}') == 1


def test_v1_models_lists_every_model_with_its_task(servers):
    three, _ = servers
    cards = httpx.get(three.url + "/v1/models", timeout=10).json()["data"]
    assert {c["id"]: c["task"] for c in cards} == {"chat": "generate", "embed": "embed", "whisper": "generate"}
    assert httpx.get(three.url + "/v1/models/embed", timeout=10).json()["task"] == "embed"
    # by name, the text model's completions are /generate's (the default model's) text
    r = httpx.post(three.url + "/v1/completions", json={"model": "chat", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "ignore_eos": True}, timeout=60)
    g = httpx.post(three.url + "/generate", json={"input_ids": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == g.json()["text"]
    assert {n: m["status"]["value"] for n, m in models(three.url).items()} == {
        "chat": "loaded", "embed": "loaded", "whisper": "loaded"}


def test_unknown_model_is_404_model_not_found(servers):
    three, _ = servers
    for path, body in (("/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}),
                       ("/v1/embeddings", {"model": "nope", "input": "hi"}),
                       ("/models/load", {"model": "nope"})):
        r = httpx.post(three.url + path, json=body, timeout=30)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "`chat`, `embed`, `whisper`" in err["message"]
    assert httpx.get(three.url + "/v1/models/nope", timeout=10).status_code == 404
    with pytest.raises(websockets.InvalidStatus) as info:  # the handshake is refused the same way
        websockets.sync.client.connect(three.url.replace("http://", "ws://") + "/generate/ws?model=nope")
    assert info.value.response.status_code == 404
    assert json.loads(info.value.response.body)["error"]["code"] == "model_not_found"
    # a route of another task is the model's own 400, naming its task
    r = httpx.post(three.url + "/v1/embeddings", json={"model": "chat", "input": "hi"}, timeout=30)
    assert r.status_code == 400 and "generate" in r.json()["error"]["message"]


def test_models_max_one_swaps_under_load_losing_nothing(servers, refs):
    _, one = servers
    check_all(one.url, refs, ("text", "embed"))  # the text requests: the GGUF file's (the default model)
    states = {n: m["status"]["value"] for n, m in models(one.url).items()}
    assert sorted(states) == ["chat-gguf", "embed"]
    assert sorted(states.values()) == ["loaded", "unloaded"], states
    log = one.log()
    assert "stopping (model" in log and "starting (model" in log
    assert len(gpu_workers(one)) <= 1
    assert one.wait_pages_free() == 0


def test_load_and_unload_as_llama_server(servers, refs):
    _, one = servers
    loaded = next(n for n, m in models(one.url).items() if m["status"]["value"] == "loaded")
    other = next(n for n in ("chat-gguf", "embed") if n != loaded)
    r = httpx.post(one.url + "/models/load", json={"model": other}, timeout=30)
    assert r.status_code == 200 and r.json() == {"success": True}
    wait_status(one.url, other, "loaded")
    assert models(one.url)[loaded]["status"]["value"] == "unloaded"
    assert httpx.post(one.url + "/models/unload", json={"model": other}, timeout=30).json() == {"success": True}
    wait_status(one.url, other, "unloaded")
    deadline = time.monotonic() + 20
    while gpu_workers(one):  # its process stops too: none runs now
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert httpx.post(one.url + "/models/unload", json={"model": "nope"}, timeout=30).status_code == 404


def test_processes_cleaned_up(servers):
    three, _ = servers
    kids = three.children()
    assert len(kids) == 1 + 3 + 3 + 1  # conductor, a data worker and a gpu worker per model, api
    three.stop()
    for pid in kids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
