"""The model interface every service sees (DESIGN.md section 3).

A model is two halves: a `ModelSpec` here (labels, pools, loops, `process_prompt`,
`get_loop_caps`; no weights, no torch, cheap to build, so the data worker and the
conductor can use it) and a torch module in `services/gpu_worker/modeling/`, which the gpu
worker picks for a spec by its class (`services.gpu_worker.modeling.registry.TORCH_MODELS`),
so `shared/` never names a service.

Everything a service may ask of a spec is declared here, with a default where a family
need not care (`load_folder`, `suppress_tokens`, ...): callers use the attribute, never
`hasattr` / `getattr(spec, name, default)`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

from shared.frames import ContextTurn, MetaValue
from shared.layout import (
    KVLabel,
    KVReqConfig,
    LabelLayout,
    PagedKVConfig,
    ProcessPromptOutput,
    kv_head_bytes,
    label_footprint,
)
from shared.pages import pages_for as pages_for  # the one definition (shared/pages.py), re-exported for specs

if TYPE_CHECKING:
    import numpy as np


class DeploymentError(Exception):
    """The deployment cannot serve this model; the message says why, for the operator."""


class PromptError(ValueError):
    """`process_prompt` refuses the request for the client's fault; `param` names the
    request field (the api answers 400 with it), the message is safe to show."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PreparedImage:
    """One image of a request, preprocessed by its spec (`ModelSpec.prepare_image`) in the
    data worker: the pixel tensors the vision encoder takes (float32 [tiles, C, H, W]),
    the text that replaces the image's placeholder in the prompt before tokenizing (the
    model's image tokens and the tags around them, as its processor writes them), and a
    content key (a hash of the file and the settings that made the pixels) that keys its
    rows in the prefix cache."""

    pixels: np.ndarray
    text: str
    key: str


@dataclass(frozen=True)
class PreparedClip:
    """One audio input of a request (an omni model's `input_audio` part), made by its spec
    (`ModelSpec.prepare_audio`) in the data worker: the encoder's input features (float32
    [mel bins, frames]), the text that replaces the clip's placeholder in the prompt before
    tokenizing (one audio token per encoder row), and a content key (a hash of the file and
    the settings that made the features) that keys its rows in the prefix cache."""

    features: np.ndarray
    text: str
    key: str


@dataclass(frozen=True)
class PreparedVideo:
    """One video input of a request (an omni model's `video_url` part), made by its spec
    (`ModelSpec.prepare_videos`) in the data worker: the sampled frames' patches shaped as
    an image's for Qwen2.5-VL ([t, h / merge, w / merge, merge^2, patch dim]: one entry a
    video token), the text that replaces its placeholder (one video token a merged block of
    a temporal patch), the position step between temporal patches (`t_scale`: seconds a
    patch spans times the model's positions a second), and a content key."""

    pixels: np.ndarray
    text: str
    key: str
    t_scale: int


@dataclass(frozen=True)
class PreparedAudio:
    """One context turn's audio, decoded by its spec (`ModelSpec.prepare_context`) in the
    data worker: mono float32 samples at the model's codec rate, the frames its codec's
    encoder makes of them (rows of the prompt), and a content key (a hash of the file and
    the settings that made the samples) that keys those rows in the prefix cache; `param`
    names it in a refusal (`context[i].audio`)."""

    samples: np.ndarray
    frames: int
    key: str
    param: str = "context"


@dataclass(frozen=True)
class PromptRequest:
    """What `process_prompt` sees of a request: its prompt ids (empty for a speech request
    that sends none), its multimodal inputs (`audio`: the client's file, undecoded;
    `images`: preprocessed, their placeholders already expanded in the ids) and the
    per-request model options (Whisper's `language`, `task`; None values are left out);
    `context`: the audio of a conversation's earlier turns (CSM), their placeholders
    already expanded in the ids."""

    token_ids: list[int] = field(default_factory=list)
    audio: bytes | None = None
    options: Mapping[str, MetaValue] = field(default_factory=dict)
    images: tuple[PreparedImage, ...] = ()
    context: tuple[PreparedAudio, ...] = ()
    #: a robot policy's numeric inputs (its "state", the client's "noise", flat; and the
    #: cameras' names, in the order of `images`)
    floats: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    cameras: tuple[str, ...] = ()
    #: audio inputs of an omni model, their placeholders already expanded in the ids
    clips: tuple[PreparedClip, ...] = ()
    #: video inputs of an omni model, their placeholders already expanded in the ids
    videos: tuple[PreparedVideo, ...] = ()


