"""Pooling models: BERT-family encoders as sentence-transformers folders ship them
(embeddings), and cross-encoders (`BertForSequenceClassification`: scores).

A pooling request is a prompt and no decode loop (DESIGN.md section 3): its footprint is
the prompt's rows, released when its forward ends. The encoder's attention is
bidirectional, so a prompt runs in one step, never in chunks (`whole_prompts`); the
conductor refuses one longer than the model's max length or the step's token budget.

What sentence-transformers decides from the folder is read here, so the worker pools as
`SentenceTransformer.encode` does: `modules.json` lists the modules (a `Normalize` module
normalizes; it has no folder of its own), `1_Pooling/config.json` the pooling mode (mean,
CLS or last token), `sentence_bert_config.json` the max length (256 for all-MiniLM-L6-v2,
not its 512 positions: longer inputs are refused, or cut where the client asks).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from shared.deferred import deferred
from shared.layout import KVLabel, LabelLayout, PagedKVConfig, ProcessPromptOutput, Span, kv_head_bytes
from shared.specs.base import DeploymentError, ModelSpec, PromptError, PromptRequest

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

#: config.json architectures this spec serves: an encoder's hidden states (embeddings),
#: and a classifier head over its pooled first token (scores)
EMBED_ARCHITECTURES = ("BertModel",)
SCORE_ARCHITECTURES = ("BertForSequenceClassification",)
POOLING_MODES = ("mean", "cls", "last")


class PoolingSpec(ModelSpec):
    """What every pooling spec shares: one label "text" in pool "kv", filled by the prompt
    and never grown (no decode loop), and sentence-transformers' folder settings. A
    subclass sets `pooling`, `normalize`, `heads`, `max_seq_len` and the pool's shape."""

    engine = "pooling"
    int8_kv = False  # whole prompts, no decode: int8 pages would only cost accuracy
    task = "embed"
    pool = "kv"
    label_name = "text"
    #: a prompt runs whole, in one step
    whole_prompts = True
    #: attention sees every row of the prompt (an encoder), else causal (a decoder's)
    bidirectional = True
    pooling = "mean"
    heads = 0

    def load_folder(self, path: str | Path) -> Self:
        """sentence-transformers' modules: pooling mode, normalization, max length."""
        path = Path(path)
        modules_file = path / "modules.json"
        if not modules_file.exists():
            return self
        modules = json.loads(modules_file.read_text())
        types = [str(m.get("type", "")) for m in modules]
        self.normalize = any(t.endswith(".Normalize") for t in types)
        for m in modules:
            if str(m.get("type", "")).endswith(".Pooling"):
                cfg = json.loads((path / m.get("path", "") / "config.json").read_text())
                self.pooling = _pooling_mode(cfg)
        st_config = path / "sentence_bert_config.json"
        if st_config.exists():
            limit = json.loads(st_config.read_text()).get("max_seq_length")
            if limit:
                self.max_seq_len = min(self.max_seq_len, int(limit))
        st_model = path / "config_sentence_transformers.json"
        if st_model.exists() and json.loads(st_model.read_text()).get("model_type") == "matryoshka":
            self.matryoshka = True
        return self

    @property
    def step_loops(self) -> tuple[str, ...]:
        return ()  # no decode loop: the prompt's forward is the whole request

    def graph_loops(self) -> dict[str, int]:
        return {}

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        ids = request.token_ids
        if not ids:
            raise PromptError("input", "an input must hold at least one token")
        tensors = {"input_ids": np.asarray(ids, dtype=np.int32)}
        first = request.options.get("pair_start")  # a cross-encoder's second text starts here
        if isinstance(first, int) and not isinstance(first, bool):
            types = np.zeros(len(ids), dtype=np.int32)
            types[first:] = 1
            tensors["token_type_ids"] = types
        layout = LabelLayout(spans=(Span.rows(len(ids)),))
        return ProcessPromptOutput(tensors, {self.label_name: layout}, {"prompt_len": len(ids)})

    def get_loop_caps(self, max_tokens: int, prompt_len: int | None = None) -> dict[str, int]:
        return {}


class EncoderSpec(PoolingSpec):
    """BERT-family encoders: embeddings (a bare `BertModel`) or scores (a classifier)."""

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        arch = (config.get("architectures") or ["BertModel"])[0]
        self.config = dict(config)
        self.task = "score" if arch in SCORE_ARCHITECTURES else "embed"
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise DeploymentError(f"position_embedding_type {config['position_embedding_type']!r} is not "
                                  "supported (only 'absolute')")
        if config.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "relu"):
            raise DeploymentError(f"hidden_act {config['hidden_act']!r} is not supported")
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.head_dim = int(config["hidden_size"]) // self.heads
        self.hidden_size = int(config["hidden_size"])
        self.vocab_size = int(config["vocab_size"])
        self.positions = int(config["max_position_embeddings"])
        self.max_seq_len = min(self.positions, max_seq_len) if max_seq_len else self.positions
        #: how rows become one vector: sentence-transformers' Pooling module, else CLS for a
        #: classifier (its pooler reads the first token) and mean for a bare encoder
        self.pooling = "cls" if self.task == "score" else "mean"
        self.normalize = False
        #: a classifier's labels (its output width); 0 for an embedding model
        self.num_labels = classifier_labels(config) if self.task == "score" else 0
        self.dimensions = self.hidden_size if self.task == "embed" else self.num_labels
        #: Matryoshka-trained models may be cut to fewer dimensions (`dimensions`); others not
        self.matryoshka = False
        self._label = KVLabel(self.label_name, self.pool, keys=False)

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return (self._label,)

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        return {self.pool: PagedKVConfig(self.pool, self.num_layers, self.heads, self.head_dim, self.dtype,
                                         self.page_size, num_pages, self.max_seq_len)}

    def bytes_per_page(self, page_size: int) -> int:
        return self.num_layers * 2 * page_size * self.heads * kv_head_bytes(self.dtype, self.head_dim)


def classifier_labels(config: Mapping[str, Any]) -> int:
    """A sequence classifier's output width: `num_labels`, else its `id2label`'s size, else 1
    (transformers' defaults), as the spec and the torch model both read it."""
    return int(config.get("num_labels", len(config.get("id2label", {}) or {}) or 1))


def _pooling_mode(cfg: Mapping[str, Any]) -> str:
    """sentence-transformers' Pooling config -> one of POOLING_MODES (others refused)."""
    modes = [m for m, key in (("cls", "pooling_mode_cls_token"), ("mean", "pooling_mode_mean_tokens"),
                              ("last", "pooling_mode_lasttoken")) if cfg.get(key)]
    other = [k for k in ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens") if cfg.get(k)]
    if other or len(modes) != 1:
        raise DeploymentError(f"sentence-transformers pooling {sorted(k for k, v in cfg.items() if v is True)} "
                              f"is not supported (one of {POOLING_MODES})")
    return modes[0]
