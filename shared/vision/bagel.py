"""BAGEL's image inputs for understanding: an image to ViT patches, and the text that stands for it.

The data worker runs this for every image of a request (numpy and Pillow, no torch). It
follows BAGEL's `InterleaveInferencer` step by step, so the ViT sees the reference's pixels:

1. `pil_img2rgb`: RGB, transparency composited onto white;
2. the VAE transform's resize first (`vae_transform.resize_transform`, which the
   inferencer applies to every input image), then the ViT transform's
   (`ImageTransform(980, 224, 14)`): each `MaxLongEdgeMinShortEdgeResize` scales the long
   edge down to `max_size`, the short edge up to `min_size`, rounds both to its stride and
   caps the pixels, then resizes with Pillow's bicubic filter (torchvision's PIL path);
3. `ToTensor` (uint8 / 255 in float32) and `Normalize(0.5, 0.5)` in float32;
4. `patchify`: [h, w, patch * patch * 3] patches, each row-major over (row, column,
   channel) inside the patch.

The text that replaces the chat template's one `<|image_pad|>` is one `<|image_pad|>` per
patch; the template writes `<|vision_start|>` and `<|vision_end|>` around it (the
reference's `start_of_image` / `end_of_image` rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from PIL import Image

from shared.deferred import deferred

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

#: Pillow's bicubic filter (torchvision's InterpolationMode.BICUBIC on a PIL image)
BICUBIC = 3
#: ImageTransform's default pixel cap
MAX_PIXELS = 14 * 14 * 9 * 1024


@dataclass(frozen=True)
class Resize:
    """One `MaxLongEdgeMinShortEdgeResize`'s settings."""

    max_size: int
    min_size: int
    stride: int
    max_pixels: int = MAX_PIXELS

    def size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) it resizes a `width` x `height` image to (its `forward`)."""
        scale = min(self.max_size / max(width, height), 1.0)
        scale = max(scale, self.min_size / min(width, height))
        w, h = self._apply(width, height, scale)
        if w * h > self.max_pixels:
            w, h = self._apply(w, h, self.max_pixels / (w * h))
        if max(w, h) > self.max_size:
            w, h = self._apply(w, h, self.max_size / max(w, h))
        return w, h

    def _apply(self, width: int, height: int, scale: float) -> tuple[int, int]:
        return self._divisible(round(width * scale)), self._divisible(round(height * scale))

    def _divisible(self, value: float) -> int:
        return max(self.stride, int(round(value / self.stride) * self.stride))

    def __call__(self, image: Any) -> Any:
        w, h = self.size(*image.size)
        return image.resize((w, h), BICUBIC)


@dataclass(frozen=True)
class BagelImages:
    """BAGEL's image settings (its app's transforms; the checkpoint folder holds none)."""

    vae: Resize = Resize(1024, 512, 16)
    vit: Resize = Resize(980, 224, 14)
    image_token: str = "<|image_pad|>"

    @property
    def placeholder(self) -> str:
        return self.image_token

    def settings_key(self) -> str:
        return f"bagel:{self.vae}:{self.vit}"

    def preprocess(self, image: Any) -> np.ndarray:
        """An image -> its patches float32 [h, w, patch * patch * 3]."""
        rgb = _to_rgb(image)
        pixels = np.asarray(self.vit(self.vae(rgb)), dtype=np.uint8)
        x = (pixels.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
        p = self.vit.stride
        h, w = x.shape[0] // p, x.shape[1] // p
        # [H, W, C] -> [h, p, w, q, C] -> [h, w, p, q, C]: patchify's "chpwq->hwpqc"
        return np.ascontiguousarray(x.reshape(h, p, w, p, 3).transpose(0, 2, 1, 3, 4).reshape(h, w, p * p * 3))

    def vae_pixels(self, image: Any) -> np.ndarray:
        """An image to edit -> the autoencoder's input float32 [3, H, W] in [-1, 1]: the VAE
        transform's resize, `ToTensor` and `Normalize(0.5, 0.5)` (the inferencer's
        `prepare_vae_images`); H x W is also the edit's output size."""
        pixels = np.asarray(self.vae(_to_rgb(image)), dtype=np.uint8)
        x = (pixels.astype(np.float32) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
        return np.ascontiguousarray(x.transpose(2, 0, 1))

    def prompt(self, patches: np.ndarray) -> str:
        """The text for one image: a placeholder per patch."""
        return self.image_token * (patches.shape[0] * patches.shape[1])


def _to_rgb(image: Any) -> Any:
    """`pil_img2rgb`: transparency onto white, else a plain RGB conversion."""
    if image.mode == "RGBA" or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new(mode="RGB", size=rgba.size, color=(255, 255, 255))
        white.paste(rgba, mask=rgba.split()[3])
        return white
    return image.convert("RGB")
