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
        where `common.image_processor_config` finds them; image_seq_length from
        processor_config.json (else config.json's mm_tokens_per_image); the token strings
        from tokenizer_config.json. ValueError for settings this module cannot reproduce
        (pan and scan) or that the vision tower cannot take (another size than its own)."""
        folder = Path(path)
        config = common.read_json(folder / "config.json")
        processor = common.read_json(folder / "processor_config.json")
        image = common.image_processor_config(folder, processor)
        if image.get("do_pan_and_scan") or processor.get("do_pan_and_scan"):
            raise ValueError(f"{folder}: do_pan_and_scan is on; pan and scan crops are not supported "
                             "(set it to false to serve one image sequence per image)")
        settings: dict[str, Any] = _image_settings(image)
        tokenizer = common.read_json(folder / "tokenizer_config.json")
        settings.update(common.special_tokens(tokenizer, tuple(DEFAULT_TOKENS)))
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

    @property
    def placeholder(self) -> str:
        """The text the chat template writes for an image (`<start_of_image>`): what `prompt`'s text replaces."""
        return self.boi_token

    def settings_key(self) -> str:
        """Every setting that changes pixel values, as one stable string: a cache of
        preprocessed images keys its entries by it with the image bytes."""
        return common.pixel_settings_key("gemma3-images/1:", self, PIXEL_FIELDS)

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """Pixel values [1, channels, height, width] float32: what the transformers
        processor gives for this image."""
        frame = common.source_image(image, self.do_convert_rgb)
        if self.do_resize:
            frame = common.resize(frame, (self.height, self.width), self.resample)
        return common.rescale_and_normalize(common.channels_first(frame)[None], self)

    def prompt(self) -> str:
        """The text that replaces one `boi_token` placeholder: the processor's
        `full_image_sequence`."""
        return f"\n\n{self.boi_token}{self.image_token * self.image_seq_length}{self.eoi_token}\n\n"


def _image_settings(image: dict[str, Any]) -> dict[str, Any]:
    """The image processor's settings from its saved dict; a missing or null entry keeps the
    class default, as transformers' `_set_attributes` does."""
    size = image.get("size")
    if size is not None and not (isinstance(size, dict) and isinstance(size.get("height"), int)
                                 and isinstance(size.get("width"), int)):
        raise ValueError(f"size must be {{'height': int, 'width': int}}, got {size!r}")
    return common.image_settings(image, {
        "height": None if size is None else int(size["height"]), "width": None if size is None else int(size["width"]),
    })
