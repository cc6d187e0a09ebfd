"""`python -m bench speech`: text to speech, mstar against transformers' `generate`.

The bench checkpoint is a random Orpheus-shaped Llama (the text bench checkpoint's shape:
8 layers, hidden 512) with the real 24 kHz SNAC codec's shape (random weights; its
decoder is what costs), made once and cached. Every request speaks the same sentence for
`--frames` frames (7 audio tokens a frame, 2048 samples: ~85 ms of sound), greedy under
the worker's code constraint (the reference gets the same constraint as a logits
processor, or a random model's tokens would not be codes).

Figures, rounds alternating the two systems (medians, spreads, per-round ratios):
- TTFA: request to the first sound. mstar: `/v1/audio/speech` streamed raw pcm, the first
  body bytes; transformers: `generate` then SNAC's decode, one request at a time (what a
  user of the reference scripts runs: the sound exists once the whole clip is decoded);
- real-time factor (wall time / audio seconds; below 1 is faster than real time) of one
  request, and of 8 at once (mstar: 8 concurrent requests; transformers: one after the
  other, as its scripts serve them).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

from bench.checkpoints import cache_dir
from bench.report import results_dir
from bench.server import MstarServer
from bench.side_by_side import Figure, report
from bench.speech_client import TEXT, mstar_one

SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)
#: hubertsiuzdak/snac_24khz's config
SNAC_24KHZ = dict(sampling_rate=24000, encoder_dim=48, encoder_rates=[2, 4, 8, 8], decoder_dim=1024,
                  decoder_rates=[8, 8, 4, 2], attn_window_size=None, codebook_dim=8, vq_strides=[4, 2, 1],
                  noise=True, depthwise=True)


def ensure_checkpoint(root: Path | None = None) -> Path:
    from tests.tts_checkpoints import make_orpheus_checkpoint, make_snac_folder

    root = root or cache_dir()
    path = root / "orpheus-bench-8x512-v1"
    if (path / "snac" / "pytorch_model.bin").exists():
        return path
    tmp = root / f".{path.name}.{os.getpid()}"
    make_orpheus_checkpoint(tmp, codebook_size=4096, **SHAPE)
    make_snac_folder(tmp / "snac", codebook_size=4096, **SNAC_24KHZ)
    try:
        tmp.rename(path)
    except OSError:
        pass
    return path


async def mstar_round(url: str, max_tokens: int, concurrency: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        ttfa, wall, size = await mstar_one(client, max_tokens)
        t0 = time.perf_counter()
        many = await asyncio.gather(*(mstar_one(client, max_tokens) for _ in range(concurrency)))
        wall_n = time.perf_counter() - t0
    seconds = size / 2 / 24000
    return {"ttfa_s": ttfa, "rtf_c1": wall / seconds, "rtf_cN": wall_n / (sum(m[2] for m in many) / 2 / 24000)}


class Reference:
    """transformers' generate under the code constraint, then SNAC's decode (snac package)."""

    def __init__(self, folder: Path) -> None:
        import json

        import torch
        import transformers
        from snac import SNAC

        from shared.specs.orpheus_codes import OrpheusCodes

        self.tok = transformers.AutoTokenizer.from_pretrained(folder)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.codes = OrpheusCodes(self.tok.get_vocab(), 4096)
        self.snac = SNAC(**json.loads((folder / "snac" / "config.json").read_text()))
        self.snac.load_state_dict(torch.load(folder / "snac" / "pytorch_model.bin", weights_only=True))
        self.snac.eval()
        self.prompt = self.codes.prompt_ids(self.tok(f"tara: {TEXT}")["input_ids"])

    def one(self, max_tokens: int) -> tuple[float, float]:
        """(seconds to the sound, audio seconds) of one request."""
        import torch
        import transformers

        codes, n = self.codes, len(self.prompt)

        class Slots(transformers.LogitsProcessor):
            def __call__(self, input_ids, scores):
                lo, hi = codes.allowed(input_ids.shape[1] - n)
                out = torch.full_like(scores, float("-inf"))
                out[:, lo:hi] = scores[:, lo:hi]
                return out

        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([self.prompt]), max_new_tokens=max_tokens, do_sample=False,
                                      logits_processor=[Slots()], eos_token_id=None, pad_token_id=0)
            frames = codes.frames(codes.codes(out[0, n:].tolist()))
            audio = self.snac.decode([torch.from_numpy(f)[None] for f in frames])
        return time.perf_counter() - t0, audio.shape[-1] / 24000

    def round(self, max_tokens: int, concurrency: int) -> dict:
        ttfa, seconds = self.one(max_tokens)
        t0 = time.perf_counter()
        total = sum(self.one(max_tokens)[1] for _ in range(concurrency))
        return {"ttfa_s": ttfa, "rtf_c1": ttfa / seconds, "rtf_cN": (time.perf_counter() - t0) / total}


def speech(args) -> Path:
    if getattr(args, "family", "orpheus") == "csm":
        from bench.speech_csm import speech_csm

        return speech_csm(args)
    if getattr(args, "family", "orpheus") != "orpheus":
        from bench.speech_families import speech_family

        return speech_family(args)
    args.frames, args.concurrency = args.frames or 24, args.concurrency or 8
    out = results_dir(args.out)
    folder = Path(args.model) if args.model else ensure_checkpoint()
    max_tokens = 7 * args.frames
    ref = Reference(folder)
    print("starting mstar serve ...", file=sys.stderr)
    server = MstarServer(str(folder), out / "logs" / "mstar.log", list(args.serve_arg)).start()
    runs: dict[str, list[dict]] = {"mstar": [], "transformers": []}
    try:
        asyncio.run(mstar_round(server.url, 14, 2))  # warm
        ref.one(14)
        for r in range(args.rounds):
            runs["mstar"].append(asyncio.run(mstar_round(server.url, max_tokens, args.concurrency)))
            runs["transformers"].append(ref.round(max_tokens, args.concurrency))
            print(f"round {r + 1}: {runs}", file=sys.stderr)
    finally:
        server.stop()
    figures = [Figure("time to first audio (ms)", "ttfa_s", 1e3), Figure("real-time factor, c1", "rtf_c1"),
               Figure(f"real-time factor, c{args.concurrency}", "rtf_cN")]
    title = f"random Orpheus-shaped 8x512 + SNAC 24 kHz's shape, {args.frames} frames (lower is better)"
    return report(out, runs, figures, "transformers", title,
                  {"mode": "speech", "args": vars(args), "model": str(folder)})
