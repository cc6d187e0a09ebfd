"""Robot policies (Pi0: `PI0ForConditionalGeneration`; Pi0.5: `PI05ForConditionalGeneration`):
cameras, a prompt and the robot's state in, a chunk of actions out.

A request is one prefix and one denoising loop (DESIGN.md section 3, "Stages" and
"Denoising loops"): the prefix (each camera's image rows, then the prompt's tokens, as
`PI0Processor` lays them out: `<image>` x rows x cameras, `<bos>`, the prompt, "\\n") is
label "prefix" in pool "kv", a rows span (no keys: its K/V depend on the pixels), written
once; the action expert then runs the `flow_loop` (cap: the config's
`num_inference_steps`, the loop's max_iters too) over chunk + 1 rows (the state's, the
chunk's) that attend to the prefix read-only and are never written to pages: no growth,
no scratch, so the footprint is the prefix's rows.

The state is normalized with the processor's dataset statistics (to [-1, 1] by the 1st and
99th percentiles where the folder has them, else (state - mean) / (std + 1e-8); float32, as
the processors' `normalize`); its length must be the statistics' (the robot's). Pi0 takes
it as the expert's first row (zero-padded to `max_state_dim`); Pi0.5 as text in the prompt
(`Pi05Spec`: "Task: ..., State: <bin> ...;\nAction: ", each value's bin of 256 over
[-1, 1]). The noise is the client's (chunk x
max_action_dim, what `sample_actions(noise=...)` takes), else drawn from a standard
normal by numpy's PCG64 seeded with the client's `seed` (reproducible), else unseeded.
The actions are the model's (`sample_actions`' output, max_action_dim wide, in the
normalized space: the processor has no inverse to apply).

Cameras: where config.json lists LeRobot's `input_features` (`observation.images.<name>`
of type VISUAL) those are the cameras the model needs, in that order, and a request must
send each (a missing or unknown one is refused naming it); otherwise the request's
cameras are taken in the order it sends them.
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
from shared.vision.common import read_json
from shared.vision.pi0 import Pi0Images

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

PI0_ARCHITECTURES = ("PI0ForConditionalGeneration",)
PI05_ARCHITECTURES = ("PI05ForConditionalGeneration",)
#: Pi0.5 writes the state into its prompt as one of this many bins of [-1, 1] per value
STATE_BINS = 256
IMAGE_TOKEN = "<image>"


class PolicySpec(InStepLoopSpec):
    """Pi0: the prefix label, the flow loop, the processor's settings."""

    engine = "policy"
    task = "act"
    whole_prompts = True
    pool = "kv"
    label_name = "prefix"
    flow_loop = in_step_loop = "flow_loop"

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        vlm, dit = config.get("vlm_config") or {}, config.get("dit_config") or {}
        text = vlm.get("text_config") or {}
        self.config = dict(config)
        self.page_size, self.dtype = page_size, dtype
        try:
            self.num_layers = int(text["num_hidden_layers"])
            self.heads = int(text["num_attention_heads"])
            self.kv_heads = int(text["num_key_value_heads"])
            self.head_dim = int(text["head_dim"])
        except KeyError as exc:
            raise DeploymentError(f"vlm_config.text_config lacks {exc}") from exc
        for key, want in (("num_hidden_layers", self.num_layers), ("num_key_value_heads", self.kv_heads),
                          ("head_dim", self.head_dim)):
            if int(dit.get(key, -1)) != want:
                raise DeploymentError(f"dit_config.{key} {dit.get(key)} != the VLM's {want}: the action expert "
                                      "reads the prefix's K/V layer by layer")
        positions = int(text.get("max_position_embeddings", 8192))
        self.max_seq_len = min(positions, max_seq_len) if max_seq_len else positions
        self.vocab_size = int(text.get("vocab_size", 0))
        self.image_token_id = int(vlm.get("image_token_id", vlm.get("image_token_index", -1)))
        self.chunk = int(config.get("chunk_size", 50))
        self.state_dim = int(config.get("max_state_dim", 32))
        self.action_dim = int(config.get("max_action_dim", 32))
        self.steps = int(config.get("num_inference_steps", 10))
        self.action_shape = (self.chunk, self.action_dim)
        vision = vlm.get("vision_config") or {}
        self.rows_per_image = (int(vision.get("image_size", 224)) // int(vision.get("patch_size", 14))) ** 2
        self.cameras = _cameras(config)
        self.images = Pi0Images()
        self.state_mean: np.ndarray | None = None
        self.state_std: np.ndarray | None = None
        self.state_q01: np.ndarray | None = None
        self.state_q99: np.ndarray | None = None
        self.bos_token = "<bos>"
        self._label = KVLabel(self.label_name, self.pool, keys=False)

    # -- the folder ------------------------------------------------------------------

    def load_folder(self, path: str | Path) -> Self:
        """The processor's settings (images, state statistics) and the tokenizer's bos."""
        folder = Path(path)
        try:
            self.images = Pi0Images.from_folder(folder)
        except ValueError as exc:
            raise DeploymentError(str(exc)) from exc
        if self.images.image_seq_length != self.rows_per_image:
            raise DeploymentError(f"the processor's image_seq_length {self.images.image_seq_length} != the "
                                  f"{self.rows_per_image} rows the vision tower makes per camera")
        processor = read_json(folder / "processor_config.json")
        for pair in (("state_mean", "state_std"), ("state_q01", "state_q99")):
            if all(processor.get(name) is not None for name in pair):
                for name in pair:
                    setattr(self, name, np.asarray(processor[name], dtype=np.float32))
        bos = read_json(folder / "tokenizer_config.json").get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        if isinstance(bos, str):
            self.bos_token = bos
        return self

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return (self._label,)

    @property
    def loop_cap(self) -> int:
        return self.steps  # (the flow loop runs a step a worker step after the prefix's: runners/loop_steps.py)

    # -- a request -------------------------------------------------------------------

    def prepare_image(self, data: bytes) -> PreparedImage:
        from PIL import Image, ImageOps, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as opened:
                image = ImageOps.exif_transpose(opened)
                image.load()
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise PromptError("images", f"the file could not be decoded as an image ({exc})") from exc
        pixels = self.images.preprocess(image)
        key = hashlib.sha256(self.images.settings_key().encode() + b"\0" + data).hexdigest()
        return PreparedImage(np.ascontiguousarray(pixels, dtype=np.float32), "", key)

    def camera_order(self, names: list[str]) -> list[str]:
        """The request's cameras in the model's order; PromptError naming a missing or
        unknown one."""
        if not names:
            raise PromptError("observation.images", "observation.images must hold at least one camera")
        if not self.cameras:
            return names
        for name in self.cameras:
            if name not in names:
                raise PromptError(f"observation.images.{name}", f"camera {name!r} is missing; the model needs "
                                                                f"{list(self.cameras)}")
        for name in names:
            if name not in self.cameras:
                raise PromptError(f"observation.images.{name}", f"camera {name!r} is not one of the model's "
                                                                f"{list(self.cameras)}")
        return list(self.cameras)

    def policy_prompt(self, text: str, cameras: int, state: list[float] | None) -> str:
        """The text `PI0Processor.build_prompts` makes (tokenized whole, no special tokens added)."""
        return f"{IMAGE_TOKEN * self.rows_per_image * cameras}{self.bos_token}{text}\n"

    def state_size(self) -> int | None:
        """The robot's state length (the statistics'), None where the folder has none."""
        stats = self.state_q01 if self.state_q01 is not None else self.state_mean
        return None if stats is None else int(stats.size)

    def normalized_state(self, state: list[float] | tuple[float, ...] | None) -> np.ndarray:
        """The state as the processor normalizes it (float32): to [-1, 1] by the dataset's 1st
        and 99th percentiles where the folder has them, else by its mean and std, else as
        sent; PromptError naming observation.state when absent or of the wrong length."""
        if state is None:
            raise PromptError("observation.state", "observation.state is required")
        values = np.asarray(state, dtype=np.float32)
        size = self.state_size()
        if size is not None and values.size != size:
            raise PromptError("observation.state", f"observation.state must hold {size} values (the robot's state), "
                                                   f"got {values.size}")
        if self.state_q01 is not None and self.state_q99 is not None:
            span = self.state_q99 - self.state_q01
            span = np.where(span == 0, np.float32(1e-8), span).astype(np.float32)
            return (np.float32(2.0) * (values - self.state_q01) / span - np.float32(1.0)).astype(np.float32)
        if self.state_mean is not None and self.state_std is not None:
            return (values - self.state_mean) / (self.state_std + np.float32(1e-8))
        return values

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        ids = request.token_ids
        if not request.images:
            raise PromptError("observation.images", "observation.images must hold at least one camera")
        rows = sum(1 for t in ids if t == self.image_token_id)
        if rows != self.rows_per_image * len(request.images):
            raise PromptError("prompt", f"the prompt holds {rows} image tokens for {len(request.images)} camera(s)")
        tensors = {"input_ids": np.asarray(ids, dtype=np.int32),
                   "pixel_values": np.concatenate([img.pixels for img in request.images]),
                   "state": self._state(request.floats.get("state")),
                   "noise": self._noise(request.floats.get("noise"), request.options.get("noise_rows"),
                                        request.options.get("seed"))}
        layout = LabelLayout(spans=(Span.rows(len(ids)),))
        return ProcessPromptOutput(tensors, {self.label_name: layout}, {"prompt_len": len(ids)})

    def _state(self, state: tuple[float, ...] | None) -> np.ndarray:
        """The state as the model takes it: normalized, zero-padded to max_state_dim."""
        values = self.normalized_state(state)
        if values.size > self.state_dim:
            raise PromptError("observation.state", f"observation.state must hold at most {self.state_dim} values, "
                                                   f"got {values.size}")
        out = np.zeros(self.state_dim, dtype=np.float32)
        out[: values.size] = values
        return out

    def _noise(self, noise: tuple[float, ...] | None, rows: object, seed: object) -> np.ndarray:
        """The client's noise (flat, `rows` rows) as the model's chunk, else drawn (seeded)."""
        shape = (self.chunk, self.action_dim)
        if noise is not None:
            if rows != self.chunk or len(noise) != self.chunk * self.action_dim:
                width = len(noise) // rows if isinstance(rows, int) and rows > 0 else 0
                raise PromptError("noise", f"noise must be {self.chunk} x {self.action_dim} (chunk_size x "
                                           f"max_action_dim), got {rows} x {width}")
            return np.asarray(noise, dtype=np.float32).reshape(shape)
        rng = np.random.default_rng(seed if isinstance(seed, int) and not isinstance(seed, bool) else None)
        return rng.standard_normal(shape, dtype=np.float32)

    def warmup_request(self, n: int) -> PromptRequest:
        """One camera of zeros, an empty prompt, a zero state: the real path, whole."""
        pixels = np.zeros((1, 3, self.images.pad_height, self.images.pad_width), dtype=np.float32)
        ids = [self.image_token_id] * self.rows_per_image + self.warmup_ids(2)
        state = (0.0,) * (self.state_size() or self.state_dim)
        return PromptRequest(ids, images=(PreparedImage(pixels, "", "warmup"),), floats={"state": state},
                             options={"seed": 0})


def _cameras(config: Mapping[str, Any]) -> tuple[str, ...]:
    """LeRobot's camera names from config.json's `input_features`, in order (none: any)."""
    features = config.get("input_features")
    if not isinstance(features, dict):
        return ()
    prefix = "observation.images."
    return tuple(name.removeprefix(prefix) for name, feat in features.items()
                 if name.startswith(prefix) and (not isinstance(feat, dict) or feat.get("type", "VISUAL") == "VISUAL"))


class Pi05Spec(PolicySpec):
    """Pi0.5: the state is text in the prompt (each normalized value's bin of 256 over
    [-1, 1], as `PI05Processor.build_prompts` writes it), not a row of the expert."""

    def policy_prompt(self, text: str, cameras: int, state: list[float] | None) -> str:
        bins = np.linspace(-1.0, 1.0, STATE_BINS + 1, dtype=np.float32)[:-1]
        # torch.bucketize(right=True) - 1: a value below -1 is bin -1, at or past the last edge 255
        digits = np.searchsorted(bins, self.normalized_state(state), side="right") - 1
        task = text.strip().replace("_", " ").replace("\n", " ")
        state_text = ", State: " + " ".join(str(int(d)) for d in digits)
        return (f"{IMAGE_TOKEN * self.rows_per_image * cameras}{self.bos_token}"
                f"Task: {task}{state_text};\nAction: ")

    def _state(self, state: tuple[float, ...] | None) -> np.ndarray:
        return np.zeros(0, dtype=np.float32)  # in the prompt: the expert takes no state row

