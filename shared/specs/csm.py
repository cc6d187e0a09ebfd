"""CSM (Sesame's Conversational Speech Model, `CsmForConditionalGeneration`): text in, Mimi
codes out, 32 codebooks a frame at 12.5 frames a second.

Two Llama stacks and a codec, as transformers' `CsmForConditionalGeneration` runs them:
- the backbone reads the prompt (text embeddings) and then one row per audio frame (the sum
  of the frame's codebook embeddings) and samples the frame's first code (`lm_head`);
- the depth decoder writes the frame's other codes: rows [the backbone's last hidden state,
  code 0's embedding, code 1's, ...] at positions 0, 1, ..., each row's head its own
  (`codebooks_head.weight[position - 1]`), `num_codebooks - 1` steps a frame;
- Mimi turns frames into 24 kHz sound (services/gpu_worker/codecs/mimi_codec.py).

KV (DESIGN.md section 3, "Speech out"): label "backbone" (pool "kv") holds the prompt's
rows and grows one row per frame on `frame_loop`; label "depth" (pool "depth") holds one
frame's depth rows as `scratch` (`num_codebooks` rows: the hidden state, then codes 0 to
`num_codebooks - 2`), written every frame and released at the frame's end. Loops:
`frame_loop` (one iteration a frame after the first, which the prompt's step makes; capped
by max_tokens, which counts frames) and `codebook_loop` (`num_codebooks - 1` depth steps a
frame, fixed by the model).

The prompt is the CSM processor's chat template for one `[speaker]text` turn:
`<|begin_of_text|>[{speaker}]{text}<|end_of_text|>`, tokenized without the tokenizer's own
specials (the template writes them). Voices are speaker ids "0" to "9" (`VOICES`; CSM
was trained on conversations whose speakers are numbered, 0 and 1 mostly). A frame whose
codes other than the last are all `codebook_eos_token_id` (0) ends the request, as
transformers' generate stops; it is sent as the token `eos_frame_token` (one past the last
code) and makes no sound unless its last code is not 0 (transformers cuts the audio at the
first all-zero frame only).

Voice continuation: a request may carry the conversation's earlier turns (`context`,
`prepare_context`), laid out before its own as the processor's template does:
`[speaker]text<eos>`, then for a turn with audio one `<|AUDIO|>` per frame Mimi's encoder
makes of it (ceil(samples / 1920)) and `<|audio_eos|>`, `<bos>` before the next turn. Each
clip's frames are a `rows` span keyed by a hash of its file (DESIGN.md section 3: the
prefix cache may share them); the gpu worker encodes the clip at admission and fills those
rows with the frames' summed codebook embeddings, and the `<|audio_eos|>` row with the
all-zero frame's (transformers' `_merge_input_ids_with_input_values`). Audio at another
rate than the codec's is resampled (shared/audio.py), not refused.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.audio import decode_audio
from shared.deferred import deferred
from shared.frames import ContextTurn
from shared.layout import KVLabel, LabelLayout, ProcessPromptOutput, Span
from shared.model_config import ModelConfig, read_model_config
from shared.specs.base import FrameDepthSpec, MetaValue, PreparedAudio, PromptError, PromptRequest, added_tokens

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

ARCHITECTURE = "CsmForConditionalGeneration"
#: the speakers a request may name (`voice`), as the prompt's `[N]` prefix
VOICES = tuple(str(i) for i in range(10))
DEFAULT_VOICE = "0"
#: the config fields of a CSM stack that are a Llama's (the rest is CSM's own)
LLAMA_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "mlp_bias")


def llama_config(raw: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    """One of CSM's two stacks as the Llama it is (transformers' `CsmDecoderLayer` is
    Llama's layer), read by the decoder family's one config reader."""
    fields = {k: raw[k] for k in LLAMA_FIELDS if k in raw and raw[k] is not None}
    return read_model_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                              "vocab_size": vocab_size, "tie_word_embeddings": False, **fields})


def mimi_frame(codec: Mapping[str, Any]) -> tuple[int, int]:
    """(sample rate, samples a frame) of a Mimi config: the SEANet's hop times the latent
    downsampling of 2 (1920 at 24 kHz: 12.5 frames a second)."""
    rate = int(codec.get("sampling_rate", 24000))
    return rate, math.prod(int(r) for r in codec.get("upsampling_ratios") or (8, 6, 5, 4)) * 2


class CsmSpec(FrameDepthSpec):
    task = "speech"
    engine = "csm_decoder"
    decode_loop = "frame_loop"
    codebook_loop = "codebook_loop"
    backbone_label = "backbone"
    depth_label = "depth"
    pool = "kv"
    depth_pool = "depth"
    metadata_keys = frozenset({"prompt_len", "voice"})
    #: Sesame's generator's sampling (temperature 0.9, top-k 50), for every codebook
    speech_defaults = (("temperature", 0.9), ("top_k", 50))

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        self.raw = dict(config)
        self.num_codebooks = int(config.get("num_codebooks") or 32)
        self.codebook_vocab = int(config["vocab_size"])
        self.config = llama_config(config, self.codebook_vocab)
        depth = dict(config.get("depth_decoder_config") or {})
        self.depth_config = llama_config(depth, self.codebook_vocab)
        self.codec_config = dict(config.get("codec_config") or {})
        if int(self.codec_config.get("num_quantizers", self.num_codebooks)) != self.num_codebooks:
            raise ValueError(f"the codec has {self.codec_config.get('num_quantizers')} codebooks; "
                             f"the model writes {self.num_codebooks}")
        self.codebook_eos = int(config.get("codebook_eos_token_id") or 0)
        #: the token a frame that ends the request is sent as (one past the last code)
        self.eos_frame_token = self.codebook_vocab
        self.stop_ids = (self.eos_frame_token,)
        self.vocab_size = self.codebook_vocab + 1
        self.text_vocab_size = int(config.get("text_vocab_size") or 0)
        self.sample_rate, self.samples_per_frame = mimi_frame(self.codec_config)
        self.frame_rate = self.sample_rate / self.samples_per_frame
        self.audio_frame_rate = self.frame_rate
        self.page_size = page_size
        self.dtype = dtype
        ctx = self.config.max_position_embeddings
        self.max_seq_len = min(ctx, max_seq_len) if max_seq_len else ctx
        self.voices = VOICES
        self.bos_id: int | None = None
        #: the folder whose safetensors hold the codec's weights (`codec_model.*`)
        self.codec_path: Path | None = None
        self.eos_text = "<|end_of_text|>"
        #: context turns (voice continuation): the ids of an audio frame's placeholder and
        #: of the all-zero frame that closes a turn's audio (transformers' `audio_token_id`,
        #: `audio_eos_token_id`), and the texts of them and of bos (from the tokenizer)
        self.audio_token_id = _optional_int(config.get("audio_token_id"))
        self.audio_eos_token_id = _optional_int(config.get("audio_eos_token_id"))
        self.audio_text: str | None = None
        self.audio_eos_text: str | None = None
        self.bos_text: str | None = None
        self._labels = (KVLabel(self.backbone_label, self.pool, keys=True, grows_on=self.decode_loop),
                        KVLabel(self.depth_label, self.depth_pool))
        #: every backbone layer reads the backbone label (the runner's decoder half)
        self.layer_labels = [self.backbone_label] * self.config.num_hidden_layers

    def load_folder(self, path: str | Path) -> CsmSpec:
        """The template's specials from the tokenizer: its bos and eos tokens."""
        path = Path(path)
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        vocab = added_tokens(path)
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        if bos is None or bos not in vocab or eos is None or eos not in vocab:
            raise ValueError(f"{path}: the tokenizer's bos and eos tokens ({bos!r}, {eos!r}) must be added tokens "
                             "(CSM's template writes them around each turn)")
        self.bos_id, self.eos_text, self.bos_text = vocab[bos], eos, bos
        names = {i: text for text, i in vocab.items()}
        self.audio_text = names.get(self.audio_token_id) if self.audio_token_id is not None else None
        self.audio_eos_text = names.get(self.audio_eos_token_id) if self.audio_eos_token_id is not None else None
        self.codec_path = path
        return self

    # -- what a request is ----------------------------------------------------------------

    def prompt_text(self, text: str, options: Mapping[str, MetaValue]) -> str:
        """`[speaker]text<eos>`: the template's turn without its leading bos, which the
        tokenizer's own specials write (or `process_prompt` adds, for a tokenizer that
        writes none)."""
        voice = options.get("voice") or DEFAULT_VOICE
        if voice not in self.voices:
            raise PromptError("voice", f"voice {voice!r} is not one of this model's speakers: {', '.join(self.voices)}")
        return f"[{voice}]{text}{self.eos_text}"

    def prepare_context(self, turns: Sequence[ContextTurn]) -> tuple[tuple[PreparedAudio, ...], str]:
        """The processor's chat template for the earlier turns, as text before the
        request's own turn: `[speaker]text<eos>`, then for a turn with audio one
        `<|AUDIO|>` per frame its encoder makes and `<|audio_eos|>`, and `<bos>` before each
        later turn (the first turn's bos is the tokenizer's, as for a text prompt). Each
        audio is decoded to mono at the codec's rate (other rates resampled)."""
        if self.audio_text is None or self.audio_eos_text is None or self.bos_text is None:
            raise PromptError("context", "the model's tokenizer lacks CSM's audio tokens: it takes no context turns")
        audios: list[PreparedAudio] = []
        parts = []
        rows = 0  # the context audio's frames so far (the conductor checks the whole prompt's rows)
        for i, turn in enumerate(turns):
            if turn.speaker not in self.voices:
                raise PromptError(f"context[{i}].speaker", f"speaker {turn.speaker!r} is not one of this model's "
                                                           f"speakers: {', '.join(self.voices)}")
            if not turn.text:
                raise PromptError(f"context[{i}].text", "a context turn's text is empty")
            text = f"[{turn.speaker}]{turn.text}{self.eos_text}"
            if turn.audio is not None:
                audio = self._context_audio(turn.audio, f"context[{i}].audio", self.max_seq_len - rows)
                audios.append(audio)
                rows += audio.frames
                text += self.audio_text * audio.frames + self.audio_eos_text
            parts.append(text)
        return tuple(audios), self.bos_text.join(parts) + self.bos_text

    def _context_audio(self, data: bytes, param: str, rows_left: int) -> PreparedAudio:
        """One turn's audio file -> its samples, frames and content key; `PromptError` on
        `param` for a file that is not WAV/FLAC audio or makes more frames than are left."""
        most = max(0, rows_left) * self.samples_per_frame / self.sample_rate
        try:
            samples = decode_audio(data, self.sample_rate, most, limit=f"with the rest of the context, {param} holds")
        except ValueError as exc:
            raise PromptError(param, str(exc)) from exc
        frames = encoded_frames(len(samples), self.samples_per_frame)
        if frames > rows_left:
            raise PromptError(param, f"{param} makes {frames} frames; {max(0, rows_left)} rows are left of the "
                                     f"model's {self.max_seq_len} (max_seq_len)")
        key = hashlib.sha256(f"csm-context:{self.sample_rate}".encode() + b"\0" + data).hexdigest()
        return PreparedAudio(samples, frames, key, param)

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        """The backbone's spans: the text's ids, and each context audio's frames as one
        rows span keyed by the audio (the gpu worker encodes it and fills those rows); the
        depth label's scratch."""
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        ids = list(request.token_ids)
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        if request.context and len(ids) >= self.max_seq_len:  # the conductor would blame the prompt
            last = request.context[-1]
            raise PromptError(last.param, f"with its context audio ({sum(a.frames for a in request.context)} frames) "
                                          f"the prompt is {len(ids)} rows: no frame fits in the model's "
                                          f"{self.max_seq_len} (max_seq_len)")
        layouts = {
            self.backbone_label: LabelLayout(spans=self._spans(ids, request.context), growth={self.decode_loop: 1}),
            self.depth_label: LabelLayout(spans=(), scratch=self.depth_rows),
        }
        meta: dict[str, MetaValue] = {"prompt_len": len(ids), "voice": str(request.options.get("voice")
                                                                          or DEFAULT_VOICE)}
        tensors = {"input_ids": np.asarray(ids, dtype=np.int32)}
        if request.context:
            tensors["context_audio"] = np.concatenate([a.samples for a in request.context]).astype(np.float32)
            tensors["context_cutoffs"] = np.cumsum([len(a.samples) for a in request.context], dtype=np.int64)
        return ProcessPromptOutput(tensors, layouts, meta)

    def _spans(self, ids: list[int], context: tuple[PreparedAudio, ...]) -> tuple[Span, ...]:
        """`ids` spans for text, a keyed `rows` span per run of audio placeholders (one run
        per context audio, in order, as long as its frames); `PromptError` otherwise."""
        holes = set() if self.audio_token_id is None else {self.audio_token_id}
        return context_spans(ids, holes, [(a.frames, a.key) for a in context],
                             f"the prompt's audio placeholders (id {self.audio_token_id}) do not match the "
                             "context's audio", "context audio(s)")

    def frames_for(self, seconds: float) -> int:
        """Frames of `seconds` of sound (at least one)."""
        return max(1, math.ceil(seconds * self.frame_rate))


