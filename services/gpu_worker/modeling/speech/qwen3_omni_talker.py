"""Qwen3-Omni's talker and its code predictor on paged KV (`Qwen3OmniMoeTalkerForConditionalGeneration`;
Code2Wav is services/gpu_worker/codecs/code2wav.py).

- The talker is a Qwen3-MoE stack (q/k norms, interleaved M-RoPE; every layer sparse, each
  with a shared expert gated by sigmoid(shared_expert_gate(x)), transformers'
  `Qwen3OmniMoeTalkerTextSparseMoeBlock`), its input table `model.codec_embedding` (codes,
  then codec control ids and the voices) and `codec_head` giving the first code of a frame.
- `text_projection` and `hidden_projection` (Linear, SiLU, Linear) map the thinker's width
  to the talker's: the first for the thinker's input embeddings of text tokens, the second
  for its hidden states (layer `accept_hidden_layer`) of image and audio rows.
- The code predictor is a dense Qwen3 stack run once per frame, fresh: position 0 the
  talker's last hidden state, position 1 the first code's talker embedding, position k + 1
  code k's embedding from `codec_embedding[k - 1]`; `lm_head[k]` at position k + 1 gives
  code k + 1 (its rows are the request's scratch: rewritten every frame).

Parameter names are the checkpoint's under `talker.` (which `load_weights` strips): the
stacks' `model.*` load into `DecoderLayer`s and `RMSNorm`s, as the decoder family's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.layers.interleaved_mrope import InterleavedMRotary
from services.gpu_worker.layers.moe import SparseMoE, stack_experts
from services.gpu_worker.layers.rope import Rotary
from services.gpu_worker.modeling.decoder.lm import MLP, DecoderLayer
from services.gpu_worker.modeling.speech.csm import Stack
from shared.model_config import ModelConfig, read_model_config
from shared.specs.qwen3_omni import omni_text_config

PREFIX = "talker."


def talker_configs(config: Mapping[str, Any]) -> tuple[ModelConfig, tuple[int, ...], ModelConfig]:
    """(the talker stack's config, its M-RoPE sections, the code predictor's config) from a
    release's config.json dict."""
    talker = config.get("talker_config") or {}
    text, section = omni_text_config({"thinker_config": {"text_config": talker.get("text_config") or {}}})
    shared = int(text.pop("shared_expert_intermediate_size", 0) or 0)
    predictor = dict(talker.get("code_predictor_config") or {})
    predictor["model_type"] = "qwen3"
    for key in ("layer_types", "use_sliding_window", "num_code_groups"):
        predictor.pop(key, None)
    cfg = msgspec.structs.replace(read_model_config(text), shared_expert_intermediate_size=shared)
    return cfg, section, read_model_config(predictor)


class ResizeMLP(nn.Module):
    """Linear, SiLU, Linear (transformers' `Qwen3OmniMoeTalkerResizeMLP`, the `qwen-tts`
    package's `Qwen3TTSTalkerResizeMLP`)."""

    def __init__(self, width: int, inter: int, out: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(width, inter)
        self.linear_fc2 = nn.Linear(inter, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class _TalkerModel(Stack):
    def __init__(self, cfg: ModelConfig, shared: ModelConfig) -> None:
        super().__init__(cfg)
        for layer in cast("list[DecoderLayer]", list(self.layers)):  # every layer sparse, with a shared expert
            layer.mlp = SparseMoE(cfg, MLP(shared))
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class _PredictorModel(Stack):
    def __init__(self, cfg: ModelConfig, groups: int, talker_hidden: int) -> None:
        super().__init__(cfg)
        self.codec_embedding = nn.ModuleList(nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(groups - 1))


class CodePredictor(nn.Module):
    """The code predictor's stack, its tables (code k >= 1, at the talker's width) and heads
    (code k + 1); `small_to_mtp_projection` maps the talker's width to its own (Qwen3-TTS'
    where they differ; an identity, with no weights, where they do not)."""

    def __init__(self, cfg: ModelConfig, groups: int, talker_hidden: int | None = None) -> None:
        super().__init__()
        talker_hidden = cfg.hidden_size if talker_hidden is None else talker_hidden
        self.model = _PredictorModel(cfg, groups, talker_hidden)
        self.lm_head = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(groups - 1))
        self.small_to_mtp_projection: nn.Module = (
            nn.Linear(talker_hidden, cfg.hidden_size) if cfg.hidden_size != talker_hidden else nn.Identity())


def load_talker_weights(model: nn.Module, state: Mapping[str, torch.Tensor], name: str,
                        stack: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                        loaded_apart: str = "") -> None:
    """`model`'s weights: the checkpoint's `talker.*` tensors, prefix stripped (`stack`
    regroups them first, e.g. the experts'); rotary buffers neither read nor missed, nor a
    submodule under `loaded_apart` (one that loads its own weights). A ValueError naming
    `name` when the names do not match."""
    own = {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX) and "rotary_emb" not in k}
    if stack is not None:
        own = stack(own)
    missing, unexpected = model.load_state_dict(own, strict=False, assign=True)
    missing = [k for k in missing if "rotary" not in k and not (loaded_apart and k.startswith(loaded_apart))]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {name}: missing {missing[:5]}, unexpected {unexpected[:5]}")


