"""The decoder-only LM family (Llama, Qwen2, Qwen3): one pool, one keyed text label that
grows a row per decode iteration."""

from __future__ import annotations

import numpy as np

from shared.layout import KVLabel, LabelLayout, PagedKVConfig, ProcessPromptOutput, Span
from shared.model import ModelSpec
from shared.model_source import register_model

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class DecoderLMSpec(ModelSpec):
    torch_impl = "services.gpu_worker.models.decoder_lm:DecoderLM"
    pool = "kv"
    decode_loop = "decode_loop"

    def __init__(self, config: dict, *, page_size: int, max_seq_len: int = 0, dtype: str = "float32") -> None:
        self.config = config
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or heads)
        self.head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
        ctx = int(config.get("max_position_embeddings", 2048))
        self.max_seq_len = min(ctx, max_seq_len) if max_seq_len else ctx
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        self._labels = (KVLabel("text", self.pool, keys=True, window=window, grows_on=self.decode_loop),)

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return self._labels

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        return {
            self.pool: PagedKVConfig(
                self.pool, self.num_layers, self.kv_heads, self.head_dim, self.dtype,
                self.page_size, num_pages, self.max_seq_len,
            )
        }

    def graph_loops(self) -> dict[str, int]:
        # Prefill emits the first token, so at most max_seq_len - 1 decode iterations.
        return {self.decode_loop: self.max_seq_len - 1}

    def process_prompt(self, token_ids: list[int]) -> ProcessPromptOutput:
        ids = np.asarray(token_ids, dtype=np.int32)
        layout = LabelLayout(spans=(Span.ids(token_ids),), growth={self.decode_loop: 1})
        return ProcessPromptOutput({"input_ids": ids}, {"text": layout}, {"prompt_len": len(token_ids)})

    def get_loop_caps(self, max_tokens: int) -> dict[str, int]:
        return {self.decode_loop: max(1, max_tokens - 1)}

    def bytes_per_page(self, page_size: int) -> int:
        return self.num_layers * 2 * page_size * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


def _factory(config: dict, **kw) -> DecoderLMSpec:
    return DecoderLMSpec(config, **kw)


for _arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
    register_model(_arch, _factory)
