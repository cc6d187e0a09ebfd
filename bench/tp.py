"""What tensor parallelism costs per decode step (issue 57): the gloo all-reduce's time beside
the step's, and the bytes the collectives move, from which what NCCL would take follows.

`python -m bench.tp [--rows 1 8 32] [--context 256] [--layers 8] [--hidden 512]` spawns N
gloo ranks (torch.multiprocessing), each holding its shard of a random Llama-shaped decoder
(`tp/load.py`'s modules, prepared and parallelized as a worker's), and times decode steps of
`rows` rows at `context` cached rows over paged KV; the same model at one rank (its layers
one module at a time, as a TP rank runs them, and through the C decode stack where it takes
the step) is the baseline. Each rank's all-reduce calls are timed inside the step.

NCCL estimate: a ring all-reduce moves 2 (N - 1) / N of the tensor's bytes per rank; at
`--nccl-gb-s` of bus bandwidth (NVLink between two H100s: ~150 GB/s for messages this size
is optimistic; the default is a conservative 50) plus `--nccl-latency-us` a call; the head's
gather of the logits to rank 0 (`gather_bytes`) is counted apart. On a
2-core machine TP 2 is not faster: the ranks share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.report import results_dir, table, write_json


def _config(a: argparse.Namespace) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.hidden,
            "intermediate_size": 3 * a.hidden, "num_hidden_layers": a.layers, "num_attention_heads": a.hidden // 64,
            "num_key_value_heads": max(1, a.hidden // 128), "head_dim": 64, "vocab_size": a.vocab,
            "max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}


class _Timed:
    """The group's all-reduce and the head's gather, timed (and their bytes counted) while `on`."""

    def __init__(self, group) -> None:
        self.on, self.seconds, self.bytes, self.calls, self.gather_bytes = False, 0.0, 0, 0, 0
        self._reduce, self._gather = group.all_reduce, group.gather_last
        group.all_reduce, group.gather_last = self.all_reduce, self.gather_last

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self._reduce(t)
        if self.on:
            self.seconds += time.perf_counter() - t0
            self.bytes += t.numel() * t.element_size()
            self.calls += 1
        return out

    def gather_last(self, t: torch.Tensor) -> torch.Tensor:
        if self.on:
            self.gather_bytes += t.numel() * t.element_size()
        return self._gather(t)

    def reset(self) -> None:
        self.seconds, self.bytes, self.calls, self.gather_bytes = 0.0, 0, 0, 0


def _model(cfg: dict, rank: int, size: int, group):
    """A prepared random model: rank `rank`'s shard (parallelized) or, at one rank, the whole."""
    from services.gpu_worker.modeling.decoder.lm import DecoderLM
    from services.gpu_worker.tp.layers import parallelize
    from services.gpu_worker.tp.shard import local_config, split_for
    from shared.model_config import read_model_config

    full = read_model_config(cfg)
    torch.manual_seed(rank)
    split = split_for(full, rank, size) if group is not None else None
    model = DecoderLM(local_config(full, split) if split is not None else full).eval()
    for p in model.parameters():
        p.requires_grad_(False).normal_(0, 0.05)
    model.reset_buffers()
    model.prepare()
    if group is not None and split is not None:
        parallelize(model, split, group)
    return model


def _inputs(model, rows: int, context: int, page_size: int = 16):
    from services.gpu_worker.attention import AttnRows, build_metadata, cpu_backend
    from services.gpu_worker.kv_memory import kv_cache
    from shared.pages import ceil_div

    c = model.config
    per = ceil_div(context + 1, page_size)
    caches = kv_cache(c.num_hidden_layers, rows * per, page_size, c.num_key_value_heads, c.head_dim, torch.float32,
                      torch.device("cpu"))
    attn = [AttnRows(list(range(r * per, (r + 1) * per)), 0, context, 1, True) for r in range(rows)]
    backend = cpu_backend(torch.float32, torch.float32, None, c.num_attention_heads, c.num_key_value_heads)
    meta = build_metadata(attn, page_size, None, backend)
    ids = torch.randint(0, c.vocab_size, (rows,))
    pos = torch.full((rows,), context, dtype=torch.int64)
    return ids, pos, caches, [meta] * c.num_hidden_layers, torch.arange(rows)


