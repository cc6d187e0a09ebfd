"""SNAC (hubertsiuzdak/snac_24khz): codes -> 24 kHz sound, whole or streamed.

Orpheus' LLM writes SNAC codes (shared/specs/orpheus_codes.py maps tokens to the three
codebook arrays); this module turns them into float32 samples. It uses the `snac` package's
modules (so the arithmetic is SNAC's own) but never its `from_pretrained`, which downloads
from the Hub when given anything that is not a folder: `load_snac` builds `SNAC(**config)`
from a local folder (config.json + pytorch_model.bin or model.safetensors) and loads the
state dict itself. Weight norm is folded into the weights once at load (the same
`torch._weight_norm` the parametrization runs on every forward, so the values are identical).

Streaming (`SnacStream`). SNAC's decoder is convolutional with symmetric ("same") padding,
so an output sample depends on frames on both sides; `receptive_field` derives, from the
decoder's modules, for every sample of a frame the first and last frame it depends on.
For snac_24khz (2048 samples a frame: 4 latents of 512 samples) that is 2 or 3 frames on
each side (latent positions -10..+13 around a sample). The stream decodes a window of the
frames from the earliest one the next unsent sample needs up to the newest, and sends the
samples whose whole dependency range has arrived: they are exactly the samples the full
decode computes (same operations on the same inputs, up to float summation order), so
the concatenation of the chunks equals `decode` of all frames, with no approximation. The
context is short enough that exactness costs nothing worth saving: each new frame decodes
a window of about 7 frames (Orpheus' own streaming decodes 4 and is not exact), and the
first chunk comes after 3 frames (Orpheus' after 4).

Noise. snac_24khz's decoder has NoiseBlocks that add `randn * linear(x)`: fresh noise on
every call, so two decodes of the same codes differ and a window's noise cannot match the
full decode's. The default `noise="positional"` draws the same standard-normal noise from a
hash of (seed, block, absolute position), so decoding is reproducible and streaming exact
while the model still gets the noise it was trained with; `"random"` is SNAC's own behaviour
(`torch.randn`, what Orpheus runs; no streaming), `"off"` drops the noise term.

Decoders with local attention (the 32 / 44 kHz SNACs) decode whole but do not stream:
their attention blocks depend on the decoded length.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from snac import SNAC  # type: ignore[import-untyped]
from snac.layers import DecoderBlock, NoiseBlock, ResidualUnit, Snake1d  # type: ignore[import-untyped]
from torch import nn
from torch.nn.utils import parametrize

NoiseMode = Literal["positional", "random", "off"]
#: one integer code array per codebook, coarsest first (n, 2n, 4n codes for n frames at 24 kHz)
Frames = Sequence[np.ndarray]


def load_snac(folder: str | Path) -> SNAC:
    """SNAC from a local folder in the Hub's layout, never a download. The state dict may
    carry weight norm as `weight_g`/`weight_v` (older torch) or as parametrizations: torch's
    load hook converts the former."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: not a SNAC folder")
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{folder} has neither pytorch_model.bin nor model.safetensors")
    model = SNAC(**json.loads(config_path.read_text()))
    model.load_state_dict(state)
    return model.eval()


def _fold_weight_norm(model: nn.Module) -> None:
    """Replace each weight-norm parametrization by the weight it computes (done once at load
    instead of on every forward)."""
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


