"""BERT-family encoders over paged KV: sentence-transformers' embedding models (a bare
`BertModel`) and cross-encoders (`BertForSequenceClassification`).

Each layer writes its prompt rows' K/V into the request's pages and attends over them
with no causal order (the metadata builder's `causal=False`): the same paged path as the
decoders, so an encoder's request holds pages by its footprint and gives them back as
every request does. Module names follow transformers' (`embeddings.word_embeddings`,
`encoder.layer.N.attention.self.query`, ...), so a checkpoint loads by name; a
classifier's `bert.` prefix is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata, paged_attention, write_kv
from services.gpu_worker.layers.linear import pack_linears, warm_packed
from services.gpu_worker.modeling.base import PoolingModel
from shared.specs.pooling import classifier_labels

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class Embeddings(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], h)
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], h)
        self.token_type_embeddings = nn.Embedding(cfg.get("type_vocab_size", 2), h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.get("layer_norm_eps", 1e-12))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids) + self.token_type_embeddings(types) + self.position_embeddings(positions)
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)


class DenseNorm(nn.Module):
    """A projection back to the hidden size, added to the residual, normalized."""

    def __init__(self, cfg: dict, width: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, cfg["hidden_size"])
        self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-12))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseNorm(cfg, cfg["hidden_size"])
        self.heads = cfg["num_attention_heads"]
        self.head_dim = cfg["hidden_size"] // self.heads
        #: q, k and v as one GEMM (`fuse`, once the weights are in place)
        self.qkv: nn.Module | None = None

    def fuse(self) -> None:
        s = self.self
        qkv = nn.Linear(s.query.in_features, 3 * s.query.out_features, device=s.query.weight.device,
                        dtype=s.query.weight.dtype)
        with torch.no_grad():
            qkv.weight.copy_(torch.cat([s.query.weight, s.key.weight, s.value.weight]))
            qkv.bias.copy_(torch.cat([s.query.bias, s.key.bias, s.value.bias]))
        self.qkv = qkv

    def forward(self, x: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(x).view(t, 3, self.heads, self.head_dim).unbind(1)
        else:
            q = self.self.query(x).view(t, self.heads, self.head_dim)
            k = self.self.key(x).view(t, self.heads, self.head_dim)
            v = self.self.value(x).view(t, self.heads, self.head_dim)
        write_kv(cache, k, v, meta)
        o = paged_attention(q, cache, meta, self.head_dim**-0.5)
        return self.output(o.reshape(t, -1), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])
        self.act = ACTIVATIONS[cfg.get("hidden_act", "gelu")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg, cfg["intermediate_size"])

    def forward(self, x: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata) -> torch.Tensor:
        x = self.attention(x, cache, meta)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))


class Pooler(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["hidden_size"])


class BertModel(PoolingModel):
    def __init__(self, config: dict) -> None:
        super().__init__()
        archs = config.get("architectures") or ["BertModel"]
        self.classifies = archs[0] == "BertForSequenceClassification"
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.pooler: Pooler | None = None
        self.classifier: nn.Linear | None = None
        if self.classifies:
            labels = classifier_labels(config)
            self.pooler = Pooler(config)
            self.classifier = nn.Linear(config["hidden_size"], labels)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = {k.removeprefix("bert."): v for k, v in state.items()}
        state = {k: v for k, v in state.items() if not k.endswith("position_ids")}  # a buffer, not a weight
        if not self.classifies:  # a bare encoder's pooler is sentence-transformers' unused module
            state = {k: v for k, v in state.items() if not k.startswith("pooler.")}
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def prepare(self) -> None:
        """q/k/v fused into one GEMM per layer, and on the CPU every GEMM of the encoder in
        the C kernel's (else oneDNN's) packed layout: a short prompt's step is GEMM-call
        bound, where torch's own float32 linear runs far below the machine's rate."""
        for layer in cast("Iterable[Layer]", self.encoder.layer):
            layer.attention.fuse()
            del layer.attention.self  # the fused copy serves
        if next(self.parameters()).device.type == "cpu":
            pack_linears(self.encoder)

    def warm_gemms(self, max_rows: int, max_sample_rows: int) -> int:
        return warm_packed(self.encoder, max_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                kv_caches: list[torch.Tensor], metas: list[AttnMetadata]) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_types)
        for layer, cache, meta in zip(cast("Iterable[Layer]", self.encoder.layer), kv_caches, metas):
            x = layer(x, cache, meta)
        return x

    def score(self, first_rows: torch.Tensor) -> torch.Tensor:
        """A classifier's logits from each input's first row ([CLS]): pooler, then head."""
        if self.pooler is None or self.classifier is None:
            raise ValueError("this model has no classifier head")
        return self.classifier(torch.tanh(self.pooler.dense(first_rows)))
