"""The Whisper family (encoder-decoder speech recognition): audio in, text out.

Two labels in two pools, because the two kinds of rows differ in everything the KV
manager cares about:
- "self" (pool "kv_self"): the decoder's self-attention rows. Its span is the forced
  decoder prompt (<|startoftranscript|><|lang|><|task|><|notimestamps|>) as `Span.rows`:
  the cross-attention feeds every decoder row, so its KV depends on the audio, not on the
  ids alone, and it is never keyed (two clips with the same prompt share nothing). It
  grows one row per decode iteration.
- "cross" (pool "kv_cross"): each decoder layer's cross-attention K/V of the encoder's
  frames, written once at admission: one `Span.rows(max_source_positions)` (1500 for a
  30 s window; audio frames, never keyed), no growth.

A page of a pool holds every decoder layer, and both pools have the decoder's layers,
heads and head_dim. `paged_pools(num_pages)` gives "kv_self" `num_pages` pages and
"kv_cross" as many pages as the same number of full-length requests need there (a
request holds ceil(1500 / page_size) cross pages against at most
ceil(max_seq_len / page_size) self pages), so neither pool runs out long before the other;
`bytes_per_page` counts one self page plus that share of cross pages.

The request reaches `process_prompt` whole: its audio file (decoded and turned into
log-mel features here, by `shared.audio`, whose torch import is the data worker's only
one and runs inside this call), its options `language` and `task`, and prompt ids (none
for a real request; the worker's warm-up sends a decoder prompt and no audio: silence).

Language: the request's, else the model's default (generation config `language`, else
the language of its `forced_decoder_ids`). A multilingual model with neither detects it
as transformers' `generate(language=None)` does: one probe step runs the decoder on
<|startoftranscript|> alone and takes the argmax of its logits over the language tokens.
The probe's row is the "self" label's `scratch` (one row, released after the step); the
real prompt <|sot|><|lang|><|task|><|notimestamps|> is then written as the span. Such a
request's "decoder_input_ids" leave the language out (<|sot|><|task|><|notimestamps|>)
and its `metadata` says `detect_language`; the runner puts the detected token in place
and reports the language with the first output. Timestamps are not produced
(<|notimestamps|> is forced).

The spec needs more than config.json: generation_config.json (language/task tables,
suppress lists), preprocessor_config.json (feature settings) and, as a fallback for the
language tokens, tokenizer.json. The registry's factory only receives config.json, so
`ModelSource.spec` calls `spec.load_folder(path)` (a no-op for other families) on the spec
it builds, and code with a folder in hand may use `WhisperSpec.from_folder(path, ...)`.
The gpu worker runs it with `services.gpu_worker.modeling.speech.whisper.WhisperModel`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from shared.audio import FeatureConfig, audio_features, log_mel_features
from shared.deferred import deferred
from shared.layout import KVLabel, LabelLayout, PagedKVConfig, ProcessPromptOutput, Span, kv_head_bytes
from shared.pages import ceil_div, pages_for
from shared.specs.base import MetaValue, ModelSpec, PromptError, PromptRequest, added_tokens

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

ARCHITECTURE = "WhisperForConditionalGeneration"
_LANG_TOKEN = re.compile(r"^<\|[a-z]{2,3}\|>$")


class WhisperSpec(ModelSpec):
    engine = "encoder_decoder"
    takes_audio = True
    decode_loop = "decode_loop"
    self_label, cross_label = "self", "cross"
    self_pool, cross_pool = "kv_self", "kv_cross"
    metadata_keys = frozenset({"prompt_len", "language", "task", "detect_language"})
    #: rows of the language probe (<|startoftranscript|> alone): the "self" label's scratch
    probe_rows = 1

    def __init__(self, config: dict, *, page_size: int, max_seq_len: int = 0, dtype: str = "float32",
                 path: str | Path | None = None) -> None:
        self.config = config
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = int(config["decoder_layers"])
        self.heads = int(config["decoder_attention_heads"])
        self.d_model = int(config["d_model"])
        self.head_dim = self.d_model // self.heads
        self.vocab_size = int(config["vocab_size"])
        self.n_mels = int(config["num_mel_bins"])
        #: encoder output rows (the cross label's span) and the mel frames that make them
        self.n_frames = int(config["max_source_positions"])
        self.input_frames = 2 * self.n_frames  # conv2 has stride 2
        self.max_target_positions = int(config["max_target_positions"])
        mt = self.max_target_positions
        self.max_seq_len = min(mt, max_seq_len) if max_seq_len else mt
        self._labels = (
            KVLabel(self.self_label, self.self_pool, keys=False, grows_on=self.decode_loop),
            KVLabel(self.cross_label, self.cross_pool, keys=False),
        )
        self.features = FeatureConfig(feature_size=self.n_mels)
        self.generation: dict = {}
        self.lang_to_id: dict[str, int] = {}
        self._apply_generation({})
        if path is not None:
            self.load_folder(path)

    @classmethod
    def from_folder(cls, path: str | Path, *, page_size: int, max_seq_len: int = 0,
                    dtype: str = "float32") -> WhisperSpec:
        config = json.loads((Path(path) / "config.json").read_text())
        return cls(config, page_size=page_size, max_seq_len=max_seq_len, dtype=dtype, path=path)

    # -- the folder's extra files ----------------------------------------------------------

    def load_folder(self, path: str | Path) -> WhisperSpec:
        """Read generation_config.json, preprocessor_config.json and (for language tokens a
        generation config does not list) tokenizer.json from the model folder."""
        path = Path(path)
        gen = {}
        if (path / "generation_config.json").exists():
            gen = json.loads((path / "generation_config.json").read_text())
        self.features = FeatureConfig.from_folder(path, feature_size=self.n_mels)
        if self.features.feature_size != self.n_mels:
            raise ValueError(f"preprocessor feature_size {self.features.feature_size} != num_mel_bins {self.n_mels}")
        if self.features.nb_max_frames != self.input_frames:
            raise ValueError(f"the feature extractor makes {self.features.nb_max_frames} frames; "
                             f"the encoder takes {self.input_frames}")
        self._apply_generation(gen, added_tokens(path))
        return self

    def _apply_generation(self, gen: dict, added: dict[str, int] | None = None) -> None:
        """Generation settings: the generation config's, else config.json's (older folders)."""
        merged = {k: v for k, v in self.config.items() if k in (
            "decoder_start_token_id", "eos_token_id", "suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids")}
        merged.update({k: v for k, v in gen.items() if v is not None})
        self.generation = merged
        added = added or {}
        self.decoder_start_token_id = int(merged["decoder_start_token_id"])
        eos = merged.get("eos_token_id")
        self.eos_token_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        self.suppress_tokens = tuple(int(t) for t in merged.get("suppress_tokens") or ())
        self.begin_suppress_tokens = tuple(int(t) for t in merged.get("begin_suppress_tokens") or ())
        self.lang_to_id = {k: int(v) for k, v in (merged.get("lang_to_id") or {}).items()}
        if not self.lang_to_id and merged.get("is_multilingual", True):
            self.lang_to_id = {t: i for t, i in added.items() if _LANG_TOKEN.match(t)}
        self.task_to_id = {k: int(v) for k, v in (merged.get("task_to_id") or {}).items()}
        for task in ("transcribe", "translate"):
            if task not in self.task_to_id and f"<|{task}|>" in added:
                self.task_to_id[task] = added[f"<|{task}|>"]
        nts = merged.get("no_timestamps_token_id", added.get("<|notimestamps|>"))
        self.no_timestamps_token_id = None if nts is None else int(nts)
        self.forced_decoder_ids = [(int(i), None if t is None else int(t))
                                   for i, t in merged.get("forced_decoder_ids") or ()]

    # -- the decoder prompt ----------------------------------------------------------------

    def forced_ids(self, language: str | None = None, task: str | None = None) -> list[int]:
        """The forced decoder prompt: <|startoftranscript|>[<|lang|><|task|>]<|notimestamps|>.

        `language` is a code ("en") or a token ("<|en|>"); None takes the model's default.
        Raises `PromptError` (a ValueError, client-safe) for a language or task the model
        does not know."""
        ids = [self.decoder_start_token_id]
        forced = dict(self.forced_decoder_ids)
        if self.lang_to_id:
            ids.append(self._language_id(language, forced.get(1)))
            ids.append(self._task_id(task, forced.get(2)))
        else:
            if language not in (None, "en", "<|en|>"):
                raise PromptError("language", f"language {language!r} is not supported: this model is English-only")
            if task not in (None, "transcribe"):
                raise PromptError("task", f"task {task!r} is not supported: this model only transcribes")
            ids.extend(t for i, t in sorted(forced.items()) if t is not None and t != self.no_timestamps_token_id)
        if self.no_timestamps_token_id is not None:
            ids.append(self.no_timestamps_token_id)
        return ids

    def _language_id(self, language: str | None, forced: int | None) -> int:
        if language is None:
            default = self.generation.get("language")
            if default is None and forced is not None:
                return forced
            language = default or ("en" if "<|en|>" in self.lang_to_id else next(iter(self.lang_to_id))[2:-2])
        token = language if language.startswith("<|") else f"<|{language.lower()}|>"
        if token not in self.lang_to_id:
            known = sorted(t[2:-2] for t in self.lang_to_id)
            raise PromptError("language", f"language {language!r} is not supported; supported: {', '.join(known)}")
        return self.lang_to_id[token]

    def _task_id(self, task: str | None, forced: int | None) -> int:
        if task is None:
            task = self.generation.get("task")
            if task is None and forced is not None:
                return forced
            task = task or "transcribe"
        if task not in self.task_to_id:
            known = ", ".join(sorted(self.task_to_id))
            raise PromptError("task", f"task {task!r} is not supported; supported: {known}")
        return self.task_to_id[task]

    def detects_language(self, language: str | None) -> bool:
        """A request without a language on a multilingual model whose configs name no
        default (no generation `language`, no language in `forced_decoder_ids`) detects it."""
        if language is not None or not self.lang_to_id:
            return False
        return self.generation.get("language") is None and dict(self.forced_decoder_ids).get(1) is None

    def decoder_prompt(self, language: str | None = None, task: str | None = None) -> tuple[list[int], bool]:
        """(the forced prompt, whether the language is detected); a detected language's
        slot (index 1) is left out of the prompt until the probe fills it."""
        if not self.detects_language(language):
            return self.forced_ids(language, task), False
        ids = self.forced_ids(next(iter(self.lang_to_id)), task)
        del ids[1]
        return ids, True

    def language_ids(self) -> list[int]:
        """The language tokens, ascending (the probe's argmax takes the lowest of a tie, as
        transformers' does over the whole vocabulary)."""
        return sorted(self.lang_to_id.values())

    def language_code(self, token_id: int) -> str | None:
        for token, i in self.lang_to_id.items():
            if i == token_id:
                return token[2:-2]
        return None

    def _describe(self, ids: list[int]) -> dict[str, MetaValue]:
        """The language and task a forced prompt names (an English-only model: en, transcribe)."""
        if not self.lang_to_id:
            return {"language": "en", "task": "transcribe"}
        by_id = {i: t for t, i in self.task_to_id.items()}
        codes = [c for c in map(self.language_code, ids) if c is not None]
        tasks = [by_id[i] for i in ids if i in by_id]
        return {"language": codes[0] if codes else None, "task": tasks[0] if tasks else None}

    # -- ModelSpec -------------------------------------------------------------------------

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return self._labels

    def _pages_per_request(self, page_size: int) -> tuple[int, int]:
        """(self pages, cross pages) of one request of max_seq_len."""
        return pages_for(self.max_seq_len, page_size), pages_for(self.n_frames, page_size)

    def cross_pool_pages(self, num_pages: int) -> int:
        """Cross pages that go with `num_pages` self pages (the same number of full requests)."""
        self_pages, cross_pages = self._pages_per_request(self.page_size)
        return ceil_div(num_pages * cross_pages, self_pages)

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        args = (self.num_layers, self.heads, self.head_dim, self.dtype, self.page_size)
        return {
            self.self_pool: PagedKVConfig(self.self_pool, *args, num_pages, self.max_seq_len),
            self.cross_pool: PagedKVConfig(self.cross_pool, *args, self.cross_pool_pages(num_pages), self.n_frames),
        }

    def graph_loops(self) -> dict[str, int]:
        # Prefill of the forced prompt emits the first token (a prompt has at least one id).
        return {self.decode_loop: self.max_seq_len - 1}

    def silence_features(self) -> np.ndarray:
        return log_mel_features(np.zeros(0, dtype=np.float32), self.features)[None]

    def features_of(self, audio: bytes | None) -> np.ndarray:
        """The client's file as `input_features` [1, n_mels, 2 * n_frames]; silence when
        there is none (the worker's warm-up). Bad audio is a `PromptError` on "file"."""
        if audio is None:
            return self.silence_features()
        try:
            return audio_features(audio, self.features)
        except ValueError as exc:
            raise PromptError("file", str(exc)) from exc

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        """The request's audio and options -> tensors "input_features" (float32
        [1, n_mels, 2 * n_frames]) and "decoder_input_ids" (int32), the two labels'
        layouts, and metadata: prompt_len, language (None until detected), task,
        detect_language. Prompt ids, when sent, are the decoder prompt as they are."""
        language, task = (_option(request.options, name) for name in ("language", "task"))
        if request.token_ids:
            ids, detect = [int(t) for t in request.token_ids], False
        else:
            ids, detect = self.decoder_prompt(language, task)
        self._check_prompt(ids, detect)
        feats = self.features_of(request.audio)
        rows = len(ids) + detect
        layouts = {
            self.self_label: LabelLayout(spans=(Span.rows(rows),), scratch=self.probe_rows if detect else 0,
                                         growth={self.decode_loop: 1}),
            self.cross_label: LabelLayout(spans=(Span.rows(self.n_frames),)),
        }
        tensors = {"input_features": np.ascontiguousarray(feats, dtype=np.float32),
                   "decoder_input_ids": np.asarray(ids, dtype=np.int32)}
        meta = {"prompt_len": rows, **self._describe(ids), "detect_language": detect}
        return ProcessPromptOutput(tensors, layouts, meta)

    def _check_prompt(self, ids: list[int], detect: bool) -> None:
        if not ids:
            raise PromptError("input_ids", "the decoder prompt is empty")
        if len(ids) + detect >= self.max_seq_len:
            raise PromptError("input_ids", f"the decoder prompt has {len(ids)} tokens; "
                                           f"max_seq_len is {self.max_seq_len}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError("input_ids", f"decoder prompt ids must be in [0, {self.vocab_size}), got {bad[0]}")

    def get_loop_caps(self, max_tokens: int, prompt_len: int | None = None) -> dict[str, int]:
        """Tokens fit in the decoder's window of max_target_positions rows less the prompt
        (the default forced prompt when `prompt_len` is None); prefill emits the first."""
        if prompt_len is None:
            prompt_len = len(self.forced_ids())
        window = self.max_seq_len - prompt_len
        return {self.decode_loop: max(1, min(max_tokens, window) - 1)}

    def bytes_per_page(self, page_size: int) -> int:
        row = self.num_layers * 2 * self.heads * kv_head_bytes(self.dtype, self.head_dim)
        self_pages, cross_pages = self._pages_per_request(page_size)
        return ceil_div(page_size * row * (self_pages + cross_pages), self_pages)



def _option(options, name: str) -> str | None:
    value = options.get(name)
    if value is not None and not isinstance(value, str):
        raise PromptError(name, f"{name} must be a string")
    return value
