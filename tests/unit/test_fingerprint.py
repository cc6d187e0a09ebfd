"""The registration check's comparison: per-worker sizing may differ, the model and every
other deployment setting must agree, and a refusal names both sides."""

from __future__ import annotations

from shared.config import Deployment
from shared.fingerprint import deployment_identity, mismatch
from shared.frames import Fingerprint


def _fp(model: str = "m (sha256 aaa)", **fields) -> Fingerprint:
    return Fingerprint(model, deployment_identity(Deployment(**fields)))


def test_per_worker_sizing_may_differ():
    ours = _fp()
    assert mismatch(ours, _fp(num_kv_pages=100, kv_memory_fraction=0.5, max_num_seqs=8, max_batch_tokens=64)) is None
    assert mismatch(ours, _fp(model="m (sha256 aaa)")) is None


def test_model_and_deployment_differences_name_both_sides():
    ours = _fp(page_size=16, dtype="float32")
    why = mismatch(ours, _fp("other (sha256 bbb)", page_size=32, dtype="bfloat16"))
    assert "it loaded model other (sha256 bbb), this conductor serves m (sha256 aaa)" in why
    assert "page_size (worker 32, conductor 16)" in why and 'dtype (worker "bfloat16", conductor "float32")' in why
    assert "prefix_cache (worker false, conductor true)" in mismatch(ours, _fp(prefix_cache=False))
    assert "sent no fingerprint" in mismatch(ours, None)
