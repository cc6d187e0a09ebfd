"""How Qwen3-Omni's talker picks each frame's first code, as transformers' talker `generate`
does (`Qwen3OmniMoeForConditionalGeneration.generate`'s talker kwargs):

- always: the 1024 ids past the codes suppressed except `codec_eos` (`suppress_tokens`),
  and the repetition penalty (1.05) over the first codes sampled so far (the talker's
  `generate` is given no input ids, so the prompt counts for nothing);
- greedy (`talker_do_sample=False`): the argmax;
- sampled (transformers' default, `talker_do_sample=True`): its warpers in its order,
  temperature, then top-k, then top-p (HF's `TopPLogitsWarper`: drop the least likely
  tokens whose probabilities sum to at most 1 - top_p, keeping one), then a draw from the
  request's own generator (`make_generator(seed)`: the same seed gives the same codes,
  whatever shares the step).

A request's talker samples with the chat route's `audio.temperature` / `audio.top_p` /
`audio.top_k` (options "talker_temperature"... on the request's metadata); what it leaves
out takes transformers' `generate` defaults (temperature 0.9, top_k 50, top_p 1.0: the
defaults of its signature, which a release's generation_config.json does not change). A
temperature of 0 is greedy; so is a request whose own temperature is 0 unless its
`audio.temperature` says otherwise (the api's choice: a greedy request is greedy in every
stage). The code predictor samples where the talker does (transformers' talker copies its
`do_sample` onto the predictor's generation config), with the predictor's own warpers:
temperature 1 (its config's), top_k 50, top_p 0.8 (fixed in the talker's forward), from the
same generator; where the talker is greedy, so is the predictor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from services.gpu_worker.sampler import make_generator, warp
from shared.frames import SamplingParams

#: transformers' `generate` defaults for the talker
REPETITION_PENALTY = 1.05
SUPPRESSED_TAIL = 1024
TEMPERATURE, TOP_K, TOP_P = 0.9, 50, 1.0
#: the code predictor's warpers when it samples (`Qwen3OmniMoeTalkerForConditionalGeneration.forward`)
PREDICTOR = SamplingParams(temperature=1.0, top_p=0.8, top_k=50)


@dataclass
class TalkerSampling:
    """One request's talker sampling: its warpers (None: greedy) and its generator."""

    params: SamplingParams | None = None
    generator: torch.Generator | None = None

    @classmethod
    def of(cls, metadata: Mapping[str, Any], seed: int | None) -> TalkerSampling:
        """From a request's metadata ("talker_temperature", "talker_top_p", "talker_top_k")
        and its seed."""
        temperature = float(metadata.get("talker_temperature", TEMPERATURE))
        if temperature == 0.0:
            return cls()
        params = SamplingParams(temperature=temperature, top_p=float(metadata.get("talker_top_p", TOP_P)),
                                top_k=int(metadata.get("talker_top_k", TOP_K)))
        return cls(params, make_generator(seed))


def first_code_scores(logits: torch.Tensor, history: list[int], codec_eos: int,
                      params: SamplingParams | None) -> torch.Tensor:
    """The first code's scores as transformers' processors leave them (float32, -inf for
    every id they drop): what the greedy argmax or the draw reads. `logits` is left alone."""
    x = logits.float().clone()
    vocab = x.shape[0]
    keep = x[codec_eos].clone()
    x[max(0, vocab - SUPPRESSED_TAIL):] = float("-inf")
    x[codec_eos] = keep
    if history:
        seen = torch.tensor(sorted(set(history)), device=x.device)
        vals = x[seen]
        x[seen] = torch.where(vals < 0, vals * REPETITION_PENALTY, vals / REPETITION_PENALTY)
    return x if params is None else warped(x, params)


def warped(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """HF's warpers on one row of float32 scores: temperature, then top-k, then top-p."""
    x = warp(x, params)
    return _top_p(x, params.top_p) if params.top_p < 1.0 else x


def predictor_codes(logits: torch.Tensor, samplings: list[TalkerSampling] | None) -> torch.Tensor:
    """One code predictor step's codes [b] from its logits [b, vocab]: the argmax, or, for
    a run that samples, a draw with the predictor's warpers (`PREDICTOR`)."""
    codes = torch.argmax(logits, dim=-1)
    if not samplings or all(s.params is None for s in samplings):
        return codes
    out = codes.tolist()
    for i, s in enumerate(samplings):
        if s.params is not None:
            out[i] = choose(warped(logits[i].float(), PREDICTOR), s)
    return torch.tensor(out, device=logits.device)


def _top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """HF's `TopPLogitsWarper` on one row (min_tokens_to_keep 1)."""
    sorted_x, order = torch.sort(x, descending=False)
    drop = sorted_x.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    drop[-1] = False
    return x.masked_fill(drop.scatter(0, order, drop), float("-inf"))


def choose(scores: torch.Tensor, sampling: TalkerSampling) -> int:
    """The first code: the argmax, or a draw from softmax(`scores`) with the request's
    generator (on the host: seeded codes do not depend on the device)."""
    if sampling.params is None:
        return int(torch.argmax(scores))
    probs = torch.softmax(scores.cpu(), dim=-1)
    return int(torch.multinomial(probs, 1, generator=sampling.generator).item())
