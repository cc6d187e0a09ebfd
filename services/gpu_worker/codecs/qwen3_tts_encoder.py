"""Qwen3-TTS' 12 Hz codec encoder (`speech_tokenizer/` of a Base checkpoint, the `qwen-tts`
package's `Qwen3TTSTokenizerV2Encoder`): a reference clip at 24 kHz -> its codes, the
frames a voice clone in ICL mode continues from (the package's `ref_code`).

The package's encoder is transformers' `MimiModel` with its decoder half dropped, so this
is mstar's Mimi encoder (codecs/mimi_encoder.py: SEANet, causal transformer, downsample,
split RVQ) on the codec folder's `encoder.*` tensors, then the package's two cuts
(`Qwen3TTSTokenizerV2Model.encode`): the first `encoder_valid_num_quantizers` codebooks,
and the first ceil(samples / `encode_downsample_rate`) frames. Every layer is causal, so a
clip's codes are the same encoded alone or right-padded in a batch, but for its last frame
when its length is not a whole number of frames: the package encodes one clip alone
(`generate_voice_clone` with one `ref_audio`), as this does.

The transformer attends to every earlier position: the package's pinned transformers
(4.57.3) builds Mimi's encoder mask without its `sliding_window` (only flash-attention 2
applies it, and the package loads its codec with the default attention). A clip under the
window (250 rows at 25 Hz: 10 s) is encoded the same either way.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.gpu_worker.codecs.code2wav import load_prefixed
from services.gpu_worker.codecs.mimi_encoder import MimiEncoder
from services.gpu_worker.codecs.qwen3_tts_codec import FOLDER, codec_config
from shared.specs.qwen3_tts import encoded_frames

PREFIX = "encoder."


class Qwen3TTSEncoder:
    """The encoder's weights (on `device`); `encode` is one clip."""

    def __init__(self, folder: str | Path, config: Mapping[str, Any] | None = None,
                 device: torch.device | str = "cpu") -> None:
        folder = Path(folder)
        cfg = dict(config) if config is not None else codec_config(folder)
        enc = dict(cfg.get("encoder_config") or {})
        if enc.get("use_streaming") or enc.get("pad_mode", "constant") != "constant" \
                or int(enc.get("audio_channels", 1)) != 1:
            raise ValueError("only the 12 Hz codec's own encoder is implemented: mono, zero padding, not streaming")
        if int(cfg.get("input_sample_rate", 24000)) != int(enc.get("sampling_rate", 24000)):
            raise ValueError("the codec's input_sample_rate is not its encoder's sampling_rate")
        self.sample_rate = int(cfg.get("input_sample_rate", 24000))
        self.config = cfg
        self.quantizers = int(cfg.get("encoder_valid_num_quantizers", 16))
        weights = load_prefixed(folder / FOLDER, PREFIX, "codec encoder weights")
        self.mimi = MimiEncoder(folder / FOLDER, enc, device, weights)
        self.mimi.window = sys.maxsize  # the package's transformers: a plain causal mask (module docstring)
        if self.mimi.s.samples_per_frame != int(cfg.get("encode_downsample_rate", 1920)):
            raise ValueError(f"the codec's encode_downsample_rate {cfg.get('encode_downsample_rate')} is not its "
                             f"encoder's strides' product {self.mimi.s.samples_per_frame}")
        if self.quantizers > self.mimi.s.quantizers:
            raise ValueError(f"encoder_valid_num_quantizers {self.quantizers} > the encoder's "
                             f"{self.mimi.s.quantizers} quantizers")

    def frames(self, samples: int) -> int:
        return encoded_frames(samples, self.config)

    def encode(self, samples: np.ndarray) -> np.ndarray:
        """Mono float32 samples at 24 kHz -> codes [frames, encoder_valid_num_quantizers]."""
        codes = self.mimi.encode(samples)
        return codes[: self.frames(len(samples)), : self.quantizers]
