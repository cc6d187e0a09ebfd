"""Qwen-family video inputs (Qwen3-Omni's thinker): an MP4's frames to flattened patches and
a grid, as transformers' `Qwen2VLVideoProcessor` makes them for `Qwen3OmniMoeProcessor`.

The data worker runs this (numpy, Pillow and PyAV only; no torch, no transformers):

1. `load_frames`: the file's first video stream, its declared frame count and average rate
   (PyAV; what transformers' "pyav" backend reads), only the sampled frames kept as RGB uint8;
2. `sample_indices`: the video processor's `sample_frames` with `fps` (2 frames a second, the
   rate qwen-omni-utils and vLLM sample Qwen-Omni videos at), `min_frames` 4, `max_frames`
   768, rounded down to whole temporal patches: `arange(0, N, N / n)` truncated (float32);
3. each sampled frame resized as `smart_resize` says (the processor's `videos_kwargs` size:
   128 to 768 merged blocks of 32 px; factor patch * merge), rescaled and normalized fused as
   the torch backend does ((x - mean / r) / (std / r) in float32), the frame count padded to
   whole temporal patches with the last frame, cut into patches in the processor's order:
   [grid_t * grid_h * grid_w, C * temporal_patch * patch^2], grid (t, h, w).

Where transformers resizes (torchvision's bicubic) this resizes with Pillow's bicubic: exact
for frames already at their `smart_resize` size (no resize), close otherwise.
The seconds a temporal patch spans are `temporal_patch_size / fps` (the processor's
`video_second_per_grid`), which with the config's `position_id_per_seconds` spaces the
video's temporal positions (`t_scale`).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from PIL import Image

from shared.deferred import deferred
from shared.vision import common
from shared.vision.qwen2_vl import BICUBIC, smart_resize

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

#: Qwen3OmniMoeProcessor's videos_kwargs size: min and max pixels of a frame
MIN_PIXELS, MAX_PIXELS = 128 * 32 * 32, 768 * 32 * 32
#: frames a second sampled (qwen-omni-utils' and vLLM's FPS for Qwen-Omni)
SAMPLE_FPS = 2.0
#: the decoder's bound on frames read before sampling (10 minutes at 30 fps)
MAX_DECODED_FRAMES = 18_000


@dataclass(frozen=True)
class VideoSettings:
    """The video processor's settings (patch sizes, normalization: the image processor's
    saved values; size and sampling: the processor's defaults)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    fps: float = SAMPLE_FPS
    min_frames: int = 4
    max_frames: int = 768

    @property
    def seconds_per_grid(self) -> float:
        """Seconds one temporal patch spans (the processor's `video_second_per_grid`)."""
        return self.temporal_patch_size / self.fps

    def key(self) -> str:
        """Every setting that changes the patches or the grid, as one string (the rows' key)."""
        return f"qwen-video/1:{self}"


def load_frames(data: bytes, settings: VideoSettings, max_pixels: int,
                max_tokens: int) -> tuple[np.ndarray, float]:
    """(the sampled frames RGB uint8 [n, H, W, 3], the stream's frames a second), as
    transformers' PyAV loader reads them: the stream's declared frame count (counted from
    its packets where it declares none) and average rate give the indices
    (`sample_indices`), and only those frames are kept while decoding. ValueError for a
    file PyAV cannot read, one without a video stream, frames over `max_pixels`, more than
    `MAX_DECODED_FRAMES` frames, more than `max_tokens` tokens, or fewer frames than it
    declares."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            stream = container.streams.video[0]
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        with av.open(io.BytesIO(data), mode="r") as container:
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            if not rate or not total:
                raise ValueError("its video stream has no frame rate or no frames")
            height, width = stream.codec_context.height, stream.codec_context.width
            _check_bounds(total, height, width, settings, max_pixels, max_tokens, float(rate))
            keep = sample_indices(total, float(rate), settings).tolist()
            wanted, frames = set(keep), {}
            for i, frame in enumerate(container.decode(stream)):
                if i > keep[-1]:
                    break
                if i in wanted:
                    frames[i] = frame.to_ndarray(format="rgb24")
    except (av.error.FFmpegError, UnicodeDecodeError) as exc:
        raise ValueError(f"it is not a video PyAV decodes ({type(exc).__name__})") from exc
    if len(frames) < len(wanted):
        raise ValueError(f"its stream declares {total} frames but fewer decode")
    return np.stack([frames[i] for i in keep]), float(rate)


def _check_bounds(total: int, height: int, width: int, settings: VideoSettings, max_pixels: int,
                  max_tokens: int, fps: float) -> None:
    """ValueError for frames over `max_pixels`, more than MAX_DECODED_FRAMES frames, or a
    video whose sampled, resized frames make more than `max_tokens` tokens."""
    if height * width > max_pixels:
        raise ValueError(f"its frames are {width}x{height} pixels; the limit is {max_pixels}")
    if total > MAX_DECODED_FRAMES:
        raise ValueError(f"it has {total} frames; the limit is {MAX_DECODED_FRAMES}")
    block = settings.patch_size * settings.merge_size
    h, w = smart_resize(height, width, block, settings.min_pixels, settings.max_pixels)
    n = len(sample_indices(total, fps, settings))
    tokens = -(-n // settings.temporal_patch_size) * (h // block) * (w // block)
    if tokens > max_tokens:
        raise ValueError(f"its {n} sampled frames make {tokens} video tokens; the limit is {max_tokens} "
                         "(the deployment's max_seq_len)")


def sample_indices(total: int, source_fps: float, settings: VideoSettings) -> np.ndarray:
    """The frames kept: the video processor's `sample_frames` with `fps` (whole temporal
    patches, at least `min_frames` where the video has them). ValueError for a video
    shorter than one temporal patch."""
    tps = settings.temporal_patch_size
    most = math.floor(min(settings.max_frames, total) / tps) * tps
    wanted = min(max(total / source_fps * settings.fps, settings.min_frames), most, total)
    n = math.floor(wanted / tps) * tps
    if n < 1:
        raise ValueError(f"it has {total} frame(s); this model needs at least {tps}")
    step = np.float32(total / n)
    return (np.arange(n, dtype=np.float32) * step).astype(np.int64)  # torch.arange(0, N, N / n).int()


def preprocess_frames(frames: np.ndarray, settings: VideoSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Sampled frames uint8 [T, H, W, 3] -> (patches float32 [t * h * w, C * tps * ps^2],
    grid (t, h, w)). ValueError for frames more elongated than 200:1."""
    height, width = frames.shape[1:3]
    ps, m, tps = settings.patch_size, settings.merge_size, settings.temporal_patch_size
    size = smart_resize(height, width, ps * m, settings.min_pixels, settings.max_pixels)
    if size != (height, width):
        frames = np.stack([np.asarray(common.resize(Image.fromarray(f), size, BICUBIC)) for f in frames])
    video = frames.transpose(0, 3, 1, 2).astype(np.float32)  # [T, C, H, W]
    scale = np.float32(1.0 / settings.rescale_factor)
    mean = np.array(settings.image_mean, dtype=np.float32) * scale
    std = np.array(settings.image_std, dtype=np.float32) * scale
    video = (video - mean[:, None, None]) / std[:, None, None]
    if pad := -len(video) % tps:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    t, channels, height, width = video.shape
    gt, gh, gw = t // tps, height // ps, width // ps
    patches = video.reshape(gt, tps, channels, gh // m, m, ps, gw // m, m, ps).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(patches.reshape(gt * gh * gw, channels * tps * ps * ps)), (gt, gh, gw)
