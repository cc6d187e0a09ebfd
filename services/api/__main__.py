"""`python -m services.api`: run the api service alone (the launcher runs it the same way).

One process: uvicorn on uvloop (`uvicorn.Server.run`, as `uvicorn.run` does, via
`ApiServer` for a clean drain). SIGINT/SIGTERM run uvicorn's shutdown, whose lifespan
closes the ZMQ sockets (aborting live requests) and removes the bound ipc socket file.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from shared import start_gate
from shared.config import (
    add_address_flags,
    add_deployment_flags,
    advertised,
    deployment_from_args,
    kv_dtype,
    resolve_addresses,
)
from shared.generation_config import FLAG_HELP as GENERATION_FLAG_HELP
from shared.logs import add_logging_flags, setup_logging
from shared.memory import release_free_heap
from shared.models import add_models_flags
from shared.zmq_utils import cleanup_ipc

if TYPE_CHECKING:
    from services.api.settings import ApiSettings
    from shared.config import Deployment
    from shared.model_source import ModelSource, TokenizerBundle
    from shared.specs.base import ModelSpec

ADDRESSES = ["api", "data_worker", "conductor", "conductor_control"]
DRAIN_S = 5.0  # after SIGTERM, open requests get this long to finish, then end with a 503
#: Idle keep-alive connections are closed after this long. uvicorn's 5 s equals httpx's
#: (and the OpenAI SDK's) client-side expiry, so a client could reuse a connection in the
#: very instant the server closed it: a lost request (httpx.ReadError) under bursty load.
#: The server must outlive its clients' idle timeouts, as behind a load balancer (60 s).
KEEP_ALIVE_S = 65.0




def add_model_flags(p: argparse.ArgumentParser) -> None:
    """How the served model is named and read: its name, tool-call format, default
    sampling and chat template."""
    p.add_argument("--served-model-name", default=os.environ.get("MSTAR_SERVED_MODEL_NAME") or None,
                   help="the name /v1/models lists and OpenAI requests must give as `model` "
                        "(env MSTAR_SERVED_MODEL_NAME; default: the Hub id, the folder's name or the .gguf's stem)")
    p.add_argument("--tool-call-parser", default=os.environ.get("MSTAR_TOOL_CALL_PARSER") or "auto",
                   choices=("auto", "hermes", "llama3_json", "mistral", "mistral_args"),
                   help="the format the model writes tool calls in: hermes, llama3_json, mistral, mistral_args, "
                        "or auto (chosen from the chat template) (env MSTAR_TOOL_CALL_PARSER; default auto)")
    p.add_argument("--generation-config", default=os.environ.get("MSTAR_GENERATION_CONFIG") or "auto",
                   help=GENERATION_FLAG_HELP)
    p.add_argument("--chat-template", default=os.environ.get("MSTAR_CHAT_TEMPLATE") or None,
                   help="a Jinja chat template file that replaces the checkpoint's "
                        "(env MSTAR_CHAT_TEMPLATE; default: the checkpoint's own)")


def build_parser() -> argparse.ArgumentParser:
    from services.api.settings import (
        DEFAULT_LOG_STATS_S,
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_WS_MAX_LIVE,
        VISION_MAX_BODY_BYTES,
    )

    p = argparse.ArgumentParser(prog="python -m services.api",
                                description="mstar api service: HTTP / SSE / WebSocket front door")
    p.add_argument("--host", default=os.environ.get("MSTAR_API_HOST", "127.0.0.1"),
                   help="HTTP bind host (env MSTAR_API_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=int(os.environ.get("MSTAR_API_PORT", "8000")),
                   help="HTTP port (env MSTAR_API_PORT; default 8000)")
    # --model, --max-seq-len (for max_model_len), and --deployment as the launcher hands it
    add_deployment_flags(p, names=("model", "max_seq_len"))
    add_model_flags(p)
    add_address_flags(p, ADDRESSES)
    add_models_flags(p)
    p.add_argument("--api-advertise-addr", default=os.environ.get("MSTAR_API_ADVERTISE_ADDR") or None,
                   help="the api address workers reply to "
                        "(env MSTAR_API_ADVERTISE_ADDR; default: the api bind address)")
    body = os.environ.get("MSTAR_MAX_BODY_BYTES")
    p.add_argument("--max-body-bytes", type=int, default=int(body) if body else None,
                   help=f"largest request body or WebSocket frame; larger is a 413 "
                        f"(env MSTAR_MAX_BODY_BYTES; default {DEFAULT_MAX_BODY_BYTES}, "
                        f"{VISION_MAX_BODY_BYTES} for a model that takes images: images come as data URLs)")
    p.add_argument("--ws-max-live", type=int, default=int(os.environ.get("MSTAR_WS_MAX_LIVE") or DEFAULT_WS_MAX_LIVE),
                   help=f"live requests per WebSocket; more get an error frame with status 429 "
                        f"(env MSTAR_WS_MAX_LIVE; default {DEFAULT_WS_MAX_LIVE})")
    p.add_argument("--keep-alive-s", type=float, default=float(os.environ.get("MSTAR_API_KEEP_ALIVE_S", KEEP_ALIVE_S)),
                   help=f"close idle keep-alive HTTP connections after this many seconds "
                        f"(env MSTAR_API_KEEP_ALIVE_S; default {KEEP_ALIVE_S:g})")
    p.add_argument("--log-stats-s", type=float,
                   default=float(os.environ.get("MSTAR_LOG_STATS_S", DEFAULT_LOG_STATS_S)),
                   help=f"log a stats line (throughput, running, waiting, KV use, prefix hits) this often while "
                        f"there is traffic; 0 is off (env MSTAR_LOG_STATS_S; default {DEFAULT_LOG_STATS_S:g})")
    # No default shown: the key must not appear in --help output or in `ps` via a default.
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every route but /health and /ready "
                        "(env MSTAR_API_KEY; default: none, no key needed)")
    add_media_flags(p)
    p.add_argument("--responses-store-max", type=int, default=int(os.environ.get("MSTAR_RESPONSES_STORE_MAX", 1000)),
                   help="most /v1/responses kept in memory for previous_response_id and GET, least recently used "
                        "evicted first; 0 keeps none (env MSTAR_RESPONSES_STORE_MAX; default 1000)")
    p.add_argument("--responses-store-ttl", type=float,
                   default=float(os.environ.get("MSTAR_RESPONSES_STORE_TTL_S", 3600.0)), metavar="SECONDS",
                   help="seconds a stored response is kept (env MSTAR_RESPONSES_STORE_TTL_S; default 3600)")
    add_logging_flags(p)
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   default=os.environ.get("MSTAR_ENABLE_PROMPT_TOKENS_DETAILS", "").lower() in ("1", "true", "on"),
                   help="usage reports the prompt tokens the prefix cache served (OpenAI's "
                        "prompt_tokens_details.cached_tokens; vLLM's flag) "
                        "(default: off; env MSTAR_ENABLE_PROMPT_TOKENS_DETAILS=1)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction,
                   default=os.environ.get("MSTAR_ACCESS_LOG", "").lower() in ("1", "true", "yes", "on"),
                   help="log one line per HTTP request (uvicorn's access log: client, method, path, status), "
                        "in --log-format (default: off; env MSTAR_ACCESS_LOG=1 turns it on)")
    return p


def add_media_flags(p: argparse.ArgumentParser) -> None:
    """Image inputs (`services/api/media.py`): where images may come from and how large.
    Defaults from the MSTAR_* variables (`settings.MEDIA_ENV`), else `MediaPolicy`'s."""
    from services.api.media import (
        DEFAULT_FETCH_TIMEOUT_S,
        DEFAULT_MAX_IMAGE_BYTES,
        DEFAULT_MAX_IMAGE_PIXELS,
        DEFAULT_MAX_IMAGES_PER_REQUEST,
    )
    from services.api.settings import media_from_env

    env = media_from_env()
    p.add_argument("--allowed-media-domains", nargs="+", default=env.get("allowed_media_domains", ()),
                   metavar="HOST",
                   help="the only hosts http(s) image URLs may name (exact match, also on each redirect), "
                        "space- or comma-separated (env MSTAR_ALLOWED_MEDIA_DOMAINS, comma-separated; "
                        "default: empty, any host, private addresses included)")
    p.add_argument("--allowed-local-media-path", default=env.get("allowed_local_media_path"), metavar="DIR",
                   help="a folder whose files (symlinks resolved) file:// image URLs may name "
                        "(env MSTAR_ALLOWED_LOCAL_MEDIA_PATH; default: none, file:// URLs are refused)")
    p.add_argument("--max-image-bytes", type=int, default=env.get("max_image_bytes", DEFAULT_MAX_IMAGE_BYTES),
                   help=f"largest image file (data URL, download or local file); larger is a 400 "
                        f"(env MSTAR_MAX_IMAGE_BYTES; default {DEFAULT_MAX_IMAGE_BYTES})")
    p.add_argument("--max-image-pixels", type=int, default=env.get("max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS),
                   help=f"most pixels (width x height) an image may have; more is a 400 "
                        f"(env MSTAR_MAX_IMAGE_PIXELS; default {DEFAULT_MAX_IMAGE_PIXELS})")
    p.add_argument("--max-images-per-request", type=int,
                   default=env.get("max_images_per_request", DEFAULT_MAX_IMAGES_PER_REQUEST),
                   help=f"most images one request may carry; more is a 400 "
                        f"(env MSTAR_MAX_IMAGES_PER_REQUEST; default {DEFAULT_MAX_IMAGES_PER_REQUEST})")
    p.add_argument("--media-fetch-timeout", type=float,
                   default=env.get("media_fetch_timeout_s", DEFAULT_FETCH_TIMEOUT_S), metavar="SECONDS",
                   help=f"seconds one http(s) image fetch may take, redirects included; longer is a 400 "
                        f"(env MSTAR_MEDIA_FETCH_TIMEOUT_S; default {DEFAULT_FETCH_TIMEOUT_S:g})")


def media_settings(args: argparse.Namespace) -> dict[str, object]:
    """The ApiSettings fields of the image-input flags; a --allowed-local-media-path that
    is not a folder is refused here, at start, rather than making every file:// URL a 400."""
    from services.api.settings import split_domains

    local = args.allowed_local_media_path
    if local is not None:
        local = os.path.abspath(os.path.expanduser(local))
        if not os.path.isdir(local):
            raise ValueError(f"--allowed-local-media-path {local} is not a folder")
    return {
        "max_image_bytes": args.max_image_bytes,
        "max_image_pixels": args.max_image_pixels,
        "media_fetch_timeout_s": args.media_fetch_timeout,
        "allowed_media_domains": split_domains(args.allowed_media_domains),
        "allowed_local_media_path": local,
        "max_images_per_request": args.max_images_per_request,
    }


def main(argv: list[str] | None = None) -> int:
    start_gate.wait("uvicorn", "services.api.server", "services.api.app")
    args = build_parser().parse_args(argv)

    log = setup_logging("api", args.log_level, args.log_format)
    addrs = resolve_addresses(args, ADDRESSES)
    try:
        reply_to = advertised(addrs["api"], args.api_advertise_addr)
    except ValueError as exc:
        log.error("%s", exc)
        return 2

    import uvicorn

    from services.api.server import ApiServer

    try:
        app, settings, drain = _build_app(args, addrs, reply_to)
    except Exception as exc:  # a bad --model or flag: say so in one line, no traceback
        log.error("cannot start the api: %s", exc)
        return 2

    release_free_heap()
    log.info("api for %s on http://%s:%d (outputs at %s, reply_to %s)%s",
             ", ".join(getattr(drain, "names", (settings.model_name,))),
             args.host, args.port, settings.api_addr, reply_to,
             "; API key required" if settings.api_key else "")
    log.info("default sampling from %s: %s", args.generation_config, settings.generation_defaults.describe())
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        log_level="warning",
        log_config=None,  # uvicorn's records go through this process's handler (text or json)
        access_log=args.access_log,
        timeout_keep_alive=args.keep_alive_s,
        # a WebSocket frame up to the body limit reaches the route (which refuses past it with
        # an error frame): a policy's openpi observations are msgpack arrays, 64 MiB allowed
        ws_max_size=max(16 << 20, getattr(drain, "max_body_bytes", settings.max_body_bytes)),
        # uvicorn annotates an int but only passes it to asyncio.timeout: a float is fine
        timeout_graceful_shutdown=DRAIN_S + 3.0,  # type: ignore[arg-type]  # only reached if draining itself hangs
    )
    if args.access_log:  # uvicorn set its access logger to log_level (warning): its lines are info
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    try:
        ApiServer(config, drain, DRAIN_S).run()
    finally:
        cleanup_ipc(addrs["api"])  # also when uvicorn failed before its lifespan shutdown
    return 0


