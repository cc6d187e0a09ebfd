"""Hugging Face transformers' `generate` on the same checkpoint and prompt ids, timed in
process: greedy, KV cache on, exactly `max_new_tokens` (EOS suppressed until then).

Batch 1 times every token with a streamer (TTFT, per-token time); a batch of B prompts of
one length (no padding) gives the batched output throughput and time per step.
"""

from __future__ import annotations

import time

from bench.stats import mean, percentile


class _Clock:
    """A `generate` streamer that stamps each new token (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(model_dir: str, prompts: list[list[int]], max_new_tokens: int, batch_sizes: list[int], *,
           batch1_requests: int = 8, progress=None) -> dict:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    kw = dict(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, use_cache=True,
              pad_token_id=0, temperature=None, top_p=None, top_k=None)
    out: dict = {"load_s": load_s, "torch_threads": torch.get_num_threads(), "batches": {}}
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        for bs in batch_sizes:
            if bs == 1:
                ttft, itl, tpot, lat, tokens = [], [], [], [], 0
                t_all = time.perf_counter()
                for p in prompts[:batch1_requests]:
                    clock = _Clock()
                    start = time.perf_counter()
                    ids = model.generate(torch.tensor([p]), streamer=clock, **kw)
                    end = time.perf_counter()
                    n = ids.shape[1] - len(p)
                    tokens += n
                    ttft.append(clock.times[0] - start)
                    itl.extend(b - a for a, b in zip(clock.times, clock.times[1:]))
                    tpot.append((end - clock.times[0]) / max(1, n - 1))
                    lat.append(end - start)
                    if progress is not None:
                        progress.update(1)
                wall = time.perf_counter() - t_all
                out["batches"]["1"] = {
                    "batch": 1, "requests": len(lat), "output_tokens": tokens, "duration_s": wall,
                    "output_throughput": tokens / wall,
                    "ttft_ms": {"mean": mean(ttft) * 1e3, "p50": percentile(ttft, 50) * 1e3,
                                "p99": percentile(ttft, 99) * 1e3},
                    "itl_ms": {"mean": mean(itl) * 1e3, "p50": percentile(itl, 50) * 1e3,
                               "p99": percentile(itl, 99) * 1e3},
                    "tpot_ms": {"mean": mean(tpot) * 1e3, "p50": percentile(tpot, 50) * 1e3,
                                "p99": percentile(tpot, 99) * 1e3},
                    "latency_ms": {"mean": mean(lat) * 1e3, "p50": percentile(lat, 50) * 1e3,
                                   "p99": percentile(lat, 99) * 1e3},
                    "itl_sample_ms": [x * 1e3 for x in itl],
                }
                continue
            batch = prompts[:bs]
            if len(batch) < bs or len({len(p) for p in batch}) != 1:
                raise ValueError(f"HF batch {bs} needs {bs} prompts of one length")
            x = torch.tensor(batch)
            start = time.perf_counter()
            model.generate(x, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1})
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            ids = model.generate(x, **kw)
            wall = time.perf_counter() - start
            tokens = (ids.shape[1] - x.shape[1]) * bs
            if progress is not None:
                progress.update(bs)
            out["batches"][str(bs)] = {
                "batch": bs, "requests": bs, "output_tokens": tokens, "duration_s": wall,
                "output_throughput": tokens / wall, "prefill_ms": prefill * 1e3,
                # one decode step for the whole batch (every request's per-token time)
                "step_ms": (wall - prefill) / max(1, max_new_tokens - 1) * 1e3,
            }
    return out
