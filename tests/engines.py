"""A tiny model and a real engine on it, for the tests of the engine's parts (scheduler,
step costs, their cache) that need real steps without the services around them; and a
model file's greedy tokens through that engine (`greedy_on`)."""

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


def tiny_engine(spec, model, num_pages: int, max_batch_tokens: int, target_s: float = 0.0, max_num_seqs: int = 8):
    """(pools, KV manager, engine): a real engine on `num_pages` pages, with a time target."""
    pools = spec.paged_pools(num_pages)
    caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim) for _ in range(p.num_layers)]
              for n, p in pools.items()}
    kv = KVManager(pools, spec.kv_labels)
    eng = build_engine(model, spec, kv, caches, eos_ids=[], max_num_seqs=max_num_seqs,
                       max_batch_tokens=max_batch_tokens, max_seq_len=spec.max_seq_len, itl_target_s=target_s)
    return pools, kv, eng


def folder_engine(path: Path | str, max_batch_tokens: int, max_num_seqs: int = 8, quantized: bool = False):
    """(source, spec, pools, KV manager, engine): a model file's (GGUF or folder) real engine
    in process on 64 pages of 16 rows, float32 weights unless `quantized`."""
    src = ModelSource(str(path))
    spec = src.spec(16)
    model = build_model(src, spec, torch.float32, quantized=quantized)
    return (src, spec, *tiny_engine(spec, model, 64, max_batch_tokens, max_num_seqs=max_num_seqs))


def greedy_on(path: Path | str, prompts: list[list[int]], max_tokens: int, quantized: bool = False) -> list[list[int]]:
    """A model file's (GGUF or folder) greedy tokens for each prompt, EOS ignored: the real
    engine in process, every prompt batched, float32 weights unless `quantized` (the C
    kernel's path for a GGUF file); pages back to zero after."""
    from shared.frames import NewRequest, SamplingParams, pack_tensors
    from shared.specs.base import PromptRequest

    _, spec, pools, kv, eng = folder_engine(path, 256, max(4, len(prompts)), quantized)
    caps = spec.clamp_caps(spec.get_loop_caps(max_tokens))
    for i, ids in enumerate(prompts):
        ppo = spec.process_prompt(PromptRequest(ids))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        eng.add(NewRequest(f"r{i}", "", refs, SamplingParams(temperature=0.0, ignore_eos=True), "", len(ids),
                           max_tokens, ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools)),
                ppo.new_input_tensors)
    got: dict[str, list[int]] = {}
    while eng.has_work:
        for _, o in eng.step().outputs:
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert kv.used_pages() == 0
    return [got[f"r{i}"] for i in range(len(prompts))]