class ModelSpec(ABC):
    #: which runner its steps need: "decoder" (services/gpu_worker/runners/base.py),
    #: "encoder_decoder" (encdec_runner.py: an encoder pass at admission, then decoding) or
    #: "pooling" (pooling_runner.py: a prompt's forward, pooled; no decode loop)
    engine: str = "decoder"
    #: its attention reads int8 KV pages (`--kv-cache-dtype int8`): only the plain text
    #: decoder's path is built and tested for them; every other family is refused at start
    #: (ModelSource.spec) rather than served through a path nobody checked
    int8_kv: bool = False
    #: what its requests ask: "generate" (tokens), "embed" (a vector per input) or "score"
    #: (a classifier's scores of a text pair); the api routes by it
    task: str = "generate"
    #: a prompt runs in one step, never in chunks (bidirectional attention sees every row)
    whole_prompts: bool = False
    #: a pooling model's output width (0 for generating models), and whether a client may
    #: ask for fewer dimensions (a Matryoshka-trained embedding model)
    dimensions: int = 0
    matryoshka: bool = False
    #: a robot policy's actions per request: (chunk, action dim); (0, 0) for other models
    action_shape: tuple[int, int] = (0, 0)
    #: a world model's prediction per step: (tokens per frame, embed dim); (0, 0) for others
    world_shape: tuple[int, int] = (0, 0)
    #: a pooling model's vectors are L2-normalized (sentence-transformers' Normalize module)
    normalize: bool = False
    #: True for models whose requests are audio (the data worker needs a file)
    takes_audio: bool = False
    #: what a prompt holds where an image goes ("" for a model that takes no images): the
    #: text its chat template writes for an image part, which the data worker replaces by
    #: each image's `PreparedImage.text` before tokenizing
    image_placeholder: str = ""
    #: what a prompt holds where an audio input goes ("" for a model that takes none: an
    #: omni model's `<|audio_pad|>`), replaced by each clip's `PreparedClip.text`
    audio_placeholder: str = ""
    #: what a prompt holds where a video input goes ("" for a model that takes none: an
    #: omni model's `<|video_pad|>`), replaced by each video's `PreparedVideo.text`
    video_placeholder: str = ""
    #: the loop that emits one token per iteration (its cap bounds max_tokens)
    decode_loop: str = "decode_loop"
    #: the `metadata` keys `process_prompt` sets itself: a client's option of the same name
    #: is dropped by the data worker, never passed to the engine
    metadata_keys: frozenset[str] = frozenset({"prompt_len"})
    #: token ids never sampled, at every step / at the first generated token (Whisper's
    #: generation config lists them; none for most families)
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    #: the width of the model's logits rows (its LM head's vocabulary); 0: not known
    vocab_size: int = 0
    #: the longest request, prompt and output rows (each family's constructor sets it)
    max_seq_len: int

    def prompt_text(self, text: str, options: Mapping[str, MetaValue]) -> str:
        """The text the tokenizer sees for a request's prompt: the prompt itself, or what a
        family wraps it in (Orpheus' "voice: text"); `PromptError` for a bad option."""
        return text

    #: tokens that end a request besides the checkpoint's EOS (Orpheus' end_of_speech)
    stop_ids: tuple[int, ...] = ()
    #: a speech model's audio sample rate (0: the model makes no sound)
    sample_rate: int = 0
    #: a speech model's frames of sound a second and output tokens a frame (Orpheus: 7 SNAC
    #: codes; CSM: 1, a frame is one step): how `max_audio_seconds` becomes a token cap
    audio_frame_rate: float = 0.0
    audio_frame_tokens: int = 1
    #: output tokens a clip takes beyond its frames' (Higgs: its BOS frame and the 7 frames
    #: of its codebooks' delay), added to a `max_audio_seconds` cap
    audio_extra_tokens: int = 0
    #: a speech model's own sampling defaults (`/v1/audio/speech` bodies may override them)
    speech_defaults: tuple[tuple[str, float], ...] = ()
    #: the `/v1/audio/speech` extension fields the family reads (Chatterbox: exaggeration,
    #: cfg_weight); the route refuses the others' fields rather than ignore them
    speech_extensions: tuple[str, ...] = ()

    def warmup_request(self, n: int) -> PromptRequest:
        """The worker's warm-up request (`n` prompt ids): a text prompt of ordinary ids, or
        no ids for a speech model (silent audio); a family whose requests need more (a
        policy's cameras and state) builds its own."""
        return PromptRequest([] if self.takes_audio else self.warmup_ids(n))

    def prepare_image(self, data: bytes) -> PreparedImage:
        """An image file (bytes as the client sent it) preprocessed as the model's processor
        does; `PromptError` on "images" for a file it cannot use. Only for models with an
        `image_placeholder`."""
        raise PromptError("images", "the served model does not take images")

    def prepare_audios(self, files: Sequence[bytes]) -> tuple[PreparedClip, ...]:
        """A request's audio inputs (the files' bytes, in prompt order) made into the
        model's features as its processor does for one prompt's clips (together: its
        feature extractor pads them to the longest); `PromptError` on "audios[i]" for a file
        it cannot use. Only for models with an `audio_placeholder`."""
        raise PromptError("audios", "the served model does not take audio inputs")

    def prepare_videos(self, files: Sequence[bytes]) -> tuple[PreparedVideo, ...]:
        """Video inputs (the files' bytes) made into the model's patches as its processor
        does; `PromptError` on "videos[i]" for a file it cannot use. Only for models with a
        `video_placeholder`."""
        raise PromptError("videos", "the served model does not take video inputs")

    def warmup_ids(self, n: int) -> list[int]:
        """A text prompt of `n` ordinary ids for the worker's warm-up request: 1, 2, ...
        skipping every placeholder id a prompt may hold only beside its media (an image's,
        an audio frame's), which made-up ids would otherwise hit: a CSM checkpoint whose
        audio placeholder is id 2 refused its own warm-up and never started."""
        reserved = {getattr(self, name, None) for name in ("image_token_id", "audio_token_id", "audio_eos_token_id")}
        ids: list[int] = []
        token = 1
        while len(ids) < n:
            if token not in reserved:
                ids.append(token)
            token += 1
        return ids

    def parameter_counts(self) -> tuple[int, int] | None:
        """(every parameter, those one token computes with): the two differ for a mixture of
        experts. Stated by /v1/models and the worker's start-up log where a family counts
        them from its config; None where it does not (the default)."""
        return None

    def join_context(self, before: str, text: str, options: Mapping[str, MetaValue]) -> str:
        """The prompt text of a request with context turns: the turns' text (`before`, from
        `prepare_context`) and the request's own (`text`, from `prompt_text`). Before it, by
        default (CSM); a family whose own text opens with a turn that comes first (Higgs'
        system turn) puts the context after that."""
        return before + text

    def prepare_context(self, turns: Sequence[ContextTurn]) -> tuple[tuple[PreparedAudio, ...], str]:
        """A conversation's earlier turns (oldest first) -> (their audio, decoded; the
        text that precedes the request's own prompt text, each turn's audio placeholders
        expanded to its frames). Only for models that continue a conversation (CSM);
        `PromptError` naming the turn's field (`context[i].audio`) for what it cannot use."""
        raise PromptError("context", "the served model takes no context turns")

    @property
    def step_loops(self) -> tuple[str, ...]:
        """The loops one decode step iterates, each once per committed token. Every one is
        capped, refused and stopped the same way: the request ends ("length") when any of
        them reaches its cap."""
        return (self.decode_loop,)

    def load_folder(self, path: str | Path) -> Self:
        """Read what the spec needs from a Hugging Face folder beyond config.json (the
        registry's factories only get config.json); `ModelSource.spec` calls it for every
        folder. Nothing to read by default; Whisper reads its generation and feature
        settings."""
        return self

    @property
    @abstractmethod
    def kv_labels(self) -> tuple[KVLabel, ...]:
        """Every label the model's requests may open, declared once."""

    def with_state_slots(self, slots: int) -> Self:
        """Size the spec's state pool (a `PagedKVConfig` with `state_floats`: linear
        attention's per-request state) to `slots` slots; nothing to size by default."""
        return self

    @abstractmethod
    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        """The paged pools the model needs, each sized to `num_pages`."""

    @abstractmethod
    def graph_loops(self) -> dict[str, int]:
        """Each loop of the model's graph and its `max_iters`."""

    @abstractmethod
    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        """Input tensors, one `LabelLayout` per label this request opens, and `metadata`
        for the engine (at least "prompt_len": the rows the prompt commits, what the
        conductor checks lengths with). Raises `PromptError` for the client's fault."""

    @abstractmethod
    def get_loop_caps(self, max_tokens: int, prompt_len: int | None = None) -> dict[str, int]:
        """Iterations the request's stop check allows for each loop."""

    @abstractmethod
    def bytes_per_page(self, page_size: int) -> int:
        """KV bytes one page costs across all pools, to size pools from memory."""

    # -- derived, shared by every model ------------------------------------------------

    def label(self, name: str) -> KVLabel:
        for lab in self.kv_labels:
            if lab.name == name:
                return lab
        raise KeyError(name)

    def validate(self, num_pages: int = 1) -> None:
        """`_refuse_undeclared_pools` plus label sanity: run before any worker starts."""
        pools = self.paged_pools(num_pages)
        loops = self.graph_loops()
        names = [lab.name for lab in self.kv_labels]
        if len(set(names)) != len(names):
            raise DeploymentError(f"model declares a KV label twice: {names}")
        for lab in self.kv_labels:
            if lab.pool not in pools:
                raise DeploymentError(f"KV label {lab.name!r} lives in pool {lab.pool!r}, "
                                      f"which the model does not declare (pools: {sorted(pools)})")
            if lab.grows_on is not None and lab.grows_on not in loops:
                raise DeploymentError(f"KV label {lab.name!r} grows on loop {lab.grows_on!r}, "
                                      f"which the graph does not have (loops: {sorted(loops)})")
        _refuse_undeclared_pools(pools, self.kv_labels)

    def refuse_undeclared_labels(self, kv_layout: dict[str, LabelLayout]) -> None:
        """Raise ValueError for a layout naming a label the model never declared."""
        declared = {lab.name for lab in self.kv_labels}
        unknown = sorted(set(kv_layout) - declared)
        if unknown:
            raise ValueError(f"layout names undeclared KV label(s) {unknown}; declared: {sorted(declared)}")
        loops = set(self.graph_loops())
        for layout in kv_layout.values():
            layout.check_loops(loops)

    def clamp_caps(self, caps: dict[str, int]) -> dict[str, int]:
        """Clamp each cap to its loop's `max_iters`; unknown loops are a model bug."""
        loops = self.graph_loops()
        unknown = sorted(set(caps) - set(loops))
        if unknown:
            raise ValueError(f"get_loop_caps names unknown loop(s) {unknown}")
        return {loop: max(0, min(int(n), loops[loop])) for loop, n in caps.items()}

    def kv_configs(
        self, kv_layout: dict[str, LabelLayout], caps: dict[str, int], pools: dict[str, PagedKVConfig]
    ) -> dict[str, KVReqConfig]:
        """A `KVReqConfig` for every declared pool, even one this layout leaves empty."""
        out: dict[str, KVReqConfig] = {}
        for name, pool in pools.items():
            fps = {}
            for label_name, layout in kv_layout.items():
                lab = self.label(label_name)
                if lab.pool == name:
                    fps[label_name] = label_footprint(layout, caps, pool.page_size, lab.window)
            out[name] = KVReqConfig(pool=name, page_size=pool.page_size, footprints=fps)
        return out