def encoded_frames(samples: int, samples_per_frame: int) -> int:
    """Frames Mimi's encoder makes of `samples` samples: every causal conv of stride r
    makes ceil(n / r) of n, so ceil(samples / samples_per_frame) in all (transformers'
    `MimiModel.get_encoded_length`, the processor's `_get_encoded_length`)."""
    return -(-samples // samples_per_frame)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def context_spans(ids: list[int], holes: set[int], clips: Sequence[tuple[int, str]], mismatch: str,
                  noun: str) -> tuple[Span, ...]:
    """`ids` as spans: text as `ids` spans, each run of `holes` ids as a keyed `rows` span of
    the next clip (`clips`: each one's rows and key, in order; the run as long as its rows,
    so the prefix cache shares a clip's rows only with the same clip). `PromptError` naming
    input_ids with `mismatch` for a run that is not its clip's length, or when the runs and
    the clips (`noun`) do not pair up. CSM's and Higgs Audio's context turns."""
    spans: list[Span] = []
    text: list[int] = []
    runs, i = 0, 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] in holes:
            j += 1
        if j == i:
            text.append(ids[i])
            i += 1
            continue
        if runs >= len(clips) or j - i != clips[runs][0]:
            raise PromptError("input_ids", mismatch)
        spans += [Span.ids(text)] if text else []
        spans.append(Span.rows(j - i, clips[runs][1]))
        text, runs, i = [], runs + 1, j
    if runs != len(clips):
        raise PromptError("input_ids", f"the prompt holds {runs} runs of audio placeholders for {len(clips)} {noun}")
    return (*spans, Span.ids(text)) if text else tuple(spans)


def _token_str(value: Any) -> str | None:
    """A tokenizer_config special: a string, or an AddedToken dict's content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
