"""Wire frames: one msgspec tagged union per socket direction (DESIGN.md section 2).

A message is a multipart ZMQ message: frame 0 is the msgpack-encoded struct, frames 1..n
are raw tensor buffers referenced by `TensorRef.index` (zero-copy both ways, never
pickled). Decoding is strict: an unknown tag or a wrong type raises `msgspec.ValidationError`,
which the receive helpers log with the peer and drop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:  # numpy is imported where tensors go by: the api of a text model never needs it (~25 MiB)
    import numpy as np

from shared.errors import ErrorKind
from shared.layout import KVReqConfig, LabelLayout, PagedKVConfig

HOT = dict(array_like=True, omit_defaults=True, gc=False)

#: a per-request model option, or a value of `process_prompt`'s metadata
MetaValue = str | int | float | bool | None


class TensorRef(msgspec.Struct, array_like=True, frozen=True):
    """A tensor carried as extra frame `index` of the same multipart message."""

    index: int
    dtype: str
    shape: tuple[int, ...]


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    # vLLM's logits processors, in its order: logit_bias, min_tokens, then the penalties
    # (presence / frequency on the output's tokens, repetition on prompt + output)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = {}
    #: EOS and `stop_token_ids` are masked until this many tokens were generated
    min_tokens: int = 0
    #: more tokens that end the request (finish reason "stop"), as EOS does
    stop_token_ids: list[int] = []
    #: alternatives returned with each generated token's logprob (None: no logprobs)
    logprobs: int | None = None
    #: ... with each prompt token's (None: none; the prompt is then computed, never shared)
    prompt_logprobs: int | None = None
    #: an llguidance grammar the output must match (structured outputs; None: free text),
    #: compiled and checked by the api (services/api/structured.py)
    grammar: str | None = None
    #: stop strings the gpu worker itself ends the request at (finish reason "stop", at the
    #: token that completes the match): set by the api only where the worker must end a
    #: stage there (speech out: the talker speaks the text up to the match); the api checks
    #: every request's stop strings itself (services/gpu_worker/stop_check.py says why)
    stop: list[str] = []

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    @property
    def processed(self) -> bool:
        """Its logits change before sampling (penalties, bias, min_p, min_tokens)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_p != 0.0 or bool(self.logit_bias) or self.min_tokens > 0)


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One position's logprobs: the token's own (float32 log-softmax of the logits the
    sampler used, after penalties), its rank (1 = most likely), and the `k` most likely
    tokens with theirs, most likely first."""

    logprob: float
    rank: int
    top_ids: list[int] = []
    top_logprobs: list[float] = []


# ---- api -> data_worker -------------------------------------------------------------


class ContextTurn(msgspec.Struct, array_like=True, gc=False):
    """An earlier turn of a conversation a speech model continues (CSM's voice
    continuation): who spoke, what they said, and the sound of it (the client's WAV/FLAC
    file, undecoded; None: the text alone)."""

    speaker: str
    text: str
    audio: bytes | None = None


class GenerateRequest(msgspec.Struct, tag="generate", **HOT):
    """A validated client request, before tokenization."""

    request_id: str
    model: str
    sampling: SamplingParams
    reply_to: str
    max_tokens: int | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None
    arrival_time: float = 0.0
    # False for a prompt rendered by a chat template, which already holds its specials.
    add_special_tokens: bool = True
    # Speech models: the uploaded audio file (WAV/FLAC bytes), and the language / task to
    # force (None: the model's default). The data worker decodes it and makes features.
    audio: bytes | None = None
    language: str | None = None
    task: str | None = None
    # Vision models: each image file as the api fetched and checked it, in prompt order;
    # the prompt holds the model's image placeholder once per image.
    images: list[bytes] = []
    # Omni models: each audio input's file as the api decoded and checked it, in prompt
    # order; the prompt holds the model's audio placeholder once per input.
    audios: list[bytes] = []
    # Omni models: each video input's file as the api decoded and checked it, in prompt
    # order; the prompt holds the model's video placeholder once per input.
    videos: list[bytes] = []
    # Speech models that continue a conversation (CSM): its earlier turns, oldest first;
    # the prompt is the turn to speak.
    context: list[ContextTurn] = []
    # Robot policies: each image's camera name (in the order of `images`) and the numeric
    # inputs ("state", "noise" flattened), which `process_prompt` checks against the model.
    cameras: list[str] = []
    floats: dict[str, list[float]] = {}
    # Per-request model options for the spec's `process_prompt` (language and task above
    # are two of them); the data worker drops a value for a key the spec sets itself.
    options: dict[str, MetaValue] = {}
    #: with max_tokens None: the model's default (generation_config.json's max_new_tokens),
    #: still bounded by what the prompt leaves (None: the most the limits allow)
    max_tokens_default: int | None = None


# ---- data_worker -> conductor -> gpu_worker -----------------------------------------


class NewRequest(msgspec.Struct, tag="new_request", **HOT):
    """The only frame that carries layouts, and the only path into `ingest_request`."""

    request_id: str
    model: str
    input_tensors: dict[str, TensorRef]
    sampling: SamplingParams
    reply_to: str
    prompt_len: int
    max_tokens: int | None = None
    kv_layout: dict[str, LabelLayout] = {}
    loop_caps: dict[str, int] = {}
    kv_configs: dict[str, KVReqConfig] = {}
    arrival_time: float = 0.0
    #: `process_prompt`'s metadata (and the client's model options it does not set)
    metadata: dict[str, MetaValue] = {}
    #: with max_tokens None: the model's default, bounded by the limits (GenerateRequest's)
    max_tokens_default: int | None = None

    def without_layouts(self) -> NewRequest:
        """The copy a data worker keeps after sending: layouts live only on the wire."""
        return msgspec.structs.replace(self, kv_layout={})


class Abort(msgspec.Struct, tag="abort", **HOT):
    request_id: str
    reason: str = "abort"


# ---- gpu_worker / conductor / data_worker -> api ------------------------------------


class Output(msgspec.Struct, **HOT):
    """New tokens of one request in one step; `finish_reason` set on its last output."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: prompt tokens the prefix cache served (not computed), on the request's first output
    cached_tokens: int = 0
    #: one per token id, when the request asked for logprobs
    logprobs: list[TokenLogprobs] = []
    #: one per prompt token after the first (on the request's first output), when asked
    prompt_logprobs: list[TokenLogprobs] = []
    #: the prompt's ids, with its logprobs (what they are the logprobs of)
    prompt_token_ids: list[int] = []
    #: what the run learned for the client, on the request's first output (Whisper's
    #: detected "language")
    metadata: dict[str, str] = {}
    #: a pooling request's result (its one output): the embedding or the scores, float32
    #: little-endian (4 bytes a value: a frame a fifth the size of a float list)
    pooled: bytes = b""
    #: a speech request's sound its tokens made final: float32 little-endian samples at
    #: the model's rate (a chunk per output; they join into the clip)
    audio: bytes = b""
    #: an in-step loop's iterations done and in all (a denoising loop's steps: a video
    #: job's progress), on the outputs its iterations send before its result
    steps_done: int = 0
    steps_total: int = 0
    #: the request's text ended on this output though the request goes on (a speech
    #: request's talker still speaks): the api flushes the text's detokenizer now, so the
    #: text's last characters do not wait for the sound's end
    text_end: bool = False