def _build_app(args: argparse.Namespace, addrs: dict[str, str], reply_to: str) -> tuple[Any, ApiSettings, Any]:
    """(the ASGI app, the default model's settings, what drains live requests at shutdown).

    One model: `create_app`'s app. Several (`--models`): each model's app behind a
    `fleet.ModelRouter`, each app's backend at the model's own output socket and data
    worker, the conductor shared."""
    from services.api.app import create_app
    from shared.models import models_from_args

    served = models_from_args(args)
    if not served:
        settings, tokenizer = _load_settings(args, addrs, reply_to)
        app = create_app(settings, tokenizer)
        return app, settings, app.state.api.backend
    import msgspec

    from services.api.auth import ApiKeyMiddleware
    from services.api.fleet import ModelRouter

    apps = {}
    key = None
    for m in served:
        ns = argparse.Namespace(**{**vars(args), "model": m.model, "served_model_name": m.name})
        own = {**addrs, "api": m.api_addr, "data_worker": m.data_worker_addr}
        settings, tokenizer = _load_settings(ns, own, advertised(m.api_addr, None))
        key = settings.api_key  # checked once, by the router in front, for every route of every app
        apps[m.name] = create_app(msgspec.structs.replace(settings, api_key=None), tokenizer)
    first = apps[served[0].name]
    router = ModelRouter(apps, max(a.state.api.settings.max_body_bytes for a in apps.values()))
    front: Any = ApiKeyMiddleware(router, key) if key else router
    return _Front(front, first.state), msgspec.structs.replace(first.state.api.settings, api_key=key), router


