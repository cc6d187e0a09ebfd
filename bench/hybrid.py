"""`python -m bench.hybrid`: Qwen3.5 (hybrid linear attention) against llama-server, side by
side on the same Q8_0 GGUF file, same client, one run (issue 50's speed goals: c1 time per
token <= 0.8x, c16 tok/s >= 2.0x, TTFT of an 896-token prompt <= 0.5x).

The file: a random `Qwen3_5ForCausalLM` of ~28M parameters in its layers (hidden 512, 8
layers, a full-attention layer every 4th, 8 / 2 heads of 64, linear attention 4 key heads /
8 value heads of 64, intermediate 1536) with SmolLM2's 49,152-id vocabulary (a real
tokenizer whose pre-tokenizer llama.cpp's converter knows; tied embeddings: 25.2M more, the
head's GEMV as big as all the layers' together, as in the small Qwen3.5s whose 248k
vocabulary makes the head most of a decode step), saved by transformers and converted by
llama.cpp's `convert_hf_to_gguf.py --outtype q8_0`, cached beside the bench checkpoint.
Random weights: only speed is measured on it.

Per system and round (alternating who goes first): start-up, c1 TTFT and TPOT (128-token
prompts, 64 out), c16 output tok/s (48 requests), the TTFT of 896-token prompts (c1, fresh
random ids each, so no prefix-cache hit on either side), peak RSS of the process tree; the
ratios mstar / llama-server per round with their spread (bench.llama_server's levels and
servers, bench.side_by_side's table / JSON / PNG). Also printed: one request's state bytes
(float32 conv window and recurrent matrix in every linear layer) beside the attention block
vLLM would round its pages to so that one block's KV holds a layer's state (528 tokens for
Qwen3.5-4B), for this model and the published Qwen3.5 shapes.

    python -m bench.hybrid                   # prints the file's path (made once)
    python -m bench.hybrid --bench --rounds 2 --llama-bin <llama-server>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
from pathlib import Path

from bench import llama_server
from bench.checkpoints import cache_dir
from bench.client import make_prompts, run_load
from bench.report import results_dir, table
from bench.server import MemorySampler, MstarServer, Server
from bench.side_by_side import Figure
from bench.side_by_side import report as side_by_side_report

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, full_attention_interval=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
             linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
             max_position_embeddings=8192, tie_word_embeddings=True)
#: the prompt length of issue 50's TTFT goal, and how many such prompts a round sends
TTFT_PROMPT, TTFT_REQUESTS = 896, 3

#: published config.json values (Hugging Face, Qwen/Qwen3.5-*) of the linear and full
#: attention parts: (linear layers, conv kernel, key heads, value heads, key dim, value dim,
#: KV heads, head dim); vLLM's figure of 528 tokens for 4B is the check on these
PUBLISHED = {
    "Qwen3.5-4B": (24, 4, 16, 32, 128, 128, 4, 256),
    "Qwen3.5-0.8B": (18, 4, 16, 16, 128, 128, 2, 256),
}


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """The random Qwen3.5 checkpoint with SmolLM2's tokenizer (from the default model's file)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from tests.llama_converter import smollm2_vocabulary

    smollm2_vocabulary(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    specials = json.loads((path / "tokenizer_config.json").read_text())
    cfg = transformers.Qwen3_5TextConfig(vocab_size=tok.get_vocab_size(), rms_norm_eps=1e-6,
                                         eos_token_id=tok.token_to_id(specials["eos_token"]),
                                         bos_token_id=tok.token_to_id(specials["bos_token"]), **SHAPE)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():  # (1 + w) norms: HF inits w to 0, which would hide the offset
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _convert(ckpt: Path, out: Path) -> Path:
    """tests.llama_converter's run of `convert_hf_to_gguf.py`, with `--no-mtp`: the converter
    asserts a Qwen3.5 config names its multi-token-prediction layers unless told to leave
    them out (transformers' `Qwen3_5ForCausalLM` has none to write)."""
    import subprocess
    import sys

    from tests.llama_converter import converter

    script = converter()
    if script is None:
        raise RuntimeError("llama.cpp's converter is not available (scripts/fetch-llama-converter fetches it)")
    env = {**os.environ, "PYTHONPATH": str(script.parent / "gguf-py")}
    env.pop("NO_LOCAL_GGUF", None)
    proc = subprocess.run([sys.executable, str(script), str(ckpt), "--outtype", "q8_0", "--no-mtp", "--outfile",
                           str(out)], env=env, cwd=script.parent, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {ckpt}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return out


def ensure_file(root: Path | None = None) -> Path:
    """The cached Q8_0 file, made on first use (built aside, renamed into place)."""
    root = root or cache_dir()
    path = root / "qwen35-8x512-smollm2-q8_0.gguf"
    if path.is_file():
        return path
    work = root / f".hybrid-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        ckpt = make_checkpoint(work / "ckpt")
        _convert(ckpt, work / path.name)
        (work / path.name).rename(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def state_bytes(linear_layers: int, kernel: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int,
                kv_heads: int, head_dim: int) -> dict:
    """One request's state as mstar keeps it (float32 conv window and recurrent matrix per
    linear layer), and vLLM's hybrid page: its attention block grows (in multiples of 16
    tokens) until one block's bf16 KV of a layer holds a layer's state (conv window in bf16,
    recurrent matrix in float32), so its prefix cache works in blocks of that many tokens."""
    conv = (kernel - 1) * (2 * key_heads * key_dim + value_heads * value_dim)
    recurrent = value_heads * key_dim * value_dim
    mstar_layer = 4 * (conv + recurrent)
    vllm_layer = 2 * conv + 4 * recurrent
    kv_token = 2 * kv_heads * head_dim * 2  # K and V, bf16, one layer
    block = 16 * math.ceil(vllm_layer / (16 * kv_token))
    return {"mstar_state_bytes": mstar_layer * linear_layers, "mstar_state_bytes_layer": mstar_layer,
            "vllm_state_bytes_layer": vllm_layer, "kv_bytes_token_layer": kv_token, "vllm_block_tokens": block,
            "vllm_page_bytes_layer": block * kv_token, "vllm_state_pages_bytes": block * kv_token * linear_layers}


def model_states() -> dict[str, dict]:
    """state_bytes of the bench file's shape and of the published Qwen3.5 shapes."""
    linear = SHAPE["num_hidden_layers"] - SHAPE["num_hidden_layers"] // SHAPE["full_attention_interval"]
    ours = (linear, SHAPE["linear_conv_kernel_dim"], SHAPE["linear_num_key_heads"], SHAPE["linear_num_value_heads"],
            SHAPE["linear_key_head_dim"], SHAPE["linear_value_head_dim"], SHAPE["num_key_value_heads"],
            SHAPE["head_dim"])
    return {"bench file": state_bytes(*ours), **{k: state_bytes(*v) for k, v in PUBLISHED.items()}}


def _ttft(server: Server, seed: int) -> list[float]:
    """TTFT (ms) of TTFT_REQUESTS prompts of TTFT_PROMPT fresh random ids, one at a time."""
    out = []
    for i in range(TTFT_REQUESTS):
        reqs = make_prompts(1, TTFT_PROMPT, 4, seed=1000 + 100 * seed + i, id_range=(10, 20000))
        results, _, _ = asyncio.run(run_load(server.url, llama_server._backend(server), reqs, 1, client="httpx"))
        if not results[0].ok:
            raise RuntimeError(f"an {TTFT_PROMPT}-token request failed: {results[0].error}")
        out.append(1000 * results[0].ttft)
    return out


def measure(server: Server, args) -> dict:
    """One system's figures in one round (bench.llama_server's levels, plus the long TTFT)."""
    server.start()
    sampler = MemorySampler(server.proc.pid, 0.5)
    sampler.start()
    try:
        out: dict = {"startup_s": server.startup_s}
        asyncio.run(run_load(server.url, llama_server._backend(server), make_prompts(2, 16, 4, seed=99), 1,
                             client="httpx"))
        c1 = llama_server._level(server, 1, args.c1_requests, args)
        c16 = llama_server._level(server, 16, args.c16_requests, args)
        ttfts = _ttft(server, args.round)
        out.update(c1=c1, c16=c16, ttft_896_all_ms=ttfts, c1_tpot_ms=c1["tpot_ms_p50"], c1_ttft_ms=c1["ttft_ms_p50"],
                   c16_tok_s=c16["out_tok_s"], ttft_896_ms=statistics.median(ttfts),
                   errors=c1["errors"] + c16["errors"])
    finally:
        out.update(sampler.stop())
        server.stop()
    return out


FIGURES = [Figure("c1 TPOT (ms)", "c1_tpot_ms"), Figure("c16 tok/s", "c16_tok_s", higher_is_better=True),
           Figure(f"TTFT {TTFT_PROMPT} (ms)", "ttft_896_ms"), Figure("c1 TTFT 128 (ms)", "c1_ttft_ms"),
           Figure("start-up (s)", "startup_s"), Figure("peak RSS (MiB)", "peak_rss_mib")]
HEADER = ["system", "round", "start-up s", "c1 TTFT ms", "c1 TPOT ms", "c16 tok/s", f"TTFT {TTFT_PROMPT} ms",
          "peak RSS MiB", "errors"]


def rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for r in runs:
        for name in ("mstar", "llama-server"):
            x = r[name]
            rows.append([name, str(r["round"]), f"{x['startup_s']:.2f}", f"{x['c1_ttft_ms']:.1f}",
                         f"{x['c1_tpot_ms']:.2f}", f"{x['c16_tok_s']:.1f}", f"{x['ttft_896_ms']:.0f}",
                         f"{x['peak_rss_mib']:.0f}", str(x["errors"])])
    return rows


def _state_rows(states: dict[str, dict]) -> list[list[str]]:
    return [[name, f"{s['mstar_state_bytes'] / 2**10:,.0f} KiB", f"{s['mstar_state_bytes_layer'] / 2**10:,.0f} KiB",
             f"{s['vllm_block_tokens']}", f"{s['vllm_page_bytes_layer'] / 2**10:,.0f} KiB",
             f"{s['vllm_state_pages_bytes'] / 2**10:,.0f} KiB"] for name, s in states.items()]


STATE_HEADER = ["model", "mstar state / request", "per linear layer", "vLLM block (tokens)",
                "vLLM page / layer", "vLLM state pages / request"]


def run_rounds(model: str, args, out_dir: Path) -> list[dict]:
    """`args.rounds` rounds of both systems on `model`, who goes first alternating; the
    table printed, the rounds returned (bench.moe runs the same)."""
    runs = []
    for rnd in range(args.rounds):
        args.round = rnd
        systems = {"mstar": lambda r=rnd: MstarServer(model, out_dir / f"mstar-{r}.log", args.serve_arg),
                   "llama-server": lambda r=rnd: llama_server.LlamaServer(args.llama_bin, model,
                                                                          out_dir / f"llama-{r}.log", args.llama_arg)}
        order = list(systems) if rnd % 2 == 0 else list(systems)[::-1]
        run: dict = {"round": rnd, "first": order[0]}
        for name in order:
            run[name] = measure(systems[name](), args)
            print(name, rnd, {k: v for k, v in run[name].items() if k not in ("c1", "c16")}, flush=True)
        runs.append(run)
    print(table(HEADER, rows(runs)))
    return runs


def bench(args) -> None:
    model = args.model or str(ensure_file())
    out_dir = results_dir(args.out)
    states = model_states()
    print(table(STATE_HEADER, _state_rows(states)), flush=True)
    runs = run_rounds(model, args, out_dir)
    report(out_dir, runs, "Qwen3.5 hybrid (30M, Q8_0)", {"args": vars(args), "states": states, "rounds": runs})


def report(out_dir: Path, runs: list[dict], title: str, extra: dict) -> None:
    """The side-by-side table, JSON and PNG of `run_rounds`' rounds (bench.moe's too)."""
    by_system = {name: [r[name] for r in runs] for name in ("mstar", "llama-server")}
    side_by_side_report(out_dir, by_system, FIGURES, "llama-server", title, extra)
    print("load average at the end:", os.getloadavg())
    print("results in", out_dir)


def parser(prog: str, doc: str | None, what: str) -> argparse.ArgumentParser:
    """The flags of a side-by-side bench on one cached GGUF file (`what` names it)."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", action="store_true", help="run the side-by-side bench (else print the file's path)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="", help=f"GGUF file (default: the cached Q8_0 {what}, made once)")
    p.add_argument("--llama-bin", default=os.environ.get("LLAMA_SERVER_BIN", str(llama_server.DEFAULT_BIN)))
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--c1-requests", type=int, default=6)
    p.add_argument("--c16-requests", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[], help="extra `mstar serve` flag (repeat)")
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-server flag (repeat)")
    p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser("python -m bench.hybrid", __doc__, "hybrid").parse_args(argv)
    if args.bench:
        bench(args)
    else:
        print(ensure_file())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
