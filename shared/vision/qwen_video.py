"""Qwen-family video inputs (Qwen3-Omni's thinker): an MP4's frames to flattened patches and
a grid, as transformers' `Qwen2VLVideoProcessor` makes them for `Qwen3OmniMoeProcessor`.

The data worker runs this (numpy, Pillow and PyAV only; no torch, no transformers):

1. `decode_video`: every frame of the file's first video stream as RGB uint8 [N, H, W, 3]
   and the stream's frame rate (PyAV; what transformers' "pyav" backend reads);
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


def decode_video(data: bytes, max_pixels: int, max_frames: int = MAX_DECODED_FRAMES) -> tuple[np.ndarray, float]:
    """(frames RGB uint8 [N, H, W, 3], the stream's frames a second). ValueError for a file
    PyAV cannot read, one without a video stream or frames, frames over `max_pixels`, or
    more than `max_frames` frames."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise ValueError("the file has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            frames: list[np.ndarray] = []
            for frame in container.decode(stream):
                if frame.width * frame.height > max_pixels:
                    raise ValueError(f"its frames are {frame.width}x{frame.height} pixels; the limit is {max_pixels}")
                if len(frames) == max_frames:
                    raise ValueError(f"it has more than {max_frames} frames")
                frames.append(frame.to_ndarray(format="rgb24"))
    except (av.error.FFmpegError, UnicodeDecodeError) as exc:
        raise ValueError(f"it is not a video PyAV decodes ({type(exc).__name__})") from exc
    if not frames:
        raise ValueError("its video stream has no frames")
    if not rate:
        raise ValueError("its video stream has no frame rate")
    return np.stack(frames), float(rate)


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
