"""The one server-and-compare loop of the per-family parity tests (tests/e2e/test_family_parity.py):
a random checkpoint served by the real services, its greedy tokens and prompt lengths equal
transformers' float32 `generate`, prompts one at a time and then eight at once (rows of several
requests in one step, each prompt's chunks cut where the shared budget ends); each prompt's
tokens and logprobs alone bitwise the same among the eight where the row says so; every KV page
and state slot back to zero under the layout debug checks; /v1/models and the start-up log count
every parameter and a token's active ones.

A row is one family x shape. Its budget is where the distinct prefill paths come from:
"chunked" (`--max-batch-tokens 16` or the row's `chunk`) prefills every prompt up to the budget
whole and cuts the longer ones (so the chunk boundary, and the window or convolution across it);
"whole" (the default 2048) prefills the long prompts in one step too (many rows, key blocks skipped
behind a window inside one chunk). Each family keeps both among its rows."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.checkpoints import make_checkpoint
from tests.e2e.test_parity import PROMPTS
from tests.reference import hf_greedy, hf_ids
from tests.servers import MstarServer

DEBUG = {"MSTAR_KV_DEBUG_ASSERTS": "1"}

#: eight different prompts for the concurrent round, several long enough to be chunked
EIGHT = [*PROMPTS, "Serving engines batch requests and page their KV cache. " * 4, "中文字符 and 3.14159",
         "What is the capital of France? Paris is the capital of France. " * 3]

#: (checkpoint folder, served /v1/models card) -> (total, active) parameters
Counts = Callable[[Path, dict], tuple[int, int]]
#: a check run on the row's server after its rounds (server, checkpoint folder)
Extra = Callable[[MstarServer, Path], None]


@dataclass(frozen=True)
class Row:
    """One family x shape: how its checkpoint is made, served and checked."""

    family: str  # a key of tests.checkpoints.FAMILIES
    overrides: dict = field(default_factory=dict)
    budget: str = "chunked"  # "whole" or "chunked"
    chunk: int = 16  # --max-batch-tokens of a chunked row
    alone: tuple[str, ...] = tuple(PROMPTS)
    together: tuple[str, ...] = tuple(EIGHT)
    max_tokens: int = 12
    invariant: bool = True  # each alone prompt bitwise the same (tokens, logprobs) among the eight
    counts: Counts | None = None
    log_counts: bool = True  # the start-up log states the counts too
    make: Callable[[Path], Path] | None = None  # a checkpoint other than make_checkpoint's
    extras: tuple[Extra, ...] = ()
    serve_args: tuple[str, ...] = ()


def checkpoint(row: Row, folder: Path) -> Path:
    return row.make(folder) if row.make else make_checkpoint(folder, row.family, **row.overrides)


@functools.cache
def want(ckpt: Path, prompt: str, max_tokens: int) -> tuple[int, list[int]]:
    """(prompt length, transformers' greedy tokens), once per checkpoint and prompt."""
    ids = hf_ids(ckpt, prompt)
    return len(ids), hf_greedy(ckpt, ids, max_tokens)


def generate(url: str, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(url + "/generate", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                            "ignore_eos": True, "logprobs": 2}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def wrong(ckpt: Path, prompts: tuple[str, ...], bodies: list[dict], max_tokens: int) -> list[tuple]:
    """The prompts whose tokens or prompt length differ from transformers'."""
    out = []
    for prompt, body in zip(prompts, bodies, strict=True):
        n, tokens = want(ckpt, prompt, max_tokens)
        if body["token_ids"] != tokens or body["usage"]["prompt_tokens"] != n:
            out.append((prompt[:30], body["usage"]["prompt_tokens"], n, body["token_ids"], tokens))
    return out


def serve(row: Row, ckpt: Path, log_path: Path) -> MstarServer:
    budget = ("--max-batch-tokens", str(row.chunk)) if row.budget == "chunked" else ()
    return MstarServer(str(ckpt), log_path, "--num-kv-pages", "128", *budget, *row.serve_args, env=DEBUG).launch()


def check_row(row: Row, ckpt: Path, log_path: Path) -> None:
    """The row's rounds on one server, then its extra checks on the same server; transformers'
    answers computed while the server starts."""
    server = serve(row, ckpt, log_path)
    try:
        for prompt in dict.fromkeys(row.alone + row.together):
            want(ckpt, prompt, row.max_tokens)
        server.wait_ready()
        alone = [generate(server.url, p, row.max_tokens) for p in row.alone]
        with ThreadPoolExecutor(len(row.together)) as pool:
            together = list(pool.map(lambda p: generate(server.url, p, row.max_tokens), row.together))
        assert server.wait_pages_free() == 0
        card = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
        for extra in row.extras:
            extra(server, ckpt)
        log = server.log()
    finally:
        server.stop()
    assert "footprint overrun" not in log.lower() and "failed (error_id=" not in log
    bad_alone = wrong(ckpt, row.alone, alone, row.max_tokens)
    bad_together = wrong(ckpt, row.together, together, row.max_tokens)
    assert not bad_alone, f"{len(bad_alone)} of {len(alone)} prompts differ from transformers: {bad_alone}"
    assert not bad_together, f"{len(bad_together)} of 8 at once differ from transformers: {bad_together}"
    if row.invariant:
        for prompt, body in zip(row.alone, alone, strict=True):  # the same bits alone and among the 8
            among = together[row.together.index(prompt)]
            assert (among["token_ids"], among["logprobs"]) == (body["token_ids"], body["logprobs"]), prompt[:30]
    lengths = [want(ckpt, p, row.max_tokens)[0] for p in row.together]
    if row.budget == "chunked":
        assert max(lengths) > row.chunk and min(lengths) <= row.chunk  # some prompts cut, some whole
    if row.counts:
        _check_counts(row.counts(ckpt, card), card, log if row.log_counts else None)


def _check_counts(counts: tuple[int, int], card: dict, log: str | None) -> None:
    from shared.specs.base import _magnitude

    total, active = counts
    assert (card["parameters"], card["active_parameters"]) == (total, active)
    if log is not None:
        assert f"{_magnitude(total)} parameters, {_magnitude(active)} active" in log
