"""Qwen3-TTS' talker and code predictor on paged KV (the `qwen-tts` package's
`Qwen3TTSTalkerForConditionalGeneration` without its codec, which
services/gpu_worker/codecs/qwen3_tts_codec.py is).

Parameter names are the checkpoint's under `talker.` (`model.layers.*`, `model.norm`,
`model.codec_embedding`, `model.text_embedding`, `text_projection.linear_fc1/2`,
`codec_head`, `code_predictor.model.*`, `code_predictor.lm_head.N`,
`code_predictor.small_to_mtp_projection`); the layers are the decoder family's
(`DecoderLayer`: the package's layers are Qwen3's, q/k norms included), each stack reading
its own pool. The runner (runners/qwen3_tts.py) drives it through CSM's interface:
- `backbone(...)`: a step's rows: prompt rows given as `row_id`s (shared/specs/qwen3_tts.py:
  text id + text_vocab * (codec id + 1)), each `text_projection(text_embedding(text))` plus
  `codec_embedding(codec)` where it has one; frame rows, each the sum of its codes'
  embeddings (code 0 from the talker's table, code k from the predictor's k-th) plus the
  projected `tts_pad`; through the talker to its final norm;
- `depth(...)`: one code predictor step: rows projected by `small_to_mtp_projection`, the
  row at position k + 1 read by `lm_head[k]` (code k + 1 of the frame).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import torch
from torch import nn

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.layers.rope import Rotary
from services.gpu_worker.modeling.base import SpeechCodesModel
from services.gpu_worker.modeling.decoder.lm import MLP, DecoderLayer
from services.gpu_worker.modeling.speech.csm import Stack
from services.gpu_worker.modeling.speech.qwen3_omni_talker import CodePredictor, ResizeMLP, load_talker_weights
from services.gpu_worker.modeling.speech.qwen3_tts_speaker import PREFIX as SPEAKER_PREFIX
from services.gpu_worker.modeling.speech.qwen3_tts_speaker import SpeakerEncoder
from shared.specs.qwen3_tts import qwen3_config


class _TalkerModel(Stack):
    def __init__(self, cfg, text_vocab: int, text_hidden: int) -> None:
        super().__init__(cfg)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(text_vocab, text_hidden)


class Qwen3TTSModel(SpeechCodesModel):
    assigns_weights = True

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        t = config.get("talker_config") or {}
        self.cfg = qwen3_config(t)
        self.depth_cfg = qwen3_config(t.get("code_predictor_config") or {})
        self.groups = int(t.get("num_code_groups", 32))
        self.text_vocab = int(t.get("text_vocab_size", 151936))
        self.tts_pad = int(config.get("tts_pad_token_id", 151671))
        hidden, text_hidden = self.cfg.hidden_size, int(t.get("text_hidden_size", 2048))
        if t.get("hidden_act", "silu") != "silu":
            raise ValueError("only Qwen3-TTS' SiLU text projection is implemented")
        self.model = _TalkerModel(self.cfg, self.text_vocab, text_hidden)
        self.text_projection = ResizeMLP(text_hidden, text_hidden, hidden)
        self.codec_head = nn.Linear(hidden, self.cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(self.depth_cfg, self.groups, hidden)
        self.rotary = Rotary(self.cfg.rope, self.cfg.head_dim, self.cfg.max_position_embeddings)
        self.depth_rotary = Rotary(self.depth_cfg.rope, self.depth_cfg.head_dim, self.depth_cfg.max_position_embeddings)
        #: a Base checkpoint's: a reference clip -> the x-vector that is its speaker row
        self.speaker_encoder = (SpeakerEncoder(config.get("speaker_encoder_config"))
                                if config.get("tts_model_type") == "base" else None)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """The checkpoint's `talker.*` tensors, and a Base checkpoint's `speaker_encoder.*`."""
        if self.speaker_encoder is not None:
            self.speaker_encoder.load_weights({k: v.float() for k, v in state.items() if k.startswith(SPEAKER_PREFIX)})
        load_talker_weights(self, state, "Qwen3-TTS' talker", loaded_apart=SPEAKER_PREFIX)

    def reset_buffers(self) -> None:
        self.rotary.reset_buffers()
        self.depth_rotary.reset_buffers()

    def prepare(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every layer of both stacks."""
        stacks = (self.model.layers, self.code_predictor.model.layers)
        for layer in cast("Iterable[DecoderLayer]", (layer for stack in stacks for layer in stack)):
            layer.self_attn.fuse()
            assert isinstance(layer.mlp, MLP)
            layer.mlp.fuse()

    def text_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.text_projection(self.model.text_embedding(ids))

    def prompt_embeds(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Prompt rows (as `row_id`s) -> the talker's input rows: the projected text
        embedding, plus the codec embedding where the row has one."""
        text, codec = row_ids % self.text_vocab, row_ids // self.text_vocab - 1
        x = self.text_rows(text)
        has = codec >= 0
        if bool(has.any()):
            x[has] = x[has] + self.model.codec_embedding(codec[has])
        return x

    def frame_embeds(self, frames: torch.Tensor, texts: torch.Tensor | None = None) -> torch.Tensor:
        """Frames [F, groups] -> the talker's next rows: the codes' embeddings summed in
        code order (as the package sums them), plus the projected text id of each (`texts`
        [F]: the streamed text's; `tts_pad` where absent)."""
        rows = [self.model.codec_embedding(frames[:, 0])] + [self.code_embeds(frames[:, k], k)
                                                               for k in range(1, self.groups)]
        if texts is None:
            texts = torch.tensor([self.tts_pad], device=frames.device)
        return torch.stack(rows, dim=1).sum(1) + self.text_rows(texts)

    def backbone(self, text_ids: torch.Tensor, text_rows: torch.Tensor, frames: torch.Tensor,
                 frame_rows: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                 meta: AttnMetadata, vectors: torch.Tensor | None = None,
                 vector_rows: torch.Tensor | None = None, frame_texts: torch.Tensor | None = None) -> torch.Tensor:
        """A step's rows (prompt rows at `text_rows`, frame rows at `frame_rows`) through the
        talker; every row's hidden state after the final norm [T, hidden]. `vectors` are
        added at `vector_rows` (prompt rows): a Base checkpoint's x-vectors, each on its
        speaker row (`tts_pad` alone), as the package sums `tts_pad_embed + speaker_embed`.
        `frame_texts`: each frame row's text id (streamed text; `frame_embeds`)."""
        table = self.model.codec_embedding.weight
        t = text_rows.numel() + frame_rows.numel()
        x = torch.empty(t, self.cfg.hidden_size, dtype=table.dtype, device=table.device)
        if text_rows.numel():
            x[text_rows] = self.prompt_embeds(text_ids)
        if frame_rows.numel():
            x[frame_rows] = self.frame_embeds(frames, frame_texts)
        if vectors is not None and vector_rows is not None:
            x[vector_rows] = x[vector_rows] + vectors.to(x.dtype)
        return self.model.run(x, self.rotary.tables(positions, x.dtype), caches, meta)

    def first_code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden).float()

    def depth(self, inputs: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor], meta: AttnMetadata,
              head_rows: torch.Tensor, head: int) -> torch.Tensor:
        """One code predictor step: `inputs` [T, talker hidden] at `positions`; the logits
        [len(head_rows), codebook] of `head_rows` under `lm_head[head]` (code `head + 1`)."""
        x = self.code_predictor.small_to_mtp_projection(inputs)
        h = self.code_predictor.model.run(x, self.depth_rotary.tables(positions, x.dtype), caches, meta)
        return self.code_predictor.lm_head[head](h[head_rows]).float()

    def code_embeds(self, codes: torch.Tensor, codebook: int) -> torch.Tensor:
        """Codes of codebook `codebook` -> the predictor's input rows [N, talker hidden]:
        code 0 from the talker's table, code k from the predictor's (k - 1)-th."""
        if codebook == 0:
            return self.model.codec_embedding(codes)
        return cast("nn.Embedding", self.code_predictor.model.codec_embedding[codebook - 1])(codes)
