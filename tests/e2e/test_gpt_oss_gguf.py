"""gpt-oss as the Hub ships it (experts in MXFP4 blocks and scales, `quantization_config`
mxfp4: tests/mxfp4.py), served from its folder, and GGUF files as llama.cpp's OWN converter
writes them from that checkpoint, so the file's experts are GGUF MXFP4, the type every
released gpt-oss GGUF has, and the rest float32.

- The file's tensors, read back, are the checkpoint's values bit for bit (MXFP4 times powers
  of two is exact in float32), in transformers' layout (gate and up interleaved again, down
  transposed back, the router and sinks under their names).
- `mstar serve file.gguf` keeps the experts in their MXFP4 blocks (qgemm.c's form 17: a
  token reads its k experts' 4.25 bits a weight) and its greedy tokens equal transformers'
  float32 `generate` on the checkpoint (sliding and full layers, sinks, YaRN, biases, the
  clamped SwiGLU), prompts past the window, one at a time and 4 at once; the pages all come
  back. With `--dtype float32` (the experts dequantized) the same tokens.
- The MXFP4 folder itself (`quantization_config` mxfp4) served: its experts kept in their
  blocks (moved into GGUF's MXFP4 layout at load, services/gpu_worker/mxfp4_weights.py), the
  same tokens; with `--dtype float32` dequantized, the same tokens.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.test_parity import PROMPTS
from tests.llama_converter import convert, converter, smollm2_vocabulary
from tests.mxfp4 import mxfp4_folders
from tests.reference import hf_greedy, hf_ids
from tests.servers import MstarServer


def _gpt_oss_converter() -> bool:
    script = converter()
    return script is not None and (script.parent / "conversion" / "gpt_oss.py").is_file()


pytestmark = pytest.mark.skipif(not _gpt_oss_converter(), reason="llama.cpp's convert_hf_to_gguf.py with gpt-oss "
                                "is not available (scripts/fetch-llama-converter fetches it)")

MAX_TOKENS = 10
#: two sliding (window 8) and two full layers, 8 experts of width 64, 2 a token; hidden 128
#: so the experts' rows are 4 MXFP4 blocks
SHAPE = dict(num_hidden_layers=4, hidden_size=128, intermediate_size=64, num_local_experts=8,
             num_experts_per_tok=2, head_dim=32, sliding_window=8)
LONG = "The quick brown fox jumps over the lazy dog. Serving engines batch requests and page their KV cache. " * 3


class Files(NamedTuple):
    rounded: Path  # the float checkpoint whose experts hold the MXFP4 values (the reference)
    gguf: Path  # the converter's file of the MXFP4 checkpoint
    mx: Path  # the MXFP4 checkpoint (the Hub's form)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    vocab = smollm2_vocabulary(root / "bpe")
    tok = Tokenizer.from_file(str(vocab / "tokenizer.json"))
    eos = tok.token_to_id(json.loads((vocab / "tokenizer_config.json").read_text())["eos_token"])
    ckpt = make_checkpoint(root / "float", "gpt_oss", vocab_size=tok.get_vocab_size(), eos_token_id=eos,
                           bos_token_id=None, pad_token_id=0, **SHAPE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / name).unlink(missing_ok=True)
        shutil.copy(vocab / name, ckpt / name)
    mx, rounded = mxfp4_folders(ckpt, root / "mxfp4", root / "rounded")
    return Files(rounded, convert(mx, root / "gpt-oss-mxfp4.gguf", "f32"), mx)


def test_the_file_holds_the_checkpoint_in_mxfp4(files):
    """The converter wrote the experts as MXFP4 and the rest as float32, and the file read
    back (dequantized) is the checkpoint, every tensor bit for bit, under its HF names."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from services.gpu_worker.gguf_weights import load_gguf_weights
    from shared import gguf_source

    reader = gguf_source._open(files.gguf)
    assert reader.get_field("general.architecture").contents() == "gpt-oss"
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.3.ffn_down_exps.weight"] == "MXFP4"
    assert types["blk.0.attn_q.weight"] == "F32"
    config, state = load_gguf_weights(files.gguf, progress=False)
    assert (config["model_type"], config["num_local_experts"], config["sliding_window"]) == ("gpt_oss", 8, 8)
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["truncate"] is False
    want = load_file(str(files.rounded / "model.safetensors"))
    assert sorted(state) == sorted(want)
    for name, w in want.items():
        assert torch.equal(torch.from_numpy(np.asarray(state[name])), w.float()), name


@pytest.mark.parametrize("form", ["gguf", "folder"])
def test_served_with_mxfp4_experts_equals_transformers(files, tmp_path, form):
    """Greedy tokens of the file (or the MXFP4 folder) served with its experts kept in MXFP4
    blocks (the log says so) equal transformers' on the checkpoint; 4 prompts at once give the
    same; pages back."""
    prompts = [*PROMPTS, LONG]
    want = {p: hf_greedy(files.rounded, hf_ids(files.rounded, p), MAX_TOKENS) for p in prompts}
    server = MstarServer(str(files.gguf if form == "gguf" else files.mx), tmp_path / "log.txt", "--num-kv-pages", "128",
                          env={"MSTAR_KV_DEBUG_ASSERTS": "1"}).start()
    try:
        for prompt in prompts:
            body = _generate(server.url, prompt)
            assert body["usage"]["prompt_tokens"] == len(hf_ids(files.rounded, prompt)), prompt
            assert body["token_ids"] == want[prompt], prompt
        with ThreadPoolExecutor(4) as pool:
            bodies = list(pool.map(lambda p: _generate(server.url, p), prompts[-4:]))
        assert [b["token_ids"] for b in bodies] == [want[p] for p in prompts[-4:]]
        assert server.wait_pages_free() == 0
    finally:
        server.stop()
    log = (tmp_path / "log.txt").read_text()
    assert "experts kept quantized (MXFP4)" in log


@pytest.mark.parametrize("form", ["gguf", "folder"])
def test_served_dequantized_equals_transformers(files, tmp_path, form):
    server = MstarServer(str(files.gguf if form == "gguf" else files.mx), tmp_path / "log.txt", "--num-kv-pages", "128",
                         "--dtype", "float32").start()
    try:
        for prompt in (PROMPTS[0], LONG):
            want = hf_greedy(files.rounded, hf_ids(files.rounded, prompt), MAX_TOKENS)
            assert _generate(server.url, prompt)["token_ids"] == want, prompt
    finally:
        server.stop()


def _generate(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/generate", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                            "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()
