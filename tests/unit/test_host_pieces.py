"""`host_pieces` (runners/base.py): a step longer than one C stack call cut into near-equal
pieces of whole decode entries and prompt chunks cut as the scheduler would cut them."""

from __future__ import annotations

from services.gpu_worker.attention import AttnRows
from services.gpu_worker.runners import base


def _rows(*entries: tuple[int, int, bool]) -> dict[str, list[AttnRows]]:
    return {"kv": [AttnRows([i], 0, cached, new, decode) for i, (cached, new, decode) in enumerate(entries)]}


def test_a_step_within_one_call_is_not_cut(monkeypatch):
    monkeypatch.setattr(base, "MAX_CHUNK_ROWS", 8)
    assert base.host_pieces(_rows((4, 1, True), (0, 7, False)), 8, [0, 7]) is None


def test_a_long_prompt_is_cut_into_near_equal_pieces_that_continue_it(monkeypatch):
    monkeypatch.setattr(base, "MAX_CHUNK_ROWS", 8)
    pieces = base.host_pieces(_rows((4, 1, True), (3, 20, False)), 21, [0, 20])
    assert pieces is not None
    assert [(lo, hi, sampled) for _, lo, hi, sampled in pieces] == [(0, 7, [0]), (7, 14, []), (14, 21, [6])]
    assert [[(r.cached, r.new, r.decode) for r in part["kv"]] for part, *_ in pieces] == [
        [(4, 1, True), (3, 6, False)], [(9, 7, False)], [(16, 7, False)]]


def test_a_decode_entry_or_a_bidirectional_block_is_never_cut(monkeypatch):
    monkeypatch.setattr(base, "MAX_CHUNK_ROWS", 4)
    assert base.host_pieces(_rows((4, 6, True), (0, 4, False)), 10, [0]) is None  # a verify step's drafts
    blocks = {"kv": [AttnRows([0], 0, 0, 10, False, ((2, 5),))]}
    assert base.host_pieces(blocks, 10, [9]) is None
