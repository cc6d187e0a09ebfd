"""`python -m bench.moe`: a mixture of experts against llama-server, side by side on the same
Q8_0 GGUF file, same client, one run (issue 51's speed goals: c1 time per token <= 0.8x,
c16 tok/s >= 2.0x, TTFT of an 896-token prompt <= 0.5x, and c1 time per token within 1.3x
of the active bytes' memory floor).

The file: a random `Qwen3MoeForCausalLM` of ~104M parameters (hidden 512, 6 layers, 32
experts of width 256, 4 a token, 8 / 2 heads of 64) with SmolLM2's 49,152-id vocabulary
(tied embeddings), saved by transformers and converted by llama.cpp's `convert_hf_to_gguf.py
--outtype q8_0`, cached beside the bench checkpoints; mstar serves its experts in their Q8_0
blocks. Random weights: only speed is measured on it.

The floor: a c1 decode token reads every tensor but the experts once and top-k of each
layer's experts (the file's bytes with each expert tensor's scaled by k / E), over the
memory bandwidth `bench.bandwidth` measures. Per system and round (alternating who goes
first): bench.hybrid's figures (start-up, c1 TTFT and TPOT, c16 tok/s, the 896-token TTFT,
peak RSS), the ratios mstar / llama-server with their spread (table, JSON, PNG).

    python -m bench.moe                   # prints the file's path (made once)
    python -m bench.moe --bench --rounds 2 --llama-bin <llama-server>
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from bench import bandwidth
from bench.checkpoints import cache_dir
from bench.hybrid import parser, report, run_rounds
from bench.report import results_dir

SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=6,
             num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)


def make_checkpoint(path: Path, seed: int = 0) -> Path:
    """The random Qwen3-MoE checkpoint with SmolLM2's tokenizer (from the default model's file)."""
    import json

    import torch
    import transformers
    from tokenizers import Tokenizer

    from tests.llama_converter import smollm2_vocabulary

    smollm2_vocabulary(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    specials = json.loads((path / "tokenizer_config.json").read_text())
    cfg = transformers.Qwen3MoeConfig(vocab_size=tok.get_vocab_size(), rms_norm_eps=1e-6,
                                      eos_token_id=tok.token_to_id(specials["eos_token"]),
                                      bos_token_id=tok.token_to_id(specials["bos_token"]), **SHAPE)
    torch.manual_seed(seed)
    transformers.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    return path


def ensure_file(root: Path | None = None) -> Path:
    """The cached Q8_0 file, made on first use (built aside, renamed into place)."""
    from tests.llama_converter import convert

    root = root or cache_dir()
    path = root / "qwen3moe-32x4-smollm2-q8_0.gguf"
    if path.is_file():
        return path
    work = root / f".moe-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        convert(make_checkpoint(work / "ckpt"), work / path.name, "q8_0", timeout=1200)
        (work / path.name).rename(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def active_bytes(path: Path) -> int:
    """What a c1 decode token reads of the file: every tensor once, each expert tensor
    (`*_exps`) scaled by top-k / experts."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    experts, used = (int(reader.fields[f"{arch}.{k}"].parts[-1][0]) for k in ("expert_count", "expert_used_count"))
    total = 0
    for t in reader.tensors:
        total += int(t.n_bytes) * used // experts if "_exps" in t.name else int(t.n_bytes)
    return total


def bench(args) -> None:
    model = Path(args.model or ensure_file())
    out_dir = results_dir(args.out)
    bytes_per_token = active_bytes(model)
    bw = bandwidth.measure()
    floor_ms = 1000 * bytes_per_token / bw
    print(f"active bytes a token {bytes_per_token / 1e6:.1f} MB, bandwidth {bw / 1e9:.1f} GB/s: "
          f"floor {floor_ms:.2f} ms", flush=True)
    runs = run_rounds(str(model), args, out_dir)
    for name in ("mstar", "llama-server"):
        tpot = min(r[name]["c1_tpot_ms"] for r in runs)
        print(f"{name}: best c1 TPOT {tpot:.2f} ms = {tpot / floor_ms:.2f}x the {floor_ms:.2f} ms floor")
    report(out_dir, runs, "Qwen3-MoE 32x4 (104M, Q8_0)", {"args": vars(args), "rounds": runs,
                                                           "active_bytes": bytes_per_token, "bandwidth_bytes_s": bw,
                                                           "floor_ms": floor_ms})


def main(argv: list[str] | None = None) -> int:
    args = parser("python -m bench.moe", __doc__, "MoE").parse_args(argv)
    if args.bench:
        bench(args)
    else:
        print(ensure_file())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
