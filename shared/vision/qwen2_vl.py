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

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

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
        from processor_config.json (nested, as transformers 5 saves it) or else
        preprocessor_config.json (as the Hub's checkpoints have it). `size` first, then
        `min_pixels` / `max_pixels` over it (the image processor's own precedence); the
        image token from tokenizer_config.json where it names one. ValueError where the
        patch and merge sizes differ from the vision tower's (config.json): the model would
        refuse every image."""
        folder = Path(path)
        processor = _read_json(folder / "processor_config.json")
        image = processor.get("image_processor")
        if not isinstance(image, dict):
            image = _read_json(folder / "preprocessor_config.json")
        settings = _image_settings(image)
        token = _tokenizer_image_token(_read_json(folder / "tokenizer_config.json"))
        if token is not None:
            settings["image_token"] = token
        images = cls(**settings)
        images._check_tower(folder, _read_json(folder / "config.json").get("vision_config") or {})
        return images

    def _check_tower(self, folder: Path, vision: dict[str, Any]) -> None:
        """The processor's patch, temporal patch and merge sizes must be the tower's."""
        pairs = (("patch_size", self.patch_size), ("temporal_patch_size", self.temporal_patch_size),
                 ("spatial_merge_size", self.merge_size))
        for name, mine in pairs:
            tower = vision.get(name)
            if tower is not None and int(tower) != mine:
                raise ValueError(f"{folder}: the processor's {name} is {mine}, the vision tower's {tower}")

    def settings_key(self) -> str:
        """Every setting that changes pixel values or the grid, as one stable string: a
        cache of preprocessed images keys its entries by it with the image bytes."""
        settings = {name: value for name, value in asdict(self).items() if name in PIXEL_FIELDS}
        return "qwen2-vl-images/1:" + json.dumps(settings, sort_keys=True)

    def preprocess(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(flattened patches float32 [grid_t * grid_h * grid_w, C * temporal_patch_size *
        patch_size^2], grid (t, h, w) in patches): what the transformers image processor
        gives for this image alone. ValueError for an image it cannot take."""
        frame = _source(image, self.do_convert_rgb)
        if self.do_resize:
            factor = self.patch_size * self.merge_size
            height, width = smart_resize(frame.height, frame.width, factor, self.min_pixels, self.max_pixels)
            frame = frame.resize((width, height), resample=Image.Resampling(self.resample), reducing_gap=None)
        pixels = np.asarray(frame)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        return self._patchify(self._normalize(pixels.transpose(2, 0, 1)))

    def prompt(self, grid: tuple[int, int, int]) -> str:
        """The text that replaces one `<|image_pad|>`: one image token per merged block."""
        return self.image_token * self.tokens(grid)

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Image tokens (the language model's rows) of an image of `grid` patches."""
        t, h, w = grid
        return t * h * w // self.merge_size**2

    def _normalize(self, pixels: np.ndarray) -> np.ndarray:
        """[C, H, W] uint8 -> float32: rescale in float64 then cast to float32 (transformers'
        `rescale`), then subtract the mean and divide by the std in float32 (its `normalize`)."""
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32)
        if self.do_normalize:
            channels = pixels.shape[0]
            mean, std = _per_channel(self.image_mean, channels), _per_channel(self.image_std, channels)
            pixels = (pixels - mean[:, None, None]) / std[:, None, None]
        return pixels

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


def _source(image: Image.Image, convert_rgb: bool) -> Image.Image:
    """The image in the mode transformers resizes it in: RGB with transparency composited
    onto white (its convert_to_rgb), or, without do_convert_rgb, Pillow's image of
    np.array(image) as its to_pil_image makes it (uint8 only)."""
    if convert_rgb:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    array = np.array(image)
    if array.dtype != np.uint8:
        raise ValueError(f"image mode {image.mode} is not 8-bit; set do_convert_rgb to read it as RGB")
    return Image.fromarray(array)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} where the file is absent."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _image_settings(image: dict[str, Any]) -> dict[str, Any]:
    """The image processor's settings from its saved dict; a missing or null entry keeps the
    class default, as transformers' `_set_attributes` does. The pixel bounds: `size`
    (shortest_edge, longest_edge), then `min_pixels` / `max_pixels` over it."""
    raw = image.get("size")
    size: dict[str, Any] = raw if isinstance(raw, dict) else {}
    values: dict[str, Any] = {
        "do_convert_rgb": image.get("do_convert_rgb"), "do_resize": image.get("do_resize"),
        "min_pixels": _first(image.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels")),
        "max_pixels": _first(image.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels")),
        "resample": image.get("resample"), "do_rescale": image.get("do_rescale"),
        "rescale_factor": image.get("rescale_factor"), "do_normalize": image.get("do_normalize"),
        "patch_size": image.get("patch_size"), "temporal_patch_size": image.get("temporal_patch_size"),
        "merge_size": image.get("merge_size"),
    }
    for name in ("image_mean", "image_std"):
        value = image.get(name)
        values[name] = None if value is None else tuple(float(v) for v in np.atleast_1d(value))
    for name in ("min_pixels", "max_pixels", "resample", "patch_size", "temporal_patch_size", "merge_size"):
        if values[name] is not None:
            values[name] = int(values[name])
    if values["rescale_factor"] is not None:
        values["rescale_factor"] = float(values["rescale_factor"])
    return {name: value for name, value in values.items() if value is not None}


def _first(*values: Any) -> Any:
    """The first value that is not None (None if all are)."""
    return next((v for v in values if v is not None), None)


def _tokenizer_image_token(config: dict[str, Any]) -> str | None:
    """The tokenizer's `image_token` (the processor uses it where the tokenizer has one)."""
    for source in (config, config.get("extra_special_tokens"), config.get("model_specific_special_tokens")):
        if isinstance(source, dict):
            value = source.get("image_token")
            if isinstance(value, dict):  # an AddedToken as saved
                value = value.get("content")
            if isinstance(value, str):
                return value
    return None


def _per_channel(values: tuple[float, ...], channels: int) -> np.ndarray:
    """A mean or std as one float32 per channel (a single value applies to all)."""
    if len(values) == 1:
        values = values * channels
    if len(values) != channels:
        raise ValueError(f"{len(values)} normalization values for {channels} channels")
    return np.array(values, dtype=np.float32)
