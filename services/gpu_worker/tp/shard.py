"""Which slice of every checkpoint tensor a tensor-parallel rank holds (Megatron's split, as
vLLM's ColumnParallelLinear / RowParallelLinear / QKVParallelLinear / VocabParallelEmbedding
make it):

- column-parallel (output rows split): q_proj by query heads, k_proj / v_proj by KV heads,
  gate_proj / up_proj by intermediate columns (Phi-3's packed qkv_proj and gate_up_proj
  are cut into the same pieces as they are read);
- row-parallel (input columns split): o_proj and down_proj, summed over the ranks by an
  all-reduce (layers.py); a bias of theirs is rank 0's alone, so the sum adds it once;
- vocab-parallel: the embedding's and the LM head's rows, the vocabulary padded up to a
  multiple of N with zero rows;
- everything else (norms, q/k norms) whole on every rank.

KV heads split where N divides them; where there are fewer KV heads than ranks and N
divides the query heads into whole groups (N a multiple of the KV heads), each KV head is
replicated on the ranks whose query heads read it. Anything else is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared.model_config import ModelConfig
from shared.pages import ceil_div
from shared.specs.base import DeploymentError


@dataclass(frozen=True)
class HeadSplit:
    """One rank's share of a config's heads, MLP columns and vocabulary."""

    rank: int
    size: int
    heads: int  # query heads of the whole model
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int

    @property
    def q_local(self) -> int:
        return self.heads // self.size

    @property
    def kv_local(self) -> int:
        return self.kv_heads // self.size if self.kv_heads % self.size == 0 else 1

    @property
    def kv_first(self) -> int:
        """The first KV head this rank holds (its query heads' group, where replicated)."""
        if self.kv_heads % self.size == 0:
            return self.rank * self.kv_local
        return self.rank * self.kv_heads // self.size

    @property
    def inter_local(self) -> int:
        return self.inter // self.size

    @property
    def vocab_local(self) -> int:
        """Rows of the embedding and head a rank holds (the vocabulary padded to N's multiple)."""
        return ceil_div(self.vocab, self.size)


def split_for(cfg: ModelConfig, rank: int, size: int) -> HeadSplit:
    """This rank's split of `cfg`, or a DeploymentError naming the field that cannot be split."""
    refuse_unsplittable(cfg, size)
    return HeadSplit(rank, size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.intermediate_size, cfg.vocab_size)


def refuse_unsplittable(cfg: ModelConfig, size: int) -> None:
    """A start-up error naming the config field and its value where `size` ranks cannot
    share the model."""
    flag = f"--tensor-parallel-size {size}"
    if cfg.has_experts:
        raise DeploymentError(f"{flag}: tensor parallelism shards dense decoder LMs; {cfg.model_type} has "
                              f"mixture-of-experts layers (num_experts {cfg.num_experts}), which it does not split")
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % size:
        raise DeploymentError(f"{flag}: num_attention_heads {heads} is not a multiple of {size}, "
                              "so the ranks cannot hold whole query heads")
    if kv % size and size % kv:
        raise DeploymentError(f"{flag}: num_key_value_heads {kv} neither divides among {size} ranks nor divides "
                              f"{size} (to be replicated), so a rank's query heads would need part of a KV head")
    if cfg.intermediate_size % size:
        raise DeploymentError(f"{flag}: intermediate_size {cfg.intermediate_size} is not a multiple of {size}")


def local_config(cfg: ModelConfig, split: HeadSplit) -> ModelConfig:
    """The config of one rank's model: its heads, MLP columns and vocabulary rows (the
    modules then take the shard's shapes as they are)."""
    import msgspec

    return msgspec.structs.replace(cfg, num_attention_heads=split.q_local, num_key_value_heads=split.kv_local,
                                   intermediate_size=split.inter_local, vocab_size=split.vocab_local)


#: (name the model loads, dim, start, stop) of one piece read from a checkpoint tensor;
#: dim -1: the whole tensor; "rank0": whole on rank 0, zeros on the others
Piece = tuple[str, int, int, int]
WHOLE, RANK0 = -1, -2

_PROJ = re.compile(r"\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|qkv_proj|sinks)|"
                   r"mlp\.(gate_proj|up_proj|down_proj|gate_up_proj))(\.weight|\.bias)?$")


def pieces(name: str, split: HeadSplit) -> list[Piece]:
    """What this rank reads of checkpoint tensor `name`."""
    s, hd = split, split.head_dim
    q = (s.rank * s.q_local * hd, (s.rank + 1) * s.q_local * hd)
    kv = (s.kv_first * hd, (s.kv_first + s.kv_local) * hd)
    inter = (s.rank * s.inter_local, (s.rank + 1) * s.inter_local)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        start = s.rank * s.vocab_local
        return [(name, 0, start, min(start + s.vocab_local, s.vocab))]
    m = _PROJ.search(name)
    if m is None:
        return [(name, WHOLE, 0, 0)]
    proj, suffix = m.group(2) or m.group(3), m.group(4) or ""
    if proj in ("o_proj", "down_proj"):
        return [(name, 1, *(q if proj == "o_proj" else inter))] if suffix == ".weight" else [(name, RANK0, 0, 0)]
    if proj == "sinks":
        return [(name, 0, s.rank * s.q_local, (s.rank + 1) * s.q_local)]
    if proj == "qkv_proj":  # Phi-3: [q; k; v] rows
        qs, ks = s.heads * hd, s.kv_heads * hd
        base = name.replace("qkv_proj", "{}")
        return [(base.format("q_proj"), 0, *q), (base.format("k_proj"), 0, qs + kv[0], qs + kv[1]),
                (base.format("v_proj"), 0, qs + ks + kv[0], qs + ks + kv[1])]
    if proj == "gate_up_proj":  # Phi-3: [gate; up] rows
        base = name.replace("gate_up_proj", "{}")
        return [(base.format("gate_proj"), 0, *inter), (base.format("up_proj"), 0, s.inter + inter[0],
                                                         s.inter + inter[1])]
    rows = q if proj == "q_proj" else kv if proj in ("k_proj", "v_proj") else inter
    return [(name, 0, *rows)]
