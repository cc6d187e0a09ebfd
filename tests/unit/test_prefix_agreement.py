"""The conductor's estimate of a worker's prefix cache and the worker's own index walk the
same pages (`shared.layout.prompt_pages` / `shareable_count`): after the same earlier
prompt, both count the same shared pages for the next one."""

from __future__ import annotations

import pytest

from services.conductor.conductor import Conductor, WorkerState
from services.gpu_worker.kv_manager import KVManager
from shared.config import Deployment
from shared.frames import NewRequest, SamplingParams
from shared.layout import KVReqConfig, LabelLayout, Span, prompt_pages, shareable_count
from shared.specs.decoder_lm import DecoderLMSpec

PS = 4
CONFIG = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 16,
          "max_position_embeddings": 1024}
A = list(range(100, 132))  # 32 ids: 8 full pages, the last holding the last prompt row


def _request(rid: str, spans: tuple[Span, ...]) -> NewRequest:
    layout = LabelLayout(spans=spans, growth={"decode_loop": 1})
    rows = layout.span_rows
    return NewRequest(rid, "", {}, SamplingParams(), "", rows, 2, {"text": layout}, {"decode_loop": 1},
                      {"kv": KVReqConfig("kv", PS)})


def _worker_hit_pages(first: NewRequest, second: NewRequest) -> int:
    spec = DecoderLMSpec(CONFIG, page_size=PS)
    kv = KVManager(spec.paged_pools(256), spec.kv_labels)
    kv.debug = True
    state = kv.ingest_request(first)
    assert kv.can_admit(state)
    kv.admit(state)
    for span in first.kv_layout["text"].spans:  # the prompt, one span at a time
        kv.reserve_rows(first.request_id, "text", span.length)
        kv.commit(first.request_id, "text", span.length)
    state = kv.ingest_request(second)
    assert kv.can_admit(state)
    return state.hit_rows // PS


def _conductor_hit_pages(tmp_path, first: NewRequest, second: NewRequest) -> int:
    spec = DecoderLMSpec(CONFIG, page_size=PS)
    addrs = {"conductor": f"ipc://{tmp_path}/c.sock", "conductor_control": f"ipc://{tmp_path}/cc.sock"}
    cond = Conductor(Deployment(page_size=PS), spec, addrs)
    try:
        w = WorkerState("w", f"ipc://{tmp_path}/w.sock", spec.paged_pools(256))
        w.remember(cond._prefix_keys(first))
        return w.hit_pages(cond._prefix_keys(second))
    finally:
        cond.pushers.close()
        cond.ctx.term()


CASES = {
    "same prompt": ((Span.ids(A),), (Span.ids(A),)),
    "longer prompt past a page-aligned one": ((Span.ids(A),), (Span.ids([*A, 1, 2, 3, 4, 5]),)),
    "shorter prompt": ((Span.ids(A),), (Span.ids(A[:13]),)),
    "diverges mid-page": ((Span.ids(A),), (Span.ids([*A[:10], 7, *A[11:]]),)),
    "shorter than a page": ((Span.ids(A[:3]),), (Span.ids(A[:3]),)),
    "ids then rows": ((Span.ids(A[:10]), Span.rows(12)), (Span.ids(A[:10]), Span.rows(12))),
    "ids then rows, then a longer ids prompt": ((Span.ids(A[:10]), Span.rows(12)), (Span.ids(A),)),
    "rows first": ((Span.rows(4), Span.ids(A)), (Span.rows(4), Span.ids(A))),
    "two ids spans": ((Span.ids(A[:6]), Span.ids(A[6:])), (Span.ids(A),)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_conductor_estimate_and_worker_index_agree(tmp_path, case):
    first_spans, second_spans = CASES[case]
    first, second = _request("a", first_spans), _request("b", second_spans)
    worker = _worker_hit_pages(first, second)
    assert _conductor_hit_pages(tmp_path, first, second) == worker
    # ...and neither shares the page holding the second prompt's last row.
    layout = second.kv_layout["text"]
    assert worker <= shareable_count(layout, PS) <= len(prompt_pages(layout, PS))


def test_cases_cover_a_hit_past_the_first_prompts_shareable_pages(tmp_path):
    """The page holding a page-aligned prompt's last row is indexed once computed, so a
    longer prompt shares it: both sides must count it (8 pages, not the first's 7)."""
    first, second = _request("a", (Span.ids(A),)), _request("b", (Span.ids([*A, 1, 2]),))
    assert _worker_hit_pages(first, second) == 8 == _conductor_hit_pages(tmp_path, first, second)


def test_a_label_the_prompt_does_not_write_does_not_stop_the_estimate(tmp_path):
    """A scratch-only label (CSM's depth decoder: no spans) holds no prompt rows; the
    conductor's keys are the keyed label's, as the worker's `_plan_hits` skips it too."""
    plain = _request("a", (Span.ids(A),))
    with_scratch = NewRequest("b", "", {}, SamplingParams(), "", len(A), 2,
                              {**plain.kv_layout, "depth": LabelLayout(spans=(), scratch=4)}, {"decode_loop": 1},
                              {"kv": KVReqConfig("kv", PS)})
    spec = DecoderLMSpec(CONFIG, page_size=PS)
    addrs = {"conductor": f"ipc://{tmp_path}/c.sock", "conductor_control": f"ipc://{tmp_path}/cc.sock"}
    cond = Conductor(Deployment(page_size=PS), spec, addrs)
    try:
        keys = cond._prefix_keys(with_scratch)
        assert keys == cond._prefix_keys(plain) and keys["kv"][1] == (len(A) - 1) // PS
    finally:
        cond.pushers.close()
        cond.ctx.term()
