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
