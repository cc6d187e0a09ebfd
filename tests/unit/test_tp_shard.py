"""What each tensor-parallel rank reads of a checkpoint (services/gpu_worker/tp/shard.py), on
the dense decoder families' random checkpoints: the ranks' column-parallel pieces stacked
are the checkpoint's q/k/v/gate/up (Phi-3's packed projections cut into them), their
row-parallel pieces side by side its o/down, their vocabulary rows its embedding and head;
a KV head fewer than the ranks is replicated on the ranks whose query heads read it; a
model the ranks cannot share is refused naming the field and its value."""

from __future__ import annotations

import json

import pytest
import torch

from services.gpu_worker.tp.load import _Safetensors, read_shard
from services.gpu_worker.tp.shard import refuse_unsplittable, split_for
from services.gpu_worker.weights import _load_safetensors
from shared.model_config import read_model_config
from shared.specs.base import DeploymentError
from tests.checkpoints import make_checkpoint


def _shards(path, size: int):
    cfg = read_model_config(json.loads((path / "config.json").read_text()))
    reader = _Safetensors(path, ())
    return cfg, [read_shard(reader, split_for(cfg, r, size)) for r in range(size)]


def _full(path) -> dict[str, torch.Tensor]:
    from services.gpu_worker.modeling.decoder.lm import _unpack_projections

    state = _load_safetensors(next(path.glob("*.safetensors")), ())
    return _unpack_projections(state, read_model_config(json.loads((path / "config.json").read_text())))


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3", "phi3"])  # (Llama, Qwen3: served in the e2e test)
def test_ranks_pieces_make_the_checkpoint(tmp_path, family):
    path = make_checkpoint(tmp_path / family, family)
    cfg, (a, b) = _shards(path, 2)
    full = _full(path)
    assert set(a) == set(b) == set(full)
    for name, t in full.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat([a[name], b[name]], dim=1), t), name
        elif name.endswith(("o_proj.bias", "down_proj.bias")):
            assert torch.equal(a[name], t) and not b[name].any(), name  # added once by the all-reduce
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(torch.cat([a[name], b[name]])[: cfg.vocab_size], t), name
        elif any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            assert torch.equal(torch.cat([a[name], b[name]]), t), name
        else:
            assert torch.equal(a[name], t) and torch.equal(b[name], t), name
    held = [sum(x.numel() for x in s.values()) for s in (a, b)]
    whole = sum(x.numel() for x in full.values())
    assert all(0.45 < h / whole < 0.56 for h in held), (held, whole)


def test_fewer_kv_heads_than_ranks_are_replicated(tmp_path):
    path = make_checkpoint(tmp_path / "q", "qwen3", num_key_value_heads=1)
    _, shards = _shards(path, 4)  # 4 query heads, one each; the one KV head on all four
    full = _full(path)
    name = "model.layers.0.self_attn.k_proj.weight"
    assert all(torch.equal(s[name], full[name]) for s in shards)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([s[q] for s in shards]), full[q])


def _cfg(**over):
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    return read_model_config({**raw, **over})


@pytest.mark.parametrize(("over", "size", "named"), [
    ({}, 3, "num_attention_heads 4 is not a multiple of 3"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16}, 2, "num_key_value_heads 3"),
    ({"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 130}, 4,
     "intermediate_size 130"),
])
def test_unsplittable_refused_by_name(over, size, named):
    with pytest.raises(DeploymentError, match=named):
        refuse_unsplittable(_cfg(**over), size)
    refuse_unsplittable(_cfg(), 2)  # 4 heads, 2 KV heads: fine
    refuse_unsplittable(_cfg(num_attention_heads=8, head_dim=16), 4)  # 2 KV heads each on two ranks


def test_placement_across_hosts():
    """--nnodes / --node-rank place each host's ranks as torch.distributed's launchers do."""
    from services.gpu_worker.tp.group import TpPlacement

    place = TpPlacement(4, rank=2, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500)
    place.check()
    assert list(place.node_ranks) == [2, 3] and place.local_rank == 0
    for bad, named in ((TpPlacement(4, nnodes=3), "--nnodes 3"), (TpPlacement(4, nnodes=2, node_rank=2), "--node-rank"),
                       (TpPlacement(4, nnodes=2), "--master-port")):
        with pytest.raises(ValueError, match=named):
            bad.check()
