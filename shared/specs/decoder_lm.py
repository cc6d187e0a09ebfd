"""The decoder-only LM family (Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3,
Phi-3).

Full-attention layers keep their KV in pool "kv" under the keyed label "text"; sliding-
window layers (Qwen2's `max_window_layers`, Mistral's `sliding_window`, Gemma's
alternation, or an explicit `layer_types`) keep theirs in pool "kv_window" under the
windowed label "window", whose retention releases pages wholly behind the window. Both
labels grow one row per decode iteration. A page holds every layer of its pool, so the two
kinds get separate pools rather than wasting half of every page.

The config is read once, by `shared.model_config.read_model_config`: a field it cannot
honour is refused there, before any worker loads weights. The architectures it serves
(`shared.model_config.ARCHITECTURES`) map to `DecoderLMSpec` in shared/specs/registry.py;
the gpu worker runs it with `services.gpu_worker.modeling.decoder.lm.DecoderLM`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shared.deferred import deferred
from shared.layout import KVLabel, LabelLayout, PagedKVConfig, ProcessPromptOutput, Span, kv_head_bytes
from shared.model_config import FULL, SLIDING, ModelConfig, parameter_counts, read_model_config
from shared.specs.base import ModelSpec, PromptError, PromptRequest

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)


class DecoderLMSpec(ModelSpec):
    int8_kv = True
    pool = "kv"
    window_pool = "kv_window"
    decode_loop = "decode_loop"
    #: how the window label's prompt rows are declared: keyed in the prefix cache only as ids
    window_span_kind = "ids"

    def __init__(self, config: Mapping[str, Any] | ModelConfig, *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        cfg = config if isinstance(config, ModelConfig) else read_model_config(config)
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        ctx = cfg.max_position_embeddings
        self.max_seq_len = min(ctx, max_seq_len) if max_seq_len else ctx
        types = cfg.layer_types
        self.window = cfg.sliding_window
        labels = []
        if FULL in types:
            labels.append(KVLabel("text", self.pool, keys=True, grows_on=self.decode_loop))
        if SLIDING in types:
            labels.append(KVLabel("window", self.window_pool, keys=True, window=self.window,
                                  grows_on=self.decode_loop))
        self._labels = tuple(labels)
        #: the label (and so the pool) each layer's attention reads and writes
        self.layer_labels = ["text" if t == FULL else "window" for t in types]

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return self._labels

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        pools = {}
        for lab in self._labels:
            layers = self.layer_labels.count(lab.name)
            pools[lab.pool] = PagedKVConfig(
                lab.pool, layers, self.kv_heads, self.head_dim, self.dtype, self.page_size, num_pages, self.max_seq_len
            )
        return pools

    def graph_loops(self) -> dict[str, int]:
        # Prefill emits the first token, so at most max_seq_len - 1 decode iterations.
        return {self.decode_loop: self.max_seq_len - 1}

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        token_ids = request.token_ids
        ids = np.asarray(token_ids, dtype=np.int32)
        layouts = {}
        for lab in self._labels:
            keyed = lab.name == "text" or self.window_span_kind == "ids"
            span = Span.ids(token_ids) if keyed else Span.rows(len(token_ids))
            layouts[lab.name] = LabelLayout(spans=(span,), growth={self.decode_loop: 1})
        return ProcessPromptOutput({"input_ids": ids}, layouts, {"prompt_len": len(token_ids)})

    def get_loop_caps(self, max_tokens: int, prompt_len: int | None = None) -> dict[str, int]:
        return {self.decode_loop: max(1, max_tokens - 1)}

    def parameter_counts(self) -> tuple[int, int] | None:
        """From the config (`shared.model_config.parameter_counts`): a mixture of experts'
        total counts every expert, its active count the router and the top-k experts."""
        counts = parameter_counts(self.config)
        return counts.total, counts.active

    def bytes_per_page(self, page_size: int) -> int:
        return self.num_layers * 2 * page_size * self.kv_heads * kv_head_bytes(self.dtype, self.head_dim)

