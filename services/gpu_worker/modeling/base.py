"""What the gpu worker asks of a torch model: one base class, every hook a method.

`services/gpu_worker/weights.py` builds a model as

    with torch.device("meta"):
        model = cls(config)                 # config.json's dict (or the GGUF's)
    if not cls.assigns_weights:
        model = model.to_empty(device="cpu")
    model.load_weights(state)               # the checkpoint's tensors, HF names
    model.reset_buffers()
    model = model.to(dtype).to(device).eval()
    model.prepare()

and the worker then calls `warm_gemms(...)` once after its warm-up request. Each hook has
a default here (a no-op, or 0), so the loader calls methods and never probes a model for
them; a family overrides the ones it needs.

Which forward a model has depends on the step loop its spec names (`ModelSpec.engine`):
a `DecoderModel` for "decoder", an `EncoderDecoderModel` (which adds `encode` and
`write_cross`) for "encoder_decoder"; `ENGINE_MODELS` ties the two.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from services.gpu_worker.attention import AttnMetadata


class ModelBase(nn.Module, metaclass=ABCMeta):
    #: True when `load_weights` assigns the checkpoint's tensors to the parameters (no
    #: allocation, no copy), so the model stays on the meta device until then; False when
    #: it copies into real tensors, which the loader allocates first (`to_empty`)
    assigns_weights: ClassVar[bool] = False
    #: checkpoint tensors under these prefixes are never read (parts of a release the model
    #: does not serve: Qwen3-Omni's talker and Code2Wav while it serves text out)
    skip_prefixes: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Take the checkpoint's state dict (Hugging Face names); raise ValueError when it
        does not match the model."""

    def reset_buffers(self) -> None:
        """(Re)compute non-persistent buffers (tables a checkpoint does not hold, e.g. RoPE's
        cos / sin), once the weights are real: the model was built on the meta device."""

    def prepare(self) -> None:
        """Once the weights are in place, in their dtype, on their device: fuse, pack or
        otherwise rearrange them for serving."""

    def warm_gemms(self, max_rows: int, max_sample_rows: int) -> int:
        """Build every GEMM kernel a step of up to `max_rows` rows (`max_sample_rows` of
        them sampled) can need, so memory does not grow under load; returns how many."""
        return 0


class DecoderModel(ModelBase):
    """`forward(input_ids [T], positions [T], kv_caches, metas, sample_rows)` -> logits
    [len(sample_rows), vocab]: `kv_caches[i]` and `metas[i]` are layer i's pool tensor and
    its label's metadata; only the rows that sample go through the LM head."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttnMetadata], sample_rows: torch.Tensor) -> torch.Tensor: ...


class VisionDecoderModel(DecoderModel):
    """A decoder LM whose prompts hold images: `encode_images` turns a request's tiles
    into the rows that replace its image tokens' embeddings, which `forward` takes as
    `embeds` (row indices of the step, their values)."""

    @abstractmethod
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles [N, C, H, W] -> their rows [N * rows per tile, hidden], in order."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttnMetadata], sample_rows: torch.Tensor,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor: ...


class GridVisionDecoderModel(DecoderModel):
    """A decoder LM whose images are grids of patches of any size with multimodal RoPE
    (Qwen2.5-VL): `encode_images` turns whole images (their patches and grids) into the
    rows that replace their image tokens' embeddings; `forward` takes positions [T] or
    [3, T] (temporal, height, width per row) and those rows as `embeds`."""

    @abstractmethod
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Patches [sum(t * h * w), patch dim] of images of grids [N, 3] -> their rows
        [sum(t * h * w) / merge^2, hidden], image after image."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                metas: list[AttnMetadata], sample_rows: torch.Tensor,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor: ...


class TowerAndLM(GridVisionDecoderModel):
    """A vision tower (`vision`: patches and grids -> rows) beside a decoder LM (`lm`) that
    holds the step's state: the LM's buffers, preparation and warm-up are the model's
    (Qwen2.5-VL, Qwen3.5, Qwen3-Omni's thinker)."""

    lm: Any
    vision: nn.Module

    def reset_buffers(self) -> None:
        self.lm.reset_buffers()

    def prepare(self) -> None:
        self.lm.prepare()

    def warm_gemms(self, max_rows: int, max_sample_rows: int) -> int:
        return self.lm.warm_gemms(max_rows, max_sample_rows)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.vision(pixel_values, grid_thw)


class EncoderDecoderModel(ModelBase):
    """An encoder run once per request (at admission), whose output `write_cross` puts into
    the cross label's pages, and a decoder over paged KV: `forward(input_ids [T],
    positions [T], self_caches, self_meta, cross_caches, cross_meta, sample_rows)` ->
    logits [len(sample_rows), vocab]."""

    @abstractmethod
    def encode(self, input_features: torch.Tensor) -> torch.Tensor:
        """Input features [B, ...] -> encoder rows [B, frames, d_model]."""

    @abstractmethod
    def write_cross(self, encoder_rows: torch.Tensor, cross_caches: list[torch.Tensor],
                    cross_meta: AttnMetadata) -> None:
        """Each decoder layer's cross K/V of the encoder rows, into the pages `cross_meta` names."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, self_caches: list[torch.Tensor],
                self_meta: AttnMetadata, cross_caches: list[torch.Tensor], cross_meta: AttnMetadata,
                sample_rows: torch.Tensor) -> torch.Tensor: ...


class PoolingModel(ModelBase):
    """An encoder whose rows are pooled into one vector per request, with no decode loop:
    `forward(input_ids [T], positions [T], token_types [T], kv_caches, metas)` -> hidden
    states [T, hidden] (layer i's pool tensor and metadata as a decoder's); `score` maps
    pooled rows to a classifier's logits (cross-encoders)."""

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_types: torch.Tensor,
                kv_caches: list[torch.Tensor], metas: list[AttnMetadata]) -> torch.Tensor: ...

    def score(self, pooled: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} has no classifier head")


