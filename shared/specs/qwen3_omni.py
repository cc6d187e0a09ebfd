"""Qwen3-Omni (`Qwen3OmniMoeForConditionalGeneration`): its thinker, and speech out.

A release folder holds four models (the thinker, the talker, the talker's code predictor and
Code2Wav). The thinker writes the text: a Qwen3-MoE language model
(`thinker_config.text_config`) that reads images through its vision tower (Qwen3-VL's,
whose intermediate features also enter the first LLM layers: "deepstack") and audio through
its audio encoder (over windows). Where the talker has voices (`talker_config.speaker_id`),
a request with the option "voice" also declares the talker's labels (pools "talker" and
"code") and the frame loop's cap (`_speech_layouts`, `get_loop_caps`); the gpu worker runs
its talker after its text (services/gpu_worker/runners/omni_speech.py).

What the spec does for a request (in the data worker, numpy only):
- images: Qwen2-VL's image processor (`shared.vision.qwen2_vl`), one `<|image_pad|>` per
  merged block, keyed by content as Qwen2.5-VL's;
- audio: `prepare_audios` decodes each clip, resamples it to 16 kHz and computes the Whisper
  log-mel features of the clip as it is (the processor's `padding="longest"` on one clip;
  128 bins), and writes one `<|audio_pad|>` per encoder row (transformers'
  `_get_feat_extract_output_lengths`); the rows are a `Span.rows` keyed by the clip's hash;
- positions: three a row, as transformers' `get_rope_index`: text and audio rows continue
  one by one in all three streams (the function gives audio sequential positions), an
  image's rows the (t, h, w) of its merged grid from where it starts (Qwen2.5-VL's for a
  still image, `shared.specs.vision_lm.mrope_positions`); the decode offset as Qwen2.5-VL's.

Tensors the gpu worker gets: "input_ids", "mrope_positions", and "pixel_values" +
"image_grid_thw" (images), "input_features" [mel bins, frames of every clip] +
"audio_frames" [clips] (audio).

Choices where the release is silent: a clip shorter than 0.1 s or longer than the
extractor's `chunk_length` (300 s) is refused; WAV, FLAC, MP3 and OGG files are read, other
rates resampled to 16 kHz, channels averaged. A request's clips are padded to its longest
before their features are made, as the processor does for one prompt's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from shared.audio import ACCEPTED_FORMATS, FeatureConfig, decode_audio, log_mel_features
from shared.deferred import deferred
from shared.layout import KVLabel, LabelLayout, PagedKVConfig, ProcessPromptOutput, Span, kv_head_bytes
from shared.specs.base import PreparedClip, PreparedImage, PreparedVideo, PromptError, PromptRequest
from shared.specs.decoder_lm import DecoderLMSpec
from shared.specs.qwen3_omni_video import OmniVideos, vision_order
from shared.specs.vision_lm import Qwen25VLSpec, VisionLMSpec, mrope_positions
from shared.vision import common

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

ARCHITECTURES = ("Qwen3OmniMoeForConditionalGeneration",)
#: Qwen3OmniMoeThinkerConfig's defaults
IMAGE_TOKEN_ID, AUDIO_TOKEN_ID, VIDEO_TOKEN_ID = 151_655, 151_646, 151_656
AUDIO_TOKEN = "<|audio_pad|>"
#: containers an audio input may come in (libsndfile's names)
AUDIO_FORMATS = ACCEPTED_FORMATS | {"MP3", "OGG"}
MIN_AUDIO_SECONDS = 0.1
#: speech out: the talker's frame loop, its label (a row a frame) and the code predictor's
#: scratch label, each in a pool of its own (their layers and heads are not the thinker's)
FRAME_LOOP = "frame_loop"
TALKER_LABEL, CODE_LABEL = "talker", "code"
#: the talker's opening rows after the user turns (transformers' `_get_talker_assistant_parts`:
#: three role tokens, four tts_pad, tts_bos, the first generated token)
TALKER_OPENING_ROWS = 9
#: Code2Wav's rate and the talker's frames a second (12.5 Hz: 1,920 samples a frame)
SPEECH_SAMPLE_RATE, SPEECH_FRAME_RATE = 24_000, 12.5
#: the frame loop's cap: 8 frames (0.64 s of speech) a text token the request may write,
#: and never more than MAX_SPEECH_SECONDS (the loop's max_iters)
FRAMES_PER_TOKEN = 8
MAX_SPEECH_SECONDS = 300


def omni_text_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(the thinker's language model as a Qwen3-MoE config.json dict, its M-RoPE sections):
    `thinker_config.text_config`, the head tying the thinker declares, the rope parameters
    without the multimodal keys (the sections are returned; the interleaving is the model's)."""
    thinker = config.get("thinker_config") or {}
    text = dict(thinker.get("text_config") or {})
    text["model_type"] = "qwen3_moe"
    text["tie_word_embeddings"] = bool(thinker.get("tie_word_embeddings", False))
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = tuple(int(s) for s in rope.pop("mrope_section", (24, 20, 20)))
    rope.pop("mrope_interleaved", None)
    rope.pop("interleaved", None)
    kind = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = "default" if kind == "mrope" else kind
    rope.setdefault("rope_theta", float(text.pop("rope_theta", 1_000_000.0)))
    text.pop("rope_scaling", None)
    text["rope_parameters"] = rope
    return text, section


