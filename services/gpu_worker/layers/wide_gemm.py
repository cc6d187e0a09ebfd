"""Prompt rows' GEMM on a bfloat16 copy of a quantized weight (`QuantLinear.widen`), split
over the compute threads.

oneDNN (through torch) runs the bfloat16 GEMM on the CPU's matrix units where it has
them (AMX tiles) or its AVX512-BF16 dot products; one call per block of `ROWS` rows, each
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
    blocks = -(-rows // ROWS)
    counter = itertools.count()  # next() on it is atomic under the GIL
    inference = torch.is_inference_mode_enabled()  # thread-local: the helpers take the caller's

    def work() -> None:
        with torch.inference_mode(inference):
            while (i := next(counter)) < blocks:
                part = out[i * ROWS : (i + 1) * ROWS]
                part.copy_(F.linear(x[i * ROWS : (i + 1) * ROWS].to(torch.bfloat16), wide))
                if bias is not None:
                    part.add_(bias)

    with torch_threads(1):
        helpers = min(threads, blocks) - 1
        futures = [_executor(threads - 1).submit(work) for _ in range(helpers)] if helpers > 0 else []
        work()
        for f in futures:
            f.result()
