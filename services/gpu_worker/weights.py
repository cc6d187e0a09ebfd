"""Load a model's torch implementation and weights from its `ModelSource`: local
safetensors files or the dequantized GGUF. Nothing is downloaded.

The torch class comes from the explicit spec -> model table
(`services.gpu_worker.modeling.registry`), and every hook the loader runs is a method of
`ModelBase` (services/gpu_worker/modeling/base.py), whose defaults do nothing."""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from services.gpu_worker.modeling.base import ModelBase
from services.gpu_worker.modeling.registry import torch_model_for
from shared.model_source import ModelSource
from shared.specs.base import ModelSpec


def build_model(source: ModelSource, spec: ModelSpec, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> ModelBase:
    """The model with its weights, in `dtype` on `device`, ready to serve: its `prepare`
    (fused and prepacked GEMMs, where a family has them) runs once its weights are in place."""
    cls = torch_model_for(spec)
    if source.kind == "gguf":
        from shared.gguf_source import load_gguf_weights

        config, arrays = load_gguf_weights(source.path, progress=True)
        state = {name: torch.from_numpy(a) for name, a in arrays.items()}  # no copy
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
    if not cls.assigns_weights:
        model = model.to_empty(device="cpu")  # its load_weights copies into real tensors
    model.load_weights(state)
    model.reset_buffers()
    model = model.to(dtype).to(device).eval()
    model.prepare()
    return model
