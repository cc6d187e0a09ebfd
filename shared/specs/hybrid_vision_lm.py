"""Qwen3.5 with images (`Qwen3_5ForConditionalGeneration`, the form Qwen3.5 is released in;
Qwen3.5-MoE's `Qwen3_5MoeForConditionalGeneration` alike: the same tower and processing, its
text model with experts): the hybrid text model of `HybridLMSpec` and Qwen2.5-VL's image
handling.

What it takes from each:
- `HybridLMSpec`: the config (`text_config`, read by `read_hybrid_config`), the "text" label
  over the full-attention layers' paged KV and the "state" label whose one page is a
  request's recurrent state (declared as one rows span of the prompt, never keyed), the
  pools and the state slots;
- `Qwen25VLSpec`: images. Qwen3.5's processor (`Qwen3VLProcessor`) uses Qwen2-VL's image
  processor (Qwen3.5 folders name `Qwen2VLImageProcessorFast`: 16 px patches, mean and std
  0.5), and writes one `<|image_pad|>` per merged block of the grid as Qwen2.5-VL's does; its
  `get_rope_index` gives a still image the positions Qwen2.5-VL's does (the temporal, height
  and width of its merged grid from the position it starts at, then max(h, w) further), so
  `prepare_image`, the image spans keyed by content and `mrope_positions` are Qwen2.5-VL's.
  The difference, the text RoPE's interleaved sections, is the model's
  (`services/gpu_worker/layers/interleaved_mrope.py`).

A folder without the image processor's settings (no preprocessor_config.json, nor an
`image_processor` in processor_config.json: what transformers' `save_pretrained` of the
model alone writes) is served as text: its images could not be made as the model was
trained on them, so an image is refused by name rather than guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from shared.hybrid_config import HybridConfig
from shared.layout import LabelLayout, ProcessPromptOutput, Span
from shared.specs.base import PreparedImage, PromptError, PromptRequest
from shared.specs.hybrid_lm import HybridLMSpec
from shared.specs.vision_lm import Qwen25VLSpec, VisionLMSpec
from shared.vision import common

#: Qwen3.5-MoE's image-text form is the same tower and processing over the text model with
#: experts (the gpu worker's model picks it by the config's model_type)
ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
#: Qwen3_5Config's default image token id (config.json normally says it)
IMAGE_TOKEN_ID = 248_056


class Qwen35VLSpec(HybridLMSpec, Qwen25VLSpec):
    """`HybridLMSpec` for the text model and its labels, `Qwen25VLSpec` for images (method
    resolution puts the hybrid's first; the image methods the hybrid overrides are named
    here). Engine "hybrid_mrope_vision_decoder": `HybridVisionRunner`."""

    engine = "hybrid_mrope_vision_decoder"
    metadata_keys = frozenset({"prompt_len", "mrope_delta"})
    rows_per_tile = 1

    def __init__(self, config: Mapping[str, Any] | HybridConfig, *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        super().__init__(config, page_size=page_size, max_seq_len=max_seq_len, dtype=dtype)
        raw: Mapping[str, Any] = {} if isinstance(config, HybridConfig) else config
        self.vlm_config = dict(raw)
        vision = raw.get("vision_config") or {}
        self.merge_size = int(vision.get("spatial_merge_size", 2))
        self.image_token_id = int(raw.get("image_token_id", IMAGE_TOKEN_ID))
        self.mrope_section = self.hybrid.mrope_section
        self.images = None

    def parameter_counts(self) -> tuple[int, int] | None:
        """Not counted, as every vision model's (`VisionLMSpec`): the hybrid's count is the
        text model's alone."""
        return VisionLMSpec.parameter_counts(self)

    def load_folder(self, path: str | Path) -> Self:
        """The image processor's settings where the folder has them (else text only)."""
        folder = Path(path)
        if not common.image_processor_config(folder, common.read_json(folder / "processor_config.json")):
            return self
        return VisionLMSpec.load_folder(self, folder)

    def prepare_image(self, data: bytes) -> PreparedImage:
        if self.images is None:
            raise PromptError("images", "the model folder has no image processor settings (preprocessor_config.json)"
                                        ": it is served as text only")
        return VisionLMSpec.prepare_image(self, data)

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        """Qwen2.5-VL's ids, positions and image spans for the "text" label; the "state"
        label's layout is the hybrid's (the prompt as one rows span)."""
        out = Qwen25VLSpec.process_prompt(self, request)
        layouts = dict(out.kv_layout)
        for lab in self.kv_labels:
            if lab.name == "state":
                layouts[lab.name] = LabelLayout(spans=(Span.rows(len(request.token_ids)),),
                                                growth={self.decode_loop: 1})
        return ProcessPromptOutput(out.new_input_tensors, layouts, out.metadata)
