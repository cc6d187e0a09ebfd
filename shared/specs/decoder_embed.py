"""Decoder-based embedding models (Qwen3-Embedding, and any decoder family mstar serves
asked for embeddings): the decoder's layers, causal, each prompt's last row the embedding,
L2-normalized (vLLM's defaults for a causal LM run for embeddings); a sentence-transformers
folder's modules say otherwise where they do.

Chosen for a folder whose `modules.json` has a Pooling module (sentence-transformers saved
it as an embedding model) or when the deployment asks (`--task embed`). The tokenizer's own
post-processor appends what the model pools on (Qwen3-Embedding's `<|endoftext|>`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shared.layout import KVLabel
from shared.model_config import SLIDING, ModelConfig
from shared.specs.base import DeploymentError
from shared.specs.decoder_lm import DecoderLMSpec
from shared.specs.pooling import PoolingSpec


class DecoderEmbedSpec(PoolingSpec, DecoderLMSpec):
    bidirectional = False
    pooling = "last"
    normalize = True

    def __init__(self, config: Mapping[str, Any] | ModelConfig, *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        DecoderLMSpec.__init__(self, config, page_size=page_size, max_seq_len=max_seq_len, dtype=dtype)
        if SLIDING in self.config.layer_types:
            raise DeploymentError("embeddings from a model with sliding-window layers are not supported "
                                  "(its window's pages are released as a long prompt runs)")
        self.heads = self.config.num_attention_heads
        self.dimensions = self.config.hidden_size
        self._labels = (KVLabel(self.label_name, self.pool, keys=False),)

    def parameter_counts(self) -> tuple[int, int] | None:
        """None: the decoder's count would include an LM head an embedder does not use."""
        return None
