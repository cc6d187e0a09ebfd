"""What the vision-language models' torch modules share: loading a checkpoint into their
parts, and (the SigLIP families) handing the LM's duties to the LM.

Idefics3 / SmolVLM, Gemma 3 and Qwen2.5-VL save one state dict whose keys say by prefix
which part a tensor belongs to (each family, and each transformers version, with its own
prefixes). Every family loads it the same way (`load_vlm_weights`): the language model's
tensors renamed to `DecoderLM`'s names (`model.*`, `lm_head.*`), each vision module's
loaded strictly by its prefix, and a tensor that no part takes refused, so a renamed or
foreign checkpoint fails at load instead of serving with weights left at zero.

Idefics3 / SmolVLM and Gemma 3 are a `DecoderLM` plus a SigLIP tower and a module that
turns its patches into LM rows; `SiglipDecoderModel` is what they do alike (buffers,
warm-up and the forward pass are the LM's, plus the tower's buffers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from services.gpu_worker.attention import AttnMetadata
from services.gpu_worker.modeling.base import VisionDecoderModel
from services.gpu_worker.modeling.decoder.lm import DecoderLM, RowEmbeds
from services.gpu_worker.modeling.vision.siglip import SiglipVisionTower, load_prefixed


def load_vlm_weights(state: Mapping[str, torch.Tensor], lm: DecoderLM, *, text: tuple[str, ...],
                     head: tuple[str, ...], parts: Sequence[tuple[nn.Module, tuple[str, ...]]]) -> None:
    """Load `state` into `lm` (keys under a `text` prefix become `model.*`, under a `head`
    prefix `lm_head.*`) and each of `parts` (module, its prefixes; the modules are
    materialized on the CPU first, as they are built on the meta device), in that order.
    ValueError for a part's missing or unexpected tensor, then for a tensor under no
    prefix at all."""
    lm_state = {"model." + k: v for k, v in renamed(state, text).items()}
    lm_state.update({"lm_head." + k: v for k, v in renamed(state, head).items()})
    lm.load_weights(lm_state)
    known = text + head
    for module, prefixes in parts:
        module.to_empty(device="cpu")
        _load_part(module, state, prefixes)
        known += prefixes
    unknown = sorted(k for k in state if not k.startswith(known))
    if unknown:
        raise ValueError(f"checkpoint tensors no part of the model takes: {unknown[:5]}")


def _load_part(module: nn.Module, state: Mapping[str, torch.Tensor], prefixes: tuple[str, ...]) -> None:
    """One module's tensors, strictly. With one prefix its errors name the checkpoint's own
    keys (prefix and all); with several (a family whose files differ by version) the tensors
    are renamed first, and its errors name the module's keys."""
    if len(prefixes) == 1:
        load_prefixed(module, state, prefixes[0])
    else:
        load_prefixed(module, renamed(state, prefixes), "")


def renamed(state: Mapping[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors under the first of `prefixes` each key starts with, that prefix removed
    (list a prefix before any shorter one it starts with)."""
    out = {}
    for key, value in state.items():
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is not None:
            out[key[len(prefix):]] = value
    return out


class SiglipDecoderModel(VisionDecoderModel):
    """A `DecoderLM` (`lm`) with a SigLIP tower (`vision`): a subclass builds both (and its
    patches-to-rows module) and implements `load_weights` and `encode_images`; the rest is
    the LM's, which runs on the embeddings with the image rows already in place."""

    assigns_weights = True
    lm: DecoderLM
    vision: SiglipVisionTower

    def reset_buffers(self) -> None:
        self.lm.reset_buffers()
        self.vision.reset_buffers()

    def prepare(self) -> None:
        self.lm.prepare()

    def warm_gemms(self, max_rows: int, max_sample_rows: int) -> int:
        return self.lm.warm_gemms(max_rows, max_sample_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttnMetadata], sample_rows: torch.Tensor, embeds: RowEmbeds | None = None) -> torch.Tensor:
        return self.lm(input_ids, positions, kv_caches, metas, sample_rows, embeds)