def _refuse_undeclared_pools(pools: dict[str, PagedKVConfig], labels: tuple[KVLabel, ...]) -> None:
    used = {lab.pool for lab in labels}
    unused = sorted(set(pools) - used)
    if unused:
        raise DeploymentError(f"paged KV pool(s) {unused} are used by no KV label; "
                              "declare a KVLabel for each pool or drop the pool")


# -- what the gpu worker's runners read of a spec ------------------------------------------


@runtime_checkable
class RunnerSpec(Protocol):
    """What every runner (services/gpu_worker/runners/base.py and its subclasses) reads of a
    spec, beyond the `ModelSpec` methods the engine calls."""

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]: ...

    @property
    def step_loops(self) -> tuple[str, ...]: ...

    def label(self, name: str) -> KVLabel: ...


@runtime_checkable
class DecoderRunnerSpec(RunnerSpec, Protocol):
    """The decoder runner's: layer i reads label `layer_labels[i]`; `config` gives the
    attention shape FlashInfer plans with (`num_attention_heads`, `attn_scale`,
    `attn_softcap`)."""

    layer_labels: list[str]
    config: Any


@runtime_checkable
class VisionRunnerSpec(DecoderRunnerSpec, Protocol):
    """The vision runner's (vision_runner.py): the placeholder id whose rows an image's
    rows replace, and how many rows each tile makes."""

    image_token_id: int
    rows_per_tile: int


