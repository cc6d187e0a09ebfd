"""Vision-language models: a decoder LM whose prompt holds images (Idefics3 / SmolVLM,
Gemma 3).

An image reaches the spec as a file (the api fetched and checked it); `prepare_image`
preprocesses it exactly as the checkpoint's processor does (numpy + Pillow, no torch: this
runs in the data worker) and says what text replaces the image's placeholder; the data
worker tokenizes the expanded prompt once, whole. `process_prompt` then finds the image
tokens in the ids: each run of `image_token_id` is a `Span.rows` whose content key is the
image's hash and the run's place in it (`image_spans`), never the placeholder ids, so the
prefix cache shares an image's rows only with the same image, and the text after it is
keyed by its ids and that image together (DESIGN.md section 3). The ids between runs
(the tags around tiles, the text) are `ids` spans as a text prompt's.

The gpu worker runs the vision tower once per image at admission
(`services/gpu_worker/runners/vision.py`) and puts its rows in place of the image tokens'
embeddings when the prompt is prefilled; positions are the row count (these families'
RoPE is the text model's own), and the footprint counts every image row as a text row.

Gemma 3's image rows attend to each other both ways in prefill (transformers' token type
blocks): its spans are `bidirectional`, and the engine keeps each such run whole (never
split between prefill chunks or at a prefix-cache hit) and unmasks it in attention.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, Self, TypeVar

from shared.deferred import deferred
from shared.layout import LabelLayout, ProcessPromptOutput, Span
from shared.specs.base import PreparedImage, PromptError, PromptRequest
from shared.specs.decoder_lm import DecoderLMSpec
from shared.vision.gemma3 import Gemma3Images
from shared.vision.idefics3 import Idefics3Images
from shared.vision.qwen2_vl import Qwen2VLImages

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

IDEFICS3_ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
GEMMA3_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


class ImageSettings(Protocol):
    """What `VisionLMSpec` reads of a family's image settings (`shared.vision.*`)."""

    @property
    def placeholder(self) -> str: ...

    def settings_key(self) -> str: ...


ImagesT = TypeVar("ImagesT", bound=ImageSettings)


def image_spans(ids: list[int], image_token_id: int, images: tuple[PreparedImage, ...],
                rows_per_tile: int, bidirectional: bool = False) -> tuple[Span, ...]:
    """The prompt's spans: `ids` spans for text, a keyed `rows` span per run of image
    tokens. Each image brings `tiles * rows_per_tile` rows, given to the runs in prompt
    order; a run keeps to one image (split at an image's end) and its key names the image
    and where in the image it starts. `bidirectional`: each run's rows attend to each other
    both ways in prefill (`Span.bidirectional`: Gemma 3). `PromptError` when the ids hold
    more or fewer image tokens than the images make."""
    want = [img.pixels.shape[0] * rows_per_tile for img in images]
    have = sum(1 for t in ids if t == image_token_id)
    if have != sum(want):
        param = "prompt" if images else "input_ids"
        raise PromptError(param, f"the prompt holds {have} image tokens (id {image_token_id}); "
                                 f"its {len(images)} image(s) make {sum(want)}")
    spans: list[Span] = []
    text: list[int] = []
    image, used = 0, 0  # the image the next image row belongs to, and its rows used so far
    i = 0
    while i < len(ids):
        if ids[i] != image_token_id:
            text.append(ids[i])
            i += 1
            continue
        if text:
            spans.append(Span.ids(text))
            text = []
        run = 0
        while i + run < len(ids) and ids[i + run] == image_token_id and used + run < want[image]:
            run += 1
        spans.append(Span.rows(run, f"{images[image].key}:{used}", bidirectional=bidirectional))
        i, used = i + run, used + run
        if used == want[image]:
            image, used = image + 1, 0
    if text:
        spans.append(Span.ids(text))
    return tuple(spans)