class StepOutputs(msgspec.Struct, tag="step_outputs", **HOT):
    """One frame per step and destination for all of its rows, not one per request."""

    outputs: list[Output]


class RequestError(msgspec.Struct, tag="request_error", **HOT):
    """A request failed. `kind` says what happened (never an HTTP status: only the api
    decides how a kind is shown); `message` is safe to show the client and `param` names
    the offending request field; details are logged under `error_id` (`new_error_id()`)
    by whoever raised it. `code` is OpenAI's optional error code, when there is one."""

    request_id: str
    kind: ErrorKind
    message: str
    param: str | None = None
    error_id: str | None = None
    code: str | None = None


class Dispatched(msgspec.Struct, tag="dispatched", **HOT):
    """The conductor placed the request on a worker: from here only that worker's failure
    can lose it, so the api knows which requests a data worker or conductor crash took."""

    request_id: str
    worker_id: str


# ---- gpu_worker -> conductor --------------------------------------------------------


class PoolStats(msgspec.Struct, array_like=True, frozen=True):
    name: str
    total_pages: int
    free_pages: int
    reserved_pages: int = 0  # set aside for admitted requests' footprints, not yet taken
    peak_used_pages: int = 0  # most pages in use at once since the worker started
    cached_pages: int = 0  # pages indexed in the prefix cache (held or evictable)


class Fingerprint(msgspec.Struct, array_like=True, frozen=True):
    """A service's model ("name (sha256 abcdef012345)") and the deployment settings every
    worker must share with the conductor, as canonical JSON (`shared.fingerprint`)."""

    model: str
    deployment: str


class WorkerReady(msgspec.Struct, tag="worker_ready", **HOT):
    """A worker announces itself, its input address and its pools before any work, and
    repeats it as its heartbeat, so a restarted conductor learns its workers again.
    `incarnation` changes when the worker process restarts."""

    worker_id: str
    address: str
    pools: list[PagedKVConfig]
    incarnation: str = ""
    #: what the worker loaded (`shared.fingerprint`): the conductor refuses a worker whose
    #: model or deployment differs from its own, with a `WorkerRefused` naming both
    fingerprint: Fingerprint | None = None


class WorkerStats(msgspec.Struct, tag="worker_stats", **HOT):
    worker_id: str
    pools: list[PoolStats]
    running: int
    waiting: int
    footprint_overruns: int = 0
    prefix_queries: int = 0  # requests that looked up the prefix cache
    prefix_hit_tokens: int = 0  # prompt rows they did not compute
    spec_draft_tokens: int = 0  # speculative drafts verified
    spec_accepted_tokens: int = 0  # of them, accepted
    #: the CPU kernels' class the worker runs (`cpu_kernels.cpu_class`: avx512, avx2, neon,
    #: generic), "" where it runs none (CUDA, no compiler, MSTAR_CPU_KERNELS=0)
    kernels: str = ""
    #: a world model's encoder runs (one per context clip not in the worker's clip cache)
    clip_encodes: int = 0
    #: a diffusion model's denoising iterations run (every request's; runners/diffusion.py)
    denoise_steps: int = 0


