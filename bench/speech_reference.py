"""The reference packages' side of `python -m bench speech --family qwen3_tts|chatterbox`,
run as a script in the package's own venv (tests/qwen3_tts_checkpoints.py and
tests/chatterbox_checkpoints.py build those venvs: their pins clash with mstar's).

    python speech_reference.py FAMILY FOLDER TEXT FRAMES COUNT

loads the package's model from FOLDER once, then speaks TEXT COUNT times one request at a
time (its own `generate`, then its codec / vocoder: the sound exists once the call
returns), FRAMES frames at most, and prints one JSON list of {"wall": seconds,
"audio_s": seconds of sound}. The first is a warm-up the caller drops.

The stubs and the size patches are the tests' own (tests/qwen3_tts_reference.py,
tests/chatterbox_reference.py), imported from tests/.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

#: tests/ in place of this script's folder, whose modules (bench/profile.py, ...) would shadow the stdlib's
sys.path[0] = str(Path(__file__).resolve().parent.parent / "tests")


def qwen3_tts(folder: Path, text: str, frames: int, count: int) -> list[dict]:
    """`Qwen3TTSModel`'s greedy custom-voice generate (the default speaker) and its 12 Hz
    codec's decode; `max_new_tokens` frames + 1 makes `frames` frames (as the tests run it)."""
    from qwen3_tts_reference import _stub_audio_packages

    _stub_audio_packages()
    import torch
    from qwen_tts import Qwen3TTSModel

    model = Qwen3TTSModel.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    speaker = next(iter(model.model.config.talker_config.spk_id))
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        with torch.inference_mode():
            codes, _ = model.model.generate(
                input_ids=model._tokenize_texts([model._build_assistant_text(text)]), instruct_ids=[None],
                languages=["Auto"], speakers=[speaker], non_streaming_mode=True,
                **model._merge_generate_kwargs(do_sample=False, subtalker_dosample=False, max_new_tokens=frames + 1))
            wavs, rate = model.model.speech_tokenizer.decode([{"audio_codes": c} for c in codes])
        out.append({"wall": time.perf_counter() - t0, "audio_s": len(wavs[0]) / rate})
    return out


def chatterbox(folder: Path, text: str, frames: int, count: int) -> list[dict]:
    """`ChatterboxTTS.generate` (its sampling defaults, a fixed seed), T3's `max_new_tokens`
    set to `frames` speech tokens (the package's generate says 1000), then S3Gen."""
    from chatterbox_reference import _stub_packages, shrink

    _stub_packages()
    shrink(folder)
    import torch
    from chatterbox.tts import ChatterboxTTS

    model = ChatterboxTTS.from_local(folder, "cpu")
    t3_inference = model.t3.inference

    def t3_run(**kw):
        kw["max_new_tokens"] = frames
        return t3_inference(**kw)

    model.t3.inference = t3_run
    out = []
    for _ in range(count):
        torch.manual_seed(0)
        t0 = time.perf_counter()
        wav = model.generate(text)
        out.append({"wall": time.perf_counter() - t0, "audio_s": wav.shape[-1] / model.sr})
    return out


if __name__ == "__main__":
    family, folder, text = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    run = {"qwen3_tts": qwen3_tts, "chatterbox": chatterbox}[family]
    print(json.dumps(run(folder, text, int(sys.argv[4]), int(sys.argv[5]))))
