"""`python -m bench speech --family csm`: CSM text to speech, mstar against transformers'
`CsmForConditionalGeneration.generate` + `MimiModel.decode`, one request at a time: the
checkpoint and the reference (bench/speech_families.py runs them).

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

import os
import time
from pathlib import Path

from bench.checkpoints import cache_dir
from bench.speech_client import TEXT
from bench.speech_timing import Reference

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


class CsmReference(Reference):
    """transformers' CSM generate (greedy, both stacks), then its codec's decode."""

    def __init__(self, folder: Path, frames: int) -> None:
        import torch
        import transformers

        self.model = transformers.CsmForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        rendered = tok.apply_chat_template([{"role": "0", "content": [{"type": "text", "text": TEXT}]}],
                                           tokenize=False)
        self.ids = tok(rendered, add_special_tokens=False, return_tensors="pt").input_ids
        self.frames = frames

    def one(self) -> dict:
        """{"wall": seconds to the sound, "audio_s"} of one request (no EOS stop: a random
        model's all-zero frame is all but impossible, and `min_new_tokens` is refused by CSM)."""
        import torch

        t0 = time.perf_counter()
        with torch.inference_mode():
            codes = self.model.generate(input_ids=self.ids, max_new_tokens=self.frames, do_sample=False,
                                        depth_decoder_do_sample=False)[0]
            audio = self.model.codec_model.decode(codes.t().unsqueeze(0)).audio_values
        return {"wall": time.perf_counter() - t0, "audio_s": audio.shape[-1] / 24000}
