"""Higgs Audio v2 (Boson AI, `HiggsAudioV2ForConditionalGeneration`): text in, X-codec
codes out, 8 codebooks a frame at 25 frames a second.

One Llama stack whose layers each hold a second pair of norms and a second MLP, used at
audio rows only ("dual FFN": attention is shared, transformers' `HiggsAudioV2DecoderLayer`);
a text row is a token's embedding, an audio row the sum of its frame's 8 codebook
embeddings (one table, code + codebook * codebook_size). One head (`audio_lm_head`)
predicts all 8 codebooks of the next frame at once: `num_codebooks * codebook_size`
logits, each codebook's vocabulary the codec's 1024 codes plus the stream BOS (1024) and
EOS (1025).

Delay pattern (transformers' `HiggsAudioV2DelayPatternLogitsProcessor`): codebook k runs k
frames behind codebook 0. The prompt ends in `<|audio_out_bos|>`, so the first frame is
all BOS and frame t has BOS in codebooks t..7 (forced); once a frame holds an EOS, each
later frame forces EOS in one more codebook (0, 1, ...), and the first all-EOS frame ends
the request (sent as `eos_frame_token`, one past the last code). The sound is the frames
between the BOS frame and the EOS frame with the delay reverted (codebook k read k frames
later: n delayed frames make n - 7 codec frames), decoded by the codec
(services/gpu_worker/codecs/higgs_codec.py).

KV: one label "kv" (pool "kv") holding the prompt's rows and one row per frame
(`frame_loop`, capped by max_tokens, which counts frames, the BOS frame included).

The prompt (Boson's examples/generation.py): the checkpoint's chat template over a system
turn "Generate audio following instruction." with the scene description between
`<|scene_desc_start|>` / `<|scene_desc_end|>`, then a user turn with the text, and the
generation prompt (the template's, ending in `<|audio_out_bos|>`). Voice "default" adds
nothing; any other voice is a speaker description: `SPEAKER0: <voice>` after the scene.

The codec is the folder processor_config.json names (`audio_tokenizer_name_or_path`, a Hub
id): a folder of that name inside the checkpoint's, else that repository in the local
Hugging Face cache (never downloaded).

Voice cloning (`context`, as CSM's field): each turn is a reference clip and what it says,
laid out as transformers' processor lays a conversation out, after the system turn (Boson's
order, `join_context`): a user turn with the text, then an assistant turn with the clip:
`<|audio_out_bos|>`, one placeholder row a delayed frame (`<|AUDIO_OUT|>` for the clip's
frames and its stream BOS / EOS, the delay token for the delay's 7), `<|audio_eos|>`. A
clip's rows are a `rows` span keyed by a hash of its file (the prefix cache shares them only
with the same clip); the gpu worker encodes the clip at admission
(codecs/higgs_encoder.py) and fills the rows with its delayed frames' summed embeddings on
the audio norms and MLPs. Audio at another rate is resampled to the codec's (shared/audio.py).

Sampling: temperature, top-k, top-p per codebook (transformers' warpers); Boson's
repetition-aware sampling (generation_config.json's `ras_win_len`,
`ras_win_max_num_repeat`) applies when sampling (services/gpu_worker/runners/higgs.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.audio import decode_audio
from shared.deferred import deferred
from shared.frames import ContextTurn
from shared.hub import resolve_model
from shared.layout import KVLabel, LabelLayout, ProcessPromptOutput, Span
from shared.specs.base import (
    DeploymentError,
    FrameLoopSpec,
    MetaValue,
    PreparedAudio,
    PromptError,
    PromptRequest,
    added_tokens,
)
from shared.specs.csm import _token_str, context_spans, llama_config

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

ARCHITECTURE = "HiggsAudioV2ForConditionalGeneration"
DEFAULT_VOICE = "default"
#: Boson's default scene (examples/scene_prompts/quiet_indoor.txt)
DEFAULT_SCENE = "Audio is recorded from a quiet room."
SYSTEM = "Generate audio following instruction."
#: the longest speaker description a voice may be
MAX_VOICE_CHARS = 500


def system_message(voice: str, scene: str = DEFAULT_SCENE) -> str:
    """Boson's system turn: the instruction, then the scene (and the speaker's description
    for a voice other than default) between the scene markers."""
    desc = scene if voice == DEFAULT_VOICE else f"{scene}\n\nSPEAKER0: {voice}"
    return f"{SYSTEM}\n\n<|scene_desc_start|>\n{desc}\n<|scene_desc_end|>"


def codec_frame(codec: Mapping[str, Any]) -> tuple[int, int]:
    """(sample rate, samples a frame) of an X-codec config: the DAC's hop (960 at 24 kHz)."""
    acoustic = codec.get("acoustic_model_config") or {}
    hop = int(np.prod(acoustic.get("downsampling_ratios") or (8, 5, 4, 2, 3)))
    return int(codec.get("sample_rate", 24000)), hop


