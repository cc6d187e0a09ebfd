"""What one api process is configured with, gathered in one frozen value.

Kept apart from the command line so tests and the launcher can build an app directly.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping

import msgspec

from services.api.media import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES_PER_REQUEST,
    MediaPolicy,
)
from shared.config import advertised, env_address
from shared.generation_config import GenerationDefaults

DEFAULT_MAX_BODY_BYTES = 1 << 20
#: ... for a model that takes images: a chat body carries its images as base64 data URLs
VISION_MAX_BODY_BYTES = 64 << 20
DEFAULT_WS_MAX_LIVE = 64
DEFAULT_LOG_STATS_S = 10.0


class ApiSettings(msgspec.Struct, frozen=True, kw_only=True):
    #: the served name (--served-model-name; default the model's: a Hub id as is, a folder's
    #: name, a .gguf's stem): what /v1/models lists and OpenAI requests must name
    model_name: str  # also put on every GenerateRequest
    api_addr: str  # where this process binds its PULL for outputs
    advertise_addr: str  # what peers use as reply_to (== api_addr unless it is 0.0.0.0)
    data_worker_addr: str
    conductor_addr: str
    control_addr: str
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies / WS frames -> 413
    ws_max_live: int = DEFAULT_WS_MAX_LIVE  # live requests per WebSocket; more -> 429
    status_timeout_s: float = 1.0  # no ClusterStatus within this = not ready
    api_key: str | None = None  # set: every route but /health and /ready needs Bearer <key>
    takes_audio: bool = False  # a speech model (Whisper): the audio routes serve, else 400
    #: a vision model's image placeholder (its spec's; "" for a model that takes no images,
    #: which refuses an image part with a 400 naming it)
    image_placeholder: str = ""
    #: an omni model's audio placeholder (its spec's; "" for a model that takes no audio
    #: inputs, which refuses an input_audio part with a 400 naming it)
    audio_placeholder: str = ""
    #: an omni model's video placeholder ("" for a model that takes no video inputs, which
    #: refuses a video_url part with a 400 naming it)
    video_placeholder: str = ""
    #: a speech model's audio sample rate (its codec's; 0 for a model that makes no sound)
    sample_rate: int = 0
    #: an omni model's voices for speech out on the chat route (its spec's; empty: text only)
    voices: tuple[str, ...] = ()
    audio_language: str | None = None  # the language a speech model assumes when none is sent
    #: a speech model's own sampling defaults (`ModelSpec.speech_defaults`), under a body's fields
    speech_defaults: dict[str, float] = {}
    #: a speech model's frames a second and tokens a frame (`ModelSpec.audio_frame_rate`):
    #: `max_audio_seconds` in tokens
    audio_frame_rate: float = 0.0
    audio_frame_tokens: int = 1
    audio_extra_tokens: int = 0
    #: a speech model that takes `instructions` (Qwen3-TTS' style instructions)
    speech_instructions: bool = False
    #: the speech extension fields the served family reads (`ModelSpec.speech_extensions`)
    speech_extensions: tuple[str, ...] = ()
    #: the longest prompt + output the deployment serves (its max_seq_len as the conductor
    #: computes it), shown as `max_model_len` by /v1/models and /tokenize; 0: not known
    max_model_len: int = 0
    #: a robot policy's actions: (chunk, action dim) of each reply's matrix
    action_shape: tuple[int, int] = (0, 0)
    #: a world model's predicted frames: (tokens, embed dim) of each step's embedding
    world_shape: tuple[int, int] = (0, 0)
    #: an image/video model's limits (the spec's): pixels per latent patch, frames per
    #: latent frame, the largest side, the most frames, the most denoising steps
    image_limits: tuple[int, int, int, int, int] = (16, 4, 2048, 189, 100)
    #: an image model that edits images (`POST /v1/images/edits`: BAGEL; not Cosmos 3): the
    #: resize its input image takes, which is the edit's size (max side, min side, stride;
    #: `shared.vision.bagel.Resize`); empty: it does not edit
    image_edit_resize: tuple[int, ...] = ()
    #: a robot policy's camera names (LeRobot's `input_features`, in order; empty: it takes
    #: any) and its state's length (0: not known): the openpi WebSocket maps onto them
    policy_cameras: tuple[str, ...] = ()
    policy_state_size: int = 0
    #: the model's parameters and those one token computes with (`ModelSpec.parameter_counts`;
    #: they differ for a mixture of experts), shown by /v1/models; 0: not counted
    parameters: int = 0
    active_parameters: int = 0
    #: the checkpoint's sampling defaults (generation_config.json; `--generation-config`),
    #: under every request's own fields
    generation_defaults: GenerationDefaults = GenerationDefaults()
    #: usage reports the prompt tokens the prefix cache served (vLLM's
    #: --enable-prompt-tokens-details: OpenAI's `prompt_tokens_details.cached_tokens`,
    #: `/generate`'s `usage.cached_tokens`, the Responses API's `input_tokens_details`)
    prompt_tokens_details: bool = False
    log_stats_s: float = DEFAULT_LOG_STATS_S  # the stats line's period while there is traffic; 0: off
    #: the format tool calls are parsed from ("auto": chosen from the chat template)
    tool_call_parser: str = "auto"
    #: what the served model does (`ModelSpec.task`): "generate", "embed" or "score"; the
    #: routes of the other tasks answer 400 naming it
    task: str = "generate"
    #: a pooling model's output width, whether a client may ask for fewer (Matryoshka),
    #: and whether its vectors are normalized (so a cut one is normalized again)
    dimensions: int = 0
    matryoshka: bool = False
    normalized: bool = False
    #: image inputs (`media.py`, `MediaPolicy`): the largest file, the most pixels, one
    #: deadline per http(s) fetch, the hosts images may come from (empty: any), the folder
    #: file:// images may come from (None: none), images per request
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    media_fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    #: stored /v1/responses (`dialects/responses/store.py`): at most this many (least
    #: recently used evicted first; 0 stores none), each for at most this many seconds
    responses_store_max: int = 1000
    responses_store_ttl_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.model_name.strip():
            raise ValueError("the served model name must be non-empty")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.ws_max_live < 1:
            raise ValueError(f"ws_max_live must be >= 1, got {self.ws_max_live}")
        if self.max_model_len < 0 or self.log_stats_s < 0:
            raise ValueError("max_model_len and log_stats_s must be >= 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")
        if self.responses_store_max < 0 or self.responses_store_ttl_s <= 0:
            raise ValueError("responses_store_max must be >= 0 and responses_store_ttl_s > 0")
        self.media_policy()  # a bad media setting is refused at start, not at the first image

    def media_policy(self) -> MediaPolicy:
        """What `media.load_image` accepts, from these settings."""
        return MediaPolicy(
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            fetch_timeout_s=self.media_fetch_timeout_s,
            allowed_media_domains=self.allowed_media_domains,
            allowed_local_media_path=self.allowed_local_media_path,
            max_images_per_request=self.max_images_per_request,
        )

    def __repr__(self) -> str:  # never print the key (settings end up in logs and tracebacks)
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        if fields["api_key"] is not None:
            fields["api_key"] = "***"
        return "ApiSettings(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def split_domains(values: str | Iterable[str]) -> tuple[str, ...]:
    """Host names from a comma- and/or space-separated list, or a list of such strings
    (`--allowed-media-domains a.com b.com` and vLLM-style `a.com,b.com` alike)."""
    items = [values] if isinstance(values, str) else list(values)
    return tuple(d for item in items for d in re.split(r"[,\s]+", item) if d)


#: image-input settings read from the environment: env var -> (ApiSettings field, parser).
#: The api's flags take their defaults from here, and `settings_from_env` reads them too.
MEDIA_ENV: dict[str, tuple[str, Callable[[str], object]]] = {
    "MSTAR_MAX_IMAGE_BYTES": ("max_image_bytes", int),
    "MSTAR_MAX_IMAGE_PIXELS": ("max_image_pixels", int),
    "MSTAR_MEDIA_FETCH_TIMEOUT_S": ("media_fetch_timeout_s", float),
    "MSTAR_ALLOWED_MEDIA_DOMAINS": ("allowed_media_domains", split_domains),
    "MSTAR_ALLOWED_LOCAL_MEDIA_PATH": ("allowed_local_media_path", str),
    "MSTAR_MAX_IMAGES_PER_REQUEST": ("max_images_per_request", int),
}


def media_from_env(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The image-input settings set (non-empty) in the environment, as ApiSettings fields."""
    env = os.environ if environ is None else environ
    return {field: parse(env[name]) for name, (field, parse) in MEDIA_ENV.items() if env.get(name)}


def settings_from_env(model_name: str, **overrides: object) -> ApiSettings:
    """Settings from MSTAR_<NAME>_ADDR / the default ipc sockets and the MSTAR_* image-input
    variables (`MEDIA_ENV`), with overrides."""
    api_addr = str(overrides.pop("api_addr", env_address("api")))
    values: dict[str, object] = {
        "model_name": model_name,
        "api_addr": api_addr,
        "advertise_addr": advertised(api_addr, None),
        "data_worker_addr": env_address("data_worker"),
        "conductor_addr": env_address("conductor"),
        "control_addr": env_address("conductor_control"),
        **media_from_env(),
    }
    values.update(overrides)
    return ApiSettings(**values)  # type: ignore[arg-type]