@runtime_checkable
class MropeVisionRunnerSpec(VisionRunnerSpec, Protocol):
    """The M-RoPE vision runner's (mrope_runner.py: Qwen2.5-VL): each image is one grid of
    patches whose rows are its merged blocks, `merge_size` x `merge_size` patches each."""

    merge_size: int


@runtime_checkable
class SpeechRunnerSpec(DecoderRunnerSpec, Protocol):
    """The speech runner's (speech_runner.py): the audio tokens' code arithmetic and the
    codec's folder."""

    codes: Any
    codec_path: Any


@runtime_checkable
class CsmRunnerSpec(DecoderRunnerSpec, Protocol):
    """The CSM runner's (csm_runner.py): the two labels and their pools, the depth stack's
    config, the codebooks, the frame that ends a request, the codec, and the ids of a
    context turn's frame rows (its audio's frames, the all-zero frame closing it)."""

    backbone_label: str
    depth_label: str
    pool: str
    depth_pool: str
    depth_config: Any
    num_codebooks: int
    codebook_vocab: int
    codebook_eos: int
    eos_frame_token: int
    codebook_loop: str
    depth_rows: int
    codec_path: Any
    codec_config: Any
    audio_token_id: int | None
    audio_eos_token_id: int | None


@runtime_checkable
class ChatterboxRunnerSpec(DecoderRunnerSpec, Protocol):
    """The Chatterbox runner's (runners/chatterbox.py): its two labels (the guidance row
    set second) and their pool, the conditioning prefix's rows, the start of speech, the
    built-in voice's file."""

    labels: tuple[str, ...]
    pool: str
    cond_rows: int
    bos: int
    conds_path: Any


