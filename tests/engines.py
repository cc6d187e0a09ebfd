"""A tiny model and a real engine on it, for the tests of the engine's parts (scheduler,
step costs, their cache) that need real steps without the services around them."""

from __future__ import annotations

from pathlib import Path

import torch

from services.gpu_worker.build import build_engine
from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.weights import build_model
from shared.model_source import ModelSource
from tests.checkpoints import make_checkpoint


def tiny_model(folder: Path, family: str = "llama"):
    """(spec with 16-row pages, float32 torch model) of a random-weight checkpoint made in `folder`."""
    src = ModelSource(str(make_checkpoint(folder, family)))
    spec = src.spec(16)
    return spec, build_model(src, spec, torch.float32)


def tiny_engine(spec, model, num_pages: int, max_batch_tokens: int, target_s: float):
    """(pools, KV manager, engine): a real engine on `num_pages` pages, with a time target."""
    pools = spec.paged_pools(num_pages)
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    kv = KVManager(pools, spec.kv_labels)
    eng = build_engine(model, spec, kv, caches, eos_ids=[], max_num_seqs=8, max_batch_tokens=max_batch_tokens,
                       max_seq_len=spec.max_seq_len, itl_target_s=target_s)
    return pools, kv, eng
