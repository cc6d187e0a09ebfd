"""The collectives a sharded decoder's forward takes, put around its modules once
`DecoderLM.prepare` has packed them: the row-parallel layers' all-reduce, the
vocab-parallel embedding's masked lookup and all-reduce, and the vocab-parallel head's
gather of the logits on rank 0.

The one-call C decode stack (`CpuDecodeStack`) runs a whole step's layer loop in C, with
no point between layers where an all-reduce could run, so a rank's model runs its layers
one module at a time (`cpu_stack` off); the C GEMM and attention kernels inside each
module are the same as a one-rank worker's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.tp.group import TpGroup
from services.gpu_worker.tp.shard import HeadSplit


class AllReduced(nn.Module):
    """A row-parallel layer (o_proj, down_proj): this rank's partial product, summed over
    the ranks in place."""

    def __init__(self, inner: nn.Module, group: TpGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    """The rows [start, start + rows) of the embedding table: ids outside them look up
    zeros, and the all-reduce adds the one rank's row that holds each id (exact: every
    other term is zero)."""

    def __init__(self, table: nn.Embedding, start: int, group: TpGroup) -> None:
        super().__init__()
        self.weight = table.weight
        self.start, self.rows = start, table.weight.shape[0]
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(x)


class GatheredHead:
    """The vocab-parallel LM head: this rank's rows of the logits, gathered side by side on
    rank 0 and cut back to the vocabulary (the padding rows dropped)."""

    def __init__(self, local: Callable[[torch.Tensor], torch.Tensor], vocab: int, group: TpGroup) -> None:
        self.local, self.vocab, self.group = local, vocab, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.group.gather_last(self.local(x))
        return logits[..., : self.vocab] if self.group.rank == 0 else logits


def parallelize(model, split: HeadSplit, group: TpGroup) -> None:
    """Put the collectives around a prepared `DecoderLM` shard, and turn its C decode
    stack off (no all-reduce fits inside its one call)."""
    from services.gpu_worker.modeling.decoder.lm import MLP, DecoderLayer

    for layer in cast("Iterable[DecoderLayer]", model.model.layers):
        attn = layer.self_attn
        attn.o_proj = AllReduced(attn.o_proj, group)  # type: ignore[assignment]
        mlp = cast("MLP", layer.mlp)
        mlp.down_proj = AllReduced(mlp.down_proj, group)  # type: ignore[assignment]
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, split.rank * split.vocab_local, group)
    head = model.head
    if head is None:  # CUDA, or no packed form: the plain weight
        weight = model.model.embed_tokens.weight if model.tied else model.lm_head.weight
        head = lambda x: F.linear(x, weight)  # noqa: E731
    object.__setattr__(model, "head", GatheredHead(head, split.vocab, group))
    model.cpu_stack = None