def _time_steps(model, rows: int, context: int, steps: int, timed: _Timed | None) -> dict:
    """Median step time (and, on a TP rank, the median step's all-reduce time, calls and bytes)."""
    ids, pos, caches, metas, sample = _inputs(model, rows, context)
    times, reduces = [], []
    with torch.inference_mode():
        for _ in range(3):
            model(ids, pos, caches, metas, sample)
        for _ in range(steps):
            if timed is not None:
                timed.reset()
                timed.on = True
            t0 = time.perf_counter()
            model(ids, pos, caches, metas, sample)
            times.append(time.perf_counter() - t0)
            if timed is not None:
                timed.on = False
                reduces.append(timed.seconds)
    out = {"step_ms": 1e3 * statistics.median(times)}
    if timed is not None:
        out.update(allreduce_ms=1e3 * statistics.median(reduces), allreduce_calls=timed.calls,
                   allreduce_bytes=timed.bytes, gather_bytes=timed.gather_bytes)
    return out


def _rank(rank: int, size: int, port: int, a: argparse.Namespace, out_path: str) -> None:
    from services.gpu_worker.tp.group import TpGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    group = TpGroup(rank, size)
    timed = _Timed(group)
    model = _model(_config(a), rank, size, group)
    res = {rows: _time_steps(model, rows, a.context, a.steps, timed) for rows in a.rows}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({str(k): v for k, v in res.items()}, f)
    dist.destroy_process_group()


def _one_rank(a: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    model = _model(_config(a), 0, 1, None)
    stack = model.cpu_stack
    res = {}
    for rows in a.rows:
        model.cpu_stack = None  # a TP rank's path: one module at a time
        modules = _time_steps(model, rows, a.context, a.steps, None)["step_ms"]
        model.cpu_stack = stack
        res[rows] = {"step_ms_modules": modules, "step_ms_stack": _time_steps(model, rows, a.context, a.steps,
                                                                              None)["step_ms"]}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--nccl-gb-s", type=float, default=50.0)
    p.add_argument("--nccl-latency-us", type=float, default=10.0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from services.gpu_worker.tp.group import free_port

    out_dir = results_dir(a.out)
    tmp = str(out_dir / "tp_rank0.json")
    mp.spawn(_rank, args=(a.size, free_port(), a, tmp), nprocs=a.size, join=True)
    with open(tmp) as f:
        tp = {int(k): v for k, v in json.load(f).items()}
    os.unlink(tmp)
    one = _one_rank(a)
    rows_out, report = [], {"config": _config(a), "size": a.size, "context": a.context, "rows": {}}
    for rows in a.rows:
        t, o = tp[rows], one[rows]
        ring = 2 * (a.size - 1) / a.size * t["allreduce_bytes"]
        nccl_ms = 1e3 * ring / (a.nccl_gb_s * 1e9) + t["allreduce_calls"] * a.nccl_latency_us / 1e3
        report["rows"][rows] = {**t, **o, "nccl_estimate_ms": nccl_ms}
        rows_out.append([str(rows), f"{o['step_ms_stack']:.2f}", f"{o['step_ms_modules']:.2f}", f"{t['step_ms']:.2f}",
                         f"{t['allreduce_ms']:.2f}", str(t["allreduce_calls"]), f"{t['allreduce_bytes'] / 1e3:.1f}",
                         f"{nccl_ms:.3f}"])
    print(table(["rows", "TP1 stack ms", "TP1 modules ms", f"TP{a.size} step ms", "gloo all-reduce ms",
                 "all-reduces", "KB/step/rank", "NCCL est. ms"], rows_out))
    write_json(out_dir / "tp.json", report)
    _plot(out_dir / "tp.png", a, report)
    return 0


def _plot(path, a: argparse.Namespace, report: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = a.rows
    r = report["rows"]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([i - 0.3 for i in x], [r[k]["step_ms_stack"] for k in rows], 0.2, label="TP1 (C stack)")
    ax.bar([i - 0.1 for i in x], [r[k]["step_ms_modules"] for k in rows], 0.2, label="TP1 (modules)")
    ax.bar([i + 0.1 for i in x], [r[k]["step_ms"] for k in rows], 0.2, label=f"TP{a.size} step")
    ax.bar([i + 0.3 for i in x], [r[k]["allreduce_ms"] for k in rows], 0.2, label="of which gloo all-reduce")
    ax.set_xticks(list(x), [str(k) for k in rows])
    ax.set_xlabel("decode rows per step")
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