class Qwen3TTSRunnerSpec(DecoderRunnerSpec, Protocol):
    """The Qwen3-TTS runner's (runners/qwen3_tts.py): CSM's labels and codebooks, the
    frame that ends a request, the sub-talker's sampling, the codec's folder, `tts_pad`."""

    backbone_label: str
    depth_label: str
    pool: str
    depth_pool: str
    depth_config: Any
    num_codebooks: int
    codebook_vocab: int
    codec_eos: int
    codebook_loop: str
    depth_rows: int
    subtalker: Any
    codec_path: Any
    codec_config: Any
    #: the text id a frame row adds when no text is streamed
    tts_pad: int


@runtime_checkable
class HiggsRunnerSpec(DecoderRunnerSpec, Protocol):
    """The Higgs runner's (runners/higgs.py): its label and pool, the codebooks and the
    stream BOS / EOS codes, the flat tokens of the delay pattern, the frame that ends a
    request, RAS's settings, the codec."""

    label_name: str
    pool: str
    num_codebooks: int
    codebook_size: int
    stream_bos: int
    stream_eos: int
    audio_token_id: int
    audio_bos_token_id: int
    audio_delay_token_id: int
    eos_frame_token: int
    ras_win_len: int
    ras_max_repeat: int
    codec_path: Any
    codec_config: Any

    def clip_rows(self, frames: int) -> int: ...


@runtime_checkable
class PoolingRunnerSpec(RunnerSpec, Protocol):
    """The pooling runner's (pooling_runner.py): how rows become one vector, and whether
    it is normalized; `heads` for the attention backend's pick."""

    label_name: str
    pooling: str
    normalize: bool
    bidirectional: bool
    heads: int


