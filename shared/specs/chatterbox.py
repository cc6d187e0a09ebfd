"""Chatterbox (Resemble AI's `chatterbox-tts`, ResembleAI/chatterbox): text in, S3 speech
tokens out (25 a second) by T3, 24 kHz sound from them by S3Gen (codecs/s3gen.py), as the
package's `ChatterboxTTS.generate`.

The Hub folder holds no config.json and no architecture: t3_cfg.safetensors (T3),
s3gen.safetensors (S3Gen: tokens -> mel -> 24 kHz), ve.safetensors (the voice encoder),
tokenizer.json and conds.pt (the built-in voice). `is_chatterbox_folder` recognises it and
`folder_config` gives it the architecture `ChatterboxTTS`; the package hard-codes its sizes
(T3's `Llama_520M`, the Perceiver's defaults), so a config.json in the folder may override
them by section ("t3": Llama fields and "perceiver"), as the tests' tiny checkpoint does.

T3 (the package's `T3.inference`): a Llama stack over input embeddings, no token table:
- the conditioning prefix (`T3CondEnc`): the speaker embedding projected (1 row), the
  Perceiver over the voice's 150 prompt speech tokens (32 rows), the emotion
  `exaggeration` projected (1 row): `cond_rows` rows;
- the text: `[START] text [STOP]`, each row `text_emb` + its learned position (0, 1, ...);
- the start of speech twice (the package's `prepare_input_embeds` writes it, then
  `inference` appends it again): `speech_emb[BOS]` + speech position 0;
- each generated token's row: `speech_emb[token]` + speech position k (the k-th token, 1...).
Classifier-free guidance: a second row set of the request (label "uncond", beside "cond"),
the same rows except that its text rows' `text_emb` is zero (positions kept); the two rows'
logits are combined `cond + cfg_weight * (cond - uncond)` before the package's processors
(repetition penalty over BOS and the generated tokens, temperature, min-p, top-p) and its
`torch.multinomial` draw, done by the runner (runners/chatterbox.py) with the request's
seeded CPU generator, so a seeded request draws the package's tokens.

KV: labels "cond" and "uncond" in one pool "kv", each holding the prompt's rows and one row
a token (`frame_loop`), never shared by the prefix cache (the prefix rows are the voice's
and `exaggeration`'s, not ids'). The token EOS (6562) ends the request and is sent.

Request extensions (`/v1/audio/speech`, as options): `exaggeration` (0..2, default 0.5) and
`cfg_weight` (0..2, default 0.5); `voice` "default" is the folder's conds.pt (the only name).

A reference clip (one `context` turn `{"audio": base64 WAV/FLAC}`, CSM's and Qwen3-TTS'
field) is the voice instead, as the package's `generate(audio_prompt_path=...)`: decoded at
24 kHz here (at most `MAX_CLIP_SECONDS`), sent as tensor `context_audio`; the gpu worker
makes its conditionals at admission (modeling/speech/chatterbox_clip.py): T3's speaker
embedding and prompt speech tokens, S3Gen's prompt tokens, mel and x-vector. The prompt's
rows are the same (the Perceiver makes 32 rows of any clip). `max_tokens` counts speech tokens (25 a
second; the package's generate allows 1000). Sampling defaults are the package's
`generate`'s: temperature 0.8, repetition_penalty 1.2, min_p 0.05, top_p 1.0.
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
from shared.specs.base import FrameLoopSpec, MetaValue, PreparedAudio, PromptError, PromptRequest
from shared.specs.csm import llama_config

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

ARCHITECTURE = "ChatterboxTTS"
#: the files of the Hub's folder that say "Chatterbox" (it has no config.json)
MARKERS = ("t3_cfg.safetensors", "conds.pt")
DEFAULT_VOICE = "default"
#: the voice of a request with a reference clip (its `voice` metadata)
CLIP_VOICE = "clip"
CLIP_RATE = 24000
#: a reference clip's longest (the package reads 10 s for S3Gen, 6 s for T3's tokens and the
#: whole clip for the voice encoder)
MAX_CLIP_SECONDS = 30.0
#: a reference clip's shortest: CAMPPlus' Kaldi frames (25 ms) and S3 tokens (40 ms) need a
#: few; the package fails on less than a frame
MIN_CLIP_SECONDS = 0.5
#: the package's `Llama_520M` (t3/llama_configs.py), its Llama fields
LLAMA_520M: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 30, "num_attention_heads": 16,
    "num_key_value_heads": 16, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
#: the Perceiver's defaults (t3/modules/perceiver.py)
PERCEIVER = {"pre_attention_query_token": 32, "pre_attention_query_size": 1024, "embedding_dim": 1024,
             "num_attn_heads": 4}
#: T3Config's English model (t3/modules/t3_config.py)
T3_CONFIG = {"start_text_token": 255, "stop_text_token": 0, "text_tokens_dict_size": 704, "max_text_tokens": 2048,
             "start_speech_token": 6561, "stop_speech_token": 6562, "speech_tokens_dict_size": 8194,
             "max_speech_tokens": 4096, "speaker_embed_size": 256, "speech_cond_prompt_len": 150}
#: request extensions: name -> (default, lowest, highest)
EXTENSIONS = {"exaggeration": (0.5, 0.0, 2.0), "cfg_weight": (0.5, 0.0, 2.0)}


def is_chatterbox_folder(path: Path) -> bool:
    return all((path / name).is_file() for name in MARKERS)


def folder_config(path: Path) -> dict[str, Any]:
    """A Chatterbox folder's config: its config.json's sections, if any, and the architecture."""
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    return {**cfg, "architectures": [ARCHITECTURE]}


def punc_norm(text: str) -> str:
    """The package's text clean-up (tts.py `punc_norm`), before tokenizing."""
    if not text:
        return "You need to add some text for me to talk."
    if text[0].islower():
        text = text[0].upper() + text[1:]
    text = " ".join(text.split())
    for old, new in (("...", ", "), ("…", ", "), (":", ","), (" - ", ", "), (";", ", "), ("—", "-"), ("–", "-"),
                     (" ,", ","), ("“", "\""), ("”", "\""), ("‘", "'"), ("’", "'")):
        text = text.replace(old, new)
    text = text.rstrip(" ")
    if not any(text.endswith(p) for p in (".", "!", "?", "-", ",")):
        text += "."
    return text


