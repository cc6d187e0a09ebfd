"""Qwen3-Omni's video inputs in the data worker: a file to its `PreparedVideo`, and a
prompt's images and videos in the order its tokens hold them.

A video is decoded, sampled and cut into patches as `shared.vision.qwen_video` describes
(the image processor's patch sizes and normalization, the processor's video size, 2 frames
a second); its text is one `<|video_pad|>` a merged block of each temporal patch (the chat
template writes `<|vision_start|><|video_pad|><|vision_end|>`, as the processor expands it
without `use_audio_in_video`); its temporal patches are `temporal_patch_size / fps`
seconds apart, `t_scale` = that times `position_id_per_seconds` positions (transformers'
`get_rope_index`: `arange(t) * second_per_grid * position_id_per_seconds`).

Limits: a frame of at most `MAX_FRAME_PIXELS` pixels before resizing, `MAX_DECODED_FRAMES`
frames in the stream, at least one temporal patch of frames (the processor's `max_frames`
768 bounds the sampled ones), and no more video tokens than the deployment's max_seq_len
(checked before any frame is decoded, so a long video costs no memory).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.deferred import deferred
from shared.specs.base import PreparedImage, PreparedVideo, PromptError
from shared.vision.qwen2_vl import Qwen2VLImages
from shared.vision.qwen_video import VideoSettings, load_frames, preprocess_frames

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

VIDEO_TOKEN = "<|video_pad|>"
#: the largest source frame decoded (4K), before sampling and resizing
MAX_FRAME_PIXELS = 3840 * 2160


@dataclass(frozen=True)
class OmniVideos:
    """A folder's video settings and the step between a video's temporal positions."""

    settings: VideoSettings
    t_scale: int
    placeholder: str = VIDEO_TOKEN

    @classmethod
    def from_images(cls, images: Qwen2VLImages, position_id_per_seconds: float) -> OmniVideos:
        """The image processor's patch sizes and normalization (the video processor reads
        the same preprocessor_config.json). ValueError where a temporal patch's positions
        are not a whole number (transformers' would be fractional; ours are integers)."""
        settings = VideoSettings(patch_size=images.patch_size, temporal_patch_size=images.temporal_patch_size,
                                 merge_size=images.merge_size, image_mean=images.image_mean,
                                 image_std=images.image_std, rescale_factor=images.rescale_factor)
        step = settings.seconds_per_grid * position_id_per_seconds
        if step != int(step):
            raise ValueError(f"position_id_per_seconds {position_id_per_seconds} gives a video's temporal patches "
                             f"{step} positions apart; mstar's positions are whole numbers")
        return cls(settings, int(step))

    def prepare(self, data: bytes, param: str, merge: int, max_tokens: int) -> PreparedVideo:
        """One video file -> its patches [t, h / merge, w / merge, merge^2, D], text, key;
        `PromptError` on `param` for a file this cannot use or whose tokens alone pass
        `max_tokens`."""
        try:
            picked, _ = load_frames(data, self.settings, MAX_FRAME_PIXELS, max_tokens)
            patches, (t, h, w) = preprocess_frames(picked, self.settings)
        except ValueError as exc:
            raise PromptError(param, f"{param}: {exc}") from exc
        pixels = patches.reshape(t, h // merge, w // merge, merge * merge, patches.shape[-1])
        key = hashlib.sha256(self.settings.key().encode() + b"\0" + data).hexdigest()
        return PreparedVideo(pixels, self.placeholder * (t * h * w // merge**2), key, self.t_scale)


def vision_order(ids: Sequence[int], image_id: int, video_id: int, images: Sequence[PreparedImage],
                 videos: Sequence[PreparedVideo]) -> tuple[list[PreparedImage], list[bool]]:
    """(the images and videos as `PreparedImage`s in the order the prompt's runs of image and
    video tokens hold them, whether each is a video). `PromptError` where the runs do not
    match the media's token counts."""
    queues = {image_id: [(img, False) for img in images],
              video_id: [(PreparedImage(v.pixels, v.text, v.key), True) for v in videos]}
    out: list[PreparedImage] = []
    kinds: list[bool] = []
    arr = np.asarray(ids, dtype=np.int64)
    i = 0
    while i < len(arr):
        tok = int(arr[i])
        if tok not in queues:
            i += 1
            continue
        end = i
        while end < len(arr) and arr[end] == tok:
            end += 1
        left = end - i
        while left:
            if not queues[tok]:
                kind = "image" if tok == image_id else "video"
                raise PromptError("prompt", f"the prompt holds more {kind} tokens than its {kind}s make")
            media, video = queues[tok].pop(0)
            rows = int(np.prod(media.pixels.shape[:3]))
            if rows > left:
                raise PromptError("prompt", f"a medium's {rows} tokens are not one run")
            out.append(media)
            kinds.append(video)
            left -= rows
        i = end
    if any(queues.values()):
        raise PromptError("prompt", "the prompt holds fewer image or video tokens than its media make")
    return out, kinds
