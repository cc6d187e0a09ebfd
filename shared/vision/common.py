"""What every image preprocessing module here shares (Idefics3 / SmolVLM, Gemma 3, Qwen2-VL).

Each family's module reproduces one transformers image processor bit for bit; the steps
below are the ones those processors take the same way (transformers' `BaseImageProcessor`
helpers): where the settings are saved, how a saved dict overrides the class defaults,
`convert_to_rgb`, the Pillow resize, `rescale` then `normalize` in their exact order and
dtypes, and how the processors find their special tokens in the tokenizer's config. Like
the family modules it uses numpy and Pillow only: the data worker imports it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from PIL import Image

from shared.deferred import deferred

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

#: the image processor settings every one of these processors has under the same name
COMMON_SETTINGS = ("do_convert_rgb", "do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize")
#: where transformers' tokenizer config keeps special tokens beside its top level, in the
#: order the Idefics3 / Gemma 3 processors' lookups read them
SPECIAL_TOKEN_SECTIONS = ("model_specific_special_tokens", "extra_special_tokens")


class NormalizeSettings(Protocol):
    """The settings `rescale_and_normalize` reads (each family's frozen dataclass has them)."""

    @property
    def do_rescale(self) -> bool: ...
    @property
    def rescale_factor(self) -> float: ...
    @property
    def do_normalize(self) -> bool: ...
    @property
    def image_mean(self) -> tuple[float, ...]: ...
    @property
    def image_std(self) -> tuple[float, ...]: ...


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} where the file is absent (a folder may lack any of
    the optional configs; an absent one leaves the defaults)."""
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def image_processor_config(folder: Path, processor: Mapping[str, Any]) -> dict[str, Any]:
    """The image processor's saved settings, where AutoProcessor finds them: nested under
    processor_config.json's `image_processor` (transformers 5 saves them there), else
    preprocessor_config.json (the Hub's checkpoints have them there)."""
    image = processor.get("image_processor")
    if isinstance(image, dict):
        return image
    return read_json(folder / "preprocessor_config.json")


def image_settings(image: Mapping[str, Any], family: Mapping[str, Any],
                   integers: tuple[str, ...] = ()) -> dict[str, Any]:
    """The dataclass arguments from an image processor's saved dict: the common settings
    and a family's own already read (`family`), mean and std as tuples of floats,
    `integers` cast to int, rescale_factor to float, in that order (so a bad value fails
    as it did in each family's own reader). A missing or null entry is left out so it
    keeps the class default, as transformers' `_set_attributes` does."""
    values: dict[str, Any] = {name: image.get(name) for name in COMMON_SETTINGS}
    values.update(family)
    for name in ("image_mean", "image_std"):
        value = image.get(name)
        values[name] = None if value is None else tuple(float(v) for v in np.atleast_1d(value))
    for name in integers:
        if values[name] is not None:
            values[name] = int(values[name])
    if values["rescale_factor"] is not None:
        values["rescale_factor"] = float(values["rescale_factor"])
    return {name: value for name, value in values.items() if value is not None}


def pixel_settings_key(tag: str, settings: Any, fields: tuple[str, ...]) -> str:
    """`tag` and the `fields` of a settings dataclass as one stable string: a cache of
    preprocessed images keys its entries by it with the image bytes, so it must change
    exactly when the pixels (or grid) would."""
    values = {name: value for name, value in asdict(settings).items() if name in fields}
    return tag + json.dumps(values, sort_keys=True)


def special_tokens(config: Mapping[str, Any], names: tuple[str, ...],
                   sections: tuple[str, ...] = SPECIAL_TOKEN_SECTIONS) -> dict[str, str]:
    """The tokenizer's attributes of these `names` (the processors take their token strings
    from them), which transformers sets from tokenizer_config.json: its top level first,
    then `sections` in order; the first string found for a name wins. A saved AddedToken
    counts as its content. Names found nowhere are left out (the caller's defaults stay)."""
    found: dict[str, str] = {}
    for source in [config, *(config.get(section) for section in sections)]:
        if not isinstance(source, dict):
            continue
        for name in names:
            value = source.get(name)
            if isinstance(value, dict):  # an AddedToken as saved
                value = value.get("content")
            if isinstance(value, str) and name not in found:
                found[name] = value
    return found


def source_image(image: Image.Image, convert_rgb: bool) -> Image.Image:
    """The image in the mode transformers resizes it in: RGB with transparency composited
    onto white (its convert_to_rgb), or, without do_convert_rgb, Pillow's image of
    np.array(image) as its to_pil_image makes it (uint8 only: other depths go through
    transformers' rescaling guesses, not reproduced here)."""
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


def resize(image: Image.Image, size: tuple[int, int], resample: int) -> Image.Image:
    """Resize to (height, width) as transformers' `resize` does: Pillow with the
    processor's filter and reducing_gap None, on the uint8 image (never rescaled first)."""
    height, width = size
    return image.resize((width, height), resample=Image.Resampling(resample), reducing_gap=None)


def channels_first(image: Image.Image | np.ndarray) -> np.ndarray:
    """An image as a uint8 [channels, height, width] array (a one-band image gets its
    channel axis), the layout the processors rescale and normalize in."""
    pixels = np.asarray(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return pixels.transpose(2, 0, 1)


def rescale_and_normalize(pixels: np.ndarray, settings: NormalizeSettings) -> np.ndarray:
    """[..., C, H, W] uint8 -> float32: rescale in float64 then cast to float32
    (transformers' `rescale`), then subtract the mean and divide by the std in float32 (its
    `normalize`). The order and dtypes are the processors' own; any other rounding would
    change pixel values."""
    if settings.do_rescale:
        pixels = (pixels.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    pixels = pixels.astype(np.float32)
    if settings.do_normalize:
        channels = pixels.shape[-3]
        mean, std = per_channel(settings.image_mean, channels), per_channel(settings.image_std, channels)
        pixels = (pixels - mean[:, None, None]) / std[:, None, None]
    return pixels


def per_channel(values: tuple[float, ...], channels: int) -> np.ndarray:
    """A mean or std as one float32 per channel (a single value applies to all, as the
    processors accept a scalar)."""
    if len(values) == 1:
        values = values * channels
    if len(values) != channels:
        raise ValueError(f"{len(values)} normalization values for {channels} channels")
    return np.array(values, dtype=np.float32)
