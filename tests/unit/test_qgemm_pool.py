"""kernels/pool.c (the quantized GEMM's thread pool) and qgemm.c's split over it: every task
runs exactly once, results are the same bits whatever the thread count and split, and a job
completes when a worker cannot run (the process pinned to one CPU) or after fork()."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from services.gpu_worker import cpu_kernels
from services.gpu_worker.layers import quant
from services.gpu_worker.layers.quant import QuantLinear
from tests.unit.test_quant import random_blocks

pytestmark = pytest.mark.kernels

needs_kernel = pytest.mark.skipif(not quant.available(), reason="no quantized GEMM kernel built")


def layers() -> dict[int, QuantLinear]:
    """form -> a layer whose columns do not fill their last tile (1000 = 62.5 tiles)."""
    n, k = 1000, 320
    return {4: QuantLinear.from_gguf("Q4_1", random_blocks("Q4_1", n, k, seed=11), (n, k)),
            8: QuantLinear.from_gguf("Q8_0", random_blocks("Q8_0", n, k, seed=12), (n, k))}


@needs_kernel
def test_every_task_runs_once_per_job(restore_threads):
    lib = cpu_kernels.library()
    for threads in (2, 3, 5):
        assert lib.mstar_pool_check(2000, 37, threads) == 0
    assert lib.mstar_pool_check(100, 3001, 2) == 0  # more tasks than slots: claimed in runs
    quant.set_threads(2)
    assert lib.mstar_pool_check(500, 9, 0) == 0  # the pool's default count
    quant.set_threads(1)
    assert lib.mstar_pool_check(50, 9, 0) == 0  # inline


@needs_kernel
@pytest.mark.parametrize("form", [4, 8])
def test_same_bits_whatever_the_threads_and_split(form, restore_threads):
    layer = layers()[form]
    g = torch.Generator().manual_seed(form)
    for rows in (1, 5, 64, 200):
        x = torch.randn(rows, layer.in_features, generator=g)
        quant.set_threads(1)
        one = layer(x)
        exact = x @ layer.weight.T
        assert float((one - exact).abs().max()) < 1e-3 * float(exact.abs().max())
        for threads in (2, 3):
            quant.set_threads(threads)
            for _ in range(3):  # the split's timing varies from call to call, the bits must not
                assert torch.equal(layer(x), one), (form, rows, threads)


@needs_kernel
def test_threads_argument_caps_or_defaults(restore_threads):
    """mstar_qlinear's `threads`: > 0 up to that many (workers started as needed), <= 0 the
    pool's default; the same bits either way."""
    lib = cpu_kernels.library()
    layer = layers()[4]
    x = torch.randn(64, layer.in_features)
    quant.set_threads(1)
    want = layer(x)
    w, d, m = layer.w.data_ptr(), layer.d.data_ptr(), layer.m.data_ptr()
    for pool, arg in ((1, 3), (3, 0), (3, 2), (2, -1)):
        lib.mstar_pool_set_threads(pool)
        out = torch.empty(64, layer.out_features)
        assert lib.mstar_qlinear(layer.form, 2, x.data_ptr(), 64, layer.in_features, layer.in_features, w, d, m,
                                 layer.out_features, None, out.data_ptr(), layer.out_features, arg,
                                 quant._scratch(lib, 64, layer.in_features)) == 0
        assert torch.equal(out, want), (pool, arg)


@needs_kernel
def test_threads_change_between_calls(restore_threads):
    lib = cpu_kernels.library()
    layer = layers()[8]
    x = torch.randn(16, layer.in_features)
    quant.set_threads(1)
    want = layer(x)
    for n in (3, 2, 1, 4, 2):
        quant.set_threads(n)
        assert quant.threads() == n and lib.mstar_pool_threads() == n
        assert torch.equal(layer(x), want)


@needs_kernel
def test_a_job_completes_when_workers_cannot_run(restore_threads):
    """Pinned to one CPU, the workers share the caller's core: each job still completes with
    the same bits, and in about one thread's time (a barrier would wait out time slices)."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity")
    layer = layers()[4]
    x1, x64 = torch.randn(1, layer.in_features), torch.randn(64, layer.in_features)
    quant.set_threads(1)
    want1, want64 = layer(x1), layer(x64)
    cpus = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(cpus)})  # the calling thread; workers started from now inherit it
        quant.set_threads(1)  # stop the workers, so the next ones start pinned too
        took = {}
        for n in (1, 3, 2):
            quant.set_threads(n)
            assert torch.equal(layer(x64), want64)
            start = time.perf_counter()
            for _ in range(200):
                assert torch.equal(layer(x1), want1)
            took[n] = time.perf_counter() - start
    finally:
        os.sched_setaffinity(0, cpus)
    assert took[2] < 3 * took[1] + 0.05, took
    assert took[3] < 3 * took[1] + 0.05, took


@needs_kernel
def test_pool_after_fork(restore_threads):
    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    layer = layers()[4]
    x = torch.randn(64, layer.in_features)
    quant.set_threads(2)
    want = layer(x).numpy().tobytes()  # the parent's workers are running
    pid = os.fork()
    if pid == 0:  # the child has none: the pool starts them again
        code = 1
        try:
            code = 0 if layer(x).numpy().tobytes() == want and layer(x).numpy().tobytes() == want else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's GEMM did not finish")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0


def test_default_threads_are_the_available_cpus(monkeypatch):
    monkeypatch.delenv("MSTAR_COMPUTE_THREADS", raising=False)
    monkeypatch.setattr(quant, "available_cpus", lambda: 6)
    assert quant.default_threads() == 6
    monkeypatch.setenv("MSTAR_COMPUTE_THREADS", "3")
    assert quant.default_threads() == 3


@needs_kernel
def test_set_threads_sets_the_pool(restore_threads):
    model = torch.nn.Sequential(layers()[4])
    for n in (3, 1, 2):
        quant.set_threads(n)
        assert quant.threads() == n and cpu_kernels.library().mstar_pool_threads() == n
        assert np.isfinite(model(torch.randn(2, 320)).numpy()).all()
