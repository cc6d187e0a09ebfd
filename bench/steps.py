"""Step times of the gpu worker's engine in this process, no services around it.

    python -m bench.steps [--model DIR] [--rows 16] [--prompt-len 128] [--steps 40] [--profile]

Builds the real worker (model, pools, warm-up), prefills `--rows` requests, then times
decode-only steps of that many rows and steps that carry a 4 x `--prompt-len` prefill with
them. What it isolates: the forward and the engine's own Python, without the api, the
conductor or a client on the other core. Run it several times: on a shared VM the same
step varies by tens of percent from one process to the next.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.steps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "mstar-bench" / "qwen2-8x512-v32000"))
    ap.add_argument("--rows", type=int, default=16, help="decoding requests")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's top ops of a decode step")
    args = ap.parse_args(argv)
    os.environ.setdefault("MSTAR_TORCH_THREADS", "1")
    import numpy as np

    from services.gpu_worker.worker import GpuWorker
    from shared.config import Deployment
    from shared.frames import NewRequest, SamplingParams, pack_tensors
    from shared.specs.base import PromptRequest

    run = tempfile.mkdtemp(prefix="mstar-steps-")
    d = Deployment(model=args.model, num_kv_pages=4096, max_seq_len=1024, prefix_cache=False)
    w = GpuWorker(d, f"ipc://{run}/w.sock", f"ipc://{run}/w.sock", f"ipc://{run}/c.sock", "steps")
    spec, eng = w.spec, w.engine
    rng = np.random.default_rng(0)
    count = iter(range(1 << 30))

    def add(out: int) -> str:
        ids = rng.integers(10, 250, args.prompt_len).tolist()
        ppo = spec.process_prompt(PromptRequest(ids))
        caps = spec.clamp_caps(spec.get_loop_caps(out, prompt_len=len(ids)))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        rid = f"r{next(count)}"
        eng.add(NewRequest(rid, "", refs, SamplingParams(temperature=0.0, ignore_eos=True), "", len(ids), out,
                           ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, w.pools)), ppo.new_input_tensors)
        return rid

    def timed() -> float:
        t0 = time.perf_counter()
        eng.step()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(args.rows):
        add(1000)
    while eng.waiting or any(s.num_computed < len(s.prompt) for s in eng.running):
        eng.step()
    for _ in range(5):
        eng.step()
    decode = [timed() for _ in range(args.steps)]
    mixed = []
    for _ in range(6):
        extra = [add(2) for _ in range(4)]
        mixed.append(timed())
        for rid in extra:
            eng.abort(rid)
    print(f"decode step, {args.rows} rows: median {statistics.median(decode):.1f} ms (min {min(decode):.1f})")
    print(f"decode {args.rows} rows + 4 x {args.prompt_len} prefill: median {statistics.median(mixed):.1f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    shutil.rmtree(run, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