class SpeechCodesModel(ModelBase):
    """A speech model that writes several codes a frame (CSM): a backbone over the
    prompt's and the frames' rows that samples each frame's first code, and a depth decoder
    that writes the frame's other codes one step at a time on its own paged label; the
    runner (runners/csm.py) drives both, so there is no single forward."""

    @abstractmethod
    def backbone(self, text_ids: torch.Tensor, text_rows: torch.Tensor, frames: torch.Tensor,
                 frame_rows: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                 meta: AttnMetadata) -> torch.Tensor: ...

    @abstractmethod
    def depth(self, inputs: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor], meta: AttnMetadata,
              head_rows: torch.Tensor, head: int) -> torch.Tensor: ...


class PolicyModel(ModelBase):
    """A robot policy (Pi0): `encode_images` turns a request's cameras into rows of its
    prefix, `prefix` writes every layer's K/V of the prefix rows into their pages (once per
    request), and `velocity` is one flow-matching step of the action expert over a batch of
    requests' chunks, reading each layer's prefix K/V as gathered from the pages; the
    runner (runners/policy.py) drives the loop of steps. `state_row`: the state is a row
    of the expert's input before the chunk (Pi0), else it is in the prompt (Pi0.5)."""

    state_row: ClassVar[bool] = True

    @abstractmethod
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def prefix(self, input_ids: torch.Tensor, positions: torch.Tensor, image_rows: torch.Tensor,
               image_at: torch.Tensor, kv_caches: list[torch.Tensor], metas: list[AttnMetadata]) -> None: ...

    @abstractmethod
    def embed_state(self, state: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def velocity(self, state_rows: torch.Tensor, noise: torch.Tensor, time: torch.Tensor,
                 prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], prefix_mask: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor: ...


class MultiCodeModel(ModelBase):
    """A speech model whose one stack writes every codebook of a frame at once (Higgs Audio
    v2): `backbone` over a step's text and frame rows, `code_logits` on the rows that
    sample; the runner (runners/higgs.py) drives both."""

    @abstractmethod
    def backbone(self, text_ids: torch.Tensor, text_rows: torch.Tensor, frames: torch.Tensor,
                 frame_rows: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                 meta: AttnMetadata) -> torch.Tensor: ...

    @abstractmethod
    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class GuidedSpeechModel(ModelBase):
    """A speech-token LM over input embeddings with classifier-free guidance (Chatterbox's
    T3): the runner (runners/chatterbox.py) makes each row's embedding (`cond_rows`,
    `text_rows`, `speech_rows`), runs both row sets through `backbone` and combines the
    two `speech_logits` rows of a request."""

    @abstractmethod
    def backbone(self, x: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                 meta: AttnMetadata) -> torch.Tensor: ...

    @abstractmethod
    def speech_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class WorldModel(ModelBase):
    """A world model (V-JEPA 2-AC): `encode` turns frames into their tokens (once per clip;
    the runner caches them by the clip's content key), `predict` is one pass of the
    action-conditioned predictor over a batch of rollouts' new frames (all from frame
    `start`), reading the K/V of their earlier frames (`past`, per layer) and returning the
    new rows' K/V with its output; the runner (runners/world.py) steps the rollouts and
    keeps their K/V in the pages."""

    @abstractmethod
    def encode(self, pixels: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def predict(self, z: torch.Tensor, actions: torch.Tensor, states: torch.Tensor, start: int,
                past: list[tuple[torch.Tensor, torch.Tensor]] | None
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]: ...


class DiffusionModel(ModelBase):
    """A text-to-image/video diffusion model (Cosmos 3): `text_kv` is a prompt's K/V per
    layer (once per prompt: the runner keeps them in its pages), `velocity` one denoising
    forward of every row set of a step together (each reading its prompt's K/V), `decode`
    the latents to frames; the runner (runners/diffusion.py) steps the loop and the
    scheduler. `components`: the pipeline folders whose weights it takes (prefixed by name)."""

    components: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def text_kv(self, ids: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    @abstractmethod
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def velocity(self, tokens: torch.Tensor, t: torch.Tensor, ropes: list[tuple[torch.Tensor, torch.Tensor]],
                 sets: list[tuple[int, int]], text: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


#: the spec's `engine` kind -> the base class its torch model must have (abstract, for
#: issubclass checks: mypy keeps `type[ModelBase]` for classes it may instantiate)
ENGINE_MODELS: dict[str, ABCMeta] = {
    "decoder": DecoderModel,
    "hybrid_decoder": DecoderModel,
    "encoder_decoder": EncoderDecoderModel,
    "pooling": PoolingModel,
    "vision_decoder": VisionDecoderModel,
    "speech_decoder": DecoderModel,
    "mrope_vision_decoder": GridVisionDecoderModel,
    "hybrid_mrope_vision_decoder": GridVisionDecoderModel,
    "omni_thinker": GridVisionDecoderModel,
    "csm_decoder": SpeechCodesModel,
    "policy": PolicyModel,
    "higgs_decoder": MultiCodeModel,
    "chatterbox_decoder": GuidedSpeechModel,
    "world": WorldModel,
    "diffusion": DiffusionModel,
}
