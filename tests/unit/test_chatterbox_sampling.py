"""Chatterbox's sampling warpers (runners/chatterbox.py) equal transformers' on random
logits: `min_p`'s sortless path at p <= 1, and top_p at 1 after min_p dropping nothing more
(the runner skips it there)."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import MinPLogitsWarper, TopPLogitsWarper

from services.gpu_worker.runners.chatterbox import min_p, top_p


def _logits(g: torch.Generator, i: int) -> torch.Tensor:
    scores = torch.randn(1, 8194, generator=g) * float(1 + 40 * torch.rand(1, generator=g))
    if i % 3 == 0:
        scores[0, :4] = scores.max()  # ties at the top
    return scores


def test_min_p_equals_transformers():
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for i in range(60):
        scores = _logits(g, i)
        for p in (1e-6, 0.05, 0.5, 1.0):
            assert torch.equal(min_p(scores, p), MinPLogitsWarper(p)(ids, scores.clone())), (i, p)


def test_top_p_at_one_after_min_p_drops_nothing():
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for i in range(60):
        kept = min_p(_logits(g, i), 0.05)
        assert torch.equal(top_p(kept, 1.0), kept)
        assert torch.equal(TopPLogitsWarper(1.0)(ids, kept.clone()), kept)