class _Front:
    """The router as the app uvicorn runs, with the default model's `state` beside it."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        await self.app(scope, receive, send)


def _load_settings(args: argparse.Namespace, addrs: dict[str, str],
                   reply_to: str) -> tuple[ApiSettings, TokenizerBundle]:
    """The api's settings and tokenizer from its flags and the checkpoint.

    Apart from `main` so that everything a bad --model or flag can break (reading the
    checkpoint, the chat template file, the speech-model check) raises from one call,
    which `main` turns into a one-line refusal instead of a traceback.
    """
    import msgspec

    from services.api.chat_template import read_template_file
    from services.api.settings import ApiSettings
    from services.api.transcription import default_language, is_speech_model
    from shared.generation_config import read_generation_defaults
    from shared.model_source import ModelSource

    d = deployment_from_args(args)
    source = ModelSource(d.model)
    tokenizer = source.tokenizer  # the bundle: tokenizer, chat template, BOS / EOS strings
    if args.chat_template:  # --chat-template FILE replaces the checkpoint's template
        tokenizer = msgspec.structs.replace(tokenizer, chat_template=read_template_file(args.chat_template))
    api_key = args.api_key if args.api_key is not None else os.environ.get("MSTAR_API_KEY") or None
    takes_audio = is_speech_model(source.config)  # the audio routes answer only for these
    spec = source.spec(d.page_size, d.max_seq_len, kv_dtype(d), d.task)  # torch-free: what the model does
    parameters, active_parameters = spec.parameter_counts() or (0, 0)
    settings = ApiSettings(
        model_name=args.served_model_name if args.served_model_name is not None else source.name,
        api_addr=addrs["api"],
        advertise_addr=reply_to,
        data_worker_addr=addrs["data_worker"],
        conductor_addr=addrs["conductor"],
        control_addr=addrs["conductor_control"],
        max_body_bytes=args.max_body_bytes or _default_body_limit(spec),
        ws_max_live=args.ws_max_live,
        api_key=api_key or None,
        takes_audio=takes_audio,
        image_placeholder=spec.image_placeholder, audio_placeholder=spec.audio_placeholder,
        voices=tuple(getattr(spec, "voices", ())),
        **speech_settings(spec),  # type: ignore[arg-type]
        audio_language=default_language(source) if takes_audio else None,
        max_model_len=max_model_len(source, d),
        parameters=parameters,
        active_parameters=active_parameters,
        log_stats_s=args.log_stats_s,
        tool_call_parser=args.tool_call_parser,
        generation_defaults=read_generation_defaults(args.generation_config,
                                                     source.path if source.kind == "hf" else None),
        task=spec.task,
        action_shape=spec.action_shape,
        world_shape=spec.world_shape, video_placeholder=spec.video_placeholder, **image_settings(spec),  # type: ignore[arg-type]
        **policy_settings(spec),  # type: ignore[arg-type]
        dimensions=spec.dimensions,
        matryoshka=spec.matryoshka,
        normalized=spec.normalize,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        responses_store_max=args.responses_store_max,
        responses_store_ttl_s=args.responses_store_ttl,
        **media_settings(args),  # type: ignore[arg-type]
    )
    return settings, tokenizer


def _default_body_limit(spec: ModelSpec) -> int:
    """The largest body by default: larger for a model whose requests carry images or audio (base64)."""
    from services.api.settings import DEFAULT_MAX_BODY_BYTES, VISION_MAX_BODY_BYTES

    big = (spec.image_placeholder or spec.audio_placeholder or spec.action_shape[0] or spec.world_shape[0]
           or bool(getattr(spec, "edit_resize", ())))  # an image model that edits: the upload
    return VISION_MAX_BODY_BYTES if big else DEFAULT_MAX_BODY_BYTES


def image_settings(spec: ModelSpec) -> dict[str, object]:
    """What the image and video routes check before queueing: an image model's sizes, frames and steps."""
    from shared.specs.image_gen import ImageGenSpec

    if not isinstance(spec, ImageGenSpec):
        return {}
    return {"image_limits": (spec.spatial, spec.temporal, spec.max_side, spec.max_frames, spec.loop_cap),
            "image_edit_resize": tuple(spec.edit_resize)}


