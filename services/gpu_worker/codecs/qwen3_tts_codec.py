"""Qwen3-TTS' 12 Hz codec decoder (`speech_tokenizer/` of a Qwen3-TTS folder, the `qwen-tts`
package's `Qwen3TTSTokenizerV2Decoder`): codes -> 24 kHz sound, whole or streamed exactly.

It is Qwen3-Omni's Code2Wav (codecs/code2wav.py) with another front and causal upsampling:

    codes [Q, n] -> split residual VQ (codebook 0's table, projected; codebooks 1.. theirs,
    summed, projected; each table `embedding_sum / cluster_usage`) -> causal conv (k 3)
    -> input_proj -> transformer (causal, sliding window, RoPE, layer scale) -> norm
    -> output_proj -> upsample (transposed conv + ConvNeXt) -> decoder (as Code2Wav's)
    -> clamp to [-1, 1]

Every transposed conv here (kernel 2r or r, stride r) is trimmed on the right only, so
output sample j reads inputs floor(j / r) - 1 and floor(j / r): n frames make exactly n *
`samples_per_frame` samples and the decode of a prefix of the codes is a prefix of the
decode of all of them. Whole clips follow the package's `chunked_decode` (300-frame chunks,
25 frames of left context), and `Code2WavStream` emits the same samples as they become
final (codecs/code2wav.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.gpu_worker.codecs.code2wav import (
    Code2WavCodec,
    Code2WavSettings,
    _causal_conv,
    decode_tail,
    load_prefixed,
)

FOLDER = "speech_tokenizer"
PREFIX = "decoder."
CLUSTER_EPS = 1e-5


def load_codec_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The decoder's tensors (`decoder.*`) of the codec folder's safetensors, prefix
    stripped, as float32 (the encoder's are not read)."""
    return load_prefixed(folder, PREFIX, "codec decoder weights")


def codec_config(folder: Path) -> dict[str, Any]:
    """speech_tokenizer/config.json of a Qwen3-TTS folder (the 12 Hz codec's only)."""
    cfg = json.loads((folder / FOLDER / "config.json").read_text())
    if cfg.get("model_type") != "qwen3_tts_tokenizer_12hz":
        raise ValueError(f"{folder / FOLDER}: codec {cfg.get('model_type')!r}; only the 12 Hz codec "
                         "(qwen3_tts_tokenizer_12hz) is implemented")
    return cfg


class Qwen3TTSCodec(Code2WavCodec):
    """The codec's decoder weights and its decode; `stream()` makes one request's stream."""

    def __init__(self, folder: str | Path, config: Mapping[str, Any] | None = None,
                 device: torch.device | str = "cpu") -> None:
        folder = Path(folder)
        cfg = dict(config) if config is not None else codec_config(folder)
        dec = dict(cfg.get("decoder_config") or {})
        self._load(Code2WavSettings(dec), load_codec_weights(folder / FOLDER), device)
        self.sample_rate = int(cfg.get("output_sample_rate", 24000))
        if int(cfg.get("decode_upsample_rate", self.samples_per_frame)) != self.samples_per_frame:
            raise ValueError(f"the codec's decode_upsample_rate {cfg.get('decode_upsample_rate')} is not its "
                             f"rates' product {self.samples_per_frame}")
        #: each codebook's table: codebook 0 the first quantizer's, the others the rest's
        self.tables = [self._table("quantizer.rvq_first.vq.layers.0.")] + [
            self._table(f"quantizer.rvq_rest.vq.layers.{i}.") for i in range(self.quantizers - 1)]

    def _table(self, p: str) -> torch.Tensor:
        usage = self.w[p + "_codebook.cluster_usage"].clamp(min=CLUSTER_EPS)
        return self.w[p + "_codebook.embedding_sum"] / usage[:, None]

    @torch.inference_mode()
    def forward(self, codes: np.ndarray) -> torch.Tensor:
        """Samples [n * samples_per_frame] of `codes` [n, Q] decoded alone (the package's
        `Qwen3TTSTokenizerV2Decoder.forward`)."""
        s, w = self.s, self.w
        idx = torch.from_numpy(codes.T.copy()).to(self.device)  # [Q, n]
        first = F.embedding(idx[0], self.tables[0]).t()[None]  # [1, dim, n]
        x = F.conv1d(first, w["quantizer.rvq_first.output_proj.weight"])
        if s.quantizers > 1:
            rest = torch.zeros((), device=self.device)
            for k in range(1, s.quantizers):
                rest = rest + F.embedding(idx[k], self.tables[k]).t()[None]
            x = x + F.conv1d(rest, w["quantizer.rvq_rest.output_proj.weight"])
        x = _causal_conv(x, w, "pre_conv.conv").transpose(1, 2)
        x = F.linear(x, w["pre_transformer.input_proj.weight"], w["pre_transformer.input_proj.bias"])
        x = self._transformer(x)
        x = F.linear(x, w["pre_transformer.output_proj.weight"], w["pre_transformer.output_proj.bias"]).transpose(1, 2)
        return decode_tail(x, w, s, _conv_t_causal)


def _conv_t_causal(x: torch.Tensor, w: Mapping[str, torch.Tensor], name: str, stride: int) -> torch.Tensor:
    """A transposed conv with (kernel - stride) samples cut from its right end only."""
    weight = w[name + ".weight"]
    trim = weight.shape[-1] - stride
    y = F.conv_transpose1d(x, weight, w.get(name + ".bias"), stride=stride)
    return y[..., : y.shape[-1] - trim] if trim else y


