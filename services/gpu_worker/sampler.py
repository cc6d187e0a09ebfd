"""Token sampling for one step: greedy rows in one argmax, the rest per row with each
request's own generator (so a seeded request's tokens do not depend on its batch).

A row whose request changes its logits (`SamplingParams.processed`) or asks for logprobs
takes the per-row path, in vLLM's order:

1. logit_bias (added), then min_tokens (EOS and `stop_token_ids` masked while fewer
   tokens than `min_tokens` were generated), then the penalties: repetition on every token
   of prompt + output (a positive logit divided by it, a negative one multiplied), then
   frequency (times each token's count in the output) and presence (once per token the
   output holds) subtracted;
2. logprobs, when asked: the float32 log-softmax of those logits (before temperature,
   min_p, top-k and top-p, which only choose among them), the chosen token's rank and the
   `k` most likely tokens;
3. a constrained request's grammar (`guided.py`): tokens it does not allow next are
   dropped, and the token chosen advances it;
4. greedy: the argmax; otherwise temperature, then min_p (tokens whose probability is
   below `min_p` times the most likely one's are dropped), then top-k, then top-p.

Rows that ask for none of this cost what they did before: one argmax over the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from services.gpu_worker.guided import Guide
from shared.frames import SamplingParams, TokenLogprobs


class Row(NamedTuple):
    """One sampled row: its request's params and generator, and what the logits
    processors read (the prompt, the tokens generated before this row, and the ids
    `min_tokens` masks)."""

    params: SamplingParams
    generator: torch.Generator
    prompt: Sequence[int] = ()
    output: Sequence[int] = ()
    stop_ids: Sequence[int] = ()
    #: the request's grammar state (structured outputs), advanced by the token sampled here
    guide: Guide | None = None


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
    return gen


def sample(logits: torch.Tensor | np.ndarray, rows: Sequence[Row]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The token of each row, and its logprobs where its request asked (else None).
    `logits` may be a float32 numpy array (the C decode stack's): greedy rows then need
    no torch op at all, each of which costs tens of microseconds right after a step."""
    # per-request CPU generators: seeded tokens do not depend on the device
    host = logits if isinstance(logits, np.ndarray) else logits.float().cpu().numpy()
    # numpy's argmax: faster than torch's on one thread, and the same ties (the first
    # maximum wins in both)
    out = host.argmax(axis=-1).tolist()
    lps: list[TokenLogprobs | None] = [None] * len(rows)
    for i, row in enumerate(rows):
        p = row.params
        if p.greedy and not p.processed and p.logprobs is None and row.guide is None:
            continue
        x = torch.from_numpy(host[i])  # (a view: the same values)
        x = process(x, row) if p.processed else x
        if p.greedy:  # the grammar chooses among the logits, as top-k does
            out[i] = int(x.numpy().argmax()) if row.guide is None else row.guide.greedy(x.numpy())
        else:
            out[i] = _draw(x if row.guide is None else row.guide.mask(x), p, row.generator)
        if p.logprobs is not None:
            lps[i] = token_logprobs(torch.log_softmax(x, dim=-1), out[i], p.logprobs)
        if row.guide is not None:
            row.guide.accept(out[i])
    return out, lps


def process(x: torch.Tensor, row: Row) -> torch.Tensor:
    """vLLM's logits processors on one row (a new tensor; `x` is left alone)."""
    p = row.params
    vocab = x.numel()
    x = x.clone()
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        if ids:
            x[torch.tensor(ids)] += torch.tensor([p.logit_bias[t] for t in ids], dtype=x.dtype)
    if len(row.output) < p.min_tokens:
        ids = [t for t in row.stop_ids if t < vocab]
        if ids:
            x[torch.tensor(ids)] = float("-inf")
    return _penalize(x, p, row.prompt, row.output)


def _penalize(x: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    vocab = x.numel()
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.zeros(vocab, dtype=torch.bool)
        ids = torch.tensor([*prompt, *output], dtype=torch.long)
        seen[ids[ids < vocab]] = True
        rp = p.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if output and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
        ids = torch.tensor(list(output), dtype=torch.long)
        counts = torch.bincount(ids[ids < vocab], minlength=vocab)[:vocab].to(x.dtype)
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(x.dtype)
    return x


def warp(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then min_p, then top-k (-inf for every token they drop)."""
    row = x / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k and p.top_k > 0 and p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    return row


def _draw(x: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    probs = torch.softmax(warp(x, p), dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        cum = sorted_p.cumsum(0)
        drop = cum - sorted_p > p.top_p  # keep the smallest prefix reaching top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def token_logprobs(lp: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """`token`'s logprob and rank in the log-softmax row `lp`, and the `k` most likely."""
    own = float(lp[token])
    rank = int((lp > lp[token]).sum()) + 1
    if k <= 0:
        return TokenLogprobs(own, rank)
    top = torch.topk(lp, min(k, lp.numel()))
    return TokenLogprobs(own, rank, top.indices.tolist(), top.values.tolist())


def prompt_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
    """Row i of `logits` predicts `tokens[i]`: each one's logprobs (raw logits, float32)."""
    lp = torch.log_softmax(logits.float().cpu(), dim=-1)
    return [token_logprobs(lp[i], int(t), k) for i, t in enumerate(tokens)]
