"""Hybrid linear-attention LMs (Qwen3.5): full-attention layers over paged KV, and Gated
DeltaNet layers whose per-request state is a fixed size.

Labels: "text" (pool "kv", keyed, one row per token, as every decoder's) for the
full-attention layers; "state" (pool "state") for the linear-attention layers. The state
pool is a `PagedKVConfig` with `state_floats` set: each of its pages is one request's whole
state (every linear layer's convolution window and recurrent matrix), and its page size is
the sequence limit, so the footprint formula gives every request exactly one slot however
long it runs: declared, admitted and released like any label (DESIGN.md, "Recurrent
state"). The state label's rows are declared as a rows span, which the prefix cache never
keys by itself: a hit on the "text" label's pages resumes from a snapshot of the state taken
at that page boundary (`with_state_slots` sizes the pool for the snapshots too; the KV
manager's `state_snapshot_rows`, docs/architecture.md "Recurrent state").

Speculative decoding stays off for hybrids (the engine's `speculation` check: the engine
kind is not "decoder"): a rejected draft would have advanced the recurrent state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shared.deferred import deferred
from shared.hybrid_config import LINEAR, HybridConfig, hybrid_parameter_counts, read_hybrid_config
from shared.layout import KVLabel, LabelLayout, PagedKVConfig, ProcessPromptOutput, Span
from shared.model_config import FULL
from shared.specs.base import PromptError, PromptRequest
from shared.specs.decoder_lm import DecoderLMSpec

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

#: state slots a spec declares before the deployment sizes them (`with_state_slots`)
DEFAULT_STATE_SLOTS = 1


class HybridLMSpec(DecoderLMSpec):
    engine = "hybrid_decoder"
    #: the C decode kernels' int8 pages are for the plain decoder's layers
    int8_kv = False
    state_pool = "state"

    def __init__(self, config: Mapping[str, Any] | HybridConfig, *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        cfg = config if isinstance(config, HybridConfig) else read_hybrid_config(config)
        self.hybrid = cfg
        self.config = cfg.attention
        self.vocab_size = cfg.attention.vocab_size
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = cfg.attention.num_hidden_layers
        self.kv_heads = cfg.attention.num_key_value_heads
        self.head_dim = cfg.attention.head_dim
        ctx = cfg.attention.max_position_embeddings
        self.max_seq_len = min(ctx, max_seq_len) if max_seq_len else ctx
        self.window = None
        self.state_slots = DEFAULT_STATE_SLOTS
        labels = []
        if FULL in cfg.layer_types:
            labels.append(KVLabel("text", self.pool, keys=True, grows_on=self.decode_loop))
        if LINEAR in cfg.layer_types:
            labels.append(KVLabel("state", self.state_pool, grows_on=self.decode_loop))
        self._labels = tuple(labels)
        self.layer_labels = ["text" if t == FULL else "state" for t in cfg.layer_types]

    def with_state_slots(self, slots: int) -> HybridLMSpec:
        """The deployment's slot count (one per request that may run at once)."""
        self.state_slots = max(1, slots)
        return self

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        pools = {}
        full = self.layer_labels.count("text")
        if full:
            pools[self.pool] = PagedKVConfig(self.pool, full, self.kv_heads, self.head_dim, self.dtype, self.page_size,
                                             num_pages, self.max_seq_len)
        linear = self.layer_labels.count("state")
        if linear:
            pools[self.state_pool] = PagedKVConfig(self.state_pool, linear, 1, 1, "float32", self.max_seq_len,
                                                   self.state_slots, self.max_seq_len,
                                                   state_floats=self.hybrid.state_floats)
        return pools

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        token_ids = request.token_ids
        layouts = {}
        for lab in self._labels:
            span = Span.ids(token_ids) if lab.keys else Span.rows(len(token_ids))
            layouts[lab.name] = LabelLayout(spans=(span,), growth={self.decode_loop: 1})
        return ProcessPromptOutput({"input_ids": np.asarray(token_ids, dtype=np.int32)}, layouts,
                                   {"prompt_len": len(token_ids)})

    def parameter_counts(self) -> tuple[int, int] | None:
        """From the config (`hybrid_parameter_counts`): the linear layers' projections,
        convolution and decay counted as they are (not as attention layers)."""
        counts = hybrid_parameter_counts(self.hybrid)
        return counts.total, counts.active

    def bytes_per_page(self, page_size: int) -> int:
        """KV bytes of one page of the full-attention pool (the state pool is sized by slots)."""
        return self.paged_pools(1)[self.pool].bytes_per_page if "text" in self.layer_labels else 1


class HybridMoESpec(HybridLMSpec):
    """Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`; its image-text folders are `Qwen35VLSpec`'s):
    the hybrid's labels and state slots as they are; its own class so that the
    gpu worker's registry gives it the model with experts (`modeling/hybrid/qwen3_5_moe.py`)."""


class Qwen3NextSpec(HybridMoESpec):
    """Qwen3-Next (`Qwen3NextForCausalLM`): Qwen3.5-MoE's spec; its model reads the
    checkpoint's fused per-key-head projections (`modeling/hybrid/qwen3_next.py`)."""
