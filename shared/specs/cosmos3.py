"""Cosmos 3 (`Cosmos3OmniPipeline`, a diffusers folder): text to image and text to video.

A request is a text prompt, its size, frames, steps, guidance and seed; the pipeline's
prompt is its chat template over a system turn (`_SYSTEM_PROMPT_IMAGE` / `_VIDEO`) and the
user's text with the pipeline's metadata sentences appended (resolution; duration for a
video), tokenized, then `<eos>` and `<|vision_start|>`; the negative prompt (CFG's
unconditional branch) is the same with the inverse sentences (`tokenize_prompt`).

Layout (DESIGN.md section 3, "Denoising loops"): label "text" in pool "kv", a rows span of
the conditional prompt's rows, then, under classifier-free guidance (guidance_scale != 1,
as the pipeline decides), the unconditional prompt's rows: a second row set of the same
request. The transformer's text pathway is causal and never reads the latents, so each
layer's text K/V are the same at every step: the worker writes them into these pages
once and every step reads them. The latents' rows (frames x patches) are recomputed each
step and never written: no growth, no scratch; the footprint is the text's rows. The
loop `denoise_loop` (cap: `MAX_STEPS`, the loop's max_iters too) runs one iteration a
worker step from the step that takes the request (runners/diffusion.py,
runners/loop_steps.py), for `num_inference_steps` of it.

The tensors the worker takes: `input_ids` (the conditional ids, then the unconditional
ones), `gen` (int64: seed, sample, steps, height, width, num_frames, conditional rows,
CFG on), `guidance` (float64). `sample` j of a request with `n` samples draws its noise
as the pipeline's j-th call on one generator seeded with `seed` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.deferred import deferred
from shared.layout import KVLabel, LabelLayout, ProcessPromptOutput, Span
from shared.specs.base import DeploymentError, PromptError, PromptRequest
from shared.specs.image_gen import ImageGenSpec, guidance_option, int_option

if TYPE_CHECKING:
    import numpy as np
else:
    np = deferred("numpy")  # imported at first use (shared/deferred.py)

ARCHITECTURES = ("Cosmos3OmniPipeline",)
#: the most denoising steps a request may ask (the loop's graph bound)
MAX_STEPS = 100
#: the largest side in pixels, the most frames a video may have
MAX_SIDE = 2048
MAX_FRAMES = 189
SYSTEM_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
SYSTEM_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."


class Cosmos3Spec(ImageGenSpec):
    """The text label, the denoising loop (`ImageGenSpec`), the pipeline's prompt templates
    and sizes."""

    engine = "diffusion"
    max_side, max_frames = MAX_SIDE, MAX_FRAMES

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        tcfg, vae = config.get("transformer") or {}, config.get("vae") or {}
        pipeline = config.get("pipeline") or {}
        self.config = dict(config)
        self.page_size, self.dtype = page_size, dtype
        try:
            self.num_layers = int(tcfg["num_hidden_layers"])
            self.heads = int(tcfg["num_attention_heads"])
            self.kv_heads = int(tcfg["num_key_value_heads"])
            self.head_dim = int(tcfg["head_dim"])
            self.vocab_size = int(tcfg["vocab_size"])
        except KeyError as exc:
            raise DeploymentError(f"transformer/config.json lacks {exc}") from exc
        if not vae:
            raise DeploymentError("the pipeline folder has no vae/config.json")
        self.spatial = int(vae.get("scale_factor_spatial") or 16) * int(tcfg.get("latent_patch_size", 2))
        self.temporal = int(vae.get("scale_factor_temporal") or 4)
        self.max_seq_len = min(4096, max_seq_len) if max_seq_len else 4096
        self.use_system_prompt = bool(pipeline.get("default_use_system_prompt", True))
        if pipeline.get("use_native_flow_schedule"):
            raise DeploymentError("use_native_flow_schedule is not served (the scheduler's own sigmas are)")
        self.template: Any = None
        self.specials: dict[str, str | None] = {}
        self.suffix_ids: list[int] = []
        self._label = KVLabel(self.label_name, self.pool, keys=False)

    def load_folder(self, path: str | Path) -> Self:
        """The tokenizer's chat template and the two ids the pipeline appends (eos, `<|vision_start|>`)."""
        from shared.diffusers_folder import tokenizer_folder

        folder = tokenizer_folder(Path(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        source = cfg.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            source = (folder / "chat_template.jinja").read_text()
        if not isinstance(source, str):
            raise DeploymentError(f"{folder}: no chat template (Cosmos 3's prompt is its chat template)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.template = env.from_string(source)
        self.specials = {k: (v.get("content") if isinstance(v, dict) else v)
                         for k, v in cfg.items() if k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        ids = [tok.token_to_id(t) if t else None for t in (self.specials.get("eos_token"), "<|vision_start|>")]
        if any(i is None for i in ids):
            raise DeploymentError(f"{folder}: the tokenizer lacks the eos token or <|vision_start|>")
        self.suffix_ids = [int(i) for i in ids if i is not None]
        return self

    @property
    def loop_cap(self) -> int:
        return MAX_STEPS  # (the loop runs an iteration a worker step, none a row: runners/loop_steps.py)

    # -- a request -------------------------------------------------------------------

    def check_size(self, width: int, height: int, num_frames: int) -> None:
        """PromptError naming `size` or `num_frames` for what the model cannot make."""
        m = self.spatial
        for side in (width, height):
            if side < m or side > MAX_SIDE or side % m:
                raise PromptError("size", f"size must be WxH with each side a multiple of {m} from {m} to "
                                          f"{MAX_SIDE}, got {width}x{height}")
        if num_frames < 1 or num_frames > MAX_FRAMES or (num_frames - 1) % self.temporal:
            raise PromptError("num_frames", f"num_frames must be 1 + a multiple of {self.temporal}, at most "
                                            f"{MAX_FRAMES}, got {num_frames}")

    def prompt_texts(self, prompt: str, negative: str | None, height: int, width: int,
                     num_frames: int, fps: float = 24.0) -> tuple[str, str]:
        """The conditional and unconditional prompts as the pipeline renders them
        (`tokenize_prompt`: templates, then the chat template), before tokenizing."""
        is_image = num_frames == 1
        kind = "image" if is_image else "video"

        def append(base: str, addition: str) -> str:
            base = base.rstrip(".")
            return f"{base}. {addition}" if base else addition

        def templated(text: str, inverse: bool) -> str:
            neg = "not " if inverse else ""
            if not is_image:
                text = append(text, f"The video is {neg}{num_frames / fps:.1f} seconds long and is {neg}of "
                                    f"{fps:.0f} FPS.")
            return append(text, f"This {kind} is {neg}of {height}x{width} resolution.")

        def render(text: str) -> str:
            messages = []
            if self.use_system_prompt:
                messages.append({"role": "system", "content": SYSTEM_IMAGE if is_image else SYSTEM_VIDEO})
            messages.append({"role": "user", "content": text})
            return self.template.render(messages=messages, add_generation_prompt=True, add_vision_id=False,
                                        **self.specials)

        return render(templated(prompt, False)), render(templated(negative or "", True))

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        o = request.options
        ids = request.token_ids
        cond_rows = int_option(o, "cond_rows", len(ids))
        steps = int_option(o, "num_inference_steps", 35)
        if steps < 1 or steps > MAX_STEPS:
            raise PromptError("num_inference_steps", f"num_inference_steps must be from 1 to {MAX_STEPS}, "
                                                     f"got {steps}")
        guidance = guidance_option(o, 6.0)
        height, width = int_option(o, "height", 720), int_option(o, "width", 1280)
        frames = int_option(o, "num_frames", 1)
        self.check_size(width, height, frames)
        cfg = float(guidance) != 1.0
        rows = ids if cfg else ids[:cond_rows]
        gen = [int_option(o, "seed", 0), int_option(o, "sample", 0), steps, height, width, frames, cond_rows,
               int(cfg)]
        tensors = {"input_ids": np.asarray(rows, dtype=np.int32), "gen": np.asarray(gen, dtype=np.int64),
                   "guidance": np.asarray([float(guidance)], dtype=np.float64)}
        layout = LabelLayout(spans=(Span.rows(len(rows)),))
        return ProcessPromptOutput(tensors, {self.label_name: layout}, {"prompt_len": len(rows)})

    def warmup_request(self, n: int) -> PromptRequest:
        """The smallest image, one step, guidance on: the real path, whole."""
        ids = self.warmup_ids(2) + self.suffix_ids
        return PromptRequest(ids + ids, options={"cond_rows": len(ids), "num_inference_steps": 1,
                                                 "guidance_scale": 2.0, "height": self.spatial,
                                                 "width": self.spatial, "num_frames": 1, "seed": 0})