@runtime_checkable
class PolicyRunnerSpec(RunnerSpec, Protocol):
    """The policy runner's (runners/policy.py): the prefix's label, the query heads (the
    attention backend's pick), the image token and its rows per camera, the flow loop."""

    label_name: str
    heads: int
    image_token_id: int
    rows_per_image: int
    flow_loop: str


@runtime_checkable
class WorldRunnerSpec(RunnerSpec, Protocol):
    """The world-model runner's (runners/world.py): the frames label, the query heads, the
    tokens per frame, the rollout loop."""

    label_name: str
    heads: int
    tokens_per_frame: int
    rollout_loop: str


@runtime_checkable
class DiffusionRunnerSpec(RunnerSpec, Protocol):
    """The diffusion runner's (runners/diffusion.py): the text label, the query heads, the
    denoising loop, the pixels per latent patch (spatial) and frames per latent (temporal),
    the pipeline's component configs (`config["transformer"]`, `config["scheduler"]`)."""

    label_name: str
    heads: int
    denoise_loop: str
    spatial: int
    temporal: int
    config: Any


@runtime_checkable
class EncoderDecoderRunnerSpec(RunnerSpec, Protocol):
    """The encoder-decoder runner's (encdec_runner.py): the two labels, the encoder's
    input and output frames, the language probe and the suppress lists."""

    self_label: str
    cross_label: str
    n_frames: int
    n_mels: int
    input_frames: int
    probe_rows: int
    decoder_start_token_id: int
    suppress_tokens: tuple[int, ...]
    begin_suppress_tokens: tuple[int, ...]

    def language_ids(self) -> list[int]: ...

    def language_code(self, token_id: int) -> str | None: ...