class HiggsSpec(FrameLoopSpec):
    task = "speech"
    engine = "higgs_decoder"
    decode_loop = "frame_loop"
    label_name = "kv"
    pool = "kv"
    metadata_keys = frozenset({"prompt_len", "voice"})
    #: Boson's generation defaults where generation_config.json says nothing
    speech_defaults = (("temperature", 1.0), ("top_k", 50), ("top_p", 0.95))
    # `max_tokens` counts frames (FrameLoopSpec): the BOS frame and the delay's 7 included, so
    # n frames make n - 8 of sound (`max_audio_seconds` adds the 8: `audio_extra_tokens`)

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        self.raw = dict(config)
        self.num_codebooks = int(config.get("num_codebooks") or 8)
        self.codebook_size = int(config.get("codebook_size") or 1026)
        self.config = llama_config(config, int(config["vocab_size"]))
        self.stream_bos = int(config.get("audio_stream_bos_id", 1024))
        self.stream_eos = int(config.get("audio_stream_eos_id", 1025))
        self.audio_token_id = int(config["audio_token_id"])
        self.audio_bos_token_id = int(config["audio_bos_token_id"])
        self.audio_delay_token_id = int(config["audio_delay_token_id"])
        eos = config.get("eos_token_id")
        self.text_eos_id = int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None
        #: the token a frame that ends the request is sent as (one past the last code)
        self.eos_frame_token = self.codebook_size
        self.stop_ids = (self.eos_frame_token,)
        self.vocab_size = self.codebook_size + 1
        self.page_size = page_size
        self.dtype = dtype
        ctx = self.config.max_position_embeddings
        self.max_seq_len = min(ctx, max_seq_len) if max_seq_len else ctx
        self.codec_path: Path | None = None
        self.codec_config: dict[str, Any] = {}
        self.sample_rate, self.samples_per_frame = 24000, 960
        self.audio_frame_rate = self.sample_rate / self.samples_per_frame
        #: the BOS frame and the delay's frames make no sound of their own
        self.audio_extra_tokens = self.num_codebooks
        self.ras_win_len = 0
        self.ras_max_repeat = 0
        self.bos_id: int | None = None
        self.bos_text = ""
        #: the texts of a clip's placeholders (`<|AUDIO_OUT|>`, the delay token), from the tokenizer
        self.audio_text: str | None = None
        self.delay_text: str | None = None
        self.template: Any = None
        self._labels = (KVLabel(self.label_name, self.pool, keys=True, grows_on=self.decode_loop),)
        self.layer_labels = [self.label_name] * self.config.num_hidden_layers

    def load_folder(self, path: str | Path) -> HiggsSpec:
        """The chat template and bos, the codec (processor_config.json), RAS's settings
        (generation_config.json)."""
        path = Path(path)
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        source = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            source = (path / "chat_template.jinja").read_text()
        if not isinstance(source, str):
            raise DeploymentError(f"{path}: no chat template (Higgs' prompt is its chat template)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.template = env.from_string(source)
        bos = _token_str(cfg.get("bos_token"))
        vocab = added_tokens(path)
        if bos is not None and bos in vocab:
            self.bos_id, self.bos_text = vocab[bos], bos
        names = {i: text for text, i in vocab.items()}
        self.audio_text, self.delay_text = names.get(self.audio_token_id), names.get(self.audio_delay_token_id)
        self.codec_path = find_codec(path)
        self.codec_config = json.loads((self.codec_path / "config.json").read_text())
        self.sample_rate, self.samples_per_frame = codec_frame(self.codec_config)
        self.audio_frame_rate = self.sample_rate / self.samples_per_frame
        gen_path = path / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        self.ras_win_len = int(gen.get("ras_win_len") or 0)
        self.ras_max_repeat = int(gen.get("ras_win_max_num_repeat") or 0)
        return self

    # -- what a request is ----------------------------------------------------------------

    def prompt_text(self, text: str, options: Mapping[str, MetaValue]) -> str:
        """The chat template over Boson's system turn and the text, its generation prompt
        opening the audio; without the leading bos, which the tokenizer's own specials
        write (or `process_prompt` adds)."""
        voice = str(options.get("voice") or DEFAULT_VOICE)
        if len(voice) > MAX_VOICE_CHARS or "<|" in voice:
            raise PromptError("voice", f"voice must be 'default' or a speaker description of at most "
                                       f"{MAX_VOICE_CHARS} characters without special tokens")
        return self._render([_system(voice), _text_turn("user", text)], True)

    def _render(self, messages: list[dict[str, Any]], generation: bool) -> str:
        """The chat template over `messages`, without its leading bos."""
        if self.template is None:
            raise PromptError("prompt", "the model's chat template was not loaded")
        rendered = self.template.render(messages=messages, add_generation_prompt=generation, tools=None,
                                        documents=None, bos_token=self.bos_text, eos_token="")
        return rendered[len(self.bos_text):] if self.bos_text and rendered.startswith(self.bos_text) else rendered

    # -- voice cloning: reference clips as context turns --------------------------------------

    def prepare_context(self, turns: Sequence[ContextTurn]) -> tuple[tuple[PreparedAudio, ...], str]:
        """Each turn is a reference clip and what it says: a user turn with the text, then
        an assistant turn with the clip (`<|audio_out_bos|>`, one placeholder row a delayed
        frame: `<|AUDIO_OUT|>` for the clip's frames and its stream BOS / EOS, the delay
        token for the 7 frames of the delay, `<|audio_eos|>`), as transformers' processor
        lays them out. The speaker field is not read (the clip is the voice)."""
        if self.audio_text is None or self.delay_text is None:
            raise PromptError("context", "the model's tokenizer lacks Higgs' audio tokens: it takes no context turns")
        audios: list[PreparedAudio] = []
        messages: list[dict[str, Any]] = []
        rows = 0
        for i, turn in enumerate(turns):
            if not turn.text:
                raise PromptError(f"context[{i}].text", "a context turn's text is empty")
            if turn.audio is None:
                raise PromptError(f"context[{i}].audio", "a context turn is a reference clip: it needs audio")
            audio = self._context_audio(turn.audio, f"context[{i}].audio", self.max_seq_len - rows)
            audios.append(audio)
            rows += self.clip_rows(audio.frames)
            messages += [_text_turn("user", turn.text), {"role": "assistant", "content": [{"type": "audio"}]}]
        parts = self._render(messages, False).split(self.audio_text)
        if len(parts) != len(audios) + 1:
            raise PromptError("context", "the model's chat template does not write one audio placeholder a clip")
        before = parts[0] + "".join(self.audio_text * (a.frames + 2) + self.delay_text * (self.num_codebooks - 1) + p
                                    for a, p in zip(audios, parts[1:]))
        return tuple(audios), before

    def join_context(self, before: str, text: str, options: Mapping[str, MetaValue]) -> str:
        """The clips' turns after the system turn (Boson's order), before the text's."""
        system = self._render([_system(str(options.get("voice") or DEFAULT_VOICE))], False)
        if not text.startswith(system):
            raise PromptError("context", "the model's chat template does not render turns one after another")
        return system + before + text[len(system):]

    def clip_rows(self, frames: int) -> int:
        """Prompt rows of a clip of `frames` codec frames: with its stream BOS and EOS, delayed."""
        return frames + 2 + self.num_codebooks - 1

    def _context_audio(self, data: bytes, param: str, rows_left: int) -> PreparedAudio:
        """One clip -> its samples, codec frames and content key; `PromptError` on `param`
        for a file that is not WAV/FLAC audio or makes more rows than are left."""
        most = max(0, rows_left) * self.samples_per_frame / self.sample_rate
        try:
            samples = decode_audio(data, self.sample_rate, most, limit=f"with the rest of the context, {param} holds")
        except ValueError as exc:
            raise PromptError(param, str(exc)) from exc
        frames = encoded_frames(len(samples), self.codec_config)
        if self.clip_rows(frames) >= rows_left:
            raise PromptError(param, f"{param} makes {self.clip_rows(frames)} rows; {max(0, rows_left)} are left of "
                                     f"the model's {self.max_seq_len} (max_seq_len)")
        key = hashlib.sha256(f"higgs-context:{self.sample_rate}".encode() + b"\0" + data).hexdigest()
        return PreparedAudio(samples, frames, key, param)

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        """The prompt's text rows; the delay pattern's start needs `<|audio_out_bos|>` among
        its last `num_codebooks` ids (the template's generation prompt ends in it)."""
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        ids = list(request.token_ids)
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        spans = self._spans(ids, request.context)
        layouts = {self.label_name: LabelLayout(spans=spans, growth={self.decode_loop: 1})}
        meta: dict[str, MetaValue] = {"prompt_len": len(ids),
                                      "voice": str(request.options.get("voice") or DEFAULT_VOICE)}
        tensors = {"input_ids": np.asarray(ids, dtype=np.int32)}
        if request.context:
            tensors["context_audio"] = np.concatenate([a.samples for a in request.context]).astype(np.float32)
            tensors["context_cutoffs"] = np.cumsum([len(a.samples) for a in request.context], dtype=np.int64)
        return ProcessPromptOutput(tensors, layouts, meta)

    def _spans(self, ids: list[int], context: tuple[PreparedAudio, ...]) -> tuple[Span, ...]:
        """`ids` spans for text, a keyed `rows` span per clip's run of placeholders (its
        delayed frames, as long as `clip_rows`: the prefix cache shares a clip's rows only
        with the same clip); `PromptError` otherwise."""
        return context_spans(ids, {self.audio_token_id, self.audio_delay_token_id},
                             [(self.clip_rows(a.frames), a.key) for a in context],
                             "the prompt's audio placeholders do not match the context's clips", "clip(s)")


def _system(voice: str) -> dict[str, Any]:
    return _text_turn("system", system_message(voice))


def _text_turn(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text}]}


