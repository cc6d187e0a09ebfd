"""Gemma 3 image inputs: an image to pixel values, and the text that stands for it.

The data worker runs this for every image of a request, so it uses numpy and Pillow only (no
torch, no transformers). It reproduces transformers' `Gemma3ImageProcessorPil` and
`Gemma3Processor`'s prompt expansion step by step, so a checkpoint sees bit-identical pixel
values and the same token ids:

1. convert to RGB, compositing any transparency onto white (`convert_to_rgb`);
2. resize to `size` (height x width, the vision tower's square) with Pillow and the
   processor's filter (bilinear by default), through a uint8 image as transformers' does;
3. scale by `rescale_factor` in float64, cast to float32, then (x - mean) / std in float32.

One image is one tile, whatever its shape. Pan and scan (`do_pan_and_scan`, extra crops
of a long image, each its own image sequence) is not reproduced: a folder that turns it on
is refused at load rather than served with other pixels than the model's.

The text that replaces one `<start_of_image>` (what the chat template writes for an image)
is the processor's `full_image_sequence`: "\\n\\n<start_of_image>", `image_seq_length`
`<image_soft_token>`s, "<end_of_image>\\n\\n". Its newlines merge with the prompt's around
it when the expanded prompt is tokenized once, whole, as the processor tokenizes it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

#: transformers' PILImageResampling.BILINEAR, the image processor's default filter
BILINEAR = 2
#: IMAGENET_STANDARD_MEAN / _STD, the image processor's class defaults
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)
#: the tokenizer's image tokens (its attributes of these names), with the Hub's strings as defaults
DEFAULT_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                  "eoi_token": "<end_of_image>"}
#: the fields of Gemma3Images that change pixel values (the rest change only the prompt)
PIXEL_FIELDS = ("do_convert_rgb", "do_resize", "height", "width", "resample", "do_rescale", "rescale_factor",
                "do_normalize", "image_mean", "image_std")


@dataclass(frozen=True)
class Gemma3Images:
    """The image settings of a Gemma 3 model folder (defaults: the image processor's class
    defaults), and the two things the data worker does with them."""

    do_convert_rgb: bool = True
    do_resize: bool = True
    height: int = 224
    width: int = 224
    resample: int = BILINEAR
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = STANDARD_MEAN
    image_std: tuple[float, ...] = STANDARD_STD
    image_seq_length: int = 256  # <image_soft_token>s per image
    boi_token: str = DEFAULT_TOKENS["boi_token"]
    image_token: str = DEFAULT_TOKENS["image_token"]
    eoi_token: str = DEFAULT_TOKENS["eoi_token"]

    @classmethod
    def from_folder(cls, path: str | Path) -> Gemma3Images:
        """Read the settings the way transformers' AutoProcessor would: the image processor's
        from processor_config.json (nested, as transformers 5 saves it) or else
        preprocessor_config.json (as the Hub's checkpoints have it); image_seq_length from
        processor_config.json (else config.json's mm_tokens_per_image); the token strings
        from tokenizer_config.json. ValueError for settings this module cannot reproduce
        (pan and scan) or that the vision tower cannot take (another size than its own)."""
        folder = Path(path)
        config = _read_json(folder / "config.json")
        processor = _read_json(folder / "processor_config.json")
        image = processor.get("image_processor")
        if not isinstance(image, dict):
            image = _read_json(folder / "preprocessor_config.json")
        if image.get("do_pan_and_scan") or processor.get("do_pan_and_scan"):
            raise ValueError(f"{folder}: do_pan_and_scan is on; pan and scan crops are not supported "
                             "(set it to false to serve one image sequence per image)")
        settings: dict[str, Any] = _image_settings(image)
        settings.update(_tokens(_read_json(folder / "tokenizer_config.json")))
        tokens = config.get("mm_tokens_per_image")
        seq = processor.get("image_seq_length", tokens)
        if seq is not None:
            settings["image_seq_length"] = int(seq)
        images = cls(**settings)
        images._check_tower(folder, config, tokens)
        return images

    def _check_tower(self, folder: Path, config: dict[str, Any], tokens: Any) -> None:
        """The pixels must be what the vision tower takes (its image_size square, every
        image resized to it), and the prompt must hold as many soft tokens as it makes rows."""
        if not self.do_resize:
            raise ValueError(f"{folder}: do_resize is off; the vision tower takes only its own image size")
        size = (config.get("vision_config") or {}).get("image_size")
        if size is not None and (self.height, self.width) != (size, size):
            raise ValueError(f"{folder}: the processor resizes to {self.height}x{self.width}, the vision tower "
                             f"takes {size}x{size}")
        if tokens is not None and int(tokens) != self.image_seq_length:
            raise ValueError(f"{folder}: processor image_seq_length {self.image_seq_length} but the model makes "
                             f"{tokens} rows per image (mm_tokens_per_image)")

    def settings_key(self) -> str:
        """Every setting that changes pixel values, as one stable string: a cache of
        preprocessed images keys its entries by it with the image bytes."""
        settings = {name: value for name, value in asdict(self).items() if name in PIXEL_FIELDS}
        return "gemma3-images/1:" + json.dumps(settings, sort_keys=True)

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """Pixel values [1, channels, height, width] float32: what the transformers
        processor gives for this image."""
        frame = _source(image, self.do_convert_rgb)
        if self.do_resize:
            frame = frame.resize((self.width, self.height), resample=Image.Resampling(self.resample),
                                 reducing_gap=None)
        pixels = np.asarray(frame)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        return self._normalize(pixels.transpose(2, 0, 1)[None])

    def prompt(self) -> str:
        """The text that replaces one `boi_token` placeholder: the processor's
        `full_image_sequence`."""
        return f"\n\n{self.boi_token}{self.image_token * self.image_seq_length}{self.eoi_token}\n\n"

    def _normalize(self, pixels: np.ndarray) -> np.ndarray:
        """Rescale in float64 then cast to float32 (transformers' `rescale`), then subtract the
        mean and divide by the std in float32 (its `normalize`)."""
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = pixels.astype(np.float32)
        if self.do_normalize:
            channels = pixels.shape[1]
            mean, std = _per_channel(self.image_mean, channels), _per_channel(self.image_std, channels)
            pixels = (pixels - mean[:, None, None]) / std[:, None, None]
        return pixels


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
    class default, as transformers' `_set_attributes` does."""
    size = image.get("size")
    if size is not None and not (isinstance(size, dict) and isinstance(size.get("height"), int)
                                 and isinstance(size.get("width"), int)):
        raise ValueError(f"size must be {{'height': int, 'width': int}}, got {size!r}")
    values: dict[str, Any] = {
        "do_convert_rgb": image.get("do_convert_rgb"), "do_resize": image.get("do_resize"),
        "height": None if size is None else int(size["height"]), "width": None if size is None else int(size["width"]),
        "resample": image.get("resample"), "do_rescale": image.get("do_rescale"),
        "rescale_factor": image.get("rescale_factor"), "do_normalize": image.get("do_normalize"),
    }
    for name in ("image_mean", "image_std"):
        value = image.get(name)
        values[name] = None if value is None else tuple(float(v) for v in np.atleast_1d(value))
    if values["rescale_factor"] is not None:
        values["rescale_factor"] = float(values["rescale_factor"])
    return {name: value for name, value in values.items() if value is not None}


def _tokens(config: dict[str, Any]) -> dict[str, str]:
    """The processor's token strings: the tokenizer's attributes of those names, which
    transformers sets from tokenizer_config.json (top level or its extra special tokens)."""
    found: dict[str, str] = {}
    sources = [config, config.get("model_specific_special_tokens"), config.get("extra_special_tokens")]
    for source in sources:
        if not isinstance(source, dict):
            continue
        for name in DEFAULT_TOKENS:
            value = source.get(name)
            if isinstance(value, dict):  # an AddedToken as saved
                value = value.get("content")
            if isinstance(value, str) and name not in found:
                found[name] = value
    return found


def _per_channel(values: tuple[float, ...], channels: int) -> np.ndarray:
    """A mean or std as one float32 per channel (a single value applies to all)."""
    if len(values) == 1:
        values = values * channels
    if len(values) != channels:
        raise ValueError(f"{len(values)} normalization values for {channels} channels")
    return np.array(values, dtype=np.float32)
