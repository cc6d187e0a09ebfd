"""Qwen3.5 GGUF files as llama.cpp's OWN converter writes them (`convert_hf_to_gguf.py`, architecture
``qwen35``: `tests/llama_converter.py`), served by `mstar serve file.gguf` through the real
services, from a tiny random ``Qwen3_5ForCausalLM`` checkpoint with SmolLM2's vocabulary (a BPE
vocabulary the converter names by its hash) and a multi-token prediction layer, as released
checkpoints have (converted as the converter does by default, into ``blk.N.nextn``; not run):

- f32: greedy tokens equal transformers' on the checkpoint, prompt ids its tokenizer's;
- Q8_0, served quantized (the C kernels on the file's blocks, the CPU's default): greedy
  tokens equal transformers' on a folder of the file's dequantized weights; and the loader's
  kept blocks are the same values as its dequantized tensors, which are the f32 file's
  within Q8_0's rounding (the value heads' reordering undone alike on both);
- where llama-server is built (../shared/peers/install-llama-server): its greedy tokens on
  the f32 file equal transformers' too, and its /tokenize ids equal mstar's on a copy whose
  tokenizer.ggml.pre is Qwen3.5's own ("qwen35": combining marks kept in words; SmolLM2's
  "smollm" is tests/e2e/test_llama_server_tokens.py's).

The shape is one llama.cpp also loads (it takes key and value heads of one size, and a head
of at least the RoPE sections' 32 dims): 2 key heads under 4 value heads (so the converter's
value-head reordering is undone) of 32 (one Q8_0 block: `ssm_out`'s columns move as whole
blocks; tests/unit/test_gguf_qwen35.py has the unaligned case).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import numpy as np
import pytest

from tests.checkpoints import make_checkpoint
from tests.llama_converter import converter, smollm2_vocabulary
from tests.reference import hf_greedy, hf_ids
from tests.servers import MstarServer


def _qwen35_converter() -> bool:
    """The converter is there and writes ``qwen35`` (a copy older than Qwen3.5 does not)."""
    script = converter()
    return script is not None and "Qwen3_5ForCausalLM" in (script.parent / "conversion" / "qwen.py").read_text()


pytestmark = pytest.mark.skipif(not _qwen35_converter(), reason="llama.cpp's convert_hf_to_gguf.py with Qwen3.5 is "
                                "not available (scripts/fetch-llama-converter fetches it)")

PROMPTS = ["The quick brown fox", "Numbers like 12345 and emoji 🎉 and 中文", "def add(a, b):\n    return", "Paris is"]
#: text for /tokenize: what the prompts hold, and combining marks (where "qwen35" splits
#: otherwise than "qwen2")
TEXTS = [*PROMPTS, "Cafe\u0301 nai\u0308ve re\u0301sume\u0301", "नमस्ते दुनिया", "ñ n\u0303 a\u0300b\u0301c", "  x\n\n\ty"]
MAX_TOKENS = 10
SHAPE = dict(head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
             linear_num_value_heads=4, mtp_num_hidden_layers=1)


class Files(NamedTuple):
    ckpt: Path  # the HF checkpoint
    f32: Path  # the converter's f32 file of it
    q8: Path  # its Q8_0 file
    dequantized: Path  # an HF folder of the Q8_0 file's weights, dequantized


def _add_mtp_layer(ckpt: Path) -> None:
    """Random ``mtp.*`` weights (a full-attention layer, its fc and norms), as a released
    checkpoint has: transformers skips them, the converter writes them as ``blk.N.nextn``."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((ckpt / "config.json").read_text())
    hidden, heads, kv, hd, ff = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                  "head_dim", "intermediate_size"))
    shapes = {"fc.weight": (hidden, 2 * hidden), "pre_fc_norm_embedding.weight": (hidden,),
              "pre_fc_norm_hidden.weight": (hidden,), "norm.weight": (hidden,),
              "layers.0.input_layernorm.weight": (hidden,), "layers.0.post_attention_layernorm.weight": (hidden,),
              "layers.0.self_attn.q_proj.weight": (2 * heads * hd, hidden),
              "layers.0.self_attn.k_proj.weight": (kv * hd, hidden),
              "layers.0.self_attn.v_proj.weight": (kv * hd, hidden),
              "layers.0.self_attn.o_proj.weight": (hidden, heads * hd), "layers.0.self_attn.q_norm.weight": (hd,),
              "layers.0.self_attn.k_norm.weight": (hd,), "layers.0.mlp.gate_proj.weight": (ff, hidden),
              "layers.0.mlp.up_proj.weight": (ff, hidden), "layers.0.mlp.down_proj.weight": (hidden, ff)}
    gen = torch.Generator().manual_seed(7)
    state = load_file(str(ckpt / "model.safetensors"))
    state.update({f"mtp.{k}": torch.randn(s, generator=gen) * 0.2 for k, s in shapes.items()})
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


