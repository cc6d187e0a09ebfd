"""The tuning cache (services/gpu_worker/tuning_cache.py): the step-cost calibration and the
quantized GEMMs' thread count, measured once and read back at the next start with the
same key; another key, a corrupt file or a tampered fit is measured again and never used;
MSTAR_TUNING_CACHE=off measures every time and keeps nothing."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from services.gpu_worker import step_costs, tuning_cache
from services.gpu_worker.step_costs import StepShape, calibrate_cached
from tests.engines import tiny_engine, tiny_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MSTAR_TUNING_CACHE", str(tmp_path / "tuning"))
    return tmp_path / "tuning"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tuning") / "llama")


def engine(spec, model):
    return tiny_engine(spec, model, 64, 64, 0.03)


@pytest.fixture
def calibrations(monkeypatch):
    """How many times the engine was calibrated (cache misses)."""
    calls = []
    real = step_costs.calibrate

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(step_costs, "calibrate", counted)
    return calls


def cal(spec, model, parts):
    pools, kv, eng = engine(spec, model)
    with kv.untracked():
        costs, hit = calibrate_cached(eng, spec, pools, 64, 8, parts)
    assert eng.scheduler.costs is costs and kv.used_pages() == 0
    return costs, hit


def same_model(a, b) -> None:
    assert np.array_equal(a.a, b.a) and np.array_equal(a.b, b.b) and a.steps == b.steps
    assert np.array_equal(a.coef, b.coef) and np.array_equal(a.prior, b.prior)
    assert a.predict(StepShape(64, 1, 2080)) == b.predict(StepShape(64, 1, 2080))


PARTS = {"model": "m", "limits": {"max_batch_tokens": 64}}


def test_a_calibration_is_kept_and_read_back_as_the_same_model(cache, calibrations, llama):
    spec, model = llama
    first, hit = cal(spec, model, PARTS)
    assert not hit and calibrations == [1] and len(list(cache.glob("step-costs-*.json"))) == 1
    second, hit = cal(spec, model, PARTS)
    assert hit and calibrations == [1]
    same_model(first, second)
    assert second.ready and second.prior is not None


def test_another_key_calibrates_again(cache, calibrations, llama):
    spec, model = llama
    cal(spec, model, PARTS)
    _, hit = cal(spec, model, {**PARTS, "limits": {"max_batch_tokens": 128}})
    assert not hit and len(calibrations) == 2 and len(list(cache.glob("step-costs-*.json"))) == 2


@pytest.mark.parametrize("damage", ["not json", "truncated", "tampered coef", "another key", "too few steps", "nan"])
def test_a_corrupt_or_tampered_calibration_is_measured_again(cache, calibrations, llama, damage):
    spec, model = llama
    cal(spec, model, PARTS)
    (path,) = cache.glob("step-costs-*.json")
    text = path.read_text()
    kept = json.loads(text)
    if damage == "not json":
        text = "{nope"
    elif damage == "truncated":
        text = text[: len(text) // 2]
    else:
        if damage == "tampered coef":
            kept["record"]["coef"][0] += 1.0
        elif damage == "another key":
            kept["key"] = "0" * 32
        elif damage == "too few steps":
            kept["record"]["steps"] = 1
        else:
            kept["record"]["b"][0] = float("nan")
        text = json.dumps(kept)
    path.write_text(text)
    again, hit = cal(spec, model, PARTS)
    assert not hit and len(calibrations) == 2
    assert json.loads(path.read_text())["record"]["coef"] == again.coef.tolist()  # rewritten whole
    _, hit = cal(spec, model, PARTS)
    assert hit


def test_off_by_env_or_no_key_always_calibrates(tmp_path, monkeypatch, calibrations, llama):
    spec, model = llama
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MSTAR_TUNING_CACHE", "off")
    assert tuning_cache.cache_dir() is None
    for _ in range(2):
        assert not cal(spec, model, PARTS)[1]
    monkeypatch.setenv("MSTAR_TUNING_CACHE", str(tmp_path / "tuning"))
    assert not cal(spec, model, None)[1]
    assert len(calibrations) == 3 and not list(tmp_path.rglob("*.json"))


def test_the_key_follows_the_model_files(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)
    a = tuning_cache.key("k", tuning_cache.files_identity(f))
    assert a == tuning_cache.key("k", tuning_cache.files_identity(f))
    os.utime(f, ns=(0, 10**9))
    assert a != tuning_cache.key("k", tuning_cache.files_identity(f))


def test_the_calibration_key_follows_the_model_file_the_code_and_the_limits_not_a_big_pools_size(
        tmp_path, monkeypatch, llama):
    from types import SimpleNamespace

    from services.gpu_worker.build import calibration_key_parts
    from shared.config import Deployment

    spec, model = llama
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 10)

    def parts(pages):
        return SimpleNamespace(source=SimpleNamespace(path=f), spec=spec, pools=spec.paged_pools(pages), model=model)

    d = Deployment()
    a = calibration_key_parts(parts(1000), d)
    assert a == calibration_key_parts(parts(2000), d)  # both hold every calibration prompt
    assert a != calibration_key_parts(parts(4), d)  # too small: the calibration it runs differs
    assert a != calibration_key_parts(parts(1000), Deployment(max_num_seqs=8))
    monkeypatch.setattr(tuning_cache, "code_digest", lambda: "other")
    assert a != calibration_key_parts(parts(1000), d)
    monkeypatch.undo()
    os.utime(f, ns=(0, 10**9))
    assert a != calibration_key_parts(parts(1000), d)
