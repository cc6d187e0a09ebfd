"""`python -m bench speech --family csm`: CSM text to speech, mstar against transformers'
`CsmForConditionalGeneration.generate` + `MimiModel.decode`, one request at a time.

The bench checkpoint is a random CSM: backbone 8 layers of 512 (the text bench
checkpoint's shape), depth decoder 4 layers of 256, 32 codebooks of 2048 codes, and Mimi
at its real shape (kyutai/mimi's config: 8 transformer layers of 512, SEANet of 64
filters, 24 kHz; random weights), made once and cached. Every request speaks the same
sentence for `--frames` frames (1920 samples, 80 ms each; greedy for every
codebook). Figures as the Orpheus mode's (bench/speech.py): TTFA (mstar: the first body
bytes of a streamed `/v1/audio/speech`; transformers: generate, then decode), the
real-time factor of one request and of `--concurrency` at once (transformers one after
the other).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from bench.checkpoints import cache_dir
from bench.report import results_dir
from bench.server import MstarServer
from bench.side_by_side import Figure, report
from bench.speech_client import TEXT, mstar_one

BACKBONE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2)
DEPTH = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
#: kyutai/mimi's decoder shape (transformers' MimiConfig defaults)
MIMI = dict(hidden_size=512, num_filters=64, codebook_dim=256, vector_quantization_hidden_dimension=256,
            upsample_groups=512, num_hidden_layers=8, intermediate_size=2048, num_attention_heads=8,
            num_key_value_heads=8, head_dim=64)


def ensure_checkpoint(root: Path | None = None) -> Path:
    from tests.tts_checkpoints import make_csm_checkpoint

    root = root or cache_dir()
    path = root / "csm-bench-8x512-depth4x256-mimi-v1"
    if (path / "model.safetensors").exists():
        return path
    tmp = root / f".{path.name}.{os.getpid()}"
    make_csm_checkpoint(tmp, codebook_size=2048, depth=DEPTH, mimi=MIMI, **BACKBONE)
    try:
        tmp.rename(path)
    except OSError:
        pass
    return path


async def mstar_round(url: str, frames: int, concurrency: int) -> dict:
    import httpx


    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        ttfa, wall, size = await mstar_one(client, frames, {"temperature": 0})
        t0 = time.perf_counter()
        many = await asyncio.gather(*(mstar_one(client, frames, {"temperature": 0})
                                      for _ in range(concurrency)))
        wall_n = time.perf_counter() - t0
    return {"ttfa_s": ttfa, "rtf_c1": wall / (size / 2 / 24000),
            "rtf_cN": wall_n / (sum(m[2] for m in many) / 2 / 24000)}


class Reference:
    """transformers' CSM generate (greedy, both stacks), then its codec's decode."""

    def __init__(self, folder: Path) -> None:
        import torch
        import transformers

        self.model = transformers.CsmForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        rendered = tok.apply_chat_template([{"role": "0", "content": [{"type": "text", "text": TEXT}]}],
                                           tokenize=False)
        self.ids = tok(rendered, add_special_tokens=False, return_tensors="pt").input_ids

    def one(self, frames: int) -> tuple[float, float]:
        """(seconds to the sound, audio seconds) of one request (no EOS stop: a random
        model's all-zero frame is all but impossible, and `min_new_tokens` is refused by CSM)."""
        import torch

        t0 = time.perf_counter()
        with torch.inference_mode():
            codes = self.model.generate(input_ids=self.ids, max_new_tokens=frames, do_sample=False,
                                        depth_decoder_do_sample=False)[0]
            audio = self.model.codec_model.decode(codes.t().unsqueeze(0)).audio_values
        return time.perf_counter() - t0, audio.shape[-1] / 24000

    def round(self, frames: int, concurrency: int) -> dict:
        ttfa, seconds = self.one(frames)
        t0 = time.perf_counter()
        total = sum(self.one(frames)[1] for _ in range(concurrency))
        return {"ttfa_s": ttfa, "rtf_c1": ttfa / seconds, "rtf_cN": (time.perf_counter() - t0) / total}


def speech_csm(args) -> Path:
    args.frames, args.concurrency = args.frames or 24, args.concurrency or 8
    out = results_dir(args.out)
    folder = Path(args.model) if args.model else ensure_checkpoint()
    ref = Reference(folder)
    print("starting mstar serve ...", file=sys.stderr)
    server = MstarServer(str(folder), out / "logs" / "mstar.log", list(args.serve_arg)).start()
    runs: dict[str, list[dict]] = {"mstar": [], "transformers": []}
    try:
        asyncio.run(mstar_round(server.url, 2, 2))  # warm
        ref.one(2)
        for r in range(args.rounds):
            runs["mstar"].append(asyncio.run(mstar_round(server.url, args.frames, args.concurrency)))
            runs["transformers"].append(ref.round(args.frames, args.concurrency))
            print(f"round {r + 1}: {runs}", file=sys.stderr)
    finally:
        server.stop()
    figures = [Figure("time to first audio (ms)", "ttfa_s", 1e3), Figure("real-time factor, c1", "rtf_c1"),
               Figure(f"real-time factor, c{args.concurrency}", "rtf_cN")]
    title = (f"random CSM 8x512, depth 4x256, 32 codebooks + Mimi's shape, {args.frames} frames "
             "(lower is better)")
    return report(out, runs, figures, "transformers", title,
                  {"mode": "speech", "family": "csm", "args": vars(args), "model": str(folder)})
