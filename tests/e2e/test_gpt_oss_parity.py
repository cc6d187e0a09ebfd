"""gpt-oss through the real services: greedy tokens equal transformers' float32 `generate`
(eager attention with sinks, as GptOssForCausalLM picks it) on random-weight checkpoints of
three shapes (experts 8, 16 and 32, top-k 1, 4 and 2, sliding windows of 8, 128 and 16 with
prompts longer than the window, sliding and full layers alternating, attention sinks, YaRN,
biases, the clamped SwiGLU), each prompt whole and cut into 16-row prefill chunks
(`--max-batch-tokens 16`), one at a time and 8 at once; the pages all come back. A prompt's
tokens and logprobs alone are bitwise the same among the 8 (experts picked and computed per
row, the C attention kernels' rows with sinks too). /v1/models counts every expert's parameters
in the total and a token's k in the active count."""

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

#: case -> GptOssConfig settings over tests.checkpoints.FAMILIES["gpt_oss"]. Head sizes 64, 16
#: and 128, as test_moe_parity's (the C decode kernel's plain-loop path at head_dim 32 or 48
#: is not batch invariant: a separate finding)
SHAPES = {
    "e8-top1-w8": dict(num_local_experts=8, num_experts_per_tok=1, num_hidden_layers=2, head_dim=64),
    "e16-top4-w128": dict(num_local_experts=16, num_experts_per_tok=4, num_hidden_layers=4, sliding_window=128,
                          head_dim=16),
    "e32-top2-w16": dict(num_local_experts=32, num_experts_per_tok=2, num_hidden_layers=3, sliding_window=16,
                         intermediate_size=48, head_dim=128),
}

#: a prompt of ~200 tokens: past gpt-oss's own window of 128
LONG = "The quick brown fox jumps over the lazy dog. Serving engines batch requests and page their KV cache. " * 8

#: eight different prompts for the concurrent round, three long enough to be chunked and to
#: pass every window
EIGHT = [*PROMPTS, LONG, "中文字符 and 3.14159", "What is the capital of France? Paris is the capital of France. " * 3]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            made[case] = make_checkpoint(tmp_path_factory.mktemp(case) / case, "gpt_oss", **SHAPES[case])
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


def _active(ckpt: Path, case: str) -> tuple[int, int]:
    """(total, active) parameters of transformers' model: a token leaves E - k experts of
    each layer idle (gate/up and down weights and biases)."""
    shape = SHAPES[case]
    total = sum(p.numel() for p in hf_model(str(ckpt)).parameters())
    inter = shape.get("intermediate_size", 32)
    expert = 3 * 64 * inter + 2 * inter + 64
    idle = shape["num_hidden_layers"] * (shape["num_local_experts"] - shape["num_experts_per_tok"]) * expert
    return total, total - idle


@pytest.mark.parametrize("budget", ["whole", "chunked"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_gpt_oss_greedy_matches_transformers(checkpoints, tmp_path, case, budget):
    ckpt = checkpoints(case)
    args = ["--num-kv-pages", "128"]
    if budget == "chunked":  # every prompt longer than 16 tokens prefilled in several steps
        args += ["--max-batch-tokens", "16"]
    server = MstarServer(str(ckpt), tmp_path / "serve.log", *args).start()
    try:
        alone = [_generate(server.url, p) for p in [*PROMPTS, LONG]]
        with ThreadPoolExecutor(len(EIGHT)) as pool:
            together = list(pool.map(functools.partial(_generate, server.url), EIGHT))
        assert server.wait_pages_free() == 0
        card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
    finally:
        server.stop()
    wrong_alone, wrong_together = _wrong(ckpt, [*PROMPTS, LONG], alone), _wrong(ckpt, EIGHT, together)
    assert not wrong_alone, f"{len(wrong_alone)} of {len(alone)} prompts differ from transformers: {wrong_alone}"
    assert not wrong_together, f"{len(wrong_together)} of 8 at once differ from transformers: {wrong_together}"
    for prompt, body in zip([*PROMPTS, LONG], alone, strict=True):  # the same bits alone and among the 8
        among = together[EIGHT.index(prompt)]
        assert (among["token_ids"], among["logprobs"]) == (body["token_ids"], body["logprobs"]), prompt[:30]
    window = SHAPES[case].get("sliding_window", 8)
    assert _want(ckpt, LONG)[0] > window  # the window drops keys
    assert (card["parameters"], card["active_parameters"]) == _active(ckpt, case)
