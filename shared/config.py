"""Deployment settings and ZMQ addresses, shared by every service's command line.

Every address has a flag and an env var (MSTAR_<NAME>_ADDR). Defaults are ipc sockets in
one run folder, so four services on one host find each other with no flags; tcp addresses
spread the same services over hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from typing import Any

import msgspec

from shared.layout import DTYPE_BYTES, KV_DTYPES
from shared.tasks import TASKS

ADDRESS_NAMES = {
    "api": "where the api pulls outputs and errors",
    "data_worker": "where the data worker pulls requests",
    "conductor": "where the conductor pulls requests and worker reports",
    "conductor_control": "the conductor's ROUTER for status queries",
}


def run_dir() -> str:
    return os.environ.get("MSTAR_RUN_DIR") or os.path.join(tempfile.gettempdir(), f"mstar-{os.getuid()}")


def default_address(name: str) -> str:
    return f"ipc://{os.path.join(run_dir(), name.replace('_', '-'))}.sock"


def env_address(name: str) -> str:
    return os.environ.get(f"MSTAR_{name.upper()}_ADDR") or default_address(name)


def add_address_flags(parser: argparse.ArgumentParser, names: list[str]) -> None:
    for name in names:
        parser.add_argument(
            f"--{name.replace('_', '-')}-addr",
            dest=f"{name}_addr",
            default=None,
            help=f"{ADDRESS_NAMES.get(name, name)} (env MSTAR_{name.upper()}_ADDR; default {default_address(name)})",
        )


def resolve_addresses(args: argparse.Namespace, names: list[str]) -> dict[str, str]:
    return {n: getattr(args, f"{n}_addr") or env_address(n) for n in names}


def host_ip() -> str:
    """This host's address as its own name resolves (in a container or a pod: its IP)."""
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def advertised(bind_address: str, advertise: str | None) -> str:
    """The address peers connect to: a tcp bind on 0.0.0.0 needs a reachable host name.
    `auto` advertises the bind's port at this host's IP (`host_ip`): what every replica of
    a scaled container uses, since the service's name would resolve to any of them."""
    if advertise == "auto":
        if not bind_address.startswith("tcp://"):
            raise ValueError(f"--advertise-addr auto needs a tcp bind address, got {bind_address}")
        return f"tcp://{host_ip()}:{bind_address.rsplit(':', 1)[1]}"
    if advertise:
        return advertise
    if bind_address.startswith("tcp://0.0.0.0") or bind_address.startswith("tcp://*"):
        raise ValueError(f"bind address {bind_address} needs an advertise address peers can reach")
    return bind_address


ADMISSION_MODES = ("footprint", "max-seq-len")

#: --dtype values
WEIGHT_DTYPES = ("auto", *DTYPE_BYTES)
#: --kv-cache-dtype values: the float types, and int8 (opt-in: each (row, KV head) vector
#: quantized with a float32 scale; the CPU's text decoders only)
KV_CACHE_DTYPES = ("auto", *KV_DTYPES)
#: --prefill-dtype values
PREFILL_DTYPES = ("auto", "bfloat16", "int8", "quantized")


def kv_dtype(d: Deployment) -> str:
    """The KV pages' dtype a deployment asks for (always one of KV_DTYPES; int8 only when
    asked for by name).

    `auto`: the weights' dtype where --dtype names one; bfloat16 for a GGUF file with
    quantized matrices under --dtype auto on the CPU (its weights are approximate already:
    llama.cpp's own default KV type is f16; half the KV bytes, perplexity within issue 19's
    1% of the float32 path (bench/perplexity.py), and the C decode kernels take bfloat16
    pages); else float32, so a float checkpoint (safetensors, or a GGUF of F32 / F16
    tensors) keeps its exact path."""
    if d.kv_cache_dtype != "auto":
        return d.kv_cache_dtype
    if d.dtype in DTYPE_BYTES:
        return d.dtype
    return "bfloat16" if d.dtype == "auto" and _quantized_gguf_on_cpu(d.model) else "float32"


#: GGUF tensor types that are not quantized
_FLOAT_GGUF_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


def _quantized_gguf_on_cpu(model: str) -> bool:
    """`model` is a GGUF file with a quantized 2-D tensor, served on the CPU: MSTAR_DEVICE
    says cpu, or (auto) the host has no NVIDIA driver (where it has one the worker may pick
    CUDA, which computes a GGUF dequantized: float32 KV, as before). Read from the GGUF
    summary every process shares (no torch here: the api and conductor never import it)."""
    device = os.environ.get("MSTAR_DEVICE", "auto")
    if device != "cpu" and (device != "auto" or os.path.exists("/proc/driver/nvidia/version")):
        return False
    try:
        from shared.gguf_source import gguf_summary
        from shared.model_source import ModelSource

        source = ModelSource(model)
        summary = gguf_summary(source.path) if source.kind == "gguf" else None
    except Exception:  # an unreadable model is refused where it is loaded, not here
        return False
    if summary is None:
        return False
    return any(len(t["ne"]) == 2 and t["type"] not in _FLOAT_GGUF_TYPES for t in summary["tensors"])


