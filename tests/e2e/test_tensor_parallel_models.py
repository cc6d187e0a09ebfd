"""`mstar serve --models-dir DIR --tensor-parallel-size 2` (issue 57): tensor parallel and
several models at once, on the families tests/e2e/test_tensor_parallel.py does not serve
(Gemma 2 with its soft-capping and sliding layer, Gemma 3 with its sliding and scaled-RoPE
global layers, Phi-3 with its packed q/k/v and gate/up projections cut into the ranks'
pieces): one server start, each model's gpu worker a group of two gloo ranks.

All the models' requests at once (4 a model, over one `/generate/ws?model=` socket each),
prompts prefilled in 16-row chunks (the smallest --max-batch-tokens): greedy tokens equal
transformers' (float32) on each model's own checkpoint; every rank's log line says it holds
about half its model's weights; pages back to zero under the layout debug checks."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.reference import hf_greedy, hf_ids
from tests.servers import MstarServer, ws_generate

FAMILIES = ("gemma2", "gemma3", "phi3")
PROMPTS = [
    "The quick brown fox",
    "Hello world! Hello again, world. Goodbye, world. " * 5,  # chunked, and past the sliding windows
    "def add(a, b):\n    return",
    "A B C D E F G H I J K L M N O P Q R S T",  # chunked
]
MAX_TOKENS = 8
ARGS = ("--tensor-parallel-size", "2", "--num-kv-pages", "64", "--max-batch-tokens", "16")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp-models")
    for i, family in enumerate(FAMILIES):
        make_checkpoint(root / family, family, seed=i)
    return root


@pytest.fixture(scope="module")
def served(models_dir, tmp_path_factory):
    """(the server, each model's request bodies and their references): the references are
    computed while the server starts."""
    srv = MstarServer("", tmp_path_factory.mktemp("tp-models-log") / "serve.log", *ARGS,
                      env={"MSTAR_KV_DEBUG_ASSERTS": "1"})
    at = srv.argv.index("--model")
    srv.argv[at:at + 2] = ["--models-dir", str(models_dir)]
    srv.launch()
    try:
        cases = {}
        for family in FAMILIES:
            bodies = [{"input_ids": hf_ids(models_dir / family, p), "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True} for p in PROMPTS]
            cases[family] = (bodies, [hf_greedy(models_dir / family, b["input_ids"], MAX_TOKENS) for b in bodies])
        yield srv.wait_ready(), cases
    finally:
        srv.stop()


def test_every_family_at_tp2_equals_transformers_all_at_once(served):
    srv, cases = served
    assert any(len(b["input_ids"]) > 16 for bodies, _ in cases.values() for b in bodies)  # some prompts chunk
    with ThreadPoolExecutor(len(FAMILIES)) as pool:
        got = dict(zip(FAMILIES, pool.map(lambda f: ws_generate(srv.url, f, cases[f][0]), FAMILIES)))
    for family in FAMILIES:
        assert [d["token_ids"] for d in got[family]] == cases[family][1], family
    assert srv.wait_pages_free() == 0
    log = srv.log()
    assert "footprint overrun" not in log and "not tight" not in log
    held = re.findall(r"rank (\d) of 2 holds \d+ of the checkpoint's \d+ weight bytes \(([\d.]+)%\)", log)
    assert sorted(r for r, _ in held) == ["0", "0", "0", "1", "1", "1"], held  # a group of two per model
    assert all(40.0 < float(p) < 60.0 for _, p in held), held
