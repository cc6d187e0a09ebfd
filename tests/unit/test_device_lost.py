"""A step that fails: on a sticky device error (CUDA's illegal memory access, ECC, ...)
every request the worker holds fails and the engine raises `DeviceLost`, so the worker
exits to be restarted; any other step error fails only that step's requests."""

from __future__ import annotations

import pytest

from services.gpu_worker.engine import DeviceLost, device_lost
from shared.errors import ErrorKind
from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.specs.base import PromptRequest
from tests.engines import tiny_engine, tiny_model


def test_which_errors_lose_the_device():
    assert device_lost(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert device_lost(RuntimeError("CUDA error: uncorrectable ECC error encountered"))
    assert device_lost(RuntimeError("CUDA error: device-side assert triggered"))
    assert not device_lost(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not device_lost(RuntimeError("illegal memory access"))  # not from CUDA
    assert not device_lost(ValueError("shape mismatch"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("lost") / "llama")


def _engine_with(llama, prompts: dict[str, int], max_batch_tokens: int):
    spec, model = llama
    pools, kv, eng = tiny_engine(spec, model, 64, max_batch_tokens, 0.0)
    for rid, n in prompts.items():
        ids = list(range(3, 3 + n))
        ppo = spec.process_prompt(PromptRequest(ids))
        caps = spec.clamp_caps(spec.get_loop_caps(4, prompt_len=n))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        eng.add(NewRequest(rid, "", refs, SamplingParams(temperature=0.0, ignore_eos=True), "api", n, 4,
                           ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools), metadata=ppo.metadata),
                ppo.new_input_tensors)
    return kv, eng


def _raise(exc):
    def execute(plan):
        raise exc
    return execute


def test_a_sticky_cuda_error_fails_every_request_and_raises_device_lost(llama):
    kv, eng = _engine_with(llama, {"a": 8, "b": 8, "c": 40}, max_batch_tokens=16)  # c waits for a later step
    eng.runner.execute = _raise(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(DeviceLost) as info:
        eng.step()
    res = info.value.result
    kinds = {err.request_id: err.kind for _, err in res.errors}
    assert kinds == {"a": ErrorKind.INTERNAL, "b": ErrorKind.INTERNAL, "c": ErrorKind.WORKER_FAILED}
    assert sorted(f.request_id for f in res.finished) == ["a", "b", "c"]
    assert not eng.has_work and kv.used_pages() == 0


def test_any_other_step_error_fails_only_that_steps_requests(llama):
    _, eng = _engine_with(llama, {"a": 8, "b": 8, "c": 40}, max_batch_tokens=16)
    eng.runner.execute = _raise(RuntimeError("boom"))
    res = eng.step()
    assert sorted(err.request_id for _, err in res.errors) == ["a", "b"]
    assert [r.request_id for r in eng.running] == ["c"]