def policy_settings(spec: ModelSpec) -> dict[str, object]:
    """What the openpi WebSocket reads of a robot policy's spec: its cameras, its state's length."""
    state_size = getattr(spec, "state_size", None)
    size = state_size() if callable(state_size) else None
    return {"policy_cameras": tuple(getattr(spec, "cameras", ())), "policy_state_size": int(size or 0)}


def speech_settings(spec) -> dict[str, object]:
    """What the speech route reads of a speech model's spec: its rate, its sampling
    defaults, and how `max_audio_seconds` becomes a token cap."""
    return {"sample_rate": spec.sample_rate, "speech_defaults": dict(spec.speech_defaults),
            "audio_frame_rate": spec.audio_frame_rate, "audio_frame_tokens": spec.audio_frame_tokens,
            "audio_extra_tokens": spec.audio_extra_tokens,
            "speech_instructions": bool(getattr(spec, "takes_instructions", False)),
            "speech_extensions": tuple(spec.speech_extensions)}


def max_model_len(source: ModelSource, d: Deployment) -> int:
    """The longest prompt + output the deployment serves: the smallest `max_seq_len` of the
    spec's pools, as the conductor's length check takes it (the spec is torch-free)."""
    spec = source.spec(d.page_size, d.max_seq_len, kv_dtype(d), d.task)
    return min(p.max_seq_len for p in spec.paged_pools(1).values())


if __name__ == "__main__":
    sys.exit(main())
