"""The sampler's logits processors against transformers' own (repetition penalty, sequence
bias, min new tokens, temperature + min_p), presence / frequency penalties against
OpenAI's formula, and logprobs against a float32 log-softmax."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from services.gpu_worker.sampler import Row, make_generator, process, sample, warp
from shared.frames import SamplingParams

VOCAB = 64
PROMPT = [3, 5, 5, 9]
OUTPUT = [9, 12, 12, 12, 40]


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _row(output=OUTPUT, stop_ids=(), **params) -> Row:
    return Row(SamplingParams(**params), make_generator(0), PROMPT, output, stop_ids)


def test_repetition_penalty_is_transformers():
    x = _logits()
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([PROMPT + OUTPUT]), x[None].clone())[0]
    torch.testing.assert_close(process(x, _row(repetition_penalty=1.7)), want, rtol=0, atol=0)


def test_logit_bias_is_transformers_sequence_bias():
    x = _logits(1)
    bias = {7: 5.5, 12: -100.0, 63: 0.25}
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([PROMPT]), x[None].clone())[0]
    torch.testing.assert_close(process(x, _row(logit_bias=bias)), want, rtol=0, atol=0)


@pytest.mark.parametrize("generated", [0, 2, 3])
def test_min_tokens_is_transformers_min_new_tokens(generated):
    x = _logits(2)
    stops = (1, 2, 30)
    out = OUTPUT[:generated]
    proc = MinNewTokensLengthLogitsProcessor(len(PROMPT), 3, list(stops))
    want = proc(torch.tensor([PROMPT + out]), x[None].clone())[0]
    got = process(x, _row(out, stops, min_tokens=3))
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(got).any() == (generated < 3)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_presence_and_frequency_penalties_are_openai_formula():
    x = _logits(3)
    got = process(x, _row(presence_penalty=0.5, frequency_penalty=0.75))
    want = x.clone()
    for t in set(OUTPUT):  # the prompt's tokens are not penalised
        want[t] -= 0.75 * OUTPUT.count(t) + 0.5
    torch.testing.assert_close(got, want)


def test_temperature_then_min_p_is_transformers():
    x = _logits(4)
    want = MinPLogitsWarper(0.2)(None, TemperatureLogitsWarper(0.7)(None, x[None].clone()))[0]
    got = warp(x, SamplingParams(temperature=0.7, min_p=0.2))
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(got).sum() > VOCAB // 2
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])


def test_logprobs_are_log_softmax_after_penalties():
    x = torch.stack([_logits(5), _logits(6)])
    rows = [_row(temperature=0, logprobs=5, repetition_penalty=1.3), _row(temperature=0)]
    toks, lps = sample(x, rows)
    lp = torch.log_softmax(process(x[0], rows[0]), -1)
    assert toks[0] == int(lp.argmax()) and toks[1] == int(x[1].argmax())
    assert lps[1] is None
    got = lps[0]
    assert got.rank == 1 and got.top_ids[0] == toks[0] and len(got.top_ids) == 5
    assert got.logprob == pytest.approx(float(lp[toks[0]]), abs=1e-6)
    assert got.top_logprobs == pytest.approx(lp.topk(5).values.tolist(), abs=1e-6)


def test_sampled_token_rank_and_seeded_repeat():
    x = _logits(7)[None]
    rows = [Row(SamplingParams(temperature=5.0, seed=3, logprobs=0), make_generator(3))]
    toks, lps = sample(x, rows)
    again, _ = sample(x, [Row(SamplingParams(temperature=5.0, seed=3, logprobs=0), make_generator(3))])
    lp = torch.log_softmax(x[0], -1)
    assert toks == again and lps[0].top_ids == []
    assert lps[0].rank == int((lp > lp[toks[0]]).sum()) + 1