def _convert(ckpt: Path, outs: dict[str, Path]) -> None:
    """`tests.llama_converter.convert` for each out type at once (two processes)."""
    script = converter()
    assert script is not None
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py")}
    env.pop("NO_LOCAL_GGUF", None)
    procs = {t: subprocess.Popen([sys.executable, str(script), str(ckpt), "--outtype", t, "--outfile", str(out)],
                                 env=env, cwd=script.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for t, out in outs.items()}
    for t, proc in procs.items():
        log, _ = proc.communicate(timeout=300)
        if proc.returncode != 0 or not outs[t].is_file():
            raise RuntimeError(f"convert_hf_to_gguf.py --outtype {t} failed:\n{log.decode()[-3000:]}")


def _dequantized_folder(ckpt: Path, gguf_path: Path, out: Path) -> Path:
    """The checkpoint's folder with the GGUF file's weights (dequantized, in HF's form)."""
    import torch
    from safetensors.torch import save_file

    from services.gpu_worker.gguf_weights import load_gguf_weights

    shutil.copytree(ckpt, out)
    _, state = load_gguf_weights(gguf_path, progress=False)
    save_file({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("qwen35-gguf")
    vocab = smollm2_vocabulary(root / "bpe")
    tok = Tokenizer.from_file(str(vocab / "tokenizer.json"))
    eos = tok.token_to_id(json.loads((vocab / "tokenizer_config.json").read_text())["eos_token"])
    ckpt = make_checkpoint(root / "tiny-qwen35", "qwen3_5", vocab_size=tok.get_vocab_size(), eos_token_id=eos,
                           bos_token_id=None, pad_token_id=0, **SHAPE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink(missing_ok=True)
        shutil.copy(vocab / name, ckpt / name)
    _add_mtp_layer(ckpt)
    f32, q8 = root / "tiny-qwen35-f32.gguf", root / "tiny-qwen35-q8_0.gguf"
    _convert(ckpt, {"f32": f32, "q8_0": q8})
    return Files(ckpt, f32, q8, _dequantized_folder(ckpt, q8, root / "tiny-qwen35-q8_0-dequantized"))


def _generate(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/generate", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                            "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


_GREEDY: dict[tuple[Path, str], list[int]] = {}


def _hf_greedy(reference: Path, prompt: str) -> list[int]:
    """transformers' greedy tokens on the prompt, once per folder (two tests ask for them)."""
    key = (reference, prompt)
    if key not in _GREEDY:
        _GREEDY[key] = hf_greedy(reference, hf_ids(reference, prompt), MAX_TOKENS)
    return _GREEDY[key]


def _served_equal_transformers(path: Path, reference: Path, tmp_path: Path) -> None:
    server = MstarServer(str(path), tmp_path / "log.txt", "--num-kv-pages", "128").start()
    try:
        for prompt in PROMPTS:
            ids = hf_ids(reference, prompt)
            body = _generate(server.url, prompt)
            assert body["usage"]["prompt_tokens"] == len(ids), prompt
            assert body["token_ids"] == _hf_greedy(reference, prompt), prompt
        assert server.wait_pages_free() == 0
    finally:
        server.stop()


def test_the_file_is_what_the_converter_writes_of_qwen35(files):
    """The converter's names and metadata this test depends on: qwen35, the nextn layer
    appended, the linear layers' fused and renamed tensors."""
    from shared import gguf_source

    reader = gguf_source._open(files.f32)
    fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("qwen35.")}
    assert reader.get_field("general.architecture").contents() == "qwen35"
    assert fields["qwen35.block_count"] == 5 and fields["qwen35.nextn_predict_layers"] == 1
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_a", "blk.0.ssm_out.weight",
            "blk.3.attn_q.weight", "blk.4.nextn.eh_proj.weight"} <= names


def test_f32_file_serves_transformers_greedy_tokens(files, tmp_path):
    from shared.model_source import ModelSource

    tokenizer = ModelSource(str(files.f32)).tokenizer.tokenizer
    assert [tokenizer.encode(p).ids for p in PROMPTS] == [hf_ids(files.ckpt, p) for p in PROMPTS]
    _served_equal_transformers(files.f32, files.ckpt, tmp_path)


def test_q8_0_weights_are_the_f32_files_within_rounding(files):
    """The Q8_0 file read with its matrices kept quantized (what the quantized server runs
    on) holds the very values of the same file dequantized, and those are the f32 file's
    within Q8_0's rounding: the same tensors in the same (HF) order."""
    import gguf

    from services.gpu_worker.gguf_weights import QuantTensor, load_gguf_weights

    _, f32 = load_gguf_weights(files.f32, progress=False)
    _, deq = load_gguf_weights(files.q8, progress=False)
    _, kept = load_gguf_weights(files.q8, progress=False, keep_quantized=frozenset({"Q8_0"}))
    assert set(f32) == set(deq) == set(kept)
    quantized = {name for name, v in kept.items() if isinstance(v, QuantTensor)}
    assert "model.layers.0.linear_attn.out_proj.weight" in quantized  # its columns moved as whole blocks
    for name, value in kept.items():
        want = np.asarray(deq[name])
        if isinstance(value, QuantTensor):
            value = gguf.quants.dequantize(value.data, gguf.GGMLQuantizationType[value.qtype]).reshape(value.shape)
        assert np.array_equal(value, want), name
        ref = np.asarray(f32[name])
        assert np.abs(want - ref).max() <= 0.01 * max(np.abs(ref).max(), 1e-6), name


def test_q8_0_file_serves_quantized_as_its_dequantized_weights(files, tmp_path):
    _served_equal_transformers(files.q8, files.dequantized, tmp_path)


# llama-server, where the peer build is there


def _llama_server_bin() -> Path | None:
    from bench.llama_server import DEFAULT_BIN

    named = os.environ.get("LLAMA_SERVER_BIN")
    if named:
        return Path(named) if Path(named).is_file() else None
    if DEFAULT_BIN.is_file():
        return DEFAULT_BIN
    built = sorted(DEFAULT_BIN.parents[2].glob("build*/bin/llama-server"))
    return built[0] if built else None


class _LlamaServer:
    """llama-server on one file, one slot (as tests/e2e/test_llama_server_tokens.py runs it)."""

    def __init__(self, binary: Path, model: Path, log: Path) -> None:
        from bench.server import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(log, "wb")
        self.proc = subprocess.Popen([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port",
                                      self.url.rsplit(":", 1)[1], "-np", "1", "-c", "1024", "--no-webui"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"llama-server exited: {log.read_text()[-2000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server not ready"
            time.sleep(0.2)

    def tokenize(self, text: str) -> list[int]:
        r = httpx.post(self.url + "/tokenize", json={"content": text, "add_special": True, "parse_special": True})
        r.raise_for_status()
        return r.json()["tokens"]

    def greedy(self, ids: list[int]) -> list[int]:
        r = httpx.post(self.url + "/completion", json={"prompt": ids, "n_predict": MAX_TOKENS, "temperature": 0,
                                                       "top_k": 1, "return_tokens": True, "cache_prompt": False},
                       timeout=120)
        r.raise_for_status()
        return r.json()["tokens"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def llama_bin() -> Path:
    binary = _llama_server_bin()
    if binary is None:
        pytest.skip("llama-server is not built (../shared/peers/install-llama-server)")
    return binary


def test_llama_server_agrees(files, llama_bin, tmp_path):
    """llama.cpp's own reading of the file: its greedy tokens are transformers' (so mstar's);
    and with tokenizer.ggml.pre "qwen35" (Qwen3.5's own split, which keeps combining marks
    inside words) in place of "smollm", its /tokenize ids are mstar's."""
    import gguf

    from shared.model_source import ModelSource

    path = tmp_path / "tiny-qwen35-pre.gguf"
    shutil.copy(files.f32, path)
    reader = gguf.GGUFReader(path, "r+")
    pre = reader.get_field("tokenizer.ggml.pre")
    assert pre is not None and len("qwen35") == len(pre.contents())  # same length: rewritten in place
    pre.parts[pre.data[0]][:] = np.frombuffer(b"qwen35", dtype=np.uint8)
    del reader, pre
    tokenizer = ModelSource(str(path)).tokenizer.tokenizer
    server = _LlamaServer(llama_bin, path, tmp_path / "llama.log")
    try:
        assert [server.tokenize(t) for t in TEXTS] == [tokenizer.encode(t).ids for t in TEXTS]
        for prompt in PROMPTS:
            assert server.greedy(hf_ids(files.ckpt, prompt)) == _hf_greedy(files.ckpt, prompt), prompt
    finally:
        server.stop()
