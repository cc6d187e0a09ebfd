"""Perplexity of the served model's numeric paths on a fixed public-domain text.

The text (tests/data/opticks_book1.txt) is Isaac Newton's Opticks (4th edition, 1730),
Book One, Part II, from its start: public domain, taken from the Project Gutenberg
transcription that libbacktrace ships as test data, with the italics underscores removed
and the Gutenberg header left out. About 3,000 tokens with SmolLM2's tokenizer.

The model runs the text as one sequence through the real paged path (prefill chunks over
KV pages, the same forward the worker runs); the perplexity is exp(mean next-token NLL)
over every position. Quality rule (issue 19): every reduced-precision path within 1% of
the float32 (dequantized) path on the default model.

    python -m bench.perplexity                # every path, the whole text
    python -m bench.perplexity --tokens 512   # a shorter prefix
    python -m bench.perplexity --paths quantized+bf16kv,quantized+int8kv   # some paths (and float32)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "opticks_book1.txt"

#: (name, --dtype, --kv-cache-dtype, --prefill-dtype) of each path on a GGUF model
PATHS = (("float32", "float32", "float32", "quantized"), ("quantized", "auto", "float32", "quantized"),
         ("quantized+bf16kv", "auto", "bfloat16", "quantized"),
         ("quantized+bf16kv+bf16prefill", "auto", "bfloat16", "bfloat16"),
         ("quantized+bf16kv+int8prefill", "auto", "bfloat16", "int8"),
         ("quantized+int8kv", "auto", "int8", "quantized"),
         ("quantized+int8kv+bf16prefill", "auto", "int8", "bfloat16"))


def text_ids(tokenizer, limit: int | None = None) -> list[int]:
    ids = tokenizer.encode(TEXT.read_text()).ids
    return ids[:limit] if limit else ids


def load(model: str, dtype: str, kv_dtype: str, prefill_dtype: str = "quantized"):
    """(model, spec, KV dtype) as the worker builds them for `--dtype dtype` and
    `--prefill-dtype prefill_dtype`."""
    from services.gpu_worker.weights import build_model, prompt_path, weight_dtype
    from shared.model_source import ModelSource

    source = ModelSource(model)
    spec = source.spec(16, 0, kv_dtype)
    dt, quantized = weight_dtype(dtype, source, "cpu")
    built = build_model(source, spec, dt, "cpu", quantized)
    prompt_path(built, prefill_dtype)
    return built, spec, getattr(torch, kv_dtype)


@torch.inference_mode()
def perplexity(model, spec, ids: list[int], kv_dtype: torch.dtype = torch.float32, chunk: int = 256) -> float:
    """exp(mean NLL of ids[1:]) with the model attending over paged KV, `chunk` rows a step."""
    from services.gpu_worker.attention import build_metadata
    from services.gpu_worker.kv_memory import kv_cache
    from services.gpu_worker.layers.prompt_rows import prompt_rows_from

    page = 16
    pools = spec.paged_pools(len(ids) // page + 2)
    caches = {name: kv_cache(p.num_layers, p.num_pages, page, p.kv_heads, p.head_dim, kv_dtype, torch.device("cpu"))
              for name, p in pools.items()}
    # layer i reads its label's pool (a model with sliding-window layers has two), in order
    taken: dict[str, int] = {}
    layer_caches = []
    for label in spec.layer_labels:
        pool = spec.label(label).pool
        layer_caches.append(caches[pool][taken.get(pool, 0)])
        taken[pool] = taken.get(pool, 0) + 1
    pages = list(range(len(ids) // page + 2))
    nll, count = 0.0, 0
    for start in range(0, len(ids), chunk):
        new = min(chunk, len(ids) - start)
        metas = {lab.name: build_metadata([(pages, 0, start, new, False)], page, lab.window) for lab in spec.kv_labels}
        x = torch.tensor(ids[start : start + new])
        with prompt_rows_from(0):  # every row is a prompt row (a --prefill-dtype bfloat16 path computes them so)
            logits = model(x, torch.arange(start, start + new), layer_caches, [metas[n] for n in spec.layer_labels],
                           torch.arange(new))
        targets = torch.tensor(ids[start + 1 : start + new + 1])
        logp = torch.log_softmax(logits[: targets.shape[0]].float(), dim=-1)
        nll -= float(logp.gather(1, targets.unsqueeze(1)).sum())
        count += targets.shape[0]
    return math.exp(nll / count)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model (default: the embedded SmolLM2 Q4_1 GGUF)")
    p.add_argument("--tokens", type=int, default=0, help="first N tokens of the text (0: all)")
    p.add_argument("--paths", default="", help="comma-separated path names to run (default: all; float32 always runs, "
                                               "the others are compared with it)")
    args = p.parse_args()
    from shared.model_source import ModelSource

    torch.set_num_threads(1)
    ids = text_ids(ModelSource(args.model).tokenizer.tokenizer, args.tokens or None)
    out = {"tokens": len(ids), "paths": {}}
    wanted = set(args.paths.split(",")) | {"float32"} if args.paths else None
    for name, dtype, kv, prefill in PATHS:
        if wanted is not None and name not in wanted:
            continue
        t0 = time.time()
        model, spec, kvd = load(args.model, dtype, kv, prefill)
        ppl = perplexity(model, spec, ids, kvd)
        out["paths"][name] = {"perplexity": round(ppl, 4), "seconds": round(time.time() - t0, 1)}
        print(name, out["paths"][name], flush=True)
    base = out["paths"]["float32"]["perplexity"]
    for r in out["paths"].values():
        r["vs_float32"] = round(r["perplexity"] / base - 1, 5)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
