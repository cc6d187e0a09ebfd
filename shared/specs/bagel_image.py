"""BAGEL text-to-image (`--task image` on a BAGEL folder): `POST /v1/images/generations`.

The request is BAGEL's `InterleaveInferencer([text])`: its context `<|im_start|>text<|im_end|>`
(the data worker renders and tokenizes it: `prompt_texts`), then the denoising loop
(runners/bagel_image.py). Its three guidance branches read three contexts: the full one,
the one without the text (empty: nothing precedes the text) and the one without images
(the full one: the prompt holds none). So the request's rows are the full context's only,
a rows span of label "text" whose K/V the worker writes once into its pages and every step
and branch reads; the latent rows are recomputed each step and never written (no growth,
no scratch): the footprint is the prompt's rows.

Options as the image route sends them (`images.py`): `guidance_scale` is BAGEL's
`cfg_text_scale` (1: no guidance; its `cfg_img_scale` 1.5, interval (0.4, 1], timestep
shift 3 and global renorm from 0 are the inferencer's defaults); `num_inference_steps` its
`num_timesteps`; `seed` (and `sample` j: the j-th draw of one generator) the latent noise.
A negative prompt has no place in BAGEL's guidance (its "no text" branch is the empty
context) and is refused. Sizes are multiples of 16 px (8x the autoencoder, 2 x 2 latent
patches) up to 1024 (its 64 x 64 latent position table).

An edit (`POST /v1/images/edits`: the inferencer's `[image, text]`) carries its input image
(`prepare_image`: the autoencoder's pixels and the ViT's patches, `EditImage`). Its rows
are its three branches' contexts (`modeling/vision/bagel_edit.py`) in the one label: the
full context (the image's latent block, its ViT block, the text), then the text alone
(the "no image" branch's, from position 0); the "no text" branch reads the full one's
first two blocks. Its size is the input's after the VAE transform's resize
(`edit_resize`); `image_guidance_scale` is the inferencer's `cfg_img_scale` (1.5 unless
told). Sample j of a seed is the j-th edit's draws of one generator (the encoder's noise,
then the latents').

It is an `ImageGenSpec` (shared/specs/image_gen.py), as Cosmos 3's spec is: the image route
and the data worker take both alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from shared.deferred import deferred
from shared.layout import KVLabel, LabelLayout, ProcessPromptOutput, Span
from shared.specs.bagel import bagel_text_config
from shared.specs.base import PreparedImage, PromptError, PromptRequest
from shared.specs.image_gen import ImageGenSpec, guidance_option, int_option
from shared.vision.bagel import BagelImages

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

MAX_STEPS = 100
#: the inferencer's `cfg_img_scale`
IMAGE_GUIDANCE = 1.5


@dataclass(frozen=True)
class EditImage(PreparedImage):
    """An edit's input image: `pixels` the autoencoder's float32 [3, H, W] in [-1, 1],
    `patches` the ViT's float32 [h, w, 14 * 14 * 3]."""

    patches: np.ndarray
#: pixels per latent row (the autoencoder's 8 x its 2 x 2 patch), the largest side (64 rows)
SPATIAL, MAX_SIDE = 16, 1024


