"""Meta's V-JEPA 2-AC checkpoint (`vjepa2-ac-vitg.pt`: a torch dict whose `encoder` and
`predictor` are state dicts, keys under `module.` / `backbone.`) -> the served folder
(config.json + model.safetensors, README "World models").

    python -m services.gpu_worker.modeling.world.convert vjepa2-ac-vitg.pt OUT_DIR

The sizes default to the released model's (`vjepa2_ac_vit_giant` in Meta's hub: a ViT-g
encoder with RoPE at 256 px, patch 16, tubelet 2, 64 frames; the AC predictor 1024 wide,
24 deep, 16 heads, 7-dim actions); `--config FILE` gives another's config.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

GIANT_AC: dict[str, Any] = {
    "architectures": ["VJEPA2ACWorldModel"],
    "model_type": "vjepa2_ac",
    "encoder": {"img_size": 256, "patch_size": 16, "tubelet_size": 2, "embed_dim": 1408, "depth": 40,
                "num_heads": 22, "mlp_ratio": 48 / 11, "use_silu": False, "wide_silu": True, "use_rope": True},
    "predictor": {"predictor_embed_dim": 1024, "depth": 24, "num_heads": 16, "mlp_ratio": 4.0, "num_frames": 64,
                  "action_embed_dim": 7, "use_silu": False, "wide_silu": True, "use_extrinsics": False},
}
#: the encoder's parameters (Meta's loader takes its state dict with strict=False)
ENCODER_PREFIXES = ("patch_embed.", "blocks.", "norm.")


def _clean(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`_clean_backbone_key` of Meta's hub: drop the `module.` and `backbone.` wrappers."""
    return {k.replace("module.", "").replace("backbone.", ""): v for k, v in state.items()}


def convert_meta_checkpoint(pt: str | Path, out: str | Path, config: dict[str, Any] | None = None) -> Path:
    """Write `out`/config.json and `out`/model.safetensors from Meta's .pt."""
    from safetensors.torch import save_file

    raw = torch.load(str(pt), map_location="cpu", weights_only=True)
    encoder = {k: v for k, v in _clean(raw["encoder"]).items() if k.startswith(ENCODER_PREFIXES)}
    predictor = _clean(raw["predictor"])
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or GIANT_AC, indent=2))
    state = {f"encoder.{k}": v.contiguous() for k, v in encoder.items()}
    state |= {f"predictor.{k}": v.contiguous() for k, v in predictor.items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="Meta's .pt (encoder and predictor state dicts)")
    ap.add_argument("out", help="the folder to write")
    ap.add_argument("--config", help="a config.json for other sizes than the released ViT-g AC model")
    args = ap.parse_args()
    config = json.loads(Path(args.config).read_text()) if args.config else None
    print(convert_meta_checkpoint(args.checkpoint, args.out, config))


if __name__ == "__main__":
    main()
