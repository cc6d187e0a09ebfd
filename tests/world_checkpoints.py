"""A tiny random V-JEPA 2-AC checkpoint in the served layout (config.json + model.safetensors
of the `cc-vjepa2` modules' state dicts, README "World models"), and the reference
rollout: `cc-vjepa2`'s own `VisionTransformer` and `VisionTransformerPredictorAC`, stepped
as Meta's training code rolls the predictor out (app/vjepa_droid/train.py:
`forward_target`, `forward_predictions`).

The package's modules import `timm` (only `drop_path`, the identity at eval) and `einops`
(imported, unused by the forward): neither loads here (timm needs torchvision, whose wheel
does not load against the CPU torch), so both are stubbed before the import.
"""

from __future__ import annotations

import json
import sys
import types
from functools import partial
from pathlib import Path

import numpy as np

IMG, PATCH, EMBED, ACTION_DIM = 16, 8, 32, 7
ENCODER = {"img_size": IMG, "patch_size": PATCH, "tubelet_size": 2, "embed_dim": EMBED, "depth": 2, "num_heads": 2,
           "mlp_ratio": 4.0, "use_silu": False, "wide_silu": True, "use_rope": True}
PREDICTOR = {"predictor_embed_dim": 48, "depth": 2, "num_heads": 2, "mlp_ratio": 4.0, "num_frames": 16,
             "action_embed_dim": ACTION_DIM, "use_silu": True, "wide_silu": True, "use_extrinsics": False}
TOKENS = (IMG // PATCH) ** 2


def _stub_missing() -> None:
    """`timm.models.layers.drop_path` and `einops.rearrange` where they do not import."""
    try:
        import timm.models.layers  # noqa: F401
    except Exception:
        layers = types.ModuleType("timm.models.layers")
        layers.drop_path = lambda x, drop_prob=0.0, training=False: x  # type: ignore[attr-defined]
        sys.modules.update({"timm": types.ModuleType("timm"), "timm.models": types.ModuleType("timm.models"),
                            "timm.models.layers": layers})
    try:
        import einops  # noqa: F401
    except ImportError:
        mod = types.ModuleType("einops")
        mod.rearrange = None  # type: ignore[attr-defined]
        sys.modules["einops"] = mod


def reference_models(seed: int, encoder: dict | None = None, predictor: dict | None = None):
    """The package's encoder (RoPE video ViT, as V-JEPA 2-AC's) and AC predictor, random;
    of ENCODER's and PREDICTOR's shape unless others are given (the bench's)."""
    import torch
    from torch import nn

    _stub_missing()
    from vjepa2.models.ac_predictor import vit_ac_predictor
    from vjepa2.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    enc = dict(encoder or ENCODER)
    vit = VisionTransformer(num_frames=2, qkv_bias=True, norm_layer=partial(nn.LayerNorm, eps=1e-6), **enc)
    pred = dict(predictor or PREDICTOR)
    width = pred.pop("predictor_embed_dim")
    pred.pop("mlp_ratio")  # vit_ac_predictor sets 4
    ac = vit_ac_predictor(img_size=(enc["img_size"], enc["img_size"]), patch_size=enc["patch_size"],
                          tubelet_size=enc["tubelet_size"], embed_dim=enc["embed_dim"], predictor_embed_dim=width,
                          **pred)
    with torch.no_grad():  # non-trivial norms and biases (the init sets them to 1 and 0)
        for m in [*vit.modules(), *ac.modules()]:
            if isinstance(m, (nn.LayerNorm, nn.Linear, nn.Conv3d)) and m.bias is not None:
                m.bias.normal_(0, 0.02)
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1, 0.1)
    return vit.eval(), ac.eval()


def make_world_checkpoint(folder: Path, seed: int, encoder_config: dict | None = None,
                          predictor_config: dict | None = None) -> Path:
    from safetensors.torch import save_file

    encoder, predictor = reference_models(seed, encoder_config, predictor_config)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["VJEPA2ACWorldModel"], "model_type": "vjepa2_ac",
              "encoder": encoder_config or ENCODER, "predictor": predictor_config or PREDICTOR}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    state = {f"encoder.{k}": v.contiguous() for k, v in encoder.state_dict().items()}
    state |= {f"predictor.{k}": v.contiguous() for k, v in predictor.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def pixels(frames: list[np.ndarray]):
    """uint8 frames [H, W, 3] (already IMG x IMG) as the encoder takes them: /255, ImageNet-normalized."""
    import torch

    mean, std = np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225], np.float32)
    x = np.stack([(f.astype(np.float32) / np.float32(255.0) - mean) / std for f in frames])
    return torch.from_numpy(x).permute(0, 3, 1, 2)  # [T, 3, H, W]


def reference_rollout(seed: int, frames: list[np.ndarray], actions: np.ndarray, states: np.ndarray,
                      steps: int) -> np.ndarray:
    """Meta's autoregressive rollout: [steps, tokens, embed] (each step's predicted frame)."""
    return rollout(*reference_models(seed), frames, actions, states, steps)


def rollout(encoder, predictor, frames: list[np.ndarray], actions: np.ndarray, states: np.ndarray,
            steps: int) -> np.ndarray:
    """`reference_rollout` with the models given (built once: the bench calls it many times);
    each step runs the predictor over every frame so far, as Meta's loop does."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        c = pixels(frames)[None].permute(0, 2, 1, 3, 4)  # [B, C, T, H, W]
        # forward_target: each frame its own tubelet (the frame twice), layer-normed
        c = c.permute(0, 2, 1, 3, 4).flatten(0, 1).unsqueeze(2).repeat(1, 1, 2, 1, 1)
        h = encoder(c)
        tokens = h.size(1)
        h = h.view(1, len(frames), -1, h.size(-1)).flatten(1, 2)
        z = F.layer_norm(h, (h.size(-1),))
        a = torch.from_numpy(actions)[None]
        s = torch.from_numpy(states)[None]
        out = []
        for k in range(steps):
            t = len(frames) + k
            nxt = predictor(z, a[:, :t], s[:, :t])
            nxt = F.layer_norm(nxt, (nxt.size(-1),))[:, -tokens:]
            z = torch.cat([z, nxt], dim=1)
            out.append(nxt[0].numpy())
    return np.stack(out)
