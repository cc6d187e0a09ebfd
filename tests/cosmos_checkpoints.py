"""A tiny random Cosmos 3 checkpoint in the diffusers folder layout (`Cosmos3OmniPipeline`:
model_index.json, transformer/, vae/, scheduler/, text_tokenizer/), made with diffusers'
own classes and `save_pretrained`, every config shrunk; and the reference: the diffusers
pipeline itself, float32, `generator=torch.Generator("cpu").manual_seed(seed)`.

The tokenizer is tests/checkpoints.py's Qwen2 BPE plus the tokens the pipeline looks up
(`<|vision_start|>`), with a Qwen-style chat template that renders a system turn. The VAE
is Wan 2.2's residual, patchified kind (`is_residual`, `patch_size` 2) shrunk to 8 px per
latent (spatial) and 2 frames per latent (temporal), so with the transformer's 2 x 2 latent
patches one token covers 16 x 16 px: 32 x 32 px is 4 tokens, a 5-frame video 3 latent frames.

The pipeline runs one sample per call; `n` samples of one request are its calls one after
another on one generator (`reference_images(n=...)`): that is how the engine draws them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.checkpoints import make_tokenizer

#: the chat template (Qwen's shape: a system turn when given, the user's, then the assistant's header)
COSMOS_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COSMOS_SPECIALS = ("<|vision_start|>", "<|vision_end|>")
Z_DIM = 4
TRANSFORMER = dict(hidden_size=64, intermediate_size=128, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=2, latent_channel=Z_DIM, latent_patch_size=2, patch_latent_dim=4 * Z_DIM,
                   rope_axes_dim=[4, 2, 2], rope_theta=10000.0, dtype="float32")
VAE = dict(base_dim=8, decoder_base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2], num_res_blocks=1,
           temperal_downsample=[False, True], is_residual=True, patch_size=2, in_channels=12, out_channels=12,
           scale_factor_spatial=8, scale_factor_temporal=2, latents_mean=[0.1, -0.2, 0.3, 0.0],
           latents_std=[1.5, 0.8, 1.2, 1.0])
#: UniPC over flow-matching sigmas (Wan's shape), multistep order 2
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0, solver_order=2,
                 num_train_timesteps=1000)


def make_cosmos3(path: Path, seed: int = 0) -> Path:
    """Save the tiny random pipeline to `path` (created) and return it."""
    import torch
    from diffusers import AutoencoderKLWan, Cosmos3OmniPipeline, UniPCMultistepScheduler
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer
    from transformers import AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    tok_dir = path / "text_tokenizer"
    tok_dir.mkdir(exist_ok=True)
    make_tokenizer(tok_dir, family="qwen2", extra_specials=COSMOS_SPECIALS)
    tcfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = COSMOS_CHAT_TEMPLATE
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tcfg))
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    torch.manual_seed(seed)
    transformer = Cosmos3OmniTransformer(vocab_size=len(tokenizer), **TRANSFORMER)
    with torch.no_grad():  # the norms start at 1: move them, so a norm read from the wrong weight shows
        for name, p in transformer.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    vae = AutoencoderKLWan(**VAE)
    scheduler = UniPCMultistepScheduler(**SCHEDULER)
    pipe = Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=tokenizer, vae=vae, scheduler=scheduler,
                               enable_safety_checker=False)
    pipe.save_pretrained(str(path), safe_serialization=True)
    return path


def load_pipeline(path: Path) -> Any:
    import torch
    from diffusers import Cosmos3OmniPipeline

    pipe = Cosmos3OmniPipeline.from_pretrained(str(path), torch_dtype=torch.float32, enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_frames(pipe: Any, prompt: str, *, height: int, width: int, num_frames: int = 1, seed: int = 0,
                     steps: int = 2, guidance_scale: float = 6.0, negative_prompt: str | None = None,
                     n: int = 1) -> list[np.ndarray]:
    """The pipeline's float frames [F, H, W, 3] in [0, 1] (output_type "np"), one array per
    sample: `n` calls on one generator seeded with `seed`."""
    import torch

    generator = torch.Generator("cpu").manual_seed(seed)
    out = []
    for _ in range(n):
        video = pipe(prompt, negative_prompt=negative_prompt, num_frames=num_frames, height=height, width=width,
                     num_inference_steps=steps, guidance_scale=guidance_scale, generator=generator,
                     output_type="np", enable_safety_check=False).video
        out.append(np.asarray(video, dtype=np.float32))
    return out


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """diffusers' `numpy_to_pil` rounding: (x * 255).round() as uint8."""
    return (frames * 255).round().astype(np.uint8)
