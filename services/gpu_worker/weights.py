"""Load a model's torch implementation and weights from its `ModelSource`: local
safetensors files or the dequantized GGUF. Nothing is downloaded."""

from __future__ import annotations

import importlib
import sys

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from shared.model import ModelSpec
from shared.model_source import ModelSource


def build_model(source: ModelSource, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model with its weights, in `dtype` on `device`, ready to serve: a model with a
    `prepare` hook (fused and prepacked GEMMs) gets it called once its weights are in place."""
    module_name, _, cls_name = spec.torch_impl.partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if source.kind == "gguf":
        from shared.gguf_source import load_gguf_weights

        config, state = load_gguf_weights(source.path, progress=True)
    else:
        config = source.config
        state = {}
        files = sorted(source.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model folder {source.path} has no *.safetensors files")
        for f in tqdm(files, desc="loading safetensors", unit="file", file=sys.stderr):
            state.update(load_file(str(f)))
    # Build on the meta device (no random init of weights about to be overwritten).
    with torch.device("meta"):
        model = cls(config)
    if not getattr(cls, "assigns_weights", False):
        model = model.to_empty(device="cpu")  # its load_weights copies into real tensors
    model.load_weights(state)
    for mod in model.modules():
        if hasattr(mod, "reset_buffers"):
            mod.reset_buffers()
    model = model.to(dtype).to(device).eval()
    if hasattr(model, "prepare"):
        model.prepare()
    return model