class RequestFinished(msgspec.Struct, tag="request_finished", **HOT):
    worker_id: str
    request_id: str
    pages_released: int
    status: str = "ok"


class Heartbeat(msgspec.Struct, tag="heartbeat", **HOT):
    """A sign of life. A gpu worker sends one every second from a thread of its own, so it
    beats through a long step: `step_s` says for how long the running step has run (0.0
    between steps), and `incarnation` which process of the worker beats."""

    sender: str
    time: float
    incarnation: str = ""
    step_s: float = 0.0


# ---- conductor -> gpu_worker ---------------------------------------------------------


class WorkerRefused(msgspec.Struct, tag="worker_refused", **HOT):
    """The conductor's answer to a `WorkerReady` whose fingerprint differs from its own:
    the worker logs `reason` and exits with status 2 (a configuration error)."""

    worker_id: str
    reason: str


# ---- api <-> conductor control (DEALER/ROUTER) ---------------------------------------


class StatusQuery(msgspec.Struct, tag="status_query", **HOT):
    #: the served model whose workers to report ("": every model's, summed)
    model: str = ""


class ModelCommand(msgspec.Struct, tag="model_command", **HOT):
    """Load or unload one served model (llama-server's router `/models/load` and
    `/models/unload`); the conductor answers with its `ClusterStatus` (`error` set when
    it refused)."""

    action: str  # "load" | "unload"
    model: str


class ModelState(msgspec.Struct, array_like=True, frozen=True):
    """One served model as the conductor sees it: `status` "loaded" (a worker is ready),
    "loading" (wanted, none ready yet), "unloading" (draining its running requests) or
    "unloaded"; `wanted` says whether its gpu workers should be running (the launcher
    starts and stops them by it)."""

    name: str
    status: str
    wanted: bool
    ready_workers: int = 0
    running: int = 0  # requests placed on its workers, not finished
    waiting: int = 0  # requests in its conductor queue
    #: seconds since a request for it last arrived (-1: never)
    idle_s: float = -1.0


class ClusterStatus(msgspec.Struct, tag="cluster_status", **HOT):
    ready_workers: int
    workers: list[WorkerStats] = []
    waiting: int = 0
    #: worker id -> requests the conductor placed there since it registered
    dispatched: dict[str, int] = {}
    #: every served model's state (several models behind one deployment)
    models: list[ModelState] = []
    #: why a `ModelCommand` was refused ("": it was not)
    error: str = ""


ToDataWorker = GenerateRequest | Abort
ToConductor = NewRequest | Abort | WorkerReady | WorkerStats | RequestFinished | Heartbeat
ToWorker = NewRequest | Abort | Heartbeat | WorkerRefused
ToApi = StepOutputs | RequestError | Dispatched | Heartbeat
ControlRequest = StatusQuery | ModelCommand
ControlReply = ClusterStatus


class FrameCodec:
    """Encode any frame; decode one socket direction's union strictly.

    Tensors (numpy arrays or anything with `__array__` / `.numpy()`) go out as their own
    buffers; on receipt they are numpy views over the ZMQ frames (no copy).
    """

    def __init__(self, union: Any) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(union)

    def encode(self, msg: msgspec.Struct, tensors: list[np.ndarray] | None = None) -> list:
        header = self._enc.encode(msg)
        if not tensors:
            return [header]
        import numpy as np

        return [header, *(np.ascontiguousarray(t).data for t in tensors)]

    def decode(self, frames: list) -> tuple[Any, list[memoryview]]:
        msg = self._dec.decode(frames[0])
        return msg, [memoryview(f) for f in frames[1:]]


def pack_tensors(named: dict[str, Any]) -> tuple[dict[str, TensorRef], list[np.ndarray]]:
    """Turn named tensors into refs + buffers for `FrameCodec.encode`."""
    import numpy as np

    refs: dict[str, TensorRef] = {}
    bufs: list[np.ndarray] = []
    for name, t in named.items():
        arr = t.numpy() if hasattr(t, "numpy") else np.asarray(t)
        arr = np.ascontiguousarray(arr)
        refs[name] = TensorRef(len(bufs) + 1, str(arr.dtype), tuple(arr.shape))
        bufs.append(arr)
    return refs, bufs


def unpack_tensors(refs: dict[str, TensorRef], buffers: list[memoryview]) -> dict[str, np.ndarray]:
    """Views over the received frames; raises ValueError on a ref that does not fit."""
    import numpy as np

    out: dict[str, np.ndarray] = {}
    for name, ref in refs.items():
        if not 1 <= ref.index <= len(buffers):
            raise ValueError(f"tensor {name!r} refers to missing frame {ref.index}")
        arr = np.frombuffer(buffers[ref.index - 1], dtype=np.dtype(ref.dtype))
        out[name] = arr.reshape(ref.shape)
    return out
