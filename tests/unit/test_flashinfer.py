"""The CUDA path against the torch path: FlashInfer's batch prefill wrapper over the same
pages and page table gives the same attention, and the engine the same greedy tokens.
Skipped cleanly without a GPU or without flashinfer; run where both exist."""

from __future__ import annotations

import pytest
import torch

from services.gpu_worker.attention import build_metadata, paged_attention, write_kv
from services.gpu_worker.flashinfer_backend import FlashInferPlanner, flashinfer_available

pytestmark = pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and flashinfer")


@pytest.mark.parametrize("window", [None, 6])
def test_flashinfer_matches_torch_paged_attention(window):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    page_size, hq, hkv, d = 16, 8, 2, 64
    cache = torch.randn(64, 2, page_size, hkv, d, device=dev)
    perm = torch.randperm(64).tolist()
    shapes = [(40, 1, True), (3, 1, True), (0, 30, False), (21, 9, False)]
    rows = []
    for cached, new, dec in shapes:
        pages = [perm.pop() for _ in range(-(-(cached + new) // page_size))]
        rows.append((pages, 0, cached, new, dec))
    ref_meta = build_metadata(rows, page_size, window, backend="torch").to(dev)
    meta = build_metadata(rows, page_size, window, backend="flashinfer").to(dev)
    t = sum(n for _, n, _ in shapes)
    q, k, v = torch.randn(t, hq, d, device=dev), torch.randn(t, hkv, d, device=dev), torch.randn(t, hkv, d, device=dev)
    write_kv(cache, k, v, meta)
    ref = paged_attention(q, cache, ref_meta, d**-0.5)
    planner = FlashInferPlanner(dev)
    planner.plan("text", meta, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size, window=window,
                 dtype=torch.float32)
    torch.testing.assert_close(paged_attention(q, cache, meta, d**-0.5), ref, rtol=2e-3, atol=2e-3)


def test_engine_greedy_tokens_match_on_cuda(tmp_path):
    from services.gpu_worker.build import build_engine
    from services.gpu_worker.kv_manager import KVManager
    from services.gpu_worker.weights import build_model
    from shared.frames import NewRequest, SamplingParams, pack_tensors
    from shared.model_source import ModelSource
    from shared.specs.base import PromptRequest
    from tests.checkpoints import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "llama", "llama", head_dim=64, hidden_size=256, num_attention_heads=4)
    src = ModelSource(str(ckpt))
    spec = src.spec(16)
    outs = {}
    for device in ("cpu", "cuda"):
        pools = spec.paged_pools(64)
        model = build_model(src, spec, torch.float32).to(device)
        caches = {n: [torch.zeros(p.num_pages, 2, p.page_size, p.kv_heads, p.head_dim, device=device)
                      for _ in range(p.num_layers)]
                  for n, p in pools.items()}
        kv = KVManager(pools, spec.kv_labels)
        planner = FlashInferPlanner(torch.device(device)) if device == "cuda" else None
        eng = build_engine(model, spec, kv, caches, eos_ids=[], max_num_seqs=8, max_batch_tokens=64,
                           max_seq_len=spec.max_seq_len, planner=planner)
        for i, ids in enumerate([[5, 6, 7, 8], list(range(10, 60))]):
            ppo = spec.process_prompt(PromptRequest(ids))
            caps = spec.clamp_caps(spec.get_loop_caps(16))
            refs, _ = pack_tensors(ppo.new_input_tensors)
            eng.add(NewRequest(f"r{i}", "", refs, SamplingParams(temperature=0.0, ignore_eos=True), "", len(ids), 16,
                               ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools)), ppo.new_input_tensors)
        got: dict[str, list[int]] = {}
        while eng.has_work:
            for _, o in eng.step().outputs:
                got.setdefault(o.request_id, []).extend(o.token_ids)
        outs[device] = got
        assert kv.used_pages() == 0
    assert outs["cuda"] == outs["cpu"]
