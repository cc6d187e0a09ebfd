"""The TTFT of one long prompt in this process: the gpu worker's engine, no services around it.

    python -m bench.prefill --model FILE.gguf [--prompt-len 896] [--runs 7] [--profile torch|cprofile]

Builds the real worker (model, pools, warm-up) on the file, then, `--runs` times, adds one
request of `--prompt-len` fresh random ids (no prefix hit) asking for one token and times the
engine's steps until its prompt is computed (the prefill side of issues 50/51's TTFT goal,
without HTTP, tokenizing or the conductor). Prints the median and min; `--profile` prints the
top ops (torch.profiler) or functions (cProfile) of one more such prefill.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time


def _worker(model: str, prefix_cache: bool = False):
    from services.gpu_worker.worker import GpuWorker
    from shared.config import Deployment

    run = tempfile.mkdtemp(prefix="mstar-prefill-")
    d = Deployment(model=model, num_kv_pages=1024, max_seq_len=2048, prefix_cache=prefix_cache)
    return GpuWorker(d, f"ipc://{run}/w.sock", f"ipc://{run}/w.sock", f"ipc://{run}/c.sock", "prefill"), run


def _prefill(w, rng, prompt_len: int, rid: str) -> tuple[float, float, int]:
    """One request's prompt through the engine: (wall ms, CPU ms of every thread, steps). The
    CPU time is the figure to compare on a shared machine (others' load stretches the wall
    time, not the cycles the prefill takes)."""
    from shared.frames import NewRequest, SamplingParams, pack_tensors
    from shared.specs.base import PromptRequest

    spec, eng = w.spec, w.engine
    ids = rng.integers(10, 20000, prompt_len).tolist()
    ppo = spec.process_prompt(PromptRequest(ids))
    caps = spec.clamp_caps(spec.get_loop_caps(1, prompt_len=len(ids)))
    refs, _ = pack_tensors(ppo.new_input_tensors)
    t0, c0 = time.perf_counter(), time.process_time()
    eng.add(NewRequest(rid, "", refs, SamplingParams(temperature=0.0, ignore_eos=True), "", len(ids), 1,
                       ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, w.pools)), ppo.new_input_tensors)
    steps = 0
    while eng.waiting or any(s.num_computed < len(s.prompt) for s in eng.running):
        eng.step()
        steps += 1
    ms, cpu = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
    while eng.waiting or eng.running:
        eng.step()
    return ms, cpu, steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-len", type=int, default=896)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--profile", choices=("torch", "cprofile"), default=None)
    ap.add_argument("--prefix-cache", action="store_true",
                    help="with the prefix cache on, as `mstar serve` runs by default (a hybrid's prompt then "
                         "keeps state snapshots)")
    args = ap.parse_args(argv)
    os.environ.setdefault("MSTAR_TORCH_THREADS", "1")
    import numpy as np

    w, run = _worker(args.model, args.prefix_cache)
    rng = np.random.default_rng(0)
    _prefill(w, rng, args.prompt_len, "warm")
    times = [_prefill(w, rng, args.prompt_len, f"r{i}") for i in range(args.runs)]
    ms, cpu = [t[0] for t in times], [t[1] for t in times]
    print(f"prefill of {args.prompt_len} rows ({times[0][2]} step(s)): wall median {statistics.median(ms):.1f} ms, "
          f"min {min(ms):.1f}; CPU (all threads) median {statistics.median(cpu):.1f} ms, min {min(cpu):.1f}")
    if args.profile == "torch":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _prefill(w, rng, args.prompt_len, "prof")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    elif args.profile == "cprofile":
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        _prefill(w, rng, args.prompt_len, "prof")
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    shutil.rmtree(run, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
