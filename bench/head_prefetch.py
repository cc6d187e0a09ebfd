"""`python -m bench.head_prefetch --model FILE.gguf`: a c1 decode step of a GGUF file whose
LM head is in a byte form (Q8_0: the real Gemma 3 270M file's tied 262,144 x 640 head), in
this process, with the head GEMV's software prefetch on and off (qgemm.c's
`mstar_qgemm_set_head_prefetch`), alternated step by step on the same request, its logits
checked bit for bit equal either way. Prints min / p25 / median per setting and the load
average: on a shared host only the alternated comparison means anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.head_prefetch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file (kept quantized)")
    ap.add_argument("--steps", type=int, default=120, help="alternated pairs")
    args = ap.parse_args(argv)
    os.environ.setdefault("MSTAR_TORCH_THREADS", "1")
    from services.gpu_worker import cpu_kernels
    from services.gpu_worker.modeling.decoder import cpu_stack
    from services.gpu_worker.worker import GpuWorker
    from shared.config import Deployment
    from shared.frames import NewRequest, SamplingParams, pack_tensors
    from shared.specs.base import PromptRequest

    run = tempfile.mkdtemp(prefix="mstar-head-")
    d = Deployment(model=args.model, num_kv_pages=256, max_seq_len=1024, prefix_cache=False)
    w = GpuWorker(d, f"ipc://{run}/w.sock", f"ipc://{run}/w.sock", f"ipc://{run}/c.sock", "head")
    spec, eng, lib = w.spec, w.engine, cpu_kernels.library()
    seen: dict = {}
    real = cpu_stack.CpuDecodeStack.run_step

    def keep(self, *a):  # the last step's stack and arguments, to rerun it as it was
        seen["call"] = (self, a)
        return real(self, *a)

    cpu_stack.CpuDecodeStack.run_step = keep  # type: ignore[method-assign]
    ids = [2, *range(1000, 1031)]
    ppo = spec.process_prompt(PromptRequest(ids))
    caps = spec.clamp_caps(spec.get_loop_caps(100, prompt_len=len(ids)))
    refs, _ = pack_tensors(ppo.new_input_tensors)
    eng.add(NewRequest("r0", "", refs, SamplingParams(temperature=0.0, ignore_eos=True), "", len(ids), 100,
                       ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, w.pools)), ppo.new_input_tensors)
    for _ in range(8):
        eng.step()
    if "call" not in seen:
        raise SystemExit("the C decode stack does not take this model's steps")
    stack, call = seen["call"]
    times: dict[int, list[float]] = {1: [], 0: []}
    logits = {}
    for i in range(args.steps):
        for on in (1, 0) if i % 2 else (0, 1):
            lib.mstar_qgemm_set_head_prefetch(on)
            t0 = time.perf_counter()
            logits[on] = real(stack, *call).copy()
            times[on].append(time.perf_counter() - t0)
    lib.mstar_qgemm_set_head_prefetch(1)
    assert (logits[0] == logits[1]).all(), "the prefetch changed the logits"
    for on, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        print(f"head prefetch {'on ' if on else 'off'}: step min {min(ts) * 1e3:.2f} p25 {q[0] * 1e3:.2f} "
              f"median {q[1] * 1e3:.2f} ms")
    print(f"load average {os.getloadavg()[0]:.1f} (logits bitwise equal)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