class VisionLMSpec(DecoderLMSpec, Generic[ImagesT]):
    """A decoder LM with a vision tower: what every family of this module shares. A
    family sets `image_token_id`, `rows_per_tile`, `images = None` and implements
    `_read_images` (its processor settings from the folder) and `_preprocess` (file ->
    pixels, placeholder text); `load_folder` sets `image_placeholder` from the settings."""

    engine = "vision_decoder"
    int8_kv = False  # bidirectional image blocks: the torch path only, not checked on int8 pages
    image_token_id: int
    rows_per_tile: int
    #: the processor's image settings, None until `load_folder` read them
    images: ImagesT | None
    #: the rows of one run of image tokens attend to each other both ways in prefill (Gemma
    #: 3's image blocks): their spans say so (`Span.bidirectional`), and the engine never
    #: splits such a run between prefill chunks or at a prefix-cache hit
    bidirectional_images: bool = False

    def parameter_counts(self) -> tuple[int, int] | None:
        """Not counted: the text config says nothing of the vision tower's parameters."""
        return None

    def prepare_image(self, data: bytes) -> PreparedImage:
        from PIL import Image, ImageOps, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as opened:
                image = ImageOps.exif_transpose(opened)  # as transformers' load_image
                image.load()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise PromptError("images", f"the file could not be decoded as an image ({exc})") from exc
        pixels, text = self._preprocess(image)
        key = hashlib.sha256(self.pixel_settings().encode() + b"\0" + data).hexdigest()
        return PreparedImage(np.ascontiguousarray(pixels, dtype=np.float32), text, key)

    def load_folder(self, path: str | Path) -> Self:
        """The processor's settings (processor_config.json or preprocessor_config.json, the
        tokenizer's image tokens): without them the model's images cannot be made as it was
        trained on them."""
        self.images = self._read_images(Path(path))
        self._check_images(self.images)
        self.image_placeholder = self.images.placeholder
        return self

    def _read_images(self, folder: Path) -> ImagesT:
        """The family's image settings from its model folder."""
        raise NotImplementedError

    def _check_images(self, images: ImagesT) -> None:
        """ValueError where the settings disagree with the model (nothing to check by default)."""

    def _check_rows(self, name: str, saved: int, per: str) -> None:
        """The processor's image token count (`name`) must be the rows the model makes `per`
        tile or image, or every prompt would hold the wrong number of image tokens."""
        if saved != self.rows_per_tile:
            raise ValueError(f"the processor's {name} {saved} != the {self.rows_per_tile} rows {per}")

    def _settings(self) -> ImagesT:
        """The loaded settings; `PromptError` before `load_folder` (no image can be made)."""
        if self.images is None:
            raise PromptError("images", "the model folder's processor settings were not loaded")
        return self.images

    def _preprocess(self, image: Any) -> tuple[np.ndarray, str]:
        raise NotImplementedError

    def pixel_settings(self) -> str:
        """Every setting that changes an image's pixels or rows (part of its content key)."""
        return self._settings().settings_key()

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        ids = request.token_ids
        spans = image_spans(ids, self.image_token_id, request.images, self.rows_per_tile, self.bidirectional_images)
        # a windowed label (never keyed) declares the prompt as one span: its footprint walk
        # releases pages behind the window between spans, but a prefill chunk may commit
        # several spans at once and hold all their pages (the text model's layout)
        whole = (Span.rows(len(ids)),)
        layouts = {lab.name: LabelLayout(spans=spans if lab.window is None else whole, growth={self.decode_loop: 1})
                   for lab in self.kv_labels}
        tensors: dict[str, np.ndarray] = {"input_ids": np.asarray(ids, dtype=np.int32)}
        if request.images:
            tensors["pixel_values"] = np.concatenate([img.pixels for img in request.images])
        return ProcessPromptOutput(tensors, layouts, {"prompt_len": len(ids)})


def text_config(config: Mapping[str, Any], model_type: str = "llama", tied: bool = False) -> dict[str, Any]:
    """The language model's config.json dict inside a VLM's: its `text_config`, with the
    head tying the checkpoint declares at the top (where its `lm_head` is); `model_type`
    and `tied` are the family's defaults where neither says."""
    text = dict(config["text_config"])
    text.setdefault("model_type", model_type)
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", tied)))
    return text


def gemma3_text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's language model config: a Gemma 3 text model, tied unless it says not."""
    return text_config(config, model_type="gemma3_text", tied=True)


