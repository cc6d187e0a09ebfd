"""Prompt rows' GEMM on a bfloat16 copy of a quantized weight (`QuantLinear.widen`), split
over the compute threads.

oneDNN (through torch) runs the bfloat16 GEMM on the CPU's matrix units where it has
them (AMX tiles) or its AVX512-BF16 dot products; one call per block of at most `ROWS` rows
(as many blocks as a multiple of the threads, none under `MIN_ROWS` rows), each
on one oneDNN thread, the blocks taken from a shared counter by `threads` threads (the
caller and a small pool). Not torch's own intra-op threads: on a machine whose other
cores are busy (the api and conductor share them) an OpenMP team waits at its barrier for
its slowest thread, where here a busy core's thread just takes fewer blocks, as the C
kernels' pool does (kernels/pool.c).

A row's result is the same whichever block or thread computes it: oneDNN's bfloat16 GEMM
gives each row the same bits whatever the row count (tests/unit/test_prompt_gemm.py checks
it for the shapes served), so results do not depend on the split, the thread count or the
chunk a prompt row is in.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from services.gpu_worker.threads import torch_threads

#: rows per oneDNN call: a block is ~1-4 ms of work for a 135M model's layers, far above a
#: block's dispatch cost (tens of microseconds), and small enough to balance two threads
ROWS = 128
#: the fewest rows a block is cut to so that a short chunk still has a block per thread: a
#: prompt chunk beside decode rows is often under ROWS x threads rows (~85 in a 100 ms step
#: of the default model), and one thread ran it all; oneDNN's bfloat16 GEMM is ~140 GFLOP/s
#: a thread at 16 rows against ~200 at 64 and up, so two 16-row blocks beat one 32-row one
MIN_ROWS = 16

_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _executor(helpers: int) -> ThreadPoolExecutor:
    """The helper threads (made at the first prompt, remade if the thread count changes)."""
    global _pool, _pool_size
    if _pool is None or _pool_size != helpers:
        if _pool is not None:
            _pool.shutdown(wait=True)
        _pool, _pool_size = ThreadPoolExecutor(helpers, thread_name_prefix="mstar-prompt-gemm"), helpers
    return _pool


def linear(x: torch.Tensor, wide: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, threads: int) -> None:
    """out [rows, n] (float32) = x [rows, k] @ wide [n, k].T (+ bias), x rounded to bfloat16
    (block by block, by the thread that multiplies it: the rounding is a pass over x)."""
    rows = x.shape[0]
    # blocks of <= ROWS rows, as many as a multiple of the threads (each takes a like share;
    # a 300-row chunk was 128 + 128 + 44), but none under MIN_ROWS
    want = threads * -(-rows // (threads * ROWS))
    size = max(MIN_ROWS, -(-rows // want))
    blocks = -(-rows // size)
    counter = itertools.count()  # next() on it is atomic under the GIL
    inference = torch.is_inference_mode_enabled()  # thread-local: the helpers take the caller's

    def work() -> None:
        with torch.inference_mode(inference):
            while (i := next(counter)) < blocks:
                part = out[i * size : (i + 1) * size]
                part.copy_(F.linear(x[i * size : (i + 1) * size].to(torch.bfloat16), wide))
                if bias is not None:
                    part.add_(bias)

    with torch_threads(1):
        helpers = min(threads, blocks) - 1
        futures = [_executor(threads - 1).submit(work) for _ in range(helpers)] if helpers > 0 else []
        work()
        for f in futures:
            f.result()