def _span(module: nn.Module, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Input positions [lo, hi] (inclusive, arrays: one interval per output) that outputs
    [lo, hi] of `module` read, padding positions included; TypeError for a module whose
    dependencies are not a fixed window (attention)."""
    if isinstance(module, nn.Sequential):
        for sub in reversed(module):
            lo, hi = _span(sub, lo, hi)
        return lo, hi
    if isinstance(module, DecoderBlock):
        return _span(module.block, lo, hi)
    if isinstance(module, ResidualUnit):  # x + block(x): the block's "same" conv covers x's own position
        in_lo, in_hi = _span(module.block, lo, hi)
        return np.minimum(in_lo, lo), np.maximum(in_hi, hi)
    if isinstance(module, nn.ConvTranspose1d):  # output o = i * s - p + j, 0 <= j < k
        k, s, p = module.kernel_size[0], module.stride[0], _int_padding(module)
        return -((-(lo + p - k + 1)) // s), (hi + p) // s
    if isinstance(module, nn.Conv1d):
        k, d, p = module.kernel_size[0], module.dilation[0], _int_padding(module)
        if module.stride[0] != 1 or 2 * p != (k - 1) * d:
            raise TypeError(f"{module} is not a stride-1 'same' convolution")
        return lo - p, hi - p + (k - 1) * d
    if isinstance(module, (Snake1d, NoiseBlock, nn.Tanh, nn.Identity)):
        return lo, hi
    raise TypeError(f"{type(module).__name__} has no fixed receptive field")


def _int_padding(module: nn.Conv1d | nn.ConvTranspose1d) -> int:
    """A convolution's padding as an int (torch allows strings such as 'same' for Conv1d)."""
    padding = module.padding
    if isinstance(padding, str):
        raise TypeError(f"{module} has padding {padding!r}")
    return int(padding[0])


@dataclass(frozen=True)
class ReceptiveField:
    """For each sample r of a frame (0 <= r < samples_per_frame), the first (`lo[r]`, <= 0)
    and last (`hi[r]`, >= 0) frame it depends on, relative to its own frame. The decoder is
    shift-equivariant by one frame, so sample q * F + r depends on frames q + lo[r] .. q + hi[r]."""

    samples_per_frame: int
    lo: np.ndarray
    hi: np.ndarray

    def __post_init__(self) -> None:
        for name, arr in (("lo", self.lo), ("hi", self.hi)):
            if np.any(np.diff(arr) < 0) or arr[-1] > arr[0] + 1:
                raise ValueError(f"the decoder's {name} dependency is not monotone: streaming would not be exact")

    @property
    def left_frames(self) -> int:
        """Most frames before its own that a sample depends on (the window's left context)."""
        return int(-self.lo.min())

    @property
    def right_frames(self) -> int:
        """Most frames after its own that a sample depends on (what the stream holds back)."""
        return int(self.hi.max())

    @property
    def first_chunk_frames(self) -> int:
        """Frames that must have arrived before the stream emits its first sample."""
        return int(self.hi[0]) + 1

    def ready(self, n_frames: int) -> int:
        """How many leading samples depend only on frames < n_frames (and are final)."""
        q = np.maximum(0, n_frames - self.hi)
        return int((q * self.samples_per_frame + np.arange(self.samples_per_frame)).min())

    def first_needed(self, sample: int) -> int:
        """The earliest frame that `sample` or any later sample depends on (>= 0)."""
        q, r = divmod(sample, self.samples_per_frame)
        return max(0, q + int(self.lo[r]))


def receptive_field(model: SNAC) -> ReceptiveField | None:
    """The decoder's per-sample frame dependencies, derived from its modules (None when it
    has attention, whose dependencies change with the decoded length)."""
    stride0 = int(model.vq_strides[0])
    per_frame = stride0 * math.prod(int(r) for r in model.decoder_rates)
    samples = np.arange(per_frame, dtype=np.int64)
    try:
        lo, hi = _span(model.decoder.model, samples, samples.copy())
    except TypeError:
        return None
    return ReceptiveField(per_frame, lo // stride0, hi // stride0)  # latent j belongs to frame j // stride0


def positional_noise(seed: int, block: int, start: int, length: int) -> np.ndarray:
    """Standard-normal float32 noise for positions [start, start + length) of noise block
    `block`: a function of (seed, block, position) only (splitmix64 hash, Box-Muller), so a
    window and the full decode see the same noise at the same absolute position."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.array([(seed << 20) ^ block], dtype=np.uint64))[0]
        pos = np.arange(start, start + length, dtype=np.uint64) * np.uint64(2) + key
        u1 = 1.0 - (_splitmix64(pos) >> np.uint64(11)).astype(np.float64) * 2.0**-53  # (0, 1]
        u2 = (_splitmix64(pos + np.uint64(1)) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(np.float32)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (wrapping uint64 arithmetic): a well-mixed hash of each element."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class SnacCodec:
    """A loaded SNAC decoder: `decode` for whole utterances, `stream` for chunked audio."""

    def __init__(self, folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 noise: NoiseMode = "positional", noise_seed: int = 0) -> None:
        if noise not in ("positional", "random", "off"):
            raise ValueError(f"noise must be 'positional', 'random' or 'off', got {noise!r}")
        model = load_snac(folder)
        _fold_weight_norm(model)
        self.model = model.to(device=device, dtype=dtype)
        self.device, self.dtype = torch.device(device), dtype
        self.noise, self.noise_seed = noise, noise_seed
        self.sampling_rate = int(model.sampling_rate)
        self.codebook_size = int(model.codebook_size)
        strides = [int(s) for s in model.vq_strides]
        #: codes of each codebook in one frame (1, 2, 4 for snac_24khz)
        self.codes_per_frame = tuple(strides[0] // s for s in strides)
        self.receptive_field = receptive_field(model)
        self.samples_per_frame = strides[0] * math.prod(int(r) for r in model.decoder_rates)

    def check_frames(self, frames: Frames) -> int:
        """Number of frames in `frames`; ValueError unless it is one integer array per
        codebook, lengths in the frame ratio, every code in [0, codebook_size)."""
        if len(frames) != len(self.codes_per_frame):
            raise ValueError(f"expected {len(self.codes_per_frame)} codebooks, got {len(frames)}")
        n = len(frames[0]) // self.codes_per_frame[0]
        for i, (codes, per) in enumerate(zip(frames, self.codes_per_frame)):
            arr = np.asarray(codes)
            if arr.ndim != 1 or arr.shape[0] != n * per or (arr.size and arr.dtype.kind not in "iu"):
                raise ValueError(f"codebook {i}: expected {n * per} integer codes ({per} per frame), "
                                 f"got shape {arr.shape} {arr.dtype}")
            if arr.size and (arr.min() < 0 or arr.max() >= self.codebook_size):
                raise ValueError(f"codebook {i}: codes outside [0, {self.codebook_size})")
        return n

    def decode(self, frames: Frames) -> np.ndarray:
        """float32 samples (samples_per_frame per frame) of whole frames."""
        n = self.check_frames(frames)
        if n == 0:
            return np.zeros(0, dtype=np.float32)
        return self.decode_window(frames, 0).float().cpu().numpy()

    @torch.inference_mode()
    def decode_window(self, frames: Frames, start_frame: int) -> torch.Tensor:
        """1-D samples (on the codec's device) of `frames` decoded on their own, as if they
        were a whole utterance, whose first frame is frame `start_frame` of the utterance
        (which places the positional noise). Frames are not checked here."""
        codes = [torch.as_tensor(np.asarray(c, dtype=np.int64), device=self.device)[None] for c in frames]
        x = self.model.quantizer.from_codes(codes)
        per_frame = int(self.model.vq_strides[0])
        block = 0
        for module in self.model.decoder.model:
            if not isinstance(module, DecoderBlock):
                x = module(x)
                continue
            for sub in module.block:
                if isinstance(sub, nn.ConvTranspose1d):
                    per_frame *= sub.stride[0]
                if isinstance(sub, NoiseBlock):
                    x = self._add_noise(sub, x, block, start_frame * per_frame)
                    block += 1
                else:
                    x = sub(x)
        return x[0, 0]

    def _add_noise(self, module: NoiseBlock, x: torch.Tensor, block: int, start: int) -> torch.Tensor:
        """NoiseBlock's `x + randn * linear(x)` with the codec's noise: positions start.. of block `block`."""
        if self.noise == "random":
            return module(x)
        if self.noise == "off":
            return x
        noise = positional_noise(self.noise_seed, block, start, x.shape[-1])
        n = torch.from_numpy(noise).to(device=x.device, dtype=x.dtype)[None, None] * module.linear(x)
        return x + n

    def stream(self, min_chunk_samples: int = 1) -> SnacStream:
        """A streaming decoder for one utterance (see SnacStream)."""
        return SnacStream(self, min_chunk_samples)


class SnacStream:
    """Frames in as they come, audio chunks out; the chunks concatenated (after `finish`)
    equal `codec.decode` of all the frames.

    `push` returns the samples that no later frame can change (possibly none): those whose
    dependencies (`codec.receptive_field`) have all arrived, decoded in a window reaching
    back to the earliest frame they need. `finish` returns the rest, decoded against the
    true end of the utterance. `min_chunk_samples` makes `push`, after its first chunk,
    wait until at least that many samples are ready (fewer, larger decodes)."""

    def __init__(self, codec: SnacCodec, min_chunk_samples: int = 1) -> None:
        if codec.receptive_field is None:
            raise ValueError("this SNAC's decoder has attention: it decodes whole but does not stream")
        if codec.noise == "random":
            raise ValueError("noise='random' draws new noise per decode: streaming needs 'positional' or 'off'")
        self.codec = codec
        self.field = codec.receptive_field
        self.min_chunk_samples = max(1, min_chunk_samples)
        self.frames_received = 0
        self.samples_emitted = 0
        self.finished = False
        self._held = [np.zeros(0, dtype=np.int64) for _ in codec.codes_per_frame]
        self._held_from = 0  # utterance frame index of the first frame in _held

    def push(self, frames: Frames) -> np.ndarray:
        """Add whole frames (one code array per codebook); the float32 samples now final."""
        if self.finished:
            raise ValueError("push after finish")
        n = self.codec.check_frames(frames)
        self._held = [np.concatenate([held, np.asarray(new, dtype=np.int64)]) for held, new in zip(self._held, frames)]
        self.frames_received += n
        end = self.field.ready(self.frames_received)
        # the first chunk goes out as soon as it is final (time to first audio); later ones
        # wait for `min_chunk_samples`: each decode re-reads the frames' left and right context
        if self.samples_emitted and end - self.samples_emitted < self.min_chunk_samples:
            return np.zeros(0, dtype=np.float32)
        return self._emit(end)

    def finish(self) -> np.ndarray:
        """The remaining samples, decoded against the utterance's end; the stream is then closed."""
        if self.finished:
            raise ValueError("finish called twice")
        self.finished = True
        return self._emit(self.frames_received * self.codec.samples_per_frame)

    def _emit(self, end: int) -> np.ndarray:
        """Samples [samples_emitted, end): decode the held frames from the first one they
        need through the newest, then drop the frames no later sample needs."""
        if end <= self.samples_emitted:
            return np.zeros(0, dtype=np.float32)
        start_frame = self.field.first_needed(self.samples_emitted)
        audio = self.codec.decode_window(self._held_since(start_frame), start_frame)
        offset = start_frame * self.codec.samples_per_frame
        chunk = audio[self.samples_emitted - offset: end - offset].float().cpu().numpy()
        self.samples_emitted = end
        keep_from = self.field.first_needed(end)
        self._held = self._held_since(keep_from)
        self._held_from = keep_from
        return chunk

    def _held_since(self, frame: int) -> list[np.ndarray]:
        """The held codes of utterance frames `frame` onwards (frame >= _held_from)."""
        skip = frame - self._held_from
        return [held[skip * per:] for held, per in zip(self._held, self.codec.codes_per_frame)]

