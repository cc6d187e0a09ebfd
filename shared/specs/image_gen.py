"""What the image and video routes and the data worker read of a spec that generates images
(Cosmos 3, BAGEL's `--task image`): `ImageGenSpec`, the base both specs share, so they
dispatch on it rather than on one family's class.

Such a spec's request is a text prompt (and a negative one, for guidance) rendered by
`prompt_texts`, sizes checked by `check_size`, then `process_prompt` over the tokenized
texts and the options; its one label "text" in pool "kv" holds the prompt's rows, which the
worker writes once and every denoising step reads; the loop `denoise_loop` runs inside the
step that takes the request. The tensor `gen` carries `GEN_FIELDS` in order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shared.layout import KVLabel
from shared.specs.base import InStepLoopSpec, PromptError

#: the tensor `gen`'s fields, in order
GEN_FIELDS = ("seed", "sample", "steps", "height", "width", "num_frames", "cond_rows", "cfg")


def int_option(options: Mapping[str, Any], name: str, default: int) -> int:
    """Option `name` as an integer (`default` when absent); a PromptError naming it otherwise."""
    value = options.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise PromptError(name, f"{name} must be an integer")
    return value


def guidance_option(options: Mapping[str, Any], default: float) -> float:
    """Option `guidance_scale` (`default` when absent); a PromptError naming it unless finite."""
    value = options.get("guidance_scale", default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise PromptError("guidance_scale", "guidance_scale must be a finite number")
    return float(value)


class ImageGenSpec(InStepLoopSpec):
    """An image (or video) generating spec: the label, pool and loop, and what the routes
    check before queueing (`spatial`, `temporal`, `max_side`, `max_frames`, `loop_cap`)."""

    task = "image"
    whole_prompts = True
    pool = "kv"
    label_name = "text"
    denoise_loop = in_step_loop = "denoise_loop"
    #: pixels per latent row, frames per latent frame (set by the subclass)
    spatial: int
    temporal: int
    #: the largest side in pixels and the most frames the model makes
    max_side: int
    max_frames: int
    #: the resize an image to edit takes (`POST /v1/images/edits`; max side, min side,
    #: stride): empty where the model makes images from text only
    edit_resize: tuple[int, ...] = ()
    #: the ids the data worker appends to each tokenized prompt text
    suffix_ids: list[int]
    _label: KVLabel

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return (self._label,)

    def check_size(self, width: int, height: int, num_frames: int) -> None:
        """PromptError naming `size` or `num_frames` for what the model cannot make."""
        raise NotImplementedError

    def prompt_texts(self, prompt: str, negative: str | None, height: int, width: int,
                     num_frames: int, fps: float = 24.0) -> tuple[str, str]:
        """(the conditional prompt's text, the unconditional one's), before tokenizing."""
        raise NotImplementedError