def audio_rows(frames: int, n_window: int = 50) -> int:
    """Encoder rows of a clip of `frames` mel frames: transformers'
    `_get_feat_extract_output_lengths` (13 rows a full window of 2 * n_window frames, three
    stride-2 convolutions over the rest)."""
    leave = frames % (n_window * 2)
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (frames // (n_window * 2)) * 13


class Qwen3OmniSpec(Qwen25VLSpec):
    """The thinker of Qwen3-Omni: Qwen2.5-VL's image handling and positions over a Qwen3-MoE
    text model, plus audio inputs. Engine "omni_thinker": `OmniRunner`."""

    engine = "omni_thinker"

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        text, section = omni_text_config(config)
        DecoderLMSpec.__init__(self, text, page_size=page_size, max_seq_len=max_seq_len, dtype=dtype)
        thinker = config.get("thinker_config") or {}
        self.vlm_config = dict(config)
        self.mrope_section = section
        vision = thinker.get("vision_config") or {}
        audio = thinker.get("audio_config") or {}
        self.merge_size = int(vision.get("spatial_merge_size", 2))
        self.image_token_id = int(thinker.get("image_token_id", IMAGE_TOKEN_ID))
        self.audio_token_id = int(thinker.get("audio_token_id", AUDIO_TOKEN_ID))
        self.video_token_id = int(thinker.get("video_token_id", VIDEO_TOKEN_ID))
        self.position_id_per_seconds = float(thinker.get("position_id_per_seconds", 25))
        self.videos: OmniVideos | None = None
        self.n_window = int(audio.get("n_window", 50))
        self.features = FeatureConfig(feature_size=int(audio.get("num_mel_bins", 128)), chunk_length=300)
        self.audio_placeholder = AUDIO_TOKEN
        self.images = None
        self._speech_init(config)

    def _speech_init(self, config: Mapping[str, Any]) -> None:
        """Speech out where the release holds a talker with voices (`talker_config.speaker_id`):
        the talker's and the code predictor's labels and pools, the voices, the frame loop."""
        talker = config.get("talker_config") or {}
        self.voices = tuple(sorted(str(k).lower() for k in (talker.get("speaker_id") or {})))
        if not self.voices or config.get("enable_audio_output") is False:
            self.voices = ()
            return
        text, predictor = talker.get("text_config") or {}, talker.get("code_predictor_config") or {}
        self.talker_shape, self.code_shape = _kv_shape(text), _kv_shape(predictor)
        self.code_groups = int(talker.get("num_code_groups", 32))
        self.im_start_id = int(config.get("im_start_token_id", 151644))
        self.user_id = int(config.get("user_token_id", 872))
        self._labels = (*self._labels, KVLabel(TALKER_LABEL, TALKER_LABEL, grows_on=FRAME_LOOP),
                        KVLabel(CODE_LABEL, CODE_LABEL))
        self.sample_rate = SPEECH_SAMPLE_RATE
        self.metadata_keys = frozenset({*self.metadata_keys, "voice"})

    @property
    def speaks(self) -> bool:
        return bool(self.voices)

    @property
    def thinker_labels(self) -> tuple[KVLabel, ...]:
        return tuple(lab for lab in self.kv_labels if lab.name not in (TALKER_LABEL, CODE_LABEL))

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        thinker = self._labels
        self._labels = self.thinker_labels
        try:
            pools = super().paged_pools(num_pages)
        finally:
            self._labels = thinker
        if self.speaks:
            for name, (layers, heads, dim) in ((TALKER_LABEL, self.talker_shape), (CODE_LABEL, self.code_shape)):
                pools[name] = PagedKVConfig(name, layers, heads, dim, self.dtype, self.page_size, num_pages,
                                            self.max_seq_len)
        return pools

    def graph_loops(self) -> dict[str, int]:
        loops = super().graph_loops()
        if self.speaks:
            loops[FRAME_LOOP] = int(MAX_SPEECH_SECONDS * SPEECH_FRAME_RATE)
        return loops

    def get_loop_caps(self, max_tokens: int, prompt_len: int | None = None) -> dict[str, int]:
        """The decode loop's cap as any decoder's; with speech, the frame loop's: the talker's
        frames after its prompt step (FRAMES_PER_TOKEN a text token, at most MAX_SPEECH_SECONDS)."""
        caps = super().get_loop_caps(max_tokens, prompt_len)
        if self.speaks:
            caps[FRAME_LOOP] = min(FRAMES_PER_TOKEN * max_tokens, int(MAX_SPEECH_SECONDS * SPEECH_FRAME_RATE))
        return caps

    def bytes_per_page(self, page_size: int) -> int:
        own = super().bytes_per_page(page_size)
        if not self.speaks:
            return own
        return own + sum(layers * 2 * page_size * heads * kv_head_bytes(self.dtype, dim)
                         for layers, heads, dim in (self.talker_shape, self.code_shape))

    def parameter_counts(self) -> tuple[int, int] | None:
        return VisionLMSpec.parameter_counts(self)

    def load_folder(self, path: str | Path) -> Self:
        """The image processor's and the feature extractor's settings (preprocessor_config.json)."""
        folder = Path(path)
        self.folder = folder
        saved = common.read_json(folder / "preprocessor_config.json")
        if saved.get("feature_size") is not None or saved.get("sampling_rate") is not None:
            self.features = FeatureConfig.from_dict({"chunk_length": 300, **saved})
        if self.features.feature_size != int(((self.vlm_config.get("thinker_config") or {}).get("audio_config")
                                              or {}).get("num_mel_bins", self.features.feature_size)):
            raise ValueError(f"{folder}: the feature extractor's feature_size {self.features.feature_size} is not the "
                             "audio encoder's num_mel_bins")
        if not common.image_processor_config(folder, common.read_json(folder / "processor_config.json")):
            return self
        VisionLMSpec.load_folder(self, folder)
        assert self.images is not None  # load_folder read them
        self.videos = OmniVideos.from_images(self.images, self.position_id_per_seconds)
        self.video_placeholder = self.videos.placeholder
        return self

    def prepare_videos(self, files: Sequence[bytes]) -> tuple[PreparedVideo, ...]:
        """Each video's sampled frames as patches (`shared.specs.qwen3_omni_video`)."""
        if self.videos is None:
            raise PromptError("videos", "the model folder has no image processor settings (preprocessor_config.json)")
        return tuple(self.videos.prepare(data, f"videos[{i}]", self.merge_size, self.max_seq_len)
                     for i, data in enumerate(files))

    def prepare_image(self, data: bytes) -> PreparedImage:
        if self.images is None:
            raise PromptError("images", "the model folder has no image processor settings (preprocessor_config.json)")
        return VisionLMSpec.prepare_image(self, data)

    def prepare_audios(self, files: Sequence[bytes]) -> tuple[PreparedClip, ...]:
        """Each clip's log-mel features [mel bins, frames] and its `<|audio_pad|>` run. As
        the processor's extractor (`padding="longest"`), every clip is padded with zeros to
        the longest before its features are made (its last frames see the zeros), then cut
        to its own frames; so a clip's key covers the length it was padded to."""
        cfg = self.features
        samples = [self._decode(data, f"audios[{i}]") for i, data in enumerate(files)]
        longest = max(s.size for s in samples)
        clips = []
        for data, wave in zip(files, samples):
            padded = np.pad(wave, (0, longest - wave.size)) if wave.size < longest else wave
            features = np.ascontiguousarray(log_mel_features(padded, cfg, pad=False)[:, : wave.size // cfg.hop_length])
            settings = f"qwen3-omni-audio/1:{cfg}:{self.n_window}:{longest}".encode()
            key = hashlib.sha256(settings + b"\0" + data).hexdigest()
            clips.append(PreparedClip(features, AUDIO_TOKEN * audio_rows(features.shape[1], self.n_window), key))
        return tuple(clips)

    def _decode(self, data: bytes, param: str) -> np.ndarray:
        """A clip's samples at the extractor's rate; `PromptError` on `param` for what it cannot use."""
        cfg = self.features
        try:
            samples = decode_audio(data, cfg.sampling_rate, max_seconds=cfg.chunk_length, limit="this model hears",
                                   formats=AUDIO_FORMATS)
        except ValueError as exc:
            raise PromptError(param, str(exc)) from exc
        if samples.size < MIN_AUDIO_SECONDS * cfg.sampling_rate:
            raise PromptError(param, f"audio is {samples.size / cfg.sampling_rate:.3f} s long; "
                                     f"this model hears at least {MIN_AUDIO_SECONDS:g} s")
        return samples

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        if request.audio is not None:
            raise PromptError("file", "the served model takes audio as input_audio parts, not a file")
        ids = request.token_ids
        out = self._vision_prompt(request)
        tensors = dict(out.new_input_tensors)
        spans = audio_spans(out.kv_layout["text"].spans, ids, self.audio_token_id, request.clips, self.n_window)
        layouts = {lab.name: LabelLayout(spans=spans, growth={self.decode_loop: 1}) for lab in self.thinker_labels}
        voice = request.options.get("voice")
        if voice is not None:
            layouts.update(self._speech_layouts(str(voice), ids))
            if request.images or request.clips or request.videos:  # the talker reads the thinker's rows of them
                unkeyed = tuple(Span.rows(sp.length) if sp.key else sp for sp in spans)
                layouts.update({lab.name: LabelLayout(spans=unkeyed, growth={self.decode_loop: 1})
                                for lab in self.thinker_labels})
        if request.clips:
            tensors["input_features"] = np.ascontiguousarray(np.concatenate([c.features for c in request.clips], 1))
            tensors["audio_frames"] = np.asarray([c.features.shape[1] for c in request.clips], dtype=np.int64)
        metadata = dict(out.metadata)
        if voice is not None:
            metadata["voice"] = str(voice).lower()
        return ProcessPromptOutput(tensors, layouts, metadata)

    def _vision_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        """Qwen2.5-VL's prompt (spans, positions, pixels) over the images and videos in
        prompt order: a video is an image of t temporal patches whose positions step by its
        `t_scale` (transformers' `get_rope_index` for a video); "input_ids" keeps the video
        tokens, the pixels and "image_grid_thw" hold both kinds in prompt order."""
        ids = request.token_ids
        if not request.videos and self.video_token_id not in ids:
            return Qwen25VLSpec.process_prompt(self, PromptRequest(ids, None, request.options, request.images))
        media, kinds = vision_order(ids, self.image_token_id, self.video_token_id, request.images, request.videos)
        scales = [v.t_scale for v in request.videos]
        steps = [scales.pop(0) if video else 1 for video in kinds]
        as_images = [self.image_token_id if t == self.video_token_id else t for t in ids]
        out = Qwen25VLSpec.process_prompt(self, PromptRequest(as_images, None, request.options, tuple(media)))
        tensors = dict(out.new_input_tensors)
        tensors["input_ids"] = np.asarray(ids, dtype=np.int32)
        grids = [(int(t), int(h), int(w)) for t, h, w in tensors["image_grid_thw"]]
        positions, delta = mrope_positions(as_images, self.image_token_id, grids, self.merge_size, steps)
        tensors["mrope_positions"] = positions
        if self.videos is not None:  # seconds a temporal patch spans (an image: moot), for the talker's positions
            spans = self.videos.settings.seconds_per_grid
            tensors["video_seconds"] = np.asarray([spans if video else 1.0 for video in kinds], dtype=np.float64)
        return ProcessPromptOutput(tensors, out.kv_layout, {**out.metadata, "mrope_delta": delta})

    def _speech_layouts(self, voice: str, ids: list[int]) -> dict[str, LabelLayout]:
        """A request that asks for speech (option "voice"): the talker's rows (its prompt:
        the user turns' rows and its opening rows; then a row a frame on the frame loop) and
        the code predictor's scratch rows (a frame's codes, rewritten every frame). Its
        image and audio rows are not keyed in the prefix cache (the caller's): the talker
        reads the thinker's hidden states at them, which only a forward gives."""
        if not self.speaks:
            raise PromptError("modalities", "this model has no talker: it writes text only")
        if voice.lower() not in self.voices:
            raise PromptError("audio.voice", f"voice {voice!r} is not one of this model's voices {list(self.voices)}")
        rows = len(user_rows(ids, self.im_start_id, self.user_id)) + TALKER_OPENING_ROWS
        return {TALKER_LABEL: LabelLayout(spans=(Span.rows(rows),), growth={FRAME_LOOP: 1}),
                CODE_LABEL: LabelLayout(spans=(), scratch=self.code_groups)}


def _kv_shape(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a stack's config."""
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return int(cfg["num_hidden_layers"]), int(cfg["num_key_value_heads"]), int(head_dim)


def user_rows(ids: list[int], im_start: int, user: int) -> list[int]:
    """The prompt positions of every user turn's tokens (transformers' `user_mask`: each
    token whose last `<|im_start|>` is followed by the user role id)."""
    out, last = [], 0
    for i, tok in enumerate(ids):
        if tok == im_start:
            last = i
        if ids[min(last + 1, len(ids) - 1)] == user:
            out.append(i)
    return out


def audio_spans(spans: tuple[Span, ...], ids: list[int], audio_token_id: int, clips: tuple[PreparedClip, ...],
                n_window: int) -> tuple[Span, ...]:
    """`spans` (text `ids` spans and image `rows` spans, in prompt order) with each run of
    audio tokens inside an `ids` span cut out as a `rows` span keyed by its clip's hash.
    `PromptError` when the ids hold more or fewer audio tokens than the clips make, or a
    clip's tokens are not one run."""
    want = [audio_rows(c.features.shape[1], n_window) for c in clips]
    have = sum(1 for t in ids if t == audio_token_id)
    if have != sum(want):
        param = "prompt" if clips else "input_ids"
        raise PromptError(param, f"the prompt holds {have} audio tokens (id {audio_token_id}); "
                                 f"its {len(clips)} audio input(s) make {sum(want)}")
    if not clips:
        return spans
    out: list[Span] = []
    clip = 0
    for span in spans:
        if span.kind != "ids":
            out.append(span)
            continue
        text: list[int] = []
        toks = list(span.token_ids)
        i = 0
        while i < len(toks):
            if toks[i] != audio_token_id:
                text.append(toks[i])
                i += 1
                continue
            if text:
                out.append(Span.ids(text))
                text = []
            n = want[clip]
            if toks[i : i + n] != [audio_token_id] * n:
                raise PromptError("prompt", f"audio input {clip}'s {n} audio tokens are not one run")
            out.append(Span.rows(n, f"{clips[clip].key}:0"))
            i, clip = i + n, clip + 1
        if text:
            out.append(Span.ids(text))
    return tuple(out)
