"""Qwen3-Omni's video preprocessing (shared/vision/qwen_video.py) against transformers'
`Qwen2VLVideoProcessor` pieces (tests/omni_video.py: its `sample_frames` and `patchify`,
the torch backend's fused normalize): the sampled frame indices for many lengths and
rates, and the patches of a clip bit for bit; the refusals."""

from __future__ import annotations

import types

import numpy as np
import pytest

from shared.vision.qwen_video import VideoSettings, load_frames, sample_indices
from tests.omni_video import _video_module, mp4_bytes, reference_video, shapes_video


@pytest.mark.parametrize("total,fps", [(6, 4.0), (5, 2.0), (3, 30.0), (2, 1.0), (30, 10.0), (100, 24.0),
                                       (241, 29.97), (1000, 1.0), (77, 7.5)])
def test_sampled_frames_are_the_processors(total: int, fps: float) -> None:
    from transformers.video_utils import VideoMetadata

    cls = _video_module().Qwen2VLVideoProcessor
    defaults = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=2, min_frames=4, max_frames=768)
    want = cls.sample_frames(defaults, VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps), fps=2.0)
    assert sample_indices(total, fps, VideoSettings()).tolist() == want.tolist()


def test_patches_equal_the_processors() -> None:
    from shared.vision.qwen_video import preprocess_frames

    data = mp4_bytes(shapes_video(frames=5, seed=9))
    frames, _ = load_frames(data, VideoSettings(), 1 << 30, 1 << 20)
    patches, grid = preprocess_frames(frames, VideoSettings())
    ref = reference_video(data)
    assert list(grid) == ref["video_grid_thw"][0].tolist()
    assert np.array_equal(patches, ref["pixel_values_videos"].numpy())


def test_refusals() -> None:
    """Not a video; frames over the pixel limit; more tokens than allowed (checked before
    decoding); fewer frames than a temporal patch."""
    with pytest.raises(ValueError, match="not a video"):
        load_frames(b"RIFF....WAVEfmt " * 8, VideoSettings(), 1 << 30, 1 << 20)
    data = mp4_bytes(shapes_video(frames=5, seed=9))
    with pytest.raises(ValueError, match="pixels; the limit is 1000"):
        load_frames(data, VideoSettings(), 1000, 1 << 20)
    with pytest.raises(ValueError, match="make 264 video tokens; the limit is 100"):
        load_frames(data, VideoSettings(), 1 << 30, 100)
    with pytest.raises(ValueError, match="at least 2"):
        sample_indices(1, 30.0, VideoSettings())
