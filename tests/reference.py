"""Hugging Face transformers as the reference implementation (tests only)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def hf_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


@functools.cache
def hf_tokenizer(path: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def hf_greedy(path: Path | str, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation, EOS ignored (the tests send ignore_eos)."""
    import torch

    model = hf_model(str(path))
    with torch.no_grad():
        out = model.generate(torch.tensor([input_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(input_ids):].tolist()


def hf_ids(path: Path | str, text: str) -> list[int]:
    return hf_tokenizer(str(path))(text)["input_ids"]


def hf_gguf_model(path: Path | str):
    """transformers' model on a GGUF file in float32 (its own loader: gguf-py's reader and
    dequantization). Its from_pretrained reads the file's header twice, once for the config
    and once for the tensors; gguf-py's reader is handed out once per call here, which on a
    262k-token vocabulary (Gemma 3) was ~40% of the load (~12 s of CI). The same reader,
    the same bytes: only the second parse is gone."""
    import gguf
    import torch
    import transformers

    path = Path(path)
    reader = gguf.GGUFReader
    parsed: dict[str, gguf.GGUFReader] = {}

    def once(file, *args, **kwargs):
        key = str(Path(file).resolve())
        if args or kwargs:
            return reader(file, *args, **kwargs)
        if key not in parsed:
            parsed[key] = reader(file)
        return parsed[key]

    gguf.GGUFReader = once  # transformers imports it from gguf at each load
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)
    finally:
        gguf.GGUFReader = reader
    return model.eval()