class ChatterboxSpec(FrameLoopSpec):
    task = "speech"
    engine = "chatterbox_decoder"
    decode_loop = "frame_loop"
    labels = ("cond", "uncond")
    pool = "kv"
    metadata_keys = frozenset({"prompt_len", "voice", "exaggeration", "cfg_weight"})
    #: the package's `ChatterboxTTS.generate` defaults
    speech_defaults = (("temperature", 0.8), ("repetition_penalty", 1.2), ("min_p", 0.05), ("top_p", 1.0))
    speech_extensions = ("exaggeration", "cfg_weight")

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        t3 = dict(config.get("t3") or {})
        self.perceiver = {**PERCEIVER, **(t3.pop("perceiver", None) or {})}
        self.llama = {**LLAMA_520M, **t3}
        self.t3 = dict(T3_CONFIG)
        self.config = llama_config(self.llama, 8)
        self.start_text, self.stop_text = self.t3["start_text_token"], self.t3["stop_text_token"]
        self.bos, self.eos = self.t3["start_speech_token"], self.t3["stop_speech_token"]
        self.speech_vocab = self.t3["speech_tokens_dict_size"]
        #: the conditioning prefix: speaker, the Perceiver's queries, emotion
        self.cond_rows = 1 + int(self.perceiver["pre_attention_query_token"]) + 1
        self.stop_ids = (self.eos,)
        self.vocab_size = self.speech_vocab
        self.voices = (DEFAULT_VOICE,)
        self.sample_rate = 24000
        self.audio_frame_rate = 25.0
        self.page_size = page_size
        self.dtype = dtype
        longest = self.cond_rows + self.t3["max_text_tokens"] + 2 + self.t3["max_speech_tokens"] + 2
        self.max_seq_len = min(longest, max_seq_len) if max_seq_len else longest
        self._labels = tuple(KVLabel(name, self.pool, keys=False, grows_on=self.decode_loop) for name in self.labels)
        #: layer i reads the pool's layer i (both labels share it)
        self.layer_labels = [self.labels[0]] * self.config.num_hidden_layers
        #: the folder's built-in voice (conds.pt), read by the gpu worker
        self.conds_path: Path | None = None

    def load_folder(self, path: str | Path) -> ChatterboxSpec:
        self.conds_path = Path(path) / "conds.pt"
        return self

    # -- what a request is ----------------------------------------------------------------

    def prompt_text(self, text: str, options: Mapping[str, MetaValue]) -> str:
        """The package's `punc_norm`, its spaces as `[SPACE]` (EnTokenizer.encode)."""
        self._voice(options)
        return punc_norm(text).replace(" ", "[SPACE]")

    def _voice(self, options: Mapping[str, MetaValue]) -> str:
        voice = str(options.get("voice") or DEFAULT_VOICE)
        if voice not in self.voices:
            raise PromptError("voice", f"voice {voice!r} is not one of this model's voices {list(self.voices)}")
        return voice

    def prepare_context(self, turns: Sequence[ContextTurn]) -> tuple[tuple[PreparedAudio, ...], str]:
        """The reference clip: one turn, audio only, decoded at 24 kHz, keyed by its bytes;
        it adds no text to the prompt."""
        if len(turns) != 1:
            raise PromptError("context", f"Chatterbox takes one reference clip; got {len(turns)} context turns")
        turn = turns[0]
        if turn.text:
            raise PromptError("context[0].text", "Chatterbox's reference clip takes no transcript: "
                                                 "send the audio alone")
        if turn.audio is None:
            raise PromptError("context[0].audio", "the reference clip needs audio")
        try:
            samples = decode_audio(turn.audio, CLIP_RATE, MAX_CLIP_SECONDS, limit="a reference clip holds")
        except ValueError as exc:
            raise PromptError("context[0].audio", str(exc)) from exc
        if len(samples) < MIN_CLIP_SECONDS * CLIP_RATE:
            raise PromptError("context[0].audio", f"the reference clip is {len(samples) / CLIP_RATE:.2f} s long; "
                                                  f"Chatterbox needs at least {MIN_CLIP_SECONDS:g} s")
        key = hashlib.sha256(f"chatterbox-clip:{CLIP_RATE}".encode() + b"\0" + turn.audio).hexdigest()
        return (PreparedAudio(samples, 1, key, "context[0].audio"),), ""

    def extensions(self, options: Mapping[str, MetaValue]) -> tuple[float, float]:
        """(exaggeration, cfg_weight): the request's, else the package's defaults;
        `PromptError` naming the field for a value that is not a number in its range."""
        out = []
        for name, (default, lo, hi) in EXTENSIONS.items():
            value = options.get(name)
            if value is None:
                out.append(default)
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= float(value) <= hi:
                raise PromptError(name, f"{name} must be a number from {lo} to {hi}")
            out.append(float(value))
        return out[0], out[1]

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        """Rows: the conditioning prefix, `[START] text [STOP]`, the start of speech twice."""
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        if len(request.context) > 1:
            raise PromptError("context", "Chatterbox takes one reference clip")
        self._voice(request.options)
        exaggeration, cfg_weight = self.extensions(request.options)
        text = list(request.token_ids)
        bad = [t for t in text if not 0 <= t < self.t3["text_tokens_dict_size"]]
        if bad:
            raise PromptError("input_ids", f"text ids must be below {self.t3['text_tokens_dict_size']}: {bad[:5]}")
        if len(text) > self.t3["max_text_tokens"]:
            raise PromptError("prompt", f"the text makes {len(text)} tokens; T3 reads at most "
                                        f"{self.t3['max_text_tokens']}")
        ids = [0] * self.cond_rows + [self.start_text, *text, self.stop_text] + [self.bos, self.bos]
        spans = (Span("rows", len(ids)),)
        layouts = {name: LabelLayout(spans=spans, growth={self.decode_loop: 1}) for name in self.labels}
        meta: dict[str, MetaValue] = {"prompt_len": len(ids), "voice": CLIP_VOICE if request.context else DEFAULT_VOICE,
                                      "exaggeration": exaggeration, "cfg_weight": cfg_weight}
        tensors = {"input_ids": np.asarray(ids, dtype=np.int32),
                   "guidance": np.asarray([exaggeration, cfg_weight], dtype=np.float32)}
        if request.context:
            tensors["context_audio"] = np.asarray(request.context[0].samples, dtype=np.float32)
        return ProcessPromptOutput(tensors, layouts, meta)
