"""Deployment settings and ZMQ addresses, shared by every service's command line.

Every address has a flag and an env var (MSTAR_<NAME>_ADDR). Defaults are ipc sockets in
one run folder, so four services on one host find each other with no flags; tcp addresses
spread the same services over hosts.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import msgspec

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


def advertised(bind_address: str, advertise: str | None) -> str:
    """The address peers connect to: a tcp bind on 0.0.0.0 needs a reachable host name."""
    if advertise:
        return advertise
    if bind_address.startswith("tcp://0.0.0.0") or bind_address.startswith("tcp://*"):
        raise ValueError(f"bind address {bind_address} needs an advertise address peers can reach")
    return bind_address


ADMISSION_MODES = ("footprint", "max-seq-len")


#: most draft tokens one step verifies, and the longest n-gram prompt lookup matches
MAX_SPECULATIVE_K = 16
MAX_SPECULATIVE_NGRAM = 8


class Deployment(msgspec.Struct, frozen=True):
    """What the conductor and the workers must agree on about the served model."""

    model: str = ""
    page_size: int = 16
    num_kv_pages: int = 0  # 0: size the pool from memory (kv_memory_fraction of available)
    kv_memory_fraction: float = 0.1
    max_seq_len: int = 0  # 0: the model's own context length
    max_num_seqs: int = 64
    max_batch_tokens: int = 512
    dtype: str = "float32"
    #: "footprint" (mstar) or "max-seq-len": reserve max_seq_len rows per request, the
    #: baseline a server without layouts must use to never preempt (for benchmarks)
    admission: str = "footprint"
    prefix_cache: bool = True
    #: prompt-lookup speculative decoding: drafts verified per step (0: off), and the
    #: longest and shortest n-gram of the history matched to find them
    speculative_k: int = 0
    speculative_ngram_max: int = 3
    speculative_ngram_min: int = 2

    def __post_init__(self) -> None:
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
        if not 0 <= self.speculative_k <= MAX_SPECULATIVE_K:
            raise ValueError(f"speculative_k must be in [0, {MAX_SPECULATIVE_K}], got {self.speculative_k}")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max <= MAX_SPECULATIVE_NGRAM:
            raise ValueError("speculative n-gram sizes need 1 <= speculative_ngram_min <= speculative_ngram_max "
                             f"<= {MAX_SPECULATIVE_NGRAM}, got {self.speculative_ngram_min} and {self.speculative_ngram_max}")


def _env(name: str, default: str) -> str:
    return os.environ.get(f"MSTAR_{name.upper()}", default)


def add_deployment_flags(parser: argparse.ArgumentParser) -> None:
    d = Deployment()
    parser.add_argument("--model", default=_env("model", ""), help="local Hugging Face folder, a .gguf file, or empty for the embedded SmolLM2-135M-Instruct (env MSTAR_MODEL)")
    parser.add_argument("--page-size", type=int, default=int(_env("page_size", str(d.page_size))), help="rows per KV page (env MSTAR_PAGE_SIZE)")
    parser.add_argument("--num-kv-pages", type=int, default=int(_env("num_kv_pages", "0")), help="pages per pool; 0 sizes it from memory (env MSTAR_NUM_KV_PAGES)")
    parser.add_argument("--kv-memory-fraction", type=float, default=float(_env("kv_memory_fraction", str(d.kv_memory_fraction))), help="fraction of available memory for KV when --num-kv-pages is 0")
    parser.add_argument("--max-seq-len", type=int, default=int(_env("max_seq_len", "0")), help="prompt + output limit; 0 uses the model's context length")
    parser.add_argument("--max-num-seqs", type=int, default=int(_env("max_num_seqs", str(d.max_num_seqs))), help="most requests in one batch")
    parser.add_argument("--admission", choices=ADMISSION_MODES, default=_env("admission", "footprint"), help="admit by each request's footprint (default) or by a max_seq_len reservation (a baseline for benchmarks)")
    parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=_env("prefix_cache", "1") != "0", help="do not share KV pages of repeated prompt prefixes (env MSTAR_PREFIX_CACHE=0)")
    parser.add_argument("--speculative-k", type=int, default=int(_env("speculative_k", "0")),
                        help=f"prompt-lookup speculative decoding: draft tokens verified per step for greedy requests, 0-{MAX_SPECULATIVE_K}; 0 is off (env MSTAR_SPECULATIVE_K)")
    parser.add_argument("--speculative-ngram-max", type=int, default=int(_env("speculative_ngram_max", str(d.speculative_ngram_max))),
                        help="longest suffix n-gram looked up in the request's history for drafts (env MSTAR_SPECULATIVE_NGRAM_MAX)")
    parser.add_argument("--speculative-ngram-min", type=int, default=int(_env("speculative_ngram_min", str(d.speculative_ngram_min))),
                        help="shortest suffix n-gram that may propose drafts (env MSTAR_SPECULATIVE_NGRAM_MIN)")
    parser.add_argument("--max-batch-tokens", type=int, default=int(_env("max_batch_tokens", str(d.max_batch_tokens))), help="token budget of one step (prefill chunks + decode rows)")


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    """The Deployment the flags ask for; a value out of range exits with its message
    (as argparse does for a malformed one), not a traceback."""
    try:
        return _deployment(args)
    except ValueError as exc:
        raise SystemExit(f"invalid deployment: {exc}") from None


def _deployment(args: argparse.Namespace) -> Deployment:
    return Deployment(
        model=args.model,
        page_size=args.page_size,
        num_kv_pages=args.num_kv_pages,
        kv_memory_fraction=args.kv_memory_fraction,
        max_seq_len=args.max_seq_len,
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        admission=args.admission,
        prefix_cache=args.prefix_cache,
        speculative_k=args.speculative_k,
        speculative_ngram_max=args.speculative_ngram_max,
        speculative_ngram_min=args.speculative_ngram_min,
    )


def deployment_argv(d: Deployment) -> list[str]:
    """The flags that recreate `d`, for the launcher to hand every child the same values."""
    return [
        "--model", d.model,
        "--page-size", str(d.page_size),
        "--num-kv-pages", str(d.num_kv_pages),
        "--kv-memory-fraction", str(d.kv_memory_fraction),
        "--max-seq-len", str(d.max_seq_len),
        "--max-num-seqs", str(d.max_num_seqs),
        "--max-batch-tokens", str(d.max_batch_tokens),
        "--admission", d.admission,
        *([] if d.prefix_cache else ["--no-prefix-cache"]),
        "--speculative-k", str(d.speculative_k),
        "--speculative-ngram-max", str(d.speculative_ngram_max),
        "--speculative-ngram-min", str(d.speculative_ngram_min),
    ]
