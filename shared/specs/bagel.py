"""BAGEL (ByteDance-Seed/BAGEL-7B-MoT): understanding, image and text in, text out.

BAGEL is a mixture of transformers: one Qwen2-shaped LLM (with per-head q/k RMSNorm)
whose every projection, norm and MLP has a second copy (`*_moe_gen`) for the latent
tokens of image generation; understanding tokens (text, ViT rows) go through the first
copy only. A SigLIP ViT (NaViT: any size, learned position embeddings looked up by
`row * 70 + column`), an MLP connector and a fixed 2-D sin-cos table turn an image's
patches into LLM rows (`shared.vision.bagel` makes the patches).

The prompt is BAGEL's `InterleaveInferencer` context, not Qwen's chat format: every text
is its own `<|im_start|>text<|im_end|>` (no roles), every image `<|vision_start|>`, one row
per patch, `<|vision_end|>`, and the answer starts after a fed `<|im_start|>`
(`BAGEL_CHAT_TEMPLATE`, which replaces the Qwen template the checkpoint's tokenizer
carries; `--chat-template FILE` still overrides it).

Positions are not the row count: an image block's rows (both tags and every patch) share
one RoPE position, and the text after it continues one past it. `process_prompt` computes
them (tensor "rope_positions" int64 [P]); a generated row r has r + delta, delta = the
prompt's last position + 1 - its length. The block's rows attend to each other both ways
(the reference prefills it with `is_causal=False`): its span is one bidirectional rows
span, keyed by the image's hash, which the engine never splits between prefill chunks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.deferred import deferred
from shared.layout import LabelLayout, ProcessPromptOutput, Span
from shared.specs.base import PromptError, PromptRequest
from shared.specs.vision_lm import VisionLMSpec
from shared.vision.bagel import BagelImages

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

BAGEL_ARCHITECTURES = ("BagelForConditionalGeneration",)
#: the tokens of an image block, as BAGEL's `add_special_tokens` names them
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
#: BAGEL's context as its inferencer builds it, over OpenAI-style message parts
BAGEL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}<|im_start|>{{ message['content'] }}<|im_end|>"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}<|im_start|>{{ part['text'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>{%- endif -%}"
)


def bagel_text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The LLM's config.json dict: config.json's `llm_config` as BAGEL's app fixes it up
    (a Qwen2 with an untied head; the q/k norms are `BagelSpec`'s)."""
    llm = dict(config["llm_config"])
    llm["model_type"] = "qwen2"
    llm["tie_word_embeddings"] = False
    return llm


def bagel_chat_template(config: Mapping[str, Any]) -> str | None:
    """BAGEL's own prompt format for a BAGEL folder (None for any other model)."""
    archs = config.get("architectures") or ()
    return BAGEL_CHAT_TEMPLATE if any(a in BAGEL_ARCHITECTURES for a in archs) else None


class BagelSpec(VisionLMSpec[BagelImages]):
    """BAGEL's understanding path (module docstring). Engine "bagel_decoder": `BagelRunner`."""

    engine = "bagel_decoder"
    #: one image token per patch: the runner's grid arithmetic with no merging
    rows_per_tile = 1
    merge_size = 1
    bidirectional_images = True

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        import msgspec

        from shared.model_config import read_model_config

        cfg = msgspec.structs.replace(read_model_config(bagel_text_config(config)), qk_norm=True)
        super().__init__(cfg, page_size=page_size, max_seq_len=max_seq_len, dtype=dtype)
        self.vlm_config = dict(config)
        self.image_token_id = -1  # from the tokenizer (`load_folder`)
        self.start_id = self.end_id = -1
        self.images = None

    def load_folder(self, path: str | Path) -> BagelSpec:
        """The image tokens' ids from the tokenizer (BAGEL's `add_special_tokens` looks them up)."""
        from tokenizers import Tokenizer

        super().load_folder(path)
        tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        names = (BagelImages.image_token, VISION_START, VISION_END)
        ids = [tok.token_to_id(t) for t in names]
        found = [i for i in ids if i is not None]
        if len(found) != len(names):
            raise ValueError(f"{path}: the tokenizer lacks one of {names}")
        self.image_token_id, self.start_id, self.end_id = found
        return self

    def _read_images(self, folder: Path) -> BagelImages:
        return BagelImages()

    def _preprocess(self, image: Any) -> tuple[np.ndarray, str]:
        settings = self._settings()
        patches = settings.preprocess(image)
        return patches[None, :, :, None, :], settings.prompt(patches)  # [t, h, w, merge^2, D]

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        ids = request.token_ids
        spans, positions = self._spans(ids, request)
        layouts = {lab.name: LabelLayout(spans=spans, growth={self.decode_loop: 1}) for lab in self.kv_labels}
        tensors: dict[str, np.ndarray] = {"input_ids": np.asarray(ids, dtype=np.int32), "rope_positions": positions}
        if request.images:
            tensors["pixel_values"] = np.concatenate([img.pixels.reshape(-1, img.pixels.shape[-1])
                                                      for img in request.images])
            tensors["image_grid_thw"] = np.asarray([img.pixels.shape[:3] for img in request.images], dtype=np.int64)
        return ProcessPromptOutput(tensors, layouts, {"prompt_len": len(ids)})

    def _spans(self, ids: list[int], request: PromptRequest) -> tuple[tuple[Span, ...], np.ndarray]:
        """The prompt's spans (text `ids` spans, one bidirectional keyed rows span per image
        block: its tags and its patches) and every row's RoPE position."""
        runs = _runs(ids, self.image_token_id)
        want = [int(np.prod(img.pixels.shape[:3])) for img in request.images]
        if [n for _, n in runs] != want:
            param = "prompt" if request.images else "input_ids"
            raise PromptError(param, f"the prompt's image token runs {[n for _, n in runs]} (id "
                                     f"{self.image_token_id}) do not match its images' patches {want}")
        spans: list[Span] = []
        positions = np.empty(len(ids), dtype=np.int64)
        row, pos = 0, 0
        for (start, n), img in zip(runs, request.images):
            lo, hi = start - 1, start + n + 1  # the block: its tags around its patches
            if lo < row or hi > len(ids) or ids[lo] != self.start_id or ids[hi - 1] != self.end_id:
                raise PromptError("prompt", f"each image's tokens must sit between {VISION_START} and {VISION_END}")
            if lo > row:
                spans.append(Span.ids(ids[row:lo]))
                positions[row:lo] = np.arange(pos, pos + lo - row)
                pos += lo - row
            spans.append(Span.rows(hi - lo, img.key, bidirectional=True))
            positions[lo:hi] = pos
            row, pos = hi, pos + 1
        if row < len(ids):
            spans.append(Span.ids(ids[row:]))
            positions[row:] = np.arange(pos, pos + len(ids) - row)
        return tuple(spans), positions


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in `ids`."""
    flags = np.asarray(ids, dtype=np.int64) == token
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.astype(np.int8), [0]))))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]
