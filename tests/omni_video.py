"""A short synthetic MP4 for Qwen3-Omni's video input, and the reference's video inputs.

The clip: a few frames of coloured shapes that move, 352 x 384 pixels (already a
`smart_resize` size of 32 px blocks within the processor's 128-768 block bounds, so no
frame is resized), encoded as H.264 by the server's own encoder at 4 fps.

The reference's inputs (`reference_video`): transformers' `Qwen2VLVideoProcessor` needs
torchvision, which this venv lacks, so its own `sample_frames`, `smart_resize` and
`patchify` (imported from transformers' module with a placeholder `torchvision` in
`sys.modules` for the import only) and the torch backend's fused rescale/normalize
(`_fuse_mean_std_and_rescale_factor`, then torchvision's normalize: (x - mean) / std) run
on the frames PyAV decodes here, with the metadata (fps) the file states; the resize is
checked to be the identity. `video_second_per_grid` is what `Qwen3OmniMoeProcessor` gives
for fps 2 (temporal_patch_size / fps). So the decoder is out of the comparison: both sides
read the same decoded frames."""

from __future__ import annotations

import importlib
import importlib.machinery
import io
import sys
import types
from functools import cache
from typing import Any

import numpy as np

FPS, FRAMES, HEIGHT, WIDTH = 4, 6, 352, 384
#: the processor's videos_kwargs size and the sampling rate the server uses
MIN_PIXELS, MAX_PIXELS, SAMPLE_FPS = 128 * 32 * 32, 768 * 32 * 32, 2.0


def shapes_video(frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH, seed: int = 3) -> np.ndarray:
    """uint8 [F, H, W, 3]: a dark noisy background, a red square sliding right and a blue
    bar sliding down, a green disc growing."""
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 40, (frames, height, width, 3), dtype=np.uint8)
    yy, xx = np.mgrid[:height, :width]
    for f in range(frames):
        x0 = 20 + 40 * f
        out[f, 60:160, x0 : x0 + 100] = (220, 30, 30)
        y0 = 10 + 35 * f
        out[f, y0 : y0 + 40, 250:370] = (30, 60, 230)
        disc = (yy - 260) ** 2 + (xx - 120) ** 2 < (30 + 8 * f) ** 2
        out[f][disc] = (40, 200, 60)
    return out


def mp4_bytes(frames: np.ndarray, fps: int = FPS) -> bytes:
    """The frames as an H.264 MP4 (the server's own encoder: `/v1/videos`' files)."""
    from services.api.dialects.openai.videos import mp4

    return mp4(frames, fps)


def decoded(data: bytes) -> tuple[np.ndarray, float]:
    """(RGB frames [N, H, W, 3], the stream's fps) as PyAV decodes the file."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


@cache
def _video_module() -> Any:
    """transformers' qwen2_vl video processing module, imported with a placeholder
    torchvision (its functions used here need none)."""

    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional"]
    for name in names:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules[name] = module
    try:
        return importlib.import_module("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    finally:
        for name in names:
            sys.modules.pop(name, None)


def reference_video(data: bytes, patch: int = 16, merge: int = 2, temporal: int = 2,
                    mean: tuple[float, ...] = (0.5, 0.5, 0.5), std: tuple[float, ...] = (0.5, 0.5, 0.5)) -> dict:
    """{"pixel_values_videos", "video_grid_thw", "video_second_per_grid"} for the file, as
    the processor makes them with fps 2 (see the module docstring)."""
    import torch
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.video_utils import VideoMetadata

    mod = _video_module()
    frames, fps = decoded(data)
    cls = mod.Qwen2VLVideoProcessor
    defaults = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=temporal,
                                     min_frames=cls.min_frames, max_frames=cls.max_frames)
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, duration=len(frames) / fps)
    picked = torch.from_numpy(frames)[cls.sample_frames(defaults, meta, fps=SAMPLE_FPS)]
    video = picked.permute(0, 3, 1, 2)[None]  # [1, T, C, H, W] uint8
    size = mod.smart_resize(video.shape[-2], video.shape[-1], factor=patch * merge, min_pixels=MIN_PIXELS,
                            max_pixels=MAX_PIXELS)
    assert size == tuple(video.shape[-2:]), "the clip must need no resize (torchvision's is not here)"
    m, s, _ = TorchvisionBackend._fuse_mean_std_and_rescale_factor(None, True, tuple(mean), tuple(std), True, 1 / 255)
    video = (video.to(torch.float32) - m.view(-1, 1, 1)) / s.view(-1, 1, 1)
    patches, t, h, w = cls.patchify(None, video, patch_size=patch, merge_size=merge, temporal_patch_size=temporal)
    return {"pixel_values_videos": patches[0], "video_grid_thw": torch.tensor([[t, h, w]]),
            "video_second_per_grid": torch.tensor([temporal / SAMPLE_FPS])}