#: most draft tokens one step verifies, and the longest n-gram prompt lookup matches
MAX_SPECULATIVE_K = 16
MAX_SPECULATIVE_NGRAM = 8
#: most tensor-parallel ranks of one gpu worker
MAX_TENSOR_PARALLEL = 64


class Deployment(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the conductor and the workers must agree on about the served model.

    Each field is a flag of every service (`--page-size`), an env var (`MSTAR_PAGE_SIZE`)
    and a key of the one-value form `--deployment '<json>'` / `MSTAR_DEPLOYMENT`, all
    made from the field and its `DEPLOYMENT_HELP` entry: a new field is written here and
    there, nowhere else."""

    model: str = ""
    page_size: int = 16
    num_kv_pages: int = 0  # 0: size the pool from memory (kv_memory_fraction of available)
    kv_memory_fraction: float = 0.1
    max_seq_len: int = 0  # 0: the model's own context length
    max_num_seqs: int = 64
    max_batch_tokens: int = 2048
    #: weights' dtype; "auto": a GGUF file's own quantized types (CPU), a checkpoint's dtype
    #: where the device computes it natively, else float32 (`WEIGHT_DTYPES`)
    dtype: str = "auto"
    #: the KV pages' dtype; "auto": `dtype` when that names a float type, bfloat16 for a
    #: quantized GGUF file on the CPU, else float32 (`kv_dtype`); "int8" (opt-in, CPU text
    #: decoders): a quarter of float32's bytes, a float32 scale per row and KV head
    kv_cache_dtype: str = "auto"
    #: how a quantized GGUF file's layers compute prompt rows on the CPU: "bfloat16" (a
    #: bfloat16 copy of their weights, oneDNN's GEMMs), "quantized" (the VNNI kernels, as
    #: decode rows), "auto" (bfloat16 where the CPU has AMX-BF16 or AVX512-BF16)
    prefill_dtype: str = "auto"
    #: "footprint" (mstar) or "max-seq-len": reserve max_seq_len rows per request, the
    #: baseline a server without layouts must use to never preempt (for benchmarks)
    admission: str = "footprint"
    prefix_cache: bool = True
    #: prompt-lookup speculative decoding: drafts verified per step (0: off), and the
    #: longest and shortest n-gram of the history matched to find them
    speculative_k: int = 0
    speculative_ngram_max: int = 3
    speculative_ngram_min: int = 2
    #: a step's time target (ms) when decode rows run: prefill chunks beside them are cut to
    #: fit it by the learned step costs (0: throughput first, the token budget alone)
    itl_target_ms: float = 100.0
    #: with no gpu worker ready, how long a request waits for one before a 503 (0: forever)
    queue_timeout_s: float = 30.0
    #: what the model serves: "auto" (its checkpoint says: a sentence-transformers folder
    #: embeds, a classifier scores, else it generates) or one asked for (vLLM's --task)
    task: str = "auto"
    #: gpu worker ranks one model is sharded over (tensor parallelism over torch.distributed:
    #: gloo on the CPU, NCCL on CUDA); every rank holds its share of each layer's heads
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"dtype must be one of {WEIGHT_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "int8" and os.environ.get("MSTAR_DEVICE", "auto").startswith("cuda"):
            raise ValueError("kv_cache_dtype int8 is the CPU path's (its C kernels); MSTAR_DEVICE asks for CUDA, "
                             "whose FlashInfer path takes float pages: use --kv-cache-dtype auto or bfloat16")
        if self.prefill_dtype not in PREFILL_DTYPES:
            raise ValueError(f"prefill_dtype must be one of {PREFILL_DTYPES}, got {self.prefill_dtype!r}")
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {self.admission!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.num_kv_pages < 0:
            raise ValueError(f"num_kv_pages must be >= 0, got {self.num_kv_pages}")
        if not 0.0 < self.kv_memory_fraction <= 0.9:
            raise ValueError(f"kv_memory_fraction must be in (0, 0.9], got {self.kv_memory_fraction}")
        if self.max_batch_tokens < 16 or self.max_num_seqs < 1:
            raise ValueError("max_batch_tokens must be >= 16 and max_num_seqs >= 1")
        if not 0 <= self.itl_target_ms <= 60_000:
            raise ValueError(f"itl_target_ms must be in [0, 60000], got {self.itl_target_ms}")
        if not 0 <= self.queue_timeout_s <= 86_400:
            raise ValueError(f"queue_timeout_s must be in [0, 86400], got {self.queue_timeout_s}")
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL:
            raise ValueError(f"tensor_parallel_size must be in [1, {MAX_TENSOR_PARALLEL}], "
                             f"got {self.tensor_parallel_size}")
        if not 0 <= self.speculative_k <= MAX_SPECULATIVE_K:
            raise ValueError(f"speculative_k must be in [0, {MAX_SPECULATIVE_K}], got {self.speculative_k}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max <= MAX_SPECULATIVE_NGRAM:
            raise ValueError("speculative n-gram sizes need 1 <= speculative_ngram_min <= speculative_ngram_max "
                             f"<= {MAX_SPECULATIVE_NGRAM}, "
                             f"got {self.speculative_ngram_min} and {self.speculative_ngram_max}")


#: Per `Deployment` field: its flag's help (the default and the env var are added to it),
#: and the choices where its values are a fixed set.
DEPLOYMENT_HELP: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "model": ("a local Hugging Face folder, a .gguf file, or a Hugging Face Hub id (org/name) already in the local "
              "Hugging Face cache (nothing is downloaded); empty: the embedded SmolLM2-135M-Instruct", None),
    "page_size": ("rows per KV page (a power of two)", None),
    "num_kv_pages": ("pages per pool; 0 sizes the pool from memory (--kv-memory-fraction)", None),
    "kv_memory_fraction": ("fraction of available memory for KV when --num-kv-pages is 0", None),
    "max_seq_len": ("prompt + output limit; 0 uses the model's context length", None),
    "max_num_seqs": ("most requests in one batch", None),
    "max_batch_tokens": ("token budget of one step (prefill chunks + decode rows)", None),
    "dtype": ("dtype of the weights: auto keeps a GGUF file's quantized weights quantized (on the CPU) and a "
              "checkpoint's dtype where the device computes it natively (else float32); float32 dequantizes "
              "a GGUF file", WEIGHT_DTYPES),
    "kv_cache_dtype": ("dtype of the KV pages (auto: --dtype when it names one, bfloat16 for a quantized GGUF "
                       "file on the CPU, else float32; bfloat16 halves the KV bytes; int8, opt-in, halves "
                       "bfloat16's: each row's K and V per KV head quantized with a float32 scale (absmax / 127), "
                       "for text decoders on the CPU only: refused at start for CUDA and other model families)",
                       KV_CACHE_DTYPES),
    "prefill_dtype": ("how a quantized GGUF file computes prompt rows on the CPU: bfloat16 keeps a bfloat16 copy of "
                      "each layer's weights (2 bytes a weight beside the quantized ~0.6) for oneDNN's GEMMs on AMX or "
                      "AVX512-BF16; quantized computes them on the quantized weights as decode rows are (each value "
                      "rounded to two bytes); int8, opt-in, rounds them to one byte as llama.cpp does (~1.5x faster "
                      "GEMMs than quantized, perplexity within 1%, but small models' greedy answers change); auto: "
                      "bfloat16 where the CPU has AMX tiles (several times faster there), else quantized (with "
                      "AVX512-BF16 alone bfloat16 is ~15% faster on a whole 2,048-token prompt but 1.3-2.9x "
                      "slower on the chunks of up to a few hundred rows a step beside running streams takes)",
                      PREFILL_DTYPES),
    "admission": ("admit by each request's footprint, or by a max_seq_len reservation (a baseline for benchmarks)",
                  ADMISSION_MODES),
    "prefix_cache": ("share KV pages of repeated prompt prefixes (--no-prefix-cache: off)", None),
    "speculative_k": (f"prompt-lookup speculative decoding: draft tokens verified per step for greedy requests, "
                      f"0-{MAX_SPECULATIVE_K}; 0 is off", None),
    "speculative_ngram_max": ("longest suffix n-gram looked up in the request's history for drafts", None),
    "speculative_ngram_min": ("shortest suffix n-gram that may propose drafts", None),
    "itl_target_ms": ("target time (ms) of a step that carries decode rows: prompt chunks beside them are sized to it "
                      "from step costs learned at warm-up and as it runs (streams stay smooth while prompts arrive); "
                      "an idle engine still prefills at the full --max-batch-tokens; 0: throughput first, "
                      "chunks by the token budget alone", None),
    "queue_timeout_s": ("with no gpu worker ready (none started yet, all failed), seconds a request waits for one "
                        "before a 503 naming the reason; 0: it waits until one comes", None),
    "task": ("what the model serves: auto (what the checkpoint is: a sentence-transformers folder serves "
             "/v1/embeddings, a sequence classifier /v1/score and /v1/rerank, anything else generates), or embed to "
             "serve a decoder LM's last-token embeddings (vLLM's --task embed)", TASKS),
    "tensor_parallel_size": ("rank processes one gpu worker's model is sharded over (vLLM's flag): each loads its "
                             "share of the attention heads, MLP columns and vocabulary and they step in lockstep "
                             "from rank 0's plan, all-reducing over torch.distributed (gloo on the CPU, NCCL on "
                             "CUDA); dense decoder LMs only (docs/tensor_parallel.md)", None),
}

DEPLOYMENT_ENV = "MSTAR_DEPLOYMENT"
_FALSE, _TRUE = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def deployment_fields() -> tuple[msgspec.structs.FieldInfo, ...]:
    return msgspec.structs.fields(Deployment)


def field_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_env(name: str) -> str:
    return f"MSTAR_{name.upper()}"


def _from_env(f: msgspec.structs.FieldInfo, raw: str) -> Any:
    """A field's value from its env var's text."""
    if f.type is bool:
        if raw.strip().lower() in _FALSE:
            return False
        if raw.strip().lower() in _TRUE:
            return True
        raise ValueError(f"{field_env(f.name)}={raw!r} is not a boolean (0/1, false/true)")
    try:
        return f.type(raw)
    except ValueError:
        raise ValueError(f"{field_env(f.name)}={raw!r} is not a{'n' if f.type is int else ''} "
                         f"{f.type.__name__}") from None


def add_deployment_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """`--deployment` and one flag per `Deployment` field (or only those in `names`).

    A flag left out is None in the parsed args: `deployment_from_args` then takes the
    value from `--deployment` / `MSTAR_DEPLOYMENT`, else the field's env var, else the
    field's default."""
    parser.add_argument("--deployment", default=None, metavar="JSON",
                        help="every deployment setting as one JSON object (as `mstar serve` hands its children), "
                             "e.g. '{\"page_size\": 32}'; a flag given as well wins "
                             f"(env {DEPLOYMENT_ENV}; default: none, each setting from its own flag or env var)")
    for f in deployment_fields():
        if names is not None and f.name not in names:
            continue
        if f.name not in DEPLOYMENT_HELP:
            raise KeyError(f"Deployment field {f.name!r} has no DEPLOYMENT_HELP entry")
        text, choices = DEPLOYMENT_HELP[f.name]
        env = field_env(f.name)
        shown = os.environ.get(env) if os.environ.get(env) is not None else f.default
        if f.type is bool:
            kw: dict[str, Any] = dict(action=argparse.BooleanOptionalAction)
            shown = str(shown).lower() if isinstance(shown, bool) else shown
        else:
            kw = dict(type=f.type, choices=choices, metavar=None if choices else f.name.upper())
        help_text = (f"{text} (default: {json.dumps(shown) if isinstance(shown, str) and not shown else shown}; "
                     f"env {env})")
        parser.add_argument(field_flag(f.name), dest=f.name, default=None, help=help_text.replace("%", "%%"), **kw)


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    """The Deployment the flags ask for: each field from its flag if given, else from
    `--deployment` / `MSTAR_DEPLOYMENT`, else its env var, else its default. A value out
    of range exits with its message (as argparse does for a malformed one), not a traceback."""
    try:
        return _deployment(args)
    except (ValueError, msgspec.ValidationError) as exc:
        raise SystemExit(f"invalid deployment: {exc}") from None


def _deployment(args: argparse.Namespace) -> Deployment:
    values: dict[str, Any] = {}
    for f in deployment_fields():
        raw = os.environ.get(field_env(f.name))
        if raw is not None:
            values[f.name] = _from_env(f, raw)
    given = getattr(args, "deployment", None)
    if given is None:
        given = os.environ.get(DEPLOYMENT_ENV) or None
    if given is not None:
        try:
            whole = msgspec.json.decode(given)
        except msgspec.DecodeError as exc:
            raise ValueError(f"--deployment / {DEPLOYMENT_ENV} is not valid JSON: {exc}") from None
        if not isinstance(whole, dict):
            raise ValueError(f"--deployment / {DEPLOYMENT_ENV} must be a JSON object, got {given!r}")
        values.update(whole)
    for f in deployment_fields():
        flag = getattr(args, f.name, None)
        if flag is not None:
            values[f.name] = flag
    return msgspec.convert(values, Deployment)


def deployment_argv(d: Deployment) -> list[str]:
    """The flags that recreate `d`, for the launcher to hand every child the same values:
    the whole deployment as one value, which wins over the child's env vars."""
    return ["--deployment", msgspec.json.encode(d).decode()]