class Qwen3OmniTalker(nn.Module):
    """The talker and its code predictor (see the module docstring)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        talker = config.get("talker_config") or {}
        self.cfg, section, self.predictor_cfg = talker_configs(config)
        self.groups = int(talker.get("num_code_groups", 32))
        shared = msgspec.structs.replace(self.cfg, intermediate_size=self.cfg.shared_expert_intermediate_size)
        hidden, thinker_hidden = self.cfg.hidden_size, int(talker.get("thinker_hidden_size", 2048))
        self.model = _TalkerModel(self.cfg, shared)
        self.codec_head = nn.Linear(hidden, self.cfg.vocab_size, bias=False)
        self.text_projection = ResizeMLP(thinker_hidden, self.cfg.intermediate_size, hidden)
        self.hidden_projection = ResizeMLP(thinker_hidden, self.cfg.intermediate_size, hidden)
        self.code_predictor = CodePredictor(self.predictor_cfg, self.groups)
        self.rotary = InterleavedMRotary(self.cfg.rope, self.cfg.head_dim, self.cfg.max_position_embeddings, section)
        self.predictor_rotary = Rotary(self.predictor_cfg.rope, self.predictor_cfg.head_dim,
                                       self.predictor_cfg.max_position_embeddings)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """The checkpoint's `talker.*` tensors (others ignored)."""
        load_talker_weights(self, state, "Qwen3-Omni's talker", lambda own: stack_experts(own, self.cfg.num_experts))

    def reset_buffers(self) -> None:
        self.rotary.reset_buffers()
        self.predictor_rotary.reset_buffers()

    def talk(self, x: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
             meta: AttnMetadata) -> torch.Tensor:
        """Input rows [T, hidden] at M-RoPE `positions` [3, T] through the talker; every
        row's hidden state after the final norm."""
        return self.model.run(x, self.rotary.tables(positions, x.dtype), caches, meta)

    def first_code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden).float()

    def codec_embeds(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec ids (first codes, control ids, voices) -> the talker's input rows."""
        return self.model.codec_embedding(ids)

    def predict(self, inputs: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                meta: AttnMetadata, head_rows: torch.Tensor, head: int) -> torch.Tensor:
        """One code predictor step: `inputs` [T, hidden] at `positions` through its stack;
        the logits [len(head_rows), codebook] of `head_rows` under `lm_head[head]` (code
        `head + 1` of the frame)."""
        h = self.code_predictor.model.run(inputs, self.predictor_rotary.tables(positions, inputs.dtype), caches, meta)
        return self.code_predictor.lm_head[head](h[head_rows]).float()

    def residual_embeds(self, codes: torch.Tensor, k: int) -> torch.Tensor:
        """Code `k` (>= 1) of frames -> the predictor's (and the next talker row's) input rows."""
        table = cast("nn.Embedding", self.code_predictor.model.codec_embedding[k - 1])
        return table(codes)

    def frame_embeds(self, frames: torch.Tensor) -> torch.Tensor:
        """Frames [F, groups] -> the sum of their codes' embeddings (the talker's next input
        before the text row is added), summed in code order as transformers sums them."""
        rows = [self.codec_embeds(frames[:, 0])] + [self.residual_embeds(frames[:, k], k)
                                                    for k in range(1, self.groups)]
        return torch.stack(rows, dim=1).sum(1)
