"""Pi0 image inputs: a camera's image to pixel values, as `PI0ImageProcessor` makes them.

The data worker runs this for every camera of a request, with numpy and Pillow only. It
reproduces transformers' Pillow backend of PI0's image processor step by step (its own
class is a torchvision backend; torchvision's bicubic is not Pillow's, and mstar reads
images with Pillow, as the reference in the tests does):

1. convert to RGB (`convert_to_rgb`);
2. resize keeping the aspect ratio so the image fits `size` (max_height x max_width), one
   side touching it (`get_image_size_for_max_height_width`: int() of each side times the
   smaller scale), with Pillow's filter (bicubic by default) on the uint8 image;
3. rescale in float64, cast to float32, normalize in float32;
4. pad at the bottom and right with zeros (after normalization) to `pad_size`.

Each camera makes `image_seq_length` rows, the vision tower's patches of the padded image.
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

#: PILImageResampling.BICUBIC, PI0ImageProcessor's filter
BICUBIC = 3
STANDARD = (0.5, 0.5, 0.5)
PIXEL_FIELDS = ("do_convert_rgb", "do_resize", "max_height", "max_width", "resample", "do_rescale",
                "rescale_factor", "do_normalize", "image_mean", "image_std", "pad_height", "pad_width")


@dataclass(frozen=True)
class Pi0Images:
    """The image settings of a Pi0 folder (defaults: PI0ImageProcessor's class defaults)."""

    do_convert_rgb: bool = True
    do_resize: bool = True
    max_height: int = 224
    max_width: int = 224
    resample: int = BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = STANDARD
    image_std: tuple[float, ...] = STANDARD
    do_pad: bool = True
    pad_height: int = 224
    pad_width: int = 224
    image_seq_length: int = 256

    @classmethod
    def from_folder(cls, path: str | Path) -> Pi0Images:
        """The settings where AutoProcessor reads them (processor_config.json's
        `image_processor`, else preprocessor_config.json); ValueError for settings the
        vision tower cannot take (no padding to its own square)."""
        folder = Path(path)
        processor = common.read_json(folder / "processor_config.json")
        image = common.image_processor_config(folder, processor)
        size, pad = image.get("size") or {}, image.get("pad_size") or {}
        own: dict[str, Any] = {"max_height": size.get("max_height"), "max_width": size.get("max_width"),
                               "pad_height": pad.get("height"), "pad_width": pad.get("width"),
                               "do_pad": image.get("do_pad"), "image_seq_length": image.get("image_seq_length")}
        settings = common.image_settings(image, own, ("resample", "max_height", "max_width", "pad_height",
                                                      "pad_width", "image_seq_length"))
        images = cls(**settings)
        if not (images.do_resize and images.do_pad):
            raise ValueError(f"{folder}: do_resize and do_pad must be on: the vision tower takes only its own size")
        return images

    def settings_key(self) -> str:
        return common.pixel_settings_key("pi0-images/1:", self, PIXEL_FIELDS)

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """Pixel values [1, channels, pad_height, pad_width] float32."""
        frame = common.source_image(image, self.do_convert_rgb)
        scale = min(self.max_height / frame.height, self.max_width / frame.width)
        size = (int(frame.height * scale), int(frame.width * scale))
        frame = common.resize(frame, size, self.resample)
        pixels = common.rescale_and_normalize(common.channels_first(frame), self)
        out = np.zeros((pixels.shape[0], self.pad_height, self.pad_width), dtype=np.float32)
        out[:, : pixels.shape[1], : pixels.shape[2]] = pixels
        return out[None]
