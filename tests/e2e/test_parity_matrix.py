"""Exact greedy tokens against transformers, for every supported architecture in both config
forms real checkpoints carry (transformers 5's `rope_parameters`, and the classic top-level
`rope_theta` + `rope_scaling` of transformers 4.x), and for every RoPE type end to end.

Each checkpoint is random-weight, made here with transformers; the classic copy shares its
weights. The reference is transformers loading the same folder. Settings chosen so each
difference matters: RoPE bases other than the default, Mistral's and Gemma's sliding
windows shorter than prompt + output, Qwen3's head_dim unequal to hidden / heads, Llama 3
scaling with an original context shorter than the prompts, Gemma 2's soft-capping low
enough to change attention, Gemma 3's linear-scaled global RoPE beside its local one.
"""

from __future__ import annotations

import httpx
import pytest

from tests.checkpoints import make_checkpoint, to_classic_config
from tests.e2e.test_parity import PROMPTS
from tests.reference import hf_greedy, hf_ids
from tests.servers import MstarServer

MAX_TOKENS = 12
SHORT = [1.0 + 0.1 * i for i in range(8)]
LONG = [1.0 + 1.5 * i for i in range(8)]

#: case -> (family, overrides of tests.checkpoints.FAMILIES' settings)
ARCHITECTURES = {
    "llama": ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
                                              "rope_theta": 500000.0})),
    "mistral": ("mistral", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen2": ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3": ("qwen3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "phi3": ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 250000.0})),
    # YaRN as gpt-oss configs carry it (truncate false; classic: the release's rope_scaling form)
    "gpt_oss": ("gpt_oss", {}),
}

#: RoPE types not covered above; dynamic decodes past the original context (from prompts
#: inside it, where the tables are exactly transformers', see rope.py)
ROPES = {
    "linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}), 0),
    "dynamic": ("llama", dict(max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                                           "rope_theta": 10000.0}), 32),
    "yarn": ("qwen2", dict(max_position_embeddings=256, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                         "original_max_position_embeddings": 16,
                                                                         "rope_theta": 1000000.0}), 0),
    # within the original context (see rope.py: transformers' Phi-3 recomputes its whole
    # cache with the long factors when a sequence crosses it; mstar does not)
    "longrope": ("phi3", dict(max_position_embeddings=512, original_max_position_embeddings=128,
                              rope_parameters={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                                               "rope_theta": 10000.0}), 0),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoints made on first use, keyed by (case, form)."""
    made: dict = {}

    def get(case: str, form: str):
        if (case, form) not in made:
            family, overrides = ARCHITECTURES[case] if case in ARCHITECTURES else ROPES[case][:2]
            path = make_checkpoint(tmp_path_factory.mktemp(case) / case, family, **overrides)
            made[case, "transformers5"] = path
            made[case, "classic"] = to_classic_config(path, path.parent / f"{case}-classic")
        return made[case, form]

    return get


def _check(ckpt, prompts: list[str], log_path, max_tokens: int = MAX_TOKENS) -> None:
    server = MstarServer(str(ckpt), log_path, "--num-kv-pages", "128").start()
    wrong = []
    try:
        for prompt in prompts:
            r = httpx.post(server.url + "/generate", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                           "ignore_eos": True}, timeout=60)
            assert r.status_code == 200, r.text
            body, ids = r.json(), hf_ids(ckpt, prompt)
            want = hf_greedy(ckpt, ids, max_tokens)
            if body["token_ids"] != want or body["usage"]["prompt_tokens"] != len(ids):
                wrong.append((prompt[:30], body["usage"]["prompt_tokens"], len(ids), body["token_ids"], want))
        assert server.wait_pages_free() == 0
    finally:
        server.stop()
    assert not wrong, f"{len(wrong)} of {len(prompts)} prompts differ from transformers: {wrong}"


@pytest.mark.parametrize("form", ["transformers5", "classic"])
@pytest.mark.parametrize("case", list(ARCHITECTURES))
def test_architecture_matches_transformers(checkpoints, tmp_path, case, form):
    _check(checkpoints(case, form), PROMPTS, tmp_path / "serve.log")


@pytest.mark.parametrize("case", list(ROPES))
def test_rope_type_matches_transformers(checkpoints, tmp_path, case):
    ckpt = checkpoints(case, "transformers5")
    original = ROPES[case][2]
    prompts = PROMPTS
    if original:  # prompts inside the original context, output past it: the switch is exercised
        prompts = [p for p in PROMPTS if len(hf_ids(ckpt, p)) < original]
        assert len(prompts) >= 3
    _check(ckpt, prompts, tmp_path / "serve.log", max_tokens=original or MAX_TOKENS)
