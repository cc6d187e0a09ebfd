"""Each branch of the deployment and intake checks: what `ModelSpec.validate` refuses before
any worker starts, the `KVReqConfig` every declared pool gets, and the worker's refusal of
a footprint the conductor computed differently."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from services.gpu_worker.kv_manager import KVManager
from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.layout import KVLabel, PagedKVConfig
from shared.specs.base import DeploymentError, PromptRequest
from shared.specs.decoder_lm import DecoderLMSpec

CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 16,
          "max_position_embeddings": 256}


class _Spec(DecoderLMSpec):
    """The decoder spec with its declarations replaced per test."""

    def __init__(self, labels: tuple[KVLabel, ...], extra_pools: tuple[str, ...] = ()) -> None:
        super().__init__(CONFIG, page_size=4)
        self._declared = labels  # kv_labels; the pools still come from the real model's labels
        self._extra = extra_pools

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return self._declared

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        pools = super().paged_pools(num_pages)
        for name in self._extra:
            pools[name] = PagedKVConfig(name, 1, 1, 8, "float32", 4, num_pages, self.max_seq_len)
        return pools


def test_a_label_declared_twice_is_refused():
    text = KVLabel("text", "kv", keys=True, grows_on="decode_loop")
    with pytest.raises(DeploymentError, match=r"declares a KV label twice: \['text', 'text'\]"):
        _Spec((text, text)).validate()


def test_a_label_in_an_undeclared_pool_is_refused():
    spec = _Spec((KVLabel("text", "kv", keys=True, grows_on="decode_loop"),
                  KVLabel("side", "elsewhere", grows_on="decode_loop")))
    with pytest.raises(DeploymentError, match=r"label 'side' lives in pool 'elsewhere', which the model does not"):
        spec.validate()


def test_a_label_growing_on_an_unknown_loop_is_refused():
    spec = _Spec((KVLabel("text", "kv", keys=True, grows_on="think_loop"),))
    with pytest.raises(DeploymentError, match=r"label 'text' grows on loop 'think_loop', which the graph does not"):
        spec.validate()


def test_a_pool_no_label_uses_is_refused():
    spec = _Spec((KVLabel("text", "kv", keys=True, grows_on="decode_loop"),), extra_pools=("orphan",))
    with pytest.raises(DeploymentError, match=r"paged KV pool\(s\) \['orphan'\] are used by no KV label"):
        spec.validate()


def _request(spec: DecoderLMSpec, pools: dict[str, PagedKVConfig], ids: list[int], max_tokens: int = 5) -> NewRequest:
    ppo = spec.process_prompt(PromptRequest(ids))
    caps = spec.clamp_caps(spec.get_loop_caps(max_tokens, prompt_len=len(ids)))
    refs, _ = pack_tensors({"input_ids": np.asarray(ids, dtype=np.int32)})
    return NewRequest("r", "", refs, SamplingParams(), "", len(ids), max_tokens, ppo.kv_layout, caps,
                      spec.kv_configs(ppo.kv_layout, caps, pools))


def test_every_declared_pool_gets_a_config_even_when_the_layout_leaves_it_empty():
    spec = DecoderLMSpec({**CONFIG, "model_type": "mistral", "sliding_window": 8}, page_size=4)
    pools = spec.paged_pools(16)
    assert set(pools) == {"kv_window"}  # a Mistral with a window on every layer: one pool
    layout_without = {}  # a layout that opens no label still configures every pool
    configs = spec.kv_configs(layout_without, {"decode_loop": 4}, pools)
    assert configs == {"kv_window": msgspec.convert({"pool": "kv_window", "page_size": 4}, type(configs["kv_window"]))}
    assert configs["kv_window"].total_pages == 0


def test_the_worker_refuses_a_footprint_the_conductor_computed_differently():
    spec = DecoderLMSpec(CONFIG, page_size=4)
    pools = spec.paged_pools(16)
    req = _request(spec, pools, [5, 6, 7])
    assert req.kv_configs["kv"].footprints == {"text": 2}  # 3 + 4 rows in pages of 4
    lying = {"kv": msgspec.structs.replace(req.kv_configs["kv"], footprints={"text": 1})}
    with pytest.raises(ValueError, match=r"label 'text': conductor footprint 1 != worker footprint 2"):
        KVManager(pools, spec.kv_labels).ingest_request(msgspec.structs.replace(req, kv_configs=lying))
    kv = KVManager(pools, spec.kv_labels)
    assert kv.ingest_request(req).footprint("kv") == 2  # the truthful one is taken
