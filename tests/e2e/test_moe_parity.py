"""Qwen3-MoE through the real services: greedy tokens equal transformers' float32 `generate`
on random-weight checkpoints of three shapes (experts 8 and 16, top-k 1, 2 and 4, renormalized
or not, a dense layer among sparse ones by `mlp_only_layers` and by `decoder_sparse_step`),
each prompt whole (the default step budget) and cut into 16-row prefill chunks
(`--max-batch-tokens 16`), one at a time and 8 at once; the pages all come back. A row's
result does not depend on its neighbours: each prompt's tokens and logprobs alone are
bitwise the same among the 8 (its experts are picked and computed per row)."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.checkpoints import make_checkpoint
from tests.e2e.test_parity import PROMPTS
from tests.reference import hf_greedy, hf_ids, hf_model
from tests.servers import MstarServer

MAX_TOKENS = 12

#: case -> Qwen3MoeConfig settings over tests.checkpoints.FAMILIES["qwen3_moe"] (head sizes
#: 32 and 48, whose decode rows the C kernel once computed with other bits beside other rows,
#: are test_mixtral_parity's)
SHAPES = {
    "e8-top2": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=2, head_dim=64),
    "e16-top4-norm-dense1": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=3,
                                 mlp_only_layers=[1], head_dim=128),
    "e16-top1-step2": dict(num_experts=16, num_experts_per_tok=1, norm_topk_prob=False, num_hidden_layers=4,
                           decoder_sparse_step=2, moe_intermediate_size=48, head_dim=16),
}

#: eight different prompts for the concurrent round, two long enough to be chunked
EIGHT = [*PROMPTS, "Serving engines batch requests and page their KV cache. " * 4, "中文字符 and 3.14159",
         "What is the capital of France? Paris is the capital of France. " * 3]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            made[case] = make_checkpoint(tmp_path_factory.mktemp(case) / case, "qwen3_moe", **SHAPES[case])
        return made[case]

    return get


@functools.cache
def _want(ckpt: Path, prompt: str) -> tuple[int, list[int]]:
    """(prompt length, transformers' greedy tokens), once per checkpoint and prompt."""
    ids = hf_ids(ckpt, prompt)
    return len(ids), hf_greedy(ckpt, ids, MAX_TOKENS)


def _generate(url: str, prompt: str) -> dict:
    r = httpx.post(url + "/generate", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                            "ignore_eos": True, "logprobs": 2}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _wrong(ckpt: Path, prompts: list[str], bodies: list[dict]) -> list[tuple]:
    wrong = []
    for prompt, body in zip(prompts, bodies, strict=True):
        n, want = _want(ckpt, prompt)
        if body["token_ids"] != want or body["usage"]["prompt_tokens"] != n:
            wrong.append((prompt[:30], body["usage"]["prompt_tokens"], n, body["token_ids"], want))
    return wrong


@pytest.mark.parametrize("budget", ["whole", "chunked"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_qwen3_moe_greedy_matches_transformers(checkpoints, tmp_path, case, budget):
    ckpt = checkpoints(case)
    args = ["--num-kv-pages", "128"]
    if budget == "chunked":  # every prompt longer than 16 tokens prefilled in several steps
        args += ["--max-batch-tokens", "16"]
    server = MstarServer(str(ckpt), tmp_path / "serve.log", *args).start()
    try:
        alone = [_generate(server.url, p) for p in PROMPTS]
        with ThreadPoolExecutor(len(EIGHT)) as pool:
            together = list(pool.map(functools.partial(_generate, server.url), EIGHT))
        assert server.wait_pages_free() == 0
        card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
        log = server.log()
    finally:
        server.stop()
    wrong_alone, wrong_together = _wrong(ckpt, PROMPTS, alone), _wrong(ckpt, EIGHT, together)
    assert not wrong_alone, f"{len(wrong_alone)} of {len(PROMPTS)} prompts differ from transformers: {wrong_alone}"
    assert not wrong_together, f"{len(wrong_together)} of 8 at once differ from transformers: {wrong_together}"
    for prompt, body in zip(PROMPTS, alone, strict=True):  # the same bits alone and among the 8
        among = together[EIGHT.index(prompt)]
        assert (among["token_ids"], among["logprobs"]) == (body["token_ids"], body["logprobs"]), prompt[:30]
    if budget == "chunked":
        assert max(_want(ckpt, p)[0] for p in EIGHT) > 16  # some prompt was cut
    # every expert counted in the total, a token's k in the active count, in the card and the log
    shape = SHAPES[case]
    total = sum(p.numel() for p in hf_model(str(ckpt)).parameters())
    sparse = sum(1 for i in range(shape["num_hidden_layers"]) if i not in shape.get("mlp_only_layers", ())
                 and (i + 1) % shape.get("decoder_sparse_step", 1) == 0)
    expert = 3 * 64 * shape.get("moe_intermediate_size", 32)  # gate, up and down of hidden 64
    idle = sparse * (shape["num_experts"] - shape["num_experts_per_tok"]) * expert
    assert (card["parameters"], card["active_parameters"]) == (total, total - idle)
    assert f"{total / 1e3:.3g}K parameters, {(total - idle) / 1e3:.3g}K active" in log