class BagelImageSpec(ImageGenSpec):
    engine = "bagel_diffusion"
    max_side, max_frames = MAX_SIDE, 1
    #: an edit's input image's resize (the VAE transform's: max side, min side, stride)
    edit_resize = (BagelImages.vae.max_size, BagelImages.vae.min_size, BagelImages.vae.stride)

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        llm = bagel_text_config(config)
        self.config = dict(config)
        self.page_size, self.dtype = page_size, dtype
        self.num_layers = int(llm["num_hidden_layers"])
        self.heads = int(llm["num_attention_heads"])
        self.kv_heads = int(llm.get("num_key_value_heads") or self.heads)
        self.head_dim = int(llm["hidden_size"]) // self.heads
        self.vocab_size = int(llm["vocab_size"])
        self.spatial, self.temporal = SPATIAL, 1
        ctx = int(llm.get("max_position_embeddings", 32768))
        self.max_seq_len = min(ctx, max_seq_len) if max_seq_len else ctx
        self.suffix_ids: list[int] = []
        self.tags: list[int] = []
        self._label = KVLabel(self.label_name, self.pool, keys=False)

    def load_folder(self, path: str | Path) -> Self:
        """The image tags' ids (the query's first and last rows)."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        ids = [tok.token_to_id(t) for t in ("<|vision_start|>", "<|vision_end|>")]
        tags = [int(i) for i in ids if i is not None]
        if len(tags) != 2:
            raise ValueError(f"{path}: the tokenizer lacks <|vision_start|> or <|vision_end|>")
        self.tags = tags
        return self

    @property
    def loop_cap(self) -> int:
        return MAX_STEPS

    def check_size(self, width: int, height: int, num_frames: int) -> None:
        for side in (width, height):
            if side < SPATIAL or side > MAX_SIDE or side % SPATIAL:
                raise PromptError("size", f"size must be WxH with each side a multiple of {SPATIAL} from {SPATIAL} "
                                          f"to {MAX_SIDE}, got {width}x{height}")
        if num_frames != 1:
            raise PromptError("num_frames", "BAGEL makes images only (num_frames 1)")

    def prompt_texts(self, prompt: str, negative: str | None, height: int, width: int,
                     num_frames: int, fps: float = 24.0) -> tuple[str, str]:
        """(the full context's text, the no-text context's: empty)."""
        if negative:
            raise PromptError("negative_prompt", "BAGEL's guidance has no negative prompt (its unconditional "
                                                 "branch is the context without the text)")
        return f"<|im_start|>{prompt}<|im_end|>", ""

    def prepare_image(self, data: bytes) -> PreparedImage:
        """An edit's input image file -> its pixels and patches (`EditImage`)."""
        import io

        from PIL import Image

        try:
            image = Image.open(io.BytesIO(data))
            image.load()
        except Exception as exc:
            raise PromptError("image", f"the image to edit is not an image Pillow reads: {exc}") from None
        images = BagelImages()
        return EditImage(images.vae_pixels(image), "", "", images.preprocess(image))

    def _edit_rows(self, ids: list[int], image: PreparedImage, height: int, width: int) -> tuple[list[int], dict]:
        """An edit's rows (module docstring) and its tensors; a `size` other than its image's
        is refused."""
        if not isinstance(image, EditImage):
            raise PromptError("image", "an edit's image must come through prepare_image")
        if image.pixels.shape[1:] != (height, width):
            raise PromptError("size", f"an edit is its image's size {image.pixels.shape[2]}x{image.pixels.shape[1]}, "
                                      f"got {width}x{height}")
        latent = (height // SPATIAL) * (width // SPATIAL)
        vit = image.patches.shape[0] * image.patches.shape[1]
        start, end = self.tags
        rows = [start] + [start] * latent + [end, start] + [start] * vit + [end] + ids + ids
        tensors = {"vae_pixels": np.asarray(image.pixels, dtype=np.float32),
                   "vit_patches": np.asarray(image.patches, dtype=np.float32),
                   "edit_text": np.asarray([len(ids)], dtype=np.int64)}
        return rows, tensors

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        o = request.options
        ids = request.token_ids
        steps = int_option(o, "num_inference_steps", 50)
        if steps < 2 or steps > MAX_STEPS:
            raise PromptError("num_inference_steps", f"num_inference_steps must be from 2 to {MAX_STEPS} (BAGEL's "
                                                     f"timesteps include both ends), got {steps}")
        guidance = guidance_option(o, 4.0)
        height, width = int_option(o, "height", 1024), int_option(o, "width", 1024)
        self.check_size(width, height, int_option(o, "num_frames", 1))
        image_guidance = o.get("image_guidance_scale", IMAGE_GUIDANCE)
        if not isinstance(image_guidance, int | float) or isinstance(image_guidance, bool):
            raise PromptError("image_guidance_scale", "image_guidance_scale must be a number")
        extra: dict[str, np.ndarray] = {}
        if len(request.images) > 1:
            raise PromptError("image", f"BAGEL edits one image at a time, got {len(request.images)}")
        if request.images:
            ids, extra = self._edit_rows(ids, request.images[0], height, width)
        gen = [int_option(o, "seed", 0), int_option(o, "sample", 0), steps, height, width, 1, len(ids),
               int(float(guidance) > 1.0)]
        tensors = {"input_ids": np.asarray(ids, dtype=np.int32), "gen": np.asarray(gen, dtype=np.int64),
                   "guidance": np.asarray([float(guidance), float(image_guidance)], dtype=np.float64), **extra}
        layout = LabelLayout(spans=(Span.rows(len(ids)),))
        return ProcessPromptOutput(tensors, {self.label_name: layout}, {"prompt_len": len(ids)})

    def warmup_request(self, n: int) -> PromptRequest:
        """The smallest image, two steps, guidance on: the real path, whole."""
        return PromptRequest(self.warmup_ids(3), options={"num_inference_steps": 2, "guidance_scale": 2.0,
                                                          "height": SPATIAL, "width": SPATIAL, "seed": 0})
