"""Idefics3 / SmolVLM image inputs: an image to pixel values, and the text that stands for it.

The data worker runs this for every image of a request, so it uses numpy and Pillow only (no
torch, no transformers). It reproduces transformers' `Idefics3ImageProcessorPil` /
`SmolVLMImageProcessorPil` (the same code) and the processors' prompt expansion step by step,
so a checkpoint sees bit-identical pixel values and the same token ids:

1. convert to RGB, compositing any transparency onto white (`convert_to_rgb`);
2. resize with Pillow (LANCZOS by default) so the longest edge is `size["longest_edge"]`,
   upscaling too, the other edge rounded up to even (`_resize_output_size_rescale_to_max_len`);
3. resize again so both edges are multiples of the tile size (`resize_for_vision_encoder`:
   the other edge is computed through the aspect ratio in floating point, then rounded up);
4. cut that into rows x cols tiles, row-major, and add the whole image squashed to one tile
   (the "global image") last; an image that already fits one tile stays one tile, rows =
   cols = 0. Without splitting, the image is squashed to one tile;
5. scale by `rescale_factor` in float64, cast to float32, then (x - mean) / std in float32.

Every resize goes through a uint8 Pillow image as transformers' does (its numpy arrays stay
uint8 until step 5, so converting them to Pillow never rescales them).
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

#: transformers' PILImageResampling.LANCZOS, the processors' default filter
LANCZOS = 1
#: transformers' MAX_IMAGE_SIZE: no edge grows past it in step 2
MAX_IMAGE_SIZE = 4096
#: model_type -> the processor class that checkpoints of that type use
PROCESSOR_OF_MODEL = {"idefics3": "Idefics3Processor", "smolvlm": "SmolVLMProcessor"}
#: the processors' token strings (Idefics3Processor hard-codes them; SmolVLMProcessor takes
#: them from the tokenizer, with these as defaults)
DEFAULT_TOKENS = {
    "image_token": "<image>",
    "fake_image_token": "<fake_token_around_image>",
    "global_image_token": "<global-img>",
    "end_of_utterance_token": "<end_of_utterance>",
}
#: the fields of Idefics3Images that change pixel values (the rest change only the prompt)
PIXEL_FIELDS = ("do_convert_rgb", "do_resize", "longest_edge", "do_image_splitting", "tile_size", "resample",
                "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")


@dataclass(frozen=True)
class Idefics3Images:
    """The image settings of an Idefics3 / SmolVLM model folder (defaults: the image
    processor's class defaults), and the two things the data worker does with them."""

    processor_class: str = "Idefics3Processor"
    do_convert_rgb: bool = True
    do_resize: bool = True
    longest_edge: int = 4 * 364  # size["longest_edge"]
    do_image_splitting: bool = True
    tile_size: int = 364  # max_image_size["longest_edge"]: a tile's (and the vision tower's) edge
    resample: int = LANCZOS
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_seq_len: int = 169  # <image> tokens per tile
    image_token: str = DEFAULT_TOKENS["image_token"]
    fake_image_token: str = DEFAULT_TOKENS["fake_image_token"]
    global_image_token: str = DEFAULT_TOKENS["global_image_token"]
    end_of_utterance_token: str = DEFAULT_TOKENS["end_of_utterance_token"]

    @classmethod
    def from_folder(cls, path: str | Path) -> Idefics3Images:
        """Read the settings the way transformers' AutoProcessor would: the image processor's
        where `common.image_processor_config` finds them; image_seq_len from
        processor_config.json, checked against what config.json's vision tower gives."""
        folder = Path(path)
        config = common.read_json(folder / "config.json")
        processor = common.read_json(folder / "processor_config.json")
        image = common.image_processor_config(folder, processor)
        processor_class = processor.get("processor_class") or image.get("processor_class") \
            or PROCESSOR_OF_MODEL.get(config.get("model_type", ""))
        if processor_class not in PROCESSOR_OF_MODEL.values():
            raise ValueError(f"{folder}: not an Idefics3 / SmolVLM processor ({processor_class!r})")
        settings: dict[str, Any] = dict(DEFAULT_TOKENS, processor_class=str(processor_class))
        if processor_class == "SmolVLMProcessor":
            tokenizer = common.read_json(folder / "tokenizer_config.json")
            settings.update(common.special_tokens(tokenizer, tuple(DEFAULT_TOKENS)))
        settings.update(_image_settings(image), image_seq_len=_image_seq_len(folder, config, processor))
        return cls(**settings)

    @property
    def placeholder(self) -> str:
        """The text the chat template writes for an image: what `prompt`'s text replaces."""
        return self.image_token

    def settings_key(self) -> str:
        """Every setting that changes pixel values, as one stable string: a cache of
        preprocessed images keys its entries by it with the image bytes."""
        return common.pixel_settings_key("idefics3-images/1:", self, PIXEL_FIELDS)

    def preprocess(self, image: Image.Image) -> tuple[np.ndarray, int, int]:
        """Pixel values [tiles, channels, tile_size, tile_size] float32 (the split tiles
        row-major, then the global image) and the split's (rows, cols), (0, 0) when the image
        was not split: what the transformers processor gives for this image, without the
        zero tiles it pads a batch with."""
        frame = common.source_image(image, self.do_convert_rgb)
        tiles: list[Image.Image | np.ndarray]
        if self.do_resize:
            frame = self._resize(frame, _fit_longest_edge(frame.height, frame.width, self.longest_edge))
        if not self.do_image_splitting:
            tiles, rows, cols = [self._resize(frame, (self.tile_size, self.tile_size))], 0, 0
        else:
            frame = self._resize(frame, _tile_multiple(frame.height, frame.width, self.tile_size))
            tiles, rows, cols = self._split(frame)
        pixels = np.stack([common.channels_first(tile) for tile in tiles])
        return common.rescale_and_normalize(pixels, self), rows, cols

    def prompt(self, rows: int, cols: int) -> str:
        """The text that replaces one `image_token` placeholder for an image split into
        rows x cols tiles, as the processors' `replace_image_token` writes it (the same text for
        Idefics3Processor and SmolVLMProcessor): per tile <fake><row_r_col_c> and
        image_seq_len <image>, a newline after each row, then a newline and the global image
        <fake><global-img><image>...<fake>. Unsplit ((0, 0)): the global image part alone."""
        tile = self.image_token * self.image_seq_len
        whole = f"{self.fake_image_token}{self.global_image_token}{tile}{self.fake_image_token}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join(
            "".join(f"{self.fake_image_token}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{grid}\n{whole}"

    def _resize(self, image: Image.Image, size: tuple[int, int]) -> Image.Image:
        """Resize to (height, width) with the processor's filter (`common.resize`)."""
        return common.resize(image, size, self.resample)

    def _split(self, image: Image.Image) -> tuple[list[Image.Image | np.ndarray], int, int]:
        """Tiles of an image whose edges are multiples of tile_size, row-major, then the
        whole image resized to one tile; an image of one tile stays itself (0, 0)."""
        size = self.tile_size
        if image.height <= size and image.width <= size:
            return [image], 0, 0
        rows, cols = (image.height - size) // size + 1, (image.width - size) // size + 1
        pixels = np.asarray(image)
        tiles: list[Image.Image | np.ndarray] = [
            pixels[r * size:(r + 1) * size, c * size:(c + 1) * size] for r in range(rows) for c in range(cols)
        ]
        tiles.append(self._resize(image, (size, size)))
        return tiles, rows, cols


def _edge(size: Any, name: str) -> int | None:
    """`longest_edge` of a size dict; the processors accept nothing else for these."""
    if size is None:
        return None
    if not isinstance(size, dict) or not isinstance(size.get("longest_edge"), int):
        raise ValueError(f"{name} must be {{'longest_edge': int}}, got {size!r}")
    return int(size["longest_edge"])


def _image_settings(image: dict[str, Any]) -> dict[str, Any]:
    """The image processor's settings from its saved dict; a missing or null entry keeps the
    class default, as transformers' `_set_attributes` does."""
    return common.image_settings(image, {
        "longest_edge": _edge(image.get("size"), "size"), "do_image_splitting": image.get("do_image_splitting"),
        "tile_size": _edge(image.get("max_image_size"), "max_image_size"),
    })


def _image_seq_len(folder: Path, config: dict[str, Any], processor: dict[str, Any]) -> int:
    """<image> tokens per tile: the processor's image_seq_len, which must be what the model's
    vision tower gives, (image_size / patch_size)^2 / scale_factor^2, or the model would
    refuse the prompt; the tower's number where the processor does not say."""
    vision = config.get("vision_config") or {}
    derived = None
    if "image_size" in vision and "patch_size" in vision:
        derived = int(((vision["image_size"] // vision["patch_size"]) ** 2) / (config.get("scale_factor", 2) ** 2))
    saved = processor.get("image_seq_len")
    if saved is not None and derived is not None and saved != derived:
        raise ValueError(f"{folder}: processor image_seq_len {saved} but the vision tower gives {derived} per tile")
    if saved is not None:
        return int(saved)
    if derived is None:
        raise ValueError(f"{folder}: neither processor_config.json nor config.json gives image_seq_len")
    return derived


def _fit_longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    """Step 2's size: the longest edge becomes `longest` (up or down), the other follows the
    aspect ratio, truncated then rounded up to even; then capped at MAX_IMAGE_SIZE. The float
    expressions are transformers' own, so the truncation lands on the same integer."""
    aspect_ratio = width / height
    if width >= height:
        width = longest
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect_ratio = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width = MAX_IMAGE_SIZE
        height = int(width / aspect_ratio)
    elif height > width and height > MAX_IMAGE_SIZE:
        height = MAX_IMAGE_SIZE
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def _tile_multiple(height: int, width: int, tile: int) -> tuple[int, int]:
    """Step 3's size: the longest edge rounded up to a multiple of `tile`, the other edge
    recomputed from the aspect ratio (truncated) and rounded up to a multiple of `tile`."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect_ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect_ratio) / tile) * tile
    return height, width
