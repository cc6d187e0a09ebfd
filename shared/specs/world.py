"""World models (V-JEPA 2-AC: `VJEPA2ACWorldModel`): a context clip, actions and states in,
the predicted embeddings of the next frames out (`POST /v1/world/rollout`).

The served folder (what a user has; README "World models"): `config.json` naming the
architecture and the two networks' sizes (`encoder`: the video ViT's `img_size`,
`patch_size`, `tubelet_size`, `embed_dim`, `depth`, `num_heads`, `mlp_ratio`, `use_silu`,
`wide_silu`; `predictor`: `VisionTransformerPredictorAC`'s `predictor_embed_dim`, `depth`,
`num_heads`, `mlp_ratio`, `num_frames`, `action_embed_dim`, `use_silu`, `wide_silu`) and
`model.safetensors` whose keys are `encoder.<name>` and `predictor.<name>`, the names of the
`cc-vjepa2` modules' state dicts (`vjepa2.models.vision_transformer.VisionTransformer`,
`vjepa2.models.ac_predictor.VisionTransformerPredictorAC`). `convert_meta_checkpoint` turns
Meta's `.pt` (its `encoder`/`target_encoder` and `predictor` state dicts) into one.

A request is one rollout as Meta's training code runs it (app/vjepa_droid/train.py,
`forward_target` / `forward_predictions`): each context frame encoded as its own tubelet
(the frame twice), the tokens layer-normed; step k runs the predictor over every frame so
far (the context's, then the k predicted), each frame's tokens after its action and state
tokens, frame-block causal, layer-norms its output and keeps the last frame's tokens. So
the actions and states have a row per context frame and per step but the last
(frames + steps - 1 rows). Layout: label "frames" in pool "kv", a rows span of every
frame the predictor takes ((frames + steps - 1) x (tokens per frame + 2) rows: each
frame's action and state tokens, then its patches), whose K/V the worker writes once per
frame as the rollout goes (the mask is frame-block causal, so they never change); the
last predicted frame is never fed back, so nothing grows past the span. The loop `rollout_loop` is
capped at the predictor's frames (`num_frames // tubelet_size`).

The clip's content key (sha256 of its frames' bytes and the preprocessing) travels as the
tensor `clip_key` (32 bytes): the worker encodes a clip once per key (runners/world.py).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from shared.deferred import deferred
from shared.layout import KVLabel, LabelLayout, ProcessPromptOutput, Span
from shared.specs.base import DeploymentError, InStepLoopSpec, PreparedImage, PromptError, PromptRequest

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

WORLD_ARCHITECTURES = ("VJEPA2ACWorldModel",)
#: ImageNet's statistics: V-JEPA 2's video transforms normalize with them
MEAN = (0.485, 0.456, 0.406)  # as float32 where used (numpy is imported at first use)
STD = (0.229, 0.224, 0.225)


def _int(section: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = section.get(key, default)
    if value is None:
        raise DeploymentError(f"config.json's {where} lacks {key!r}")
    return int(value)


class WorldSpec(InStepLoopSpec):
    """V-JEPA 2-AC: the frames label, the rollout loop, the images' size."""

    engine = "world"
    task = "rollout"
    whole_prompts = True
    pool = "kv"
    label_name = "frames"
    rollout_loop = in_step_loop = "rollout_loop"

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        enc, pred = config.get("encoder") or {}, config.get("predictor") or {}
        self.config = dict(config)
        self.page_size, self.dtype = page_size, dtype
        self.img_size = _int(enc, "img_size", "encoder", 256)
        self.patch_size = _int(enc, "patch_size", "encoder", 16)
        self.embed_dim = _int(enc, "embed_dim", "encoder")
        self.num_layers = _int(pred, "depth", "predictor")
        self.heads = _int(pred, "num_heads", "predictor")
        width = _int(pred, "predictor_embed_dim", "predictor")
        if width % self.heads:
            raise DeploymentError(f"predictor_embed_dim {width} is not a multiple of num_heads {self.heads}")
        self.kv_heads, self.head_dim = self.heads, width // self.heads
        self.action_dim = _int(pred, "action_embed_dim", "predictor", 7)
        if pred.get("use_extrinsics"):
            raise DeploymentError("predictor.use_extrinsics is not served (no extrinsics field in a rollout)")
        self.max_frames = _int(pred, "num_frames", "predictor", 64) // _int(enc, "tubelet_size", "encoder", 2)
        self.grid = self.img_size // self.patch_size
        self.tokens_per_frame = self.grid * self.grid
        self.world_shape = (self.tokens_per_frame, self.embed_dim)
        self.rows_per_frame = self.tokens_per_frame + 2  # the action's and the state's tokens first
        most = self.max_frames * self.rows_per_frame
        self.max_seq_len = min(most, max_seq_len) if max_seq_len else most
        self.vocab_size = 1
        self._label = KVLabel(self.label_name, self.pool, keys=False)

    def load_folder(self, path: str | Path) -> Self:
        return self

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return (self._label,)

    @property
    def loop_cap(self) -> int:
        return self.max_frames  # (the rollout runs a step a worker step: runners/loop_steps.py)

    # -- a request -------------------------------------------------------------------

    def prepare_image(self, data: bytes) -> PreparedImage:
        """A frame as the encoder takes it: RGB, resized to img_size x img_size (bilinear),
        scaled to [0, 1], normalized by ImageNet's mean and std; [1, 3, H, W] float32."""
        from PIL import Image, UnidentifiedImageError

        try:
            opened = Image.open(io.BytesIO(data))
            opened.load()
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise PromptError("frames", f"not an image file: {exc}") from exc
        img = opened.convert("RGB")
        if img.size != (self.img_size, self.img_size):
            img = img.resize((self.img_size, self.img_size), Image.Resampling.BILINEAR)
        mean, std = np.asarray(MEAN, dtype=np.float32), np.asarray(STD, dtype=np.float32)
        pixels = (np.asarray(img, dtype=np.float32) / np.float32(255.0) - mean) / std
        key = hashlib.sha256(data).hexdigest()
        return PreparedImage(pixels.transpose(2, 0, 1)[None].astype(np.float32), "", key)

    def clip_key(self, frames: tuple[PreparedImage, ...]) -> str:
        """The content key of a context clip: its frames' bytes (as hashed by
        `prepare_image`) and the preprocessing that turns them into pixels."""
        h = hashlib.sha256(f"vjepa2-ac:{self.img_size}:bilinear:imagenet".encode())
        for frame in frames:
            h.update(frame.key.encode())
        return h.hexdigest()

    def rows(self, frames: int, steps: int) -> int:
        """The predictor's largest input for a rollout: frames + steps - 1 frames of rows."""
        return (frames + steps - 1) * self.rows_per_frame

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        frames = len(request.images)
        steps = request.options.get("steps")
        if not frames:
            raise PromptError("frames", "frames must hold at least one image (the context clip)")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise PromptError("steps", "steps must be an integer >= 1")
        if frames + steps - 1 > self.max_frames:
            raise PromptError("steps", f"frames + steps - 1 must be at most the predictor's {self.max_frames} "
                                       f"frames, got {frames} + {steps} - 1")
        want = frames + steps - 1
        tensors: dict[str, np.ndarray] = {"pixel_values": np.concatenate([f.pixels for f in request.images]),
                                          "steps": np.asarray([steps], dtype=np.int64),
                                          "clip_key": np.frombuffer(bytes.fromhex(self.clip_key(request.images)),
                                                                    dtype=np.uint8).copy()}
        for name in ("actions", "states"):
            values = request.floats.get(name, ())
            got_rows = request.options.get(f"{name}_rows")
            if got_rows != want or len(values) != want * self.action_dim:
                width = len(values) // got_rows if isinstance(got_rows, int) and got_rows > 0 else 0
                raise PromptError(name, f"{name} must be {want} rows (frames + steps - 1) of {self.action_dim} "
                                        f"values, got {got_rows} x {width}")
            tensors[name] = np.asarray(values, dtype=np.float32).reshape(want, self.action_dim)
        n = self.rows(frames, steps)
        tensors["input_ids"] = np.zeros(n, dtype=np.int32)
        layout = LabelLayout(spans=(Span.rows(n),))
        return ProcessPromptOutput(tensors, {self.label_name: layout}, {"prompt_len": n})

    def warmup_request(self, n: int) -> PromptRequest:
        """One black frame, one step, zero actions and states: the real path, whole."""
        pixels = np.zeros((1, 3, self.img_size, self.img_size), dtype=np.float32)
        zeros = (0.0,) * self.action_dim
        return PromptRequest([], images=(PreparedImage(pixels, "", "warmup"),),
                             floats={"actions": zeros, "states": zeros},
                             options={"steps": 1, "actions_rows": 1, "states_rows": 1})
