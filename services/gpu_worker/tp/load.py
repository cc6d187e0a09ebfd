"""Load one rank's shard of a decoder LM: only its slices are read from the checkpoint
(safetensors' slices, read from the mapped file), then the model is prepared as a one-rank
worker's is and the collectives are put around it (layers.py).

A GGUF file is dequantized (to float32) and each tensor cut as it is taken, so a rank
keeps only its share, though each whole tensor passes through memory once at load; its
quantized GEMMs do not run sharded (a quantized block would straddle the column split).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from services.gpu_worker.gguf_weights import load_gguf_weights
from services.gpu_worker.modeling.decoder.lm import DecoderLM
from services.gpu_worker.modeling.registry import torch_model_for
from services.gpu_worker.tp.group import TpGroup
from services.gpu_worker.tp.layers import parallelize
from services.gpu_worker.tp.shard import RANK0, WHOLE, HeadSplit, local_config, pieces, split_for
from shared.model_config import read_model_config
from shared.model_source import ModelSource
from shared.specs.base import DeploymentError, ModelSpec

log = logging.getLogger("mstar.tp")


class _Safetensors:
    """A folder's safetensors files, read by slice."""

    def __init__(self, folder: Path, skip: tuple[str, ...]) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model folder {folder} has no *.safetensors files")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self.where = {k: h for h in self._handles for k in h.keys() if not k.startswith(skip)}  # noqa: SIM118

    def names(self) -> list[str]:
        return list(self.where)

    def full_bytes(self, name: str) -> int:
        sl = self.where[name].get_slice(name)
        n = 1
        for d in sl.get_shape():
            n *= d
        return n * _ITEM.get(sl.get_dtype(), 4)

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if dim == WHOLE:
            return self.where[name].get_tensor(name)
        sl = self.where[name].get_slice(name)
        return sl[start:stop] if dim == 0 else sl[:, start:stop]


_ITEM = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


class _Arrays:
    """A GGUF file's dequantized tensors (numpy, as `load_gguf_weights` gives them)."""

    def __init__(self, arrays: dict[str, Any]) -> None:
        self.arrays = arrays

    def names(self) -> list[str]:
        return list(self.arrays)

    def full_bytes(self, name: str) -> int:
        return int(self.arrays[name].nbytes)

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        t = torch.from_numpy(self.arrays[name])
        return t if dim == WHOLE else t.narrow(dim, start, stop - start).clone()


def read_shard(reader, split: HeadSplit) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds, under the names the model loads (vocab rows padded)."""
    state: dict[str, torch.Tensor] = {}
    for name in reader.names():
        for out, dim, start, stop in pieces(name, split):
            if dim == RANK0:
                t = reader.read(name, WHOLE, 0, 0)
                state[out] = t if split.rank == 0 else torch.zeros_like(t)
                continue
            t = reader.read(name, dim, start, stop)
            if out in ("model.embed_tokens.weight", "lm_head.weight") and t.shape[0] < split.vocab_local:
                t = torch.cat([t, t.new_zeros(split.vocab_local - t.shape[0], *t.shape[1:])])
            state[out] = t
    return state


def build_shard(source: ModelSource, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str,
                group: TpGroup) -> DecoderLM:
    """This rank's `DecoderLM`: its slices of the weights, prepared, with the collectives."""
    from services.gpu_worker.weights import _no_init

    cls = torch_model_for(spec)
    if cls is not DecoderLM:
        raise DeploymentError(f"--tensor-parallel-size {group.size}: tensor parallelism shards decoder LMs; "
                              f"this model runs as {cls.__name__}, which it does not split")
    if source.kind == "gguf":
        config, arrays = load_gguf_weights(source.path, progress=False)
        reader: _Safetensors | _Arrays = _Arrays(arrays)
    else:
        config, reader = source.config, _Safetensors(source.path, cls.skip_prefixes)
    cfg = read_model_config(config)
    split = split_for(cfg, group.rank, group.size)
    state = read_shard(reader, split)
    held = sum(t.numel() * t.element_size() for t in state.values())
    whole = sum(reader.full_bytes(n) for n in reader.names())
    log.info("tensor-parallel rank %d of %d holds %d of the checkpoint's %d weight bytes (%.1f%%): %d of %d query "
             "heads, %d of %d KV heads, %d of %d MLP columns, %d vocabulary rows", group.rank, group.size, held,
             whole, 100.0 * held / max(1, whole), split.q_local, split.heads, split.kv_local, split.kv_heads,
             split.inter_local, split.inter, split.vocab_local)
    del reader
    with torch.device("meta"), _no_init():
        model = DecoderLM(local_config(cfg, split))
    model.load_weights(state)
    del state
    model.reset_buffers()
    model = model.to(dtype).to(device).eval()
    model.prepare()
    parallelize(model, split, group)
    return model
