"""The memory-bandwidth floor of one decode token (issue 34): a one-row decode step must
read every weight once (the tied LM head reads the whole embedding table), so no server
can make a token faster than the weights' bytes over the memory bandwidth.

`measure()` reads a buffer far larger than the caches on every core at once (torch's sum
over a 1 GiB float32 tensor of random values, the median of 7: what a streaming read
reaches here; one run of a best-of-5 over ones read 54 GB/s on a VM whose reads otherwise
measure 19-28); `weight_bytes`
sums the bytes of every tensor in a GGUF file (quantized as stored).
"""

from __future__ import annotations

import statistics
import time

import torch

from shared.cgroup import available_cpus


def measure(gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes per second a streaming read reaches on every available core (median of `repeats`)."""
    buf = torch.rand(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    saved = torch.get_num_threads()
    torch.set_num_threads(available_cpus())
    try:
        buf.sum()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(saved)
    return buf.numel() * 4 / statistics.median(times)


def weight_bytes(gguf_path: str) -> int:
    """Bytes of every tensor in the GGUF file, as stored."""
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(gguf_path).tensors)


def floor(gguf_path: str) -> dict:
    """{bandwidth_gb_s, weights_mb, tpot_floor_ms}: the least time a one-row decode step takes."""
    bw, wb = measure(), weight_bytes(gguf_path)
    return {"bandwidth_gb_s": bw / 1e9, "weights_mb": wb / 1e6, "tpot_floor_ms": 1e3 * wb / bw}
