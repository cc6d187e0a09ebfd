"""`python -m bench speech`: text to speech, mstar against transformers' `generate`: the
Orpheus checkpoint and reference (bench/speech_families.py, the driver of every family's
run, times them).

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

import os
import time
from pathlib import Path

from bench.checkpoints import cache_dir
from bench.speech_client import TEXT
from bench.speech_timing import Reference

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


class OrpheusReference(Reference):
    """transformers' generate under the code constraint, then SNAC's decode (snac package)."""

    def __init__(self, folder: Path, max_tokens: int) -> None:
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
        self.max_tokens = max_tokens

    def one(self) -> dict:
        """{"wall": seconds to the sound, "audio_s"} of one request."""
        import torch
        import transformers

        codes, n, max_tokens = self.codes, len(self.prompt), self.max_tokens

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
        return {"wall": time.perf_counter() - t0, "audio_s": audio.shape[-1] / 24000}

