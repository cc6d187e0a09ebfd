"""Token sampling for one step: greedy rows in one argmax, the rest per row with each
request's own generator (so a seeded request's tokens do not depend on its batch)."""

from __future__ import annotations

import torch

from shared.frames import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return gen


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> list[int]:
    logits = logits.float().cpu()  # per-request CPU generators: seeded tokens do not depend on the device
    # numpy's argmax: faster than torch's on one thread, and the same ties (the first
    # maximum wins in both)
    out = logits.numpy().argmax(axis=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k and p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            cum = sorted_p.cumsum(0)
            drop = cum - sorted_p > p.top_p  # keep the smallest prefix reaching top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        out[i] = int(torch.multinomial(probs, 1, generator=gens[i]).item())
    return out
