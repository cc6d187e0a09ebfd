"""Mixtral through the real services: greedy tokens equal transformers' float32 `generate` on
random-weight `MixtralForCausalLM` checkpoints of three shapes (experts 8, 8 and 64, top-k 2,
1 and 8, always renormalized; no sliding window and a window of 8; head sizes 32, 48 and 16,
which the C decode kernel now computes batch invariantly), each prompt whole and cut into
16-row prefill chunks, one at a time and 8 at once; the pages all come back, each prompt's
tokens and logprobs alone are bitwise the same among the 8 (without a window: see the test),
and /v1/models and the start-up log count every expert in the total and a token's k in the
active parameters. The helpers are test_moe_parity's (Qwen3-MoE's same checks)."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from shared.specs.base import _magnitude
from tests.checkpoints import make_checkpoint
from tests.e2e.test_moe_parity import EIGHT, _generate, _want, _wrong
from tests.e2e.test_parity import PROMPTS
from tests.reference import hf_model
from tests.servers import MstarServer

#: case -> MixtralConfig settings over tests.checkpoints.FAMILIES["mixtral"]
SHAPES = {
    "e8-top2-d32": dict(num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2, head_dim=32),
    "e8-top1-d48-window8": dict(num_local_experts=8, num_experts_per_tok=1, num_hidden_layers=2, head_dim=48,
                                sliding_window=8),
    "e64-top8-d16": dict(num_local_experts=64, num_experts_per_tok=8, num_hidden_layers=3, head_dim=16,
                         intermediate_size=48),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            made[case] = make_checkpoint(tmp_path_factory.mktemp(case) / case, "mixtral", **SHAPES[case])
        return made[case]

    return get


@pytest.mark.parametrize("budget", ["whole", "chunked"])
@pytest.mark.parametrize("case", list(SHAPES))
def test_mixtral_greedy_matches_transformers(checkpoints, tmp_path, case, budget):
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
        if SHAPES[case].get("sliding_window"):
            # not under a window: there a prompt prefilled whole and the same prompt in chunks
            # (as the scheduler cuts it beside running streams) differ in the last bits. A
            # dense Mistral with window 8 does the same (a 73-token prompt's logprobs under
            # --max-batch-tokens 2048 differ from 16, 32 or 40, which agree): a finding apart
            # from the experts. The tokens are still transformers'.
            break
        among = together[EIGHT.index(prompt)]
        assert (among["token_ids"], among["logprobs"]) == (body["token_ids"], body["logprobs"]), prompt[:30]
    if budget == "chunked":
        assert max(_want(ckpt, p)[0] for p in EIGHT) > 16  # some prompt was cut
    shape = SHAPES[case]
    total = sum(p.numel() for p in hf_model(str(ckpt)).parameters())
    expert = 3 * 64 * shape.get("intermediate_size", 32)  # gate (w1), up (w3) and down (w2) of hidden 64
    idle = shape["num_hidden_layers"] * (shape["num_local_experts"] - shape["num_experts_per_tok"]) * expert
    assert (card["parameters"], card["active_parameters"]) == (total, total - idle)
    assert f"{_magnitude(total)} parameters, {_magnitude(total - idle)} active" in log