def protocol_members(proto: type) -> list[str]:
    """The names a runner protocol declares (its own and its bases')."""
    names: list[str] = []
    for cls in reversed(proto.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        for name in (*getattr(cls, "__annotations__", {}), *vars(cls)):
            if not name.startswith("_") and name not in names:
                names.append(name)
    return names


def refuse_runner_gaps(spec: Any, proto: type) -> None:
    """DeploymentError naming what `spec` lacks of what its runner reads (`proto`), before
    any weight is read."""
    missing = [n for n in protocol_members(proto) if not hasattr(spec, n)]
    if missing:
        raise DeploymentError(f"{type(spec).__name__} runs on the {spec.engine!r} engine, whose runner reads "
                              f"{missing} of its spec, which it does not have ({proto.__name__})")


def added_tokens(folder: str | Path) -> dict[str, int]:
    """The added tokens (content -> id) of a folder's tokenizer.json, {} where it has none:
    where a family's special tokens live when its configs do not list them (Whisper's
    language tokens, Orpheus' `<custom_token_N>` codes)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return {}
    return {t["content"]: int(t["id"]) for t in json.loads(path.read_text()).get("added_tokens", [])}


def describe_parameters(spec: ModelSpec) -> str:
    """"; 30.5B parameters, 3.35B active" (a mixture of experts), "; 135M parameters"
    (dense), or "" where the spec does not count them: for the start-up log line."""
    counts = spec.parameter_counts()
    if counts is None:
        return ""
    total, active = counts
    text = f"; {_magnitude(total)} parameters"
    return text + (f", {_magnitude(active)} active" if active != total else "")


def _magnitude(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


class InStepLoopSpec(ModelSpec):
    """A model whose one loop runs in the runner, not as decode steps, over one paged pool
    (a robot policy's flow-matching steps, a world model's rollout, a diffusion model's
    denoising): no step loop (an iteration writes no row), one iteration a worker step from
    the step that runs the prompt (services/gpu_worker/runners/loop_steps.py); the loop's
    graph bound and cap both `loop_cap`, the pool `pool` of the model's layers."""

    #: the loop's name, and the pool's (set by the subclass)
    in_step_loop: str
    pool: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    max_seq_len: int

    @property
    def loop_cap(self) -> int:
        raise NotImplementedError

    @property
    def step_loops(self) -> tuple[str, ...]:
        return ()  # the loop is the runner's (an iteration a worker step, no row), not a decode step's

    def graph_loops(self) -> dict[str, int]:
        return {self.in_step_loop: self.loop_cap}

    def get_loop_caps(self, max_tokens: int, prompt_len: int | None = None) -> dict[str, int]:
        return {self.in_step_loop: self.loop_cap}

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        return {self.pool: PagedKVConfig(self.pool, self.num_layers, self.kv_heads, self.head_dim, self.dtype,
                                         self.page_size, num_pages, self.max_seq_len)}

    def bytes_per_page(self, page_size: int) -> int:
        return self.num_layers * 2 * page_size * self.kv_heads * kv_head_bytes(self.dtype, self.head_dim)


class FrameLoopSpec(ModelSpec):
    """A speech model that makes a frame (or a speech token) a step on one pool of its
    decoder's layers (Higgs Audio, Chatterbox's T3): its labels, its pool, its one loop.
    `max_tokens` counts frames; the prompt's step makes the first."""

    #: the frame loop (set by the subclass), the labels' pool
    decode_loop: str
    pool: str
    config: Any  # the decoder's ModelConfig
    dtype: str
    page_size: int
    max_seq_len: int
    _labels: tuple[KVLabel, ...]

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return self._labels

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        c = self.config
        return {self.pool: PagedKVConfig(self.pool, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                         self.dtype, self.page_size, num_pages, self.max_seq_len)}

    def graph_loops(self) -> dict[str, int]:
        # the prompt's step makes the first frame, so at most max_seq_len - 1 more
        return {self.decode_loop: self.max_seq_len - 1}

    def get_loop_caps(self, max_tokens: int, prompt_len: int | None = None) -> dict[str, int]:
        return {self.decode_loop: max(1, max_tokens - 1)}

    def bytes_per_page(self, page_size: int) -> int:
        c = self.config
        return c.num_hidden_layers * 2 * page_size * c.num_key_value_heads * kv_head_bytes(self.dtype, c.head_dim)


class FrameDepthSpec(ModelSpec):
    """A speech model that makes a frame a step: a backbone row on `pool`, then a depth
    decoder's inner loop over the frame's codebooks on scratch rows of `depth_pool` (CSM's
    depth decoder, Qwen3-TTS's code predictor). Its pools, loops and caps: `max_tokens`
    counts frames, and each frame runs the whole codebook loop."""

    #: the frame loop and the codebook loop (set by the subclass), the labels' pools
    decode_loop: str
    codebook_loop: str
    pool: str
    depth_pool: str
    num_codebooks: int
    config: Any  # the backbone's ModelConfig
    depth_config: Any  # the depth decoder's
    dtype: str
    page_size: int
    max_seq_len: int
    _labels: tuple[KVLabel, ...]

    @property
    def depth_rows(self) -> int:
        """Rows one frame's depth decode writes: the backbone's hidden state and codes 0 to
        `num_codebooks - 2` (the last code is sampled, never fed back)."""
        return self.num_codebooks

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return self._labels

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        b, d = self.config, self.depth_config
        return {
            self.pool: PagedKVConfig(self.pool, b.num_hidden_layers, b.num_key_value_heads, b.head_dim, self.dtype,
                                     self.page_size, num_pages, self.max_seq_len),
            self.depth_pool: PagedKVConfig(self.depth_pool, d.num_hidden_layers, d.num_key_value_heads, d.head_dim,
                                           self.dtype, self.page_size, num_pages, self.max_seq_len),
        }

    def graph_loops(self) -> dict[str, int]:
        # the prompt's step makes the first frame, so at most max_seq_len - 1 more
        return {self.decode_loop: self.max_seq_len - 1, self.codebook_loop: self.num_codebooks - 1}

    def get_loop_caps(self, max_tokens: int, prompt_len: int | None = None) -> dict[str, int]:
        return {self.decode_loop: max(1, max_tokens - 1), self.codebook_loop: self.num_codebooks - 1}

    def bytes_per_page(self, page_size: int) -> int:
        return sum(c.num_hidden_layers * 2 * page_size * c.num_key_value_heads * kv_head_bytes(self.dtype, c.head_dim)
                   for c in (self.config, self.depth_config))