class Idefics3Spec(VisionLMSpec[Idefics3Images]):
    """Idefics3 and SmolVLM: SigLIP tiles, pixel shuffle and a linear connector; a Llama
    text model. An image is split into tiles of `max_image_size` plus the whole image
    scaled down (`shared.vision.idefics3`); each tile is one run of `image_seq_len`
    image tokens between `<fake_token_around_image><row_i_col_j>` tags."""

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        super().__init__(text_config(config), page_size=page_size, max_seq_len=max_seq_len, dtype=dtype)
        self.vlm_config = dict(config)
        vision = config["vision_config"]
        self.scale_factor = int(config.get("scale_factor", 2))
        self.image_token_id = int(config["image_token_id"])
        patches = (int(vision["image_size"]) // int(vision["patch_size"])) ** 2
        self.rows_per_tile = patches // self.scale_factor**2
        self.images = None

    def _read_images(self, folder: Path) -> Idefics3Images:
        return Idefics3Images.from_folder(folder)

    def _check_images(self, images: Idefics3Images) -> None:
        self._check_rows("image_seq_len", images.image_seq_len, "the vision tower makes per tile")

    def _preprocess(self, image: Any) -> tuple[np.ndarray, str]:
        settings = self._settings()
        pixels, rows, cols = settings.preprocess(image)
        return pixels, settings.prompt(rows, cols)


class Gemma3VisionSpec(VisionLMSpec[Gemma3Images]):
    """Gemma 3 with images: a SigLIP tower whose patches are average-pooled to
    `mm_tokens_per_image` rows, RMS-normed and projected; the Gemma 3 text model (its
    sliding-window label as for text). Each image is one tile, resized to the tower's
    size (`shared.vision.gemma3`), and one run of `mm_tokens_per_image` soft tokens between
    `<start_of_image>` and `<end_of_image>`, whose rows attend to each other both ways."""

    bidirectional_images = True

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        super().__init__(gemma3_text_config(config), page_size=page_size, max_seq_len=max_seq_len, dtype=dtype)
        self.vlm_config = dict(config)
        self.image_token_id = gemma3_image_token_id(config)
        self.rows_per_tile = int(config.get("mm_tokens_per_image", 256))
        self.images = None

    def _read_images(self, folder: Path) -> Gemma3Images:
        return Gemma3Images.from_folder(folder)

    def _check_images(self, images: Gemma3Images) -> None:
        self._check_rows("image_seq_length", images.image_seq_length, "the model makes per image")

    def _preprocess(self, image: Any) -> tuple[np.ndarray, str]:
        settings = self._settings()
        return settings.preprocess(image), settings.prompt()


def gemma3_image_token_id(config: Mapping[str, Any]) -> int:
    """The soft token's id: config.json says `image_token_index` (Gemma3Config maps
    `image_token_id` to it); either name is read."""
    for name in ("image_token_index", "image_token_id"):
        if config.get(name) is not None:
            return int(config[name])
    return 262_144  # Gemma3Config's default




# -- Qwen2.5-VL: one image = one variable grid of rows, M-RoPE positions -------------------

QWEN25_VL_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)
#: top-level keys of a Qwen2.5-VL config.json that are not its language model's
QWEN25_VL_KEYS = frozenset({"architectures", "model_type", "text_config", "vision_config", "image_token_id",
                            "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id"})


