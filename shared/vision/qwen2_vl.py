"""Qwen2-VL / Qwen2.5-VL image inputs: an image to flattened patches and its grid, and the
text that stands for it.

The data worker runs this for every image of a request, so it uses numpy and Pillow only (no
torch, no transformers). It reproduces transformers' `Qwen2VLImageProcessorPil` (the image
processor of both families' processors) and `Qwen2_5_VLProcessor.replace_image_token` step
by step, so a checkpoint sees bit-identical pixel values and the same token ids:

1. convert to RGB, compositing any transparency onto white (`convert_to_rgb`);
2. `smart_resize`: both edges to multiples of patch_size * merge_size, the area kept within
   [min_pixels, max_pixels] and the aspect ratio as close as those allow; resized with
   Pillow (bicubic by default) through a uint8 image as transformers' does. A pixel off
   changes every patch after it, so the sizes are transformers' own float expressions;
3. scale by `rescale_factor` in float64, cast to float32, then (x - mean) / std in float32;
4. cut into patch_size squares, ordered by merge block (each block's merge_size^2 patches
   row-major, the blocks row-major), each patch repeated temporal_patch_size times (a
   still image is one frame, which the Conv3d patch embedding sees twice), flattened
   channel-major: [grid_h * grid_w, C * temporal_patch_size * patch_size^2], grid (1, h, w).

The text that replaces one `<|image_pad|>` (the chat template writes
`<|vision_start|><|image_pad|><|vision_end|>` for an image) is `<|image_pad|>` repeated
grid_t * grid_h * grid_w / merge_size^2 times: one token per merged block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from shared.deferred import deferred
from shared.vision import common

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

#: transformers' PILImageResampling.BICUBIC, the image processor's default filter
BICUBIC = 3
#: OPENAI_CLIP_MEAN / _STD, the image processor's class defaults
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: the processor's image token (the tokenizer's `image_token` where it names one)
IMAGE_TOKEN = "<|image_pad|>"
#: smart_resize refuses images more elongated than this, as transformers does
MAX_ASPECT_RATIO = 200
#: the fields of Qwen2VLImages that change pixel values or the grid (the rest: the prompt only)
PIXEL_FIELDS = ("do_convert_rgb", "do_resize", "min_pixels", "max_pixels", "resample", "do_rescale",
                "rescale_factor", "do_normalize", "image_mean", "image_std", "patch_size", "temporal_patch_size",
                "merge_size")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) divisible by `factor`, their product within [min_pixels, max_pixels],
    the aspect ratio as close as those allow: transformers' `smart_resize`, expression for
    expression (Python's round, floor and ceil on the same floats). ValueError for an image
    more than 200 times longer than wide (or the other way)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                         f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLImages:
    """The image settings of a Qwen2-VL / Qwen2.5-VL model folder (defaults: the image
    processor's class defaults), and the two things the data worker does with them."""

    do_convert_rgb: bool = True
    do_resize: bool = True
    min_pixels: int = 56 * 56  # size["shortest_edge"]
    max_pixels: int = 28 * 28 * 1280  # size["longest_edge"]
    resample: int = BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_token: str = IMAGE_TOKEN

    @classmethod
    def from_folder(cls, path: str | Path) -> Qwen2VLImages:
        """Read the settings the way transformers' AutoProcessor would: the image processor's
        where `common.image_processor_config` finds them. `size` first, then
        `min_pixels` / `max_pixels` over it (the image processor's own precedence); the
        image token from tokenizer_config.json where it names one. ValueError where the
        patch and merge sizes differ from the vision tower's (config.json): the model would
        refuse every image."""
        folder = Path(path)
        processor = common.read_json(folder / "processor_config.json")
        image = common.image_processor_config(folder, processor)
        settings = _image_settings(image)
        # this processor's lookup reads extra_special_tokens before model_specific_special_tokens
        tokenizer = common.read_json(folder / "tokenizer_config.json")
        settings.update(common.special_tokens(tokenizer, ("image_token",), common.SPECIAL_TOKEN_SECTIONS[::-1]))
        images = cls(**settings)
        images._check_tower(folder, common.read_json(folder / "config.json").get("vision_config") or {})
        return images

    def _check_tower(self, folder: Path, vision: dict[str, Any]) -> None:
        """The processor's patch, temporal patch and merge sizes must be the tower's."""
        pairs = (("patch_size", self.patch_size), ("temporal_patch_size", self.temporal_patch_size),
                 ("spatial_merge_size", self.merge_size))
        for name, mine in pairs:
            tower = vision.get(name)
            if tower is not None and int(tower) != mine:
                raise ValueError(f"{folder}: the processor's {name} is {mine}, the vision tower's {tower}")

    @property
    def placeholder(self) -> str:
        """The text that stands for an image's tokens (`<|image_pad|>`): what `prompt`'s text replaces."""
        return self.image_token

    def settings_key(self) -> str:
        """Every setting that changes pixel values or the grid, as one stable string: a
        cache of preprocessed images keys its entries by it with the image bytes."""
        return common.pixel_settings_key("qwen2-vl-images/1:", self, PIXEL_FIELDS)

    def preprocess(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(flattened patches float32 [grid_t * grid_h * grid_w, C * temporal_patch_size *
        patch_size^2], grid (t, h, w) in patches): what the transformers image processor
        gives for this image alone. ValueError for an image it cannot take."""
        frame = common.source_image(image, self.do_convert_rgb)
        if self.do_resize:
            factor = self.patch_size * self.merge_size
            size = smart_resize(frame.height, frame.width, factor, self.min_pixels, self.max_pixels)
            frame = common.resize(frame, size, self.resample)
        return self._patchify(common.rescale_and_normalize(common.channels_first(frame), self))

    def prompt(self, grid: tuple[int, int, int]) -> str:
        """The text that replaces one `<|image_pad|>`: one image token per merged block."""
        return self.image_token * self.tokens(grid)

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Image tokens (the language model's rows) of an image of `grid` patches."""
        t, h, w = grid
        return t * h * w // self.merge_size**2

    def _patchify(self, image: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """[C, H, W] -> patches in merge-block order, each repeated over the temporal patch
        (the image processor's `patchify`)."""
        channels, height, width = image.shape
        ps, m, tps = self.patch_size, self.merge_size, self.temporal_patch_size
        if height % (ps * m) or width % (ps * m):
            raise ValueError(f"a {height}x{width} image does not split into {ps * m} px merge blocks "
                             "(do_resize is off)")
        gh, gw = height // ps, width // ps
        patches = image.reshape(channels, gh // m, m, ps, gw // m, m, ps).transpose(1, 4, 2, 5, 0, 3, 6)
        patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tps, ps, ps))
        return np.ascontiguousarray(patches.reshape(gh * gw, channels * tps * ps * ps)), (1, gh, gw)


def _image_settings(image: dict[str, Any]) -> dict[str, Any]:
    """The image processor's settings from its saved dict; a missing or null entry keeps the
    class default, as transformers' `_set_attributes` does. The pixel bounds: `size`
    (shortest_edge, longest_edge), then `min_pixels` / `max_pixels` over it."""
    raw = image.get("size")
    size: dict[str, Any] = raw if isinstance(raw, dict) else {}
    family = {
        "min_pixels": _first(image.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels")),
        "max_pixels": _first(image.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels")),
        "patch_size": image.get("patch_size"), "temporal_patch_size": image.get("temporal_patch_size"),
        "merge_size": image.get("merge_size"),
    }
    integers = ("min_pixels", "max_pixels", "resample", "patch_size", "temporal_patch_size", "merge_size")
    return common.image_settings(image, family, integers)


def _first(*values: Any) -> Any:
    """The first value that is not None (None if all are)."""
    return next((v for v in values if v is not None), None)
