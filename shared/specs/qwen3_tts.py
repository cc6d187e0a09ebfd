"""Qwen3-TTS (the `qwen-tts` package's `Qwen3TTSForConditionalGeneration`, CustomVoice
checkpoints): text in, 12 Hz codec codes out, `num_code_groups` codebooks a frame.

Two Qwen3 stacks and a codec, as the package's `generate` runs them:
- the talker reads the prompt and then one row per frame (the sum of the frame's code
  embeddings plus the projected `tts_pad` text row) and samples the frame's first code
  (`codec_head`); its positions are one stream (its 3-D RoPE gets the same position in all
  three, which is 1-D RoPE);
- the code predictor writes the frame's other codes: rows [the talker's last hidden state,
  code 0's talker embedding, code 1's, ...] at positions 0, 1, ..., `lm_head[k]` at row k + 1
  giving code k + 1 (its rows are scratch, rewritten every frame, as CSM's depth decoder);
- the 12 Hz codec in `speech_tokenizer/` turns frames into 24 kHz sound
  (services/gpu_worker/codecs/qwen3_tts_codec.py).

The prompt (the package's `generate` in its default non-streaming mode): each row is a
projected text embedding (`text_projection(text_embedding(id))`) plus, for some, a codec
embedding; a row is sent as one id, `text + text_vocab * (codec + 1)` (the text id alone
when it has no codec part), so the prefix cache keys exactly what makes the row:
- `<|im_start|>user\\n{instructions}<|im_end|>\\n` when instructions are given (text only);
- `<|im_start|>assistant\\n` (the first three ids of the assistant text, text only);
- `tts_pad` x (K - 2), `tts_bos` over the codec ids `nothink, think_bos, think_eos`
  (`think, think_bos, <language>, think_eos` for a dialect speaker), the speaker, `codec_pad`
  (K - 1 rows: K counts `codec_bos` too);
- the text's ids, then `tts_eos`, each over `codec_pad`; then `tts_pad` over `codec_bos`.
The tokenizer is vocab.json + merges.txt (shared/bpe_files.py). A text holding the
tokenizer's special tokens is refused: the prompt's parts are found by them.

Voices are the checkpoint's speakers (`talker_config.spk_id`, lower case); the language is
the package's "Auto" (a dialect speaker's dialect, as the package does).

Base checkpoints (`tts_model_type` "base") have no speakers: the voice is a reference clip,
sent as one `context` turn (CSM's and Higgs' cloning field) `{"audio": base64 WAV/FLAC}`
without text: the package's `x_vector_only_mode` (its `generate_voice_clone` with
`non_streaming_mode=True`, the prompt layout above). The speaker row is the clip's x-vector
(the speaker encoder, run by the runner at admission:
services/gpu_worker/modeling/speech/qwen3_tts_speaker.py) plus the projected `tts_pad`: a
rows span of one row keyed by the clip's bytes; its id in `input_ids` is a placeholder
(`tts_pad` alone), its position `clip_row`, the clip's samples (24 kHz) `context_audio`.
A clip with its transcript (`{"text", "audio"}`) is the package's ICL mode
(`x_vector_only_mode=False`): the transcript's turn is tokenized before the request's (the
package's `_build_ref_text`), its text ids become text rows over `codec_pad` before the
text's, and the last `tts_pad` over `codec_bos` row is followed by the clip's codec frames
(the 12 Hz encoder's, run by the runner at admission: codecs/qwen3_tts_encoder.py), each a
frame row as a decoding request's (its codes' embeddings summed, plus the projected
`tts_pad`): a rows span of `frames` rows keyed by the clip, after the ids; its size,
ceil(samples / `encode_downsample_rate`), is `ref_frames`.

Streaming text (the `/v1/audio/speech` extension `non_streaming_mode: false`, the package's
`non_streaming_mode=False`): the text rows and `tts_eos` leave the prompt; its first id is
on the `codec_bos` row, an ICL clip's frame rows carry the next ones (`frame_texts`, in the
frames' key; `tts_pad` past the text), and the rest (`trailing`) are fed one a generated
frame by the runner (then `tts_pad`). `voice` on a Base checkpoint
and `context` on a CustomVoice one are refused by name. Sampling:
generation_config.json's (`do_sample`, `temperature`, `top_k`, `top_p`,
`repetition_penalty` over the first codes generated) for the first code; its `subtalker_*`
for the others (greedy for a request sent with temperature 0).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.audio import decode_audio
from shared.deferred import deferred
from shared.frames import ContextTurn
from shared.layout import KVLabel, LabelLayout, ProcessPromptOutput, Span
from shared.model_config import ModelConfig, read_model_config
from shared.specs.base import FrameDepthSpec, MetaValue, PreparedAudio, PromptError, PromptRequest

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

ARCHITECTURE = "Qwen3TTSForConditionalGeneration"
#: the config fields of a stack that are a Qwen3's
QWEN3_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                "rope_theta", "attention_bias")
#: the package's hard defaults where generation_config.json says nothing
SUBTALKER_DEFAULTS = {"subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_k": 50,
                      "subtalker_top_p": 1.0}
#: the speaker encoder's rate (the package's `extract_speaker_embedding` takes 24 kHz only)
CLIP_RATE = 24000
#: the longest reference clip read, in seconds
MAX_CLIP_SECONDS = 60.0


def encoded_frames(samples: int, codec: Mapping[str, Any]) -> int:
    """The codec frames the package keeps of a clip of `samples` at 24 kHz (its
    `Qwen3TTSTokenizerV2Model.encode`: ceil(samples / encode_downsample_rate))."""
    return -(-samples // int(codec.get("encode_downsample_rate", 1920)))


def qwen3_config(raw: Mapping[str, Any]) -> ModelConfig:
    """One of the two stacks as the Qwen3 it is (q/k norms, SiLU MLP)."""
    fields = {k: raw[k] for k in QWEN3_FIELDS if k in raw and raw[k] is not None}
    return read_model_config({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                              "tie_word_embeddings": False, **fields})


class Qwen3TTSSpec(FrameDepthSpec):
    task = "speech"
    engine = "qwen3_tts"
    decode_loop = "frame_loop"
    codebook_loop = "codebook_loop"
    backbone_label = "talker"
    depth_label = "code"
    pool = "kv"
    depth_pool = "code"
    metadata_keys = frozenset({"prompt_len", "voice"})
    #: the package's `non_streaming_mode` (false: the text fed a token a frame)
    speech_extensions = ("non_streaming_mode",)
    #: the package's hard defaults (its `_merge_generate_kwargs`), under generation_config.json
    speech_defaults = (("temperature", 0.9), ("top_k", 50), ("top_p", 1.0), ("repetition_penalty", 1.05))

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        self.raw = dict(config)
        t = dict(config.get("talker_config") or {})
        self.talker_raw = t
        self.config = qwen3_config(t)
        self.depth_config = qwen3_config(t.get("code_predictor_config") or {})
        self.num_codebooks = int(t.get("num_code_groups", 32))
        self.codebook_vocab = self.depth_config.vocab_size
        self.text_vocab = int(t.get("text_vocab_size", 151936))
        self.vocab_size = self.config.vocab_size
        self.codec_eos = int(t.get("codec_eos_token_id", 4198))
        self.eos_frame_token = self.codec_eos
        self.stop_ids = (self.codec_eos,)
        ids = {k: int(t[k]) for k in ("codec_pad_id", "codec_bos_id", "codec_think_id", "codec_nothink_id",
                                       "codec_think_bos_id", "codec_think_eos_id") if k in t}
        self.codec_ids = ids
        self.speakers = {str(k).lower(): int(v) for k, v in (t.get("spk_id") or {}).items()}
        self.dialects = {str(k).lower(): v for k, v in (t.get("spk_is_dialect") or {}).items()}
        self.languages = {str(k).lower(): int(v) for k, v in (t.get("codec_language_id") or {}).items()}
        self.voices = tuple(self.speakers)
        self.default_voice = self.voices[0] if self.voices else ""
        self.im_start = int(config.get("im_start_token_id", 151644))
        self.im_end = int(config.get("im_end_token_id", 151645))
        self.tts_pad = int(config.get("tts_pad_token_id", 151671))
        self.tts_bos = int(config.get("tts_bos_token_id", 151672))
        self.tts_eos = int(config.get("tts_eos_token_id", 151673))
        #: the 0.6B CustomVoice checkpoints take no instructions (the package drops them)
        self.takes_instructions = str(config.get("tts_model_size") or "") not in ("0b6", "")
        kind = config.get("tts_model_type", "custom_voice")
        #: a Base checkpoint: the voice is a reference clip (its x-vector), never a name
        self.clones = kind == "base"
        if kind not in ("custom_voice", "base") or (not self.clones and not self.voices):
            raise ValueError(f"only Qwen3-TTS CustomVoice (named speakers) and Base (a reference clip) checkpoints "
                             f"are served; this one is {kind!r}")
        self.page_size = page_size
        self.dtype = dtype
        ctx = self.config.max_position_embeddings
        self.max_seq_len = min(ctx, max_seq_len) if max_seq_len else ctx
        self.sample_rate, self.samples_per_frame = 24000, 1920
        self.audio_frame_rate = self.sample_rate / self.samples_per_frame
        self.codec_path: Path | None = None
        self.codec_config: dict[str, Any] = {}
        self.subtalker = dict(SUBTALKER_DEFAULTS)
        self.special_texts: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")
        self._labels = (KVLabel(self.backbone_label, self.pool, keys=True, grows_on=self.decode_loop),
                        KVLabel(self.depth_label, self.depth_pool))
        self.layer_labels = [self.backbone_label] * self.config.num_hidden_layers

    def load_folder(self, path: str | Path) -> Qwen3TTSSpec:
        """The codec's config (speech_tokenizer/), the sub-talker's sampling
        (generation_config.json), the tokenizer's special tokens."""
        path = Path(path)
        self.codec_path = path
        self.codec_config = json.loads((path / "speech_tokenizer" / "config.json").read_text())
        self.sample_rate = int(self.codec_config.get("output_sample_rate", 24000))
        self.samples_per_frame = int(self.codec_config.get("decode_upsample_rate", 1920))
        self.audio_frame_rate = self.sample_rate / self.samples_per_frame
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        self.subtalker = {k: gen.get(k, v) for k, v in SUBTALKER_DEFAULTS.items()}
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        specials = [t.get("content") for t in (cfg.get("added_tokens_decoder") or {}).values() if t.get("special")]
        self.special_texts = tuple(s for s in specials if isinstance(s, str) and s) or self.special_texts
        return self

    # -- what a request is ----------------------------------------------------------------

    def prompt_text(self, text: str, options: Mapping[str, MetaValue]) -> str:
        """The instructions' user turn (if any) and the assistant turn the package tokenizes."""
        self._voice(options)
        instructions = str(options.get("instructions") or "")
        for name, value in (("input", text), ("instructions", instructions)):
            special = next((s for s in self.special_texts if s in value), None)
            if special is not None:
                raise PromptError(name, f"{name} holds the model's special token {special!r}")
        if instructions and self.clones:
            raise PromptError("instructions", "a Qwen3-TTS Base checkpoint takes no instructions")
        if instructions and not self.takes_instructions:
            raise PromptError("instructions", "this Qwen3-TTS checkpoint (0.6B) takes no instructions")
        user = f"<|im_start|>user\n{instructions}<|im_end|>\n" if instructions else ""
        return f"{user}<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"

    def _voice(self, options: Mapping[str, MetaValue]) -> str:
        if self.clones:
            if options.get("voice"):
                raise PromptError("voice", "this Qwen3-TTS Base checkpoint has no named speakers: its voice is a "
                                           "reference clip, sent as a context turn ({\"audio\": ...})")
            return ""
        voice = str(options.get("voice") or self.default_voice).lower()
        if voice not in self.speakers:
            raise PromptError("voice", f"voice {options.get('voice')!r} is not one of this model's speakers: "
                                       f"{', '.join(self.voices)}")
        return voice

    def warmup_request(self, n: int) -> PromptRequest:
        """A prompt of the package's shape: the assistant turn around `n` ordinary ids (and
        for a Base checkpoint a second of silence as the reference clip)."""
        ids = [self.im_start, 1, 2, *range(3, 3 + max(1, n - 8)), self.im_end, 2, self.im_start, 1, 2]
        clip = (PreparedAudio(np.zeros(CLIP_RATE, dtype=np.float32), 0, "qwen3-tts-warmup"),) if self.clones else ()
        return PromptRequest(ids, context=clip)

    def prepare_context(self, turns: Sequence[ContextTurn]) -> tuple[tuple[PreparedAudio, ...], str]:
        """A Base checkpoint's reference clip: one turn, decoded at 24 kHz. Audio alone is
        x-vector mode (no text added; `frames` 0); with its transcript, ICL mode: the
        transcript's turn (`<|im_start|>assistant\n{text}<|im_end|>\n`, as the package's
        `_build_ref_text`) goes before the request's own, and `frames` is the codec frames
        the clip makes (rows of the prompt)."""
        if not self.clones:
            raise PromptError("context", "this Qwen3-TTS CustomVoice checkpoint speaks its named speakers (voice); "
                                         "a reference clip is for a Base checkpoint")
        if len(turns) != 1:
            raise PromptError("context", f"a Qwen3-TTS Base checkpoint takes one reference clip; got {len(turns)}")
        turn = turns[0]
        special = next((s for s in self.special_texts if s in (turn.text or "")), None)
        if special is not None:
            raise PromptError("context[0].text", f"context[0].text holds the model's special token {special!r}")
        if turn.audio is None:
            raise PromptError("context[0].audio", "the reference clip needs audio")
        most = MAX_CLIP_SECONDS
        if turn.text:  # ICL: the clip's frames are prompt rows
            most = min(most, self.max_seq_len * self.codec_frame_samples / CLIP_RATE)
        try:
            samples = decode_audio(turn.audio, CLIP_RATE, most, limit="a reference clip holds")
        except ValueError as exc:
            raise PromptError("context[0].audio", str(exc)) from exc
        key = hashlib.sha256(f"qwen3-tts-xvector:{CLIP_RATE}".encode() + b"\0" + turn.audio).hexdigest()
        if not turn.text:
            return (PreparedAudio(samples, 0, key, "context[0].audio"),), ""
        frames = encoded_frames(len(samples), self.codec_config)
        return (PreparedAudio(samples, frames, key, "context[0].audio"),), \
            f"<|im_start|>assistant\n{turn.text}<|im_end|>\n"

    def codec_prefix(self, voice: str) -> list[int]:
        """The codec ids of the prompt's tag rows: think / language (a dialect speaker's) or
        nothink, the speaker, codec_pad, codec_bos (the package's `codec_input_embedding`).
        A Base checkpoint's speaker is its clip's x-vector: `codec_pad` stands in its place
        here (`prompt_rows` writes the row as `tts_pad` alone; the runner adds the x-vector)."""
        c = self.codec_ids
        if self.clones:
            return [c["codec_nothink_id"], c["codec_think_bos_id"], c["codec_think_eos_id"], c["codec_pad_id"],
                    c["codec_pad_id"], c["codec_bos_id"]]
        dialect = self.dialects.get(voice)
        if dialect:
            tags = [c["codec_think_id"], c["codec_think_bos_id"], self.languages[str(dialect).lower()],
                    c["codec_think_eos_id"]]
        else:
            tags = [c["codec_nothink_id"], c["codec_think_bos_id"], c["codec_think_eos_id"]]
        return [*tags, self.speakers[voice], c["codec_pad_id"], c["codec_bos_id"]]

    def row_id(self, text: int, codec: int | None = None) -> int:
        """One prompt row as one id: its text id, and its codec id folded in above the text vocabulary."""
        return text if codec is None else text + self.text_vocab * (codec + 1)

    def prompt_rows(self, ids: list[int], voice: str, instructed: bool, icl: bool = False, frames: int = 0,
                    streaming: bool = False) -> tuple[list[int], list[int], list[int]]:
        """(the prompt's rows as `row_id`s but an ICL clip's `frames` frame rows, which
        `process_prompt` adds last; the text id added to each of those; the text ids fed
        one a generated frame) from its tokens (see the module docstring). In ICL mode the
        tokens open with the transcript's turn, whose text goes before the request's. In
        streaming mode (the package's `non_streaming_mode=False`) the text (and `tts_eos`)
        is not in the prompt's text rows: its first id is on the `codec_bos` row, the next
        ones on the clip's frame rows, the rest fed one a generated frame (then `tts_pad`)."""
        split = 0
        if instructed or icl:
            starts = [i for i, t in enumerate(ids) if t == self.im_start]
            if len(starts) < 3:
                field = "context[0].text" if icl else "instructions"
                raise PromptError(field, f"the prompt does not hold the {field} turn")
            split = starts[1]
        before, said = ids[:split], ids[split:]
        if len(said) < 8 or said[0] != self.im_start:
            raise PromptError("input", "the prompt is not the assistant turn Qwen3-TTS speaks")
        codec = self.codec_prefix(voice)
        pad, bos = self.codec_ids["codec_pad_id"], self.codec_ids["codec_bos_id"]
        tags = [self.tts_pad] * (len(codec) - 2) + [self.tts_bos]
        heads = [self.row_id(t, c) for t, c in zip(tags, codec[:-1])]
        if self.clones:  # the speaker row: `tts_pad` alone here, plus the x-vector in the runner
            heads[-2] = self.row_id(self.tts_pad)
        instruct, ref = ([], before[3:-2]) if icl else (before, [])
        head = [self.row_id(t) for t in instruct + said[:3]] + heads
        texts = [*ref, *said[3:-5], self.tts_eos]
        if not streaming:
            return head + [self.row_id(t, pad) for t in texts] + [self.row_id(self.tts_pad, bos)], \
                [self.tts_pad] * frames, []
        over = texts[: frames + 1] + [self.tts_pad] * (frames + 1 - len(texts))
        return [*head, self.row_id(over[0], bos)], over[1:], texts[frames + 1:]

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        """The talker's rows (ids spans: each row's id says all that makes it; a Base
        checkpoint's clip rows, keyed by the clip: `clip_spans`), the code predictor's scratch."""
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        voice = self._voice(request.options)
        if any(not 0 <= t < self.text_vocab for t in request.token_ids):
            raise PromptError("input_ids", f"the prompt's ids must be text ids, below {self.text_vocab}")
        if self.clones and len(request.context) != 1:
            raise PromptError("context", "a Qwen3-TTS Base checkpoint clones the voice of a reference clip: "
                                         "send one context turn {\"audio\": base64 WAV} (and its \"text\")")
        clip = request.context[0] if self.clones else None
        frames = clip.frames if clip is not None else 0
        streaming = request.options.get("non_streaming_mode", True) is False
        rows, frame_texts, trailing = self.prompt_rows(list(request.token_ids), voice,
                                                       bool(request.options.get("instructions")), frames > 0,
                                                       frames, streaming)
        tensors = {"input_ids": np.asarray(rows, dtype=np.int64)}
        spans: tuple[Span, ...] = (Span.ids(rows),)
        if clip is not None:
            spans = self.clip_spans(rows, clip, frame_texts, tensors)
            rows += [self.row_id(self.tts_pad)] * clip.frames
            tensors["input_ids"] = np.asarray(rows, dtype=np.int64)
        if streaming:
            tensors["trailing"] = np.asarray(trailing, dtype=np.int64)
        if clip is not None and clip.frames and len(rows) >= self.max_seq_len:
            raise PromptError("context[0].audio", f"the clip's {clip.frames} frames make the prompt {len(rows)} "
                                                  f"rows; the model takes {self.max_seq_len} (max_seq_len)")
        layouts = {
            self.backbone_label: LabelLayout(spans=spans, growth={self.decode_loop: 1}),
            self.depth_label: LabelLayout(spans=(), scratch=self.depth_rows),
        }
        meta: dict[str, MetaValue] = {"prompt_len": len(rows), "voice": voice}
        return ProcessPromptOutput(tensors, layouts, meta)

    def clip_spans(self, rows: list[int], clip: PreparedAudio, frame_texts: list[int],
                   tensors: dict[str, np.ndarray]) -> tuple[Span, ...]:
        """A Base checkpoint's spans: the text rows, the speaker row (the clip's x-vector: a
        rows span keyed by the clip) and, in ICL mode, the clip's codec frames after the
        last row (a rows span keyed by the clip, the codec and the text ids on its rows).
        Its tensors: the clip's samples ("context_audio"), the speaker row ("clip_row"),
        the frames ("ref_frames") and their text ids ("frame_texts")."""
        at = self.clip_row()
        spans = [Span.ids(rows[:at]), Span.rows(1, clip.key), Span.ids(rows[at + 1:])]
        if clip.frames:
            made = f"qwen3-tts-codes:{self.codec_frame_samples}:{clip.key}:{','.join(map(str, frame_texts))}"
            spans.append(Span.rows(clip.frames, hashlib.sha256(made.encode()).hexdigest()))
        tensors["context_audio"] = np.asarray(clip.samples, dtype=np.float32)
        tensors["clip_row"] = np.asarray([at], dtype=np.int64)
        tensors["ref_frames"] = np.asarray([clip.frames], dtype=np.int64)
        tensors["frame_texts"] = np.asarray(frame_texts, dtype=np.int64)
        return tuple(spans)

    def clip_row(self) -> int:
        """The speaker row's place in a Base checkpoint's prompt (which takes no
        instructions): after the assistant's first 3 ids and the 3 tag rows."""
        return 3 + 3

    @property
    def codec_frame_samples(self) -> int:
        """Samples (24 kHz) a codec frame of the encoder takes (`encode_downsample_rate`)."""
        return int(self.codec_config.get("encode_downsample_rate", 1920))

