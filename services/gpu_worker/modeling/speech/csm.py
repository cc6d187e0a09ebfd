"""CSM's two Llama stacks on paged KV (`CsmForConditionalGeneration` without its codec,
which services/gpu_worker/codecs/mimi_codec.py is).

Parameter names are the checkpoint's (`backbone_model.*`, `depth_decoder.*`,
`embed_text_tokens`, `lm_head`), so its safetensors load as they are; `codec_model.*` is
the codec's and is skipped here. The layers are the decoder family's (`DecoderLayer`:
transformers' `CsmDecoderLayer` is Llama's), each stack reading its own pool:
- `backbone(...)`: a step's rows, text rows embedded by `embed_text_tokens` and frame rows
  by the sum of their codebooks' embeddings (transformers' `CsmBackboneModelEmbeddings`:
  code + codebook * vocab into one table), through the backbone to the final norm; the
  sampled rows' `lm_head` gives the frame's first code;
- `depth(...)`: one step of the depth decoder over every frame of the step: input rows are
  the backbone's last hidden state (position 0) or a code's embedding (position k: code
  k - 1 of the frame, from the same shared table), projected to the depth width; the row
  at position k reads its own head `codebooks_head.weight[k - 1]`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.layers.rope import Rotary
from services.gpu_worker.modeling.base import SpeechCodesModel
from services.gpu_worker.modeling.decoder.lm import MLP, DecoderLayer, RMSNorm
from shared.model_config import ModelConfig
from shared.specs.csm import llama_config

#: the checkpoint's name of the shared codebook table (the backbone's copy is tied to it)
AUDIO_TABLE = "depth_decoder.model.embed_tokens.weight"
BACKBONE_TABLE = "backbone_model.embed_tokens.embed_audio_tokens.weight"


class Stack(nn.Module):
    """A decoder stack's layers and final norm (HF's `layers.N.*`, `norm.weight`): CSM's two,
    Qwen3-TTS' and Qwen3-Omni's talkers and code predictors."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def run(self, x: torch.Tensor, rope, caches: list[torch.Tensor], meta: AttnMetadata) -> torch.Tensor:
        for layer, cache in zip(self.layers, caches):
            x = layer(x, rope, cache, meta)
        return self.norm(x)


class _DepthModel(Stack):
    def __init__(self, cfg: ModelConfig, table_rows: int, backbone_hidden: int) -> None:
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(table_rows, backbone_hidden)
        self.inputs_embeds_projector = nn.Linear(backbone_hidden, cfg.hidden_size, bias=False)


class _CodebooksHead(nn.Module):
    def __init__(self, heads: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, hidden, vocab))


class _Depth(nn.Module):
    def __init__(self, cfg: ModelConfig, num_codebooks: int, vocab: int, backbone_hidden: int) -> None:
        super().__init__()
        self.model = _DepthModel(cfg, num_codebooks * vocab, backbone_hidden)
        self.codebooks_head = _CodebooksHead(num_codebooks - 1, cfg.hidden_size, vocab)


class CsmModel(SpeechCodesModel):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.num_codebooks = int(config.get("num_codebooks") or 32)
        self.vocab = int(config["vocab_size"])
        self.cfg = llama_config(config, self.vocab)
        self.depth_cfg = llama_config(config.get("depth_decoder_config") or {}, self.vocab)
        hidden = self.cfg.hidden_size
        self.embed_text_tokens = nn.Embedding(int(config["text_vocab_size"]), hidden)
        self.backbone_model = Stack(self.cfg)
        self.lm_head = nn.Linear(hidden, self.vocab, bias=False)
        self.depth_decoder = _Depth(self.depth_cfg, self.num_codebooks, self.vocab, hidden)
        self.rotary = Rotary(self.cfg.rope, self.cfg.head_dim, self.cfg.max_position_embeddings)
        self.depth_rotary = Rotary(self.depth_cfg.rope, self.depth_cfg.head_dim,
                                   self.depth_cfg.max_position_embeddings)

    assigns_weights = True

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        state = {k: v for k, v in state.items() if not k.startswith("codec_model.") and "rotary_emb" not in k}
        if AUDIO_TABLE not in state and BACKBONE_TABLE in state:  # the tie saved on the other side
            state[AUDIO_TABLE] = state[BACKBONE_TABLE]
        state.pop(BACKBONE_TABLE, None)
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if "rotary" not in k]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match CSM: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def reset_buffers(self) -> None:
        self.rotary.reset_buffers()
        self.depth_rotary.reset_buffers()

    def prepare(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every layer of both stacks."""
        stacks = (self.backbone_model.layers, self.depth_decoder.model.layers)
        for layer in cast("Iterable[DecoderLayer]", (layer for stack in stacks for layer in stack)):
            layer.self_attn.fuse()
            assert isinstance(layer.mlp, MLP)  # CSM's Llama stacks have no mixture of experts
            layer.mlp.fuse()

    @property
    def table(self) -> torch.Tensor:
        """The codebook embeddings, code c of codebook k at row c + k * vocab."""
        return self.depth_decoder.model.embed_tokens.weight

    def frame_embeds(self, frames: torch.Tensor) -> torch.Tensor:
        """Frames [F, num_codebooks] of codes -> the backbone's input rows [F, hidden]: the
        sum of each code's embedding, summed in codebook order as transformers sums."""
        offsets = torch.arange(self.num_codebooks, device=frames.device) * self.vocab
        return F.embedding(frames + offsets, self.table).sum(dim=1)

    def backbone(self, text_ids: torch.Tensor, text_rows: torch.Tensor, frames: torch.Tensor,
                 frame_rows: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                 meta: AttnMetadata) -> torch.Tensor:
        """A step's rows (text rows at `text_rows`, frame rows at `frame_rows`) through the
        backbone; every row's hidden state after the final norm [T, hidden]."""
        t = text_rows.numel() + frame_rows.numel()
        x = torch.empty(t, self.cfg.hidden_size, dtype=self.table.dtype, device=self.table.device)
        if text_rows.numel():
            x[text_rows] = self.embed_text_tokens(text_ids)
        if frame_rows.numel():
            x[frame_rows] = self.frame_embeds(frames)
        return self.backbone_model.run(x, self.rotary.tables(positions, x.dtype), caches, meta)

    def first_code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def depth(self, inputs: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor], meta: AttnMetadata,
              head_rows: torch.Tensor, head: int) -> torch.Tensor:
        """One depth step: `inputs` [T, backbone hidden] at `positions`, through the depth
        stack; the logits [len(head_rows), vocab] of `head_rows`, all at position `head + 1`
        (the code they predict is codebook `head + 1`)."""
        x = self.depth_decoder.model.inputs_embeds_projector(inputs)
        h = self.depth_decoder.model.run(x, self.depth_rotary.tables(positions, x.dtype), caches, meta)
        return (h[head_rows] @ self.depth_decoder.codebooks_head.weight[head]).float()

    def code_embeds(self, codes: torch.Tensor, codebook: int) -> torch.Tensor:
        """Codes of codebook `codebook` -> the depth decoder's input rows [N, backbone hidden]."""
        return F.embedding(codes + codebook * self.vocab, self.table)
