"""S3Gen (Chatterbox's `S3Token2Wav.inference`): a request's speech tokens -> 24 kHz sound,
whole (its flow matching attends over the whole utterance, so nothing is final before the
last token).

The folder's s3gen.safetensors (`flow.*`: codecs/s3gen_flow.py; `mel2wav.*`:
codecs/s3gen_hift.py), its config.json's "s3gen" section where the sizes are not the
package's, and the built-in voice's S3Gen half (conds.pt's "gen": the prompt's tokens, mel
and x-vector). As the package's `generate`: tokens at or above 6561 (the start / end of
speech, unused ids) are dropped; the flow's noise and the vocoder's source are drawn from
the request's generator after T3's draws (the package's global generator after its
sampling loop); the first 20 ms are silenced and the next 20 ms faded in (`trim_fade`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from services.gpu_worker.codecs.s3gen_flow import S3GenFlow
from services.gpu_worker.codecs.s3gen_hift import HiFT

#: S3Gen's token vocabulary (codes at or above it are T3's specials)
SPEECH_VOCAB = 6561
SAMPLE_RATE = 24000


def trim_fade() -> torch.Tensor:
    n = SAMPLE_RATE // 50
    fade = torch.zeros(2 * n)
    fade[n:] = (torch.cos(torch.linspace(torch.pi, 0, n)) + 1) / 2
    return fade


def valid_tokens(tokens: list[int]) -> list[int]:
    """The package's `drop_invalid_tokens` (after the first start of speech, before the
    first end of speech), then only S3Gen's codes."""
    start = tokens.index(SPEECH_VOCAB) + 1 if SPEECH_VOCAB in tokens else 0
    end = tokens.index(SPEECH_VOCAB + 1) if SPEECH_VOCAB + 1 in tokens else len(tokens)
    return [t for t in tokens[start:end] if 0 <= t < SPEECH_VOCAB]


class S3Gen:
    def __init__(self, folder: Path, device: torch.device) -> None:
        cfg_path = folder / "config.json"
        sections = (json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}).get("s3gen") or {}
        self.flow = S3GenFlow(sections)
        self.hift = HiFT(sections.get("HiFTGenerator"), sections.get("ConvRNNF0Predictor"))
        with safe_open(str(folder / "s3gen.safetensors"), framework="pt") as f:
            for prefix, module in (("flow.", self.flow), ("mel2wav.", self.hift)):
                state = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
                module.load_state_dict(state)
        self.hift.fold_weight_norm()
        self.flow.to(device).eval()
        self.hift.to(device).eval()
        self.device = device
        gen = torch.load(folder / "conds.pt", map_location="cpu", weights_only=True)["gen"]
        self.voice = tuple(gen[k].to(device) for k in ("prompt_token", "prompt_feat", "embedding"))
        self.fade = trim_fade().to(device)

    def decode(self, tokens: list[int], generator: torch.Generator,
               voice: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> np.ndarray:
        """Float32 samples of `tokens` (T3's, its end of speech included or not), in the
        built-in voice or `voice` (a reference clip's prompt tokens, mel and x-vector)."""
        codes = valid_tokens(tokens)
        if not codes:
            return np.zeros(0, dtype=np.float32)
        prompt_tokens, prompt_feat, xvector = (t.to(self.device) for t in voice) if voice is not None else self.voice
        with torch.inference_mode():
            ids = torch.tensor([codes], dtype=torch.long, device=self.device)
            mel = self.flow(ids, prompt_tokens, prompt_feat.float(), xvector.float(), generator)
            wav = self.hift(mel, generator)
            n = min(len(self.fade), wav.shape[1])
            wav[:, :n] *= self.fade[:n]
        return wav[0].float().cpu().numpy()