def encoded_frames(samples: int, codec: Mapping[str, Any]) -> int:
    """Frames the codec's encoder makes of `samples` samples: its semantic path's length
    (resampled to 16 kHz, padded 160 a side, HuBERT's convs, every
    `semantic_downsample_factor`-th row, the semantic encoder's strides), which the
    acoustic path is padded to match (codecs/higgs_encoder.py)."""
    rate, sem_rate = int(codec.get("sample_rate", 24000)), int(codec.get("semantic_sample_rate", 16000))
    g = math.gcd(rate, sem_rate)
    n = -(-samples * (sem_rate // g) // (rate // g)) if rate != sem_rate else samples
    length = n + 320
    semantic = codec.get("semantic_model_config") or {}
    for k, s in zip(semantic.get("conv_kernel") or (10, 3, 3, 3, 3, 2, 2),
                    semantic.get("conv_stride") or (5, 2, 2, 2, 2, 2, 2)):
        length = (length - int(k)) // int(s) + 1
    _, hop = codec_frame(codec)
    step = max(1, int(hop / (rate / sem_rate) / int(codec.get("downsample_factor", 320))))
    length = -(-length // step)
    for s in codec.get("strides") or (1, 1):
        k = 3 if int(s) == 1 else 2 * int(s)
        length = (length + 2 * ((k - 1) // 2) - k) // int(s) + 1
    return length


def find_codec(folder: Path) -> Path:
    """The codec's folder: processor_config.json's `audio_tokenizer_name_or_path` as a
    folder inside the checkpoint's (its full name, or its last part), else as a path or a
    Hub id in the local Hugging Face cache (`shared.hub.resolve_model`)."""
    proc_path = folder / "processor_config.json"
    proc = json.loads(proc_path.read_text()) if proc_path.is_file() else {}
    name = (proc.get("audio_tokenizer") or {}).get("audio_tokenizer_name_or_path")
    if not isinstance(name, str) or not name:
        raise DeploymentError(f"{folder}: processor_config.json names no audio_tokenizer_name_or_path "
                              "(the codec Higgs' codes are decoded with)")
    for inside in (folder / name, folder / name.rsplit("/", 1)[-1]):
        if (inside / "config.json").is_file():
            return inside
    found = resolve_model(name)
    if not (found / "config.json").is_file():
        raise DeploymentError(f"the codec {name!r} ({found}) has no config.json")
    return found