class Qwen25VLSpec(VisionLMSpec[Qwen2VLImages]):
    """Qwen2.5-VL: a ViT with 2-D RoPE and windowed attention over an image's native-resolution
    grid of patches, merged 2 x 2 into one row each; a Qwen2 text model with multimodal RoPE.

    Each image is one run of `<|image_pad|>` whose length follows its grid (t * h * w /
    merge_size^2), so `PreparedImage.pixels` keeps the grid in its shape: [t, h / merge,
    w / merge, merge^2, C * temporal_patch * patch^2], one entry per image token (the
    processor's patch order, a view of `shared.vision.qwen2_vl`'s flattened patches).

    Positions are not the row count: every prompt row has three (temporal, height, width),
    as transformers' `get_rope_index` computes them: text rows all three equal and
    continuing; an image's rows (t, h, w) of its merged grid, offset by the position it
    starts at; the text after an image continues from the image's largest position + 1.
    `process_prompt` computes them here (numpy), as tensor "mrope_positions" int64 [3, P],
    and the decode offset `mrope_delta` (metadata: a generated row r has position r +
    delta in all three), so the gpu worker only looks them up (`mrope_runner.py`)."""

    engine = "mrope_vision_decoder"
    metadata_keys = frozenset({"prompt_len", "mrope_delta"})
    #: rows per entry of `pixels`' flattened grid (each entry is one image token's patches)
    rows_per_tile = 1

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        text, section = qwen25_vl_text_config(config)
        super().__init__(text, page_size=page_size, max_seq_len=max_seq_len, dtype=dtype)
        if sum(section) * 2 != self.head_dim:
            raise ValueError(f"mrope_section {list(section)} must sum to head_dim / 2 = {self.head_dim // 2}")
        self.vlm_config = dict(config)
        self.mrope_section = section
        vision = config.get("vision_config") or {}
        self.merge_size = int(vision.get("spatial_merge_size", 2))
        self.image_token_id = int(config.get("image_token_id", 151_655))  # Qwen2_5_VLConfig's default
        self.images = None

    def _read_images(self, folder: Path) -> Qwen2VLImages:
        return Qwen2VLImages.from_folder(folder)

    def _preprocess(self, image: Any) -> tuple[np.ndarray, str]:
        settings = self._settings()
        try:
            patches, grid = settings.preprocess(image)
        except ValueError as exc:  # an aspect ratio over 200, say
            raise PromptError("images", str(exc)) from exc
        t, h, w, m = *grid, self.merge_size
        return patches.reshape(t, h // m, w // m, m * m, patches.shape[-1]), settings.prompt(grid)

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        ids = request.token_ids
        # one "tile" per image token (rows_per_tile 1): each image's grid flattened, a view
        tokens = tuple(replace(img, pixels=img.pixels.reshape(-1, *img.pixels.shape[3:])) for img in request.images)
        spans = image_spans(ids, self.image_token_id, tokens, self.rows_per_tile)
        grids = [image_grid(img.pixels, self.merge_size) for img in request.images]
        positions, delta = mrope_positions(ids, self.image_token_id, grids, self.merge_size)
        layouts = {lab.name: LabelLayout(spans=spans, growth={self.decode_loop: 1}) for lab in self.kv_labels}
        tensors: dict[str, np.ndarray] = {"input_ids": np.asarray(ids, dtype=np.int32), "mrope_positions": positions}
        if request.images:
            tensors["pixel_values"] = np.concatenate([img.pixels.reshape(-1, img.pixels.shape[-1])
                                                      for img in request.images])
            tensors["image_grid_thw"] = np.asarray(grids, dtype=np.int64)
        return ProcessPromptOutput(tensors, layouts, {"prompt_len": len(ids), "mrope_delta": delta})


def qwen25_vl_text_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(the language model's config.json dict, its M-RoPE sections) from a Qwen2.5-VL
    config: its `text_config` (transformers 5) or its top level (the Hub's flat files).
    The text model is Qwen2's (q/k/v biases, no o bias, head_dim = hidden / heads as
    transformers computes it); its RoPE is plain RoPE of the same frequencies, applied to
    three position streams split by `mrope_section` (rope type "mrope" or "default")."""
    nested = config.get("text_config")
    text = dict(nested) if isinstance(nested, Mapping) else {k: v for k, v in config.items() if k not in QWEN25_VL_KEYS}
    text["model_type"] = "qwen2"
    text.pop("head_dim", None)
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    key = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
    rope = dict(text.get(key) or {})
    section = tuple(int(s) for s in rope.pop("mrope_section", (16, 24, 24)))  # transformers' default
    kind = rope.pop("type", None) or rope.get("rope_type") or "default"
    rope["rope_type"] = "default" if kind == "mrope" else kind
    text.pop("rope_scaling", None)
    text["rope_parameters"] = rope
    return text, section


def image_grid(pixels: np.ndarray, merge: int) -> tuple[int, int, int]:
    """An image's (t, h, w) in patches, from its `PreparedImage.pixels` [t, h / merge,
    w / merge, merge^2, D]."""
    t, h, w = pixels.shape[:3]
    return int(t), int(h) * merge, int(w) * merge


def mrope_positions(ids: list[int], image_token_id: int | tuple[int, ...], grids: list[tuple[int, int, int]],
                    merge: int, t_scales: list[int] | None = None) -> tuple[np.ndarray, int]:
    """(positions int64 [3, len(ids)], decode offset) as transformers' `get_rope_index`
    gives them for still images: text rows (p, p, p) continuing; each image's rows the
    meshgrid of (p + t, p + h, p + w) over its merged grid, after which p advances by
    max(h, w); the offset is the largest position + 1 - len(ids). Each image's tokens
    must be one run (as the processor writes them); two images back to back are two
    grids. `PromptError` otherwise. A video (Qwen3-Omni: `image_token_id` its image and
    video token ids, `grids` both kinds in prompt order) spaces its temporal patches by its
    `t_scales` entry (1 for a still image), and p advances past its largest position."""
    image_rows = np.isin(np.asarray(ids, dtype=np.int64), np.atleast_1d(np.asarray(image_token_id, dtype=np.int64)))
    edges = np.flatnonzero(np.diff(image_rows.astype(np.int8))) + 1
    bounds = zip(np.concatenate(([0], edges)).tolist(), np.concatenate((edges, [len(ids)])).tolist())
    parts: list[np.ndarray] = []
    pos, image = 0, 0
    for start, end in bounds:
        if start == end:
            continue
        if not image_rows[start]:
            parts.append(np.broadcast_to(np.arange(pos, pos + end - start, dtype=np.int64), (3, end - start)))
            pos += end - start
            continue
        left = end - start
        while left:
            if image == len(grids):
                raise PromptError("prompt", f"the prompt holds more image tokens than its {len(grids)} image(s) make")
            t, h, w = grids[image][0], grids[image][1] // merge, grids[image][2] // merge
            if t * h * w > left:
                raise PromptError("prompt", f"image {image}'s {t * h * w} image tokens are not one run")
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
            grid[0] *= 1 if t_scales is None else t_scales[image]
            parts.append(grid + pos)
            pos, left, image = pos + int(grid.max()) + 1, left - t * h * w, image + 1
    if not parts:
        return np.zeros((3, 0), dtype=np.int64), 0
    positions = np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.int64)
    return positions, int(positions.max()) + 1 - len(ids)
