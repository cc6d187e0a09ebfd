"""The time-budgeted scheduler: the step-cost model it learns, the chunks it cuts from
known costs, and that a time target changes only when rows run, never what they compute."""

from __future__ import annotations

import numpy as np
import pytest

from services.gpu_worker.request import Request
from services.gpu_worker.scheduler import MIN_PREFILL_ROWS, Limits, Scheduler
from services.gpu_worker.step_costs import StepCosts, StepShape, calibrate, chunk_shape
from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.specs.base import PromptRequest
from tests.engines import tiny_engine, tiny_model

MS = 1e-3


def known_costs(c0=5.0, row=0.5, sample=1.0, key=0.0) -> StepCosts:
    """A cost model that has learned exactly these (ms) coefficients."""
    costs = StepCosts()
    rng = np.random.default_rng(0)
    for _ in range(40):
        s = StepShape(int(rng.integers(1, 300)), int(rng.integers(1, 40)), int(rng.integers(0, 50_000)))
        costs.observe(s, (c0 + row * s.rows + sample * s.sampled + key * s.keys / 1024) * MS)
    costs.anchor()  # as warm-up leaves it
    return costs


# -- the cost model ----------------------------------------------------------------------


def test_the_fit_recovers_known_costs():
    costs = known_costs(4.0, 0.3, 0.8, 0.05)
    assert costs.ready
    np.testing.assert_allclose(costs.coef, np.array([4.0, 0.3, 0.8, 0.05]) * MS, rtol=1e-3, atol=1e-6)
    assert costs.predict(StepShape(16, 16, 16 * 200)) == pytest.approx((4.0 + 16 * 1.1 + 0.05 * 3200 / 1024) * MS)


def test_observations_sum_as_numpy_would():
    """observe keeps its sums in Python floats (a decode step's cheaper path): each is the
    decayed sum of x x^T and x * seconds that numpy's element-wise arithmetic gives, bit for
    bit, and the fit solved from them predicts the same."""
    from services.gpu_worker.step_costs import DECAY, KEY_UNIT, OUTLIER

    costs, a, b = StepCosts(), np.zeros((4, 4)), np.zeros(4)
    rng = np.random.default_rng(3)
    for _ in range(300):
        s = StepShape(int(rng.integers(1, 300)), int(rng.integers(1, 40)), int(rng.integers(0, 500_000)))
        seconds = float(rng.uniform(1e-3, 0.1))
        if costs.ready:  # the outlier clip, as observe applies it
            seconds = min(seconds, OUTLIER * max(costs.predict(s), 1e-4))
        costs.observe(s, seconds)
        x = np.array([1.0, s.rows, s.sampled, s.keys / KEY_UNIT])
        a *= DECAY
        a += np.outer(x, x)
        b *= DECAY
        b += x * seconds
    assert np.array_equal(costs.a, a) and np.array_equal(costs.b, b)
    s = StepShape(16, 16, 4000)
    assert costs.predict(s) == pytest.approx(float(np.array([1.0, 16, 16, 4000 / KEY_UNIT]) @ costs.coef), rel=1e-12)


def test_costs_never_go_negative_and_follow_a_slower_machine():
    costs = StepCosts()
    for rows in (1, 2, 4, 8) * 3:  # a step that costs the same whatever its rows: no negative slope
        costs.observe(StepShape(rows, rows, 0), 10 * MS)
    assert (costs.coef >= 0).all()
    costs.anchor()
    before = costs.predict(StepShape(16, 16, 0))
    for _ in range(400):  # the machine gets twice as slow: the fit follows
        for rows in (4, 16):
            costs.observe(StepShape(rows, rows, 0), 20 * MS)
    assert costs.predict(StepShape(16, 16, 0)) > 1.8 * before


def test_a_stalled_step_counts_as_a_bounded_outlier():
    costs = known_costs()
    before = costs.predict(StepShape(16, 16, 0))
    costs.observe(StepShape(16, 16, 0), 10.0)  # the process lost its core for 10 s
    assert costs.predict(StepShape(16, 16, 0)) < 1.2 * before


def test_chunk_within_solves_for_rows_from_known_costs():
    costs = known_costs(5.0, 0.5, 1.0)
    assert costs.chunk_within(10 * MS, 0, 128) == 20  # 0.5 ms a row
    assert costs.chunk_within(10.4 * MS, 0, 20) == 19  # the 20th would also sample: 1 ms more
    assert costs.chunk_within(11 * MS, 0, 20) == 20
    assert costs.chunk_within(0.0, 0, 128) == 0
    costs.coef[3] = 1e-17  # a fit's leftover key cost: the root must not cancel to 19
    assert costs.chunk_within(10 * MS, 0, 128) == 20
    with_keys = known_costs(5.0, 0.5, 1.0, key=1.0)  # 1 ms per 1024 keys: a later chunk costs more
    assert with_keys.chunk_within(10 * MS, 900, 128) < with_keys.chunk_within(10 * MS, 0, 128)
    n = with_keys.chunk_within(10 * MS, 900, 128)
    cost = lambda k: with_keys.predict(chunk_shape(900, k, 0)) - with_keys.predict(StepShape())  # noqa: E731
    assert cost(n) <= 10 * MS < cost(n + 1)


# -- the scheduler, from known costs ---------------------------------------------------------


def req(rid: str, prompt_len: int, computed: int) -> Request:
    r = Request(rid, "", SamplingParams(temperature=0.0), 64, {"decode_loop": 63}, list(range(1, prompt_len + 1)), None,
                None, iters={"decode_loop": 0})
    r.num_computed = computed
    if computed >= prompt_len:
        r.output = [1]
    return r


def scheduler(target_ms: float, costs: StepCosts | None = None, budget: int = 512) -> Scheduler:
    s = Scheduler(None, Limits(64, budget, 4096, None, target_ms * MS), ("decode_loop",))
    if costs is not None:
        s.costs = costs
    return s


def plan_rows(s: Scheduler) -> tuple[list[int], list[int]]:
    plan = s.schedule()
    return [e.rows for e in plan.entries if e.decode], [e.rows for e in plan.entries if not e.decode]


def test_prefill_beside_decode_rows_is_cut_to_the_target():
    s = scheduler(30, known_costs(5.0, 0.5, 1.0))
    s.running = [req(f"d{i}", 10, 10) for i in range(10)] + [req("p0", 128, 0), req("p1", 128, 0)]
    decodes, chunks = plan_rows(s)
    # 10 decode rows: 5 + 10 * 1.5 = 20 ms; 10 ms left at 0.5 ms a row = 20 rows
    assert decodes == [1] * 10 and chunks == [20]


def test_decode_rows_always_go_and_prompts_still_move():
    s = scheduler(30, known_costs(5.0, 0.5, 1.0))
    s.running = [req(f"d{i}", 10, 10) for i in range(40)] + [req("p0", 128, 0)]  # 65 ms of decode rows
    decodes, chunks = plan_rows(s)
    assert decodes == [1] * 40 and chunks == [MIN_PREFILL_ROWS]


def test_an_idle_engine_prefills_at_the_full_token_budget():
    s = scheduler(30, known_costs(5.0, 0.5, 1.0), budget=512)
    s.running = [req("p0", 300, 0), req("p1", 300, 0)]
    assert plan_rows(s) == ([], [300, 212])


def test_a_wave_of_prompts_four_times_the_decode_rows_goes_at_the_full_budget():
    s = scheduler(30, known_costs(5.0, 0.5, 1.0), budget=2048)
    # 3 prompts of a wave the previous step caught now decode; the other 12 arrived meanwhile
    s.running = [req(f"d{i}", 128, 128) for i in range(3)] + [req(f"p{i}", 128, 0) for i in range(12)]
    assert plan_rows(s) == ([1] * 3, [128] * 12)
    s.running = [req(f"d{i}", 128, 128) for i in range(4)] + [req(f"p{i}", 128, 0) for i in range(12)]
    s.limits = Limits(64, 2048, 4096, None, 30.2 * MS)  # (off the boundary of a whole row)
    decodes, chunks = plan_rows(s)  # fewer than four prompts a decode row: cut to the target
    # 4 decode rows: 5 + 4 * 1.5 = 11 ms; 19.2 ms left at 0.5 ms a row = 38 rows
    assert decodes == [1] * 4 and chunks == [38]


def test_a_few_long_prompts_do_not_stall_a_running_stream():
    # c4 with long prompts: one stream decodes while three 2,048-token prompts wait; prefilled
    # whole they would hold its next token for the whole step (~1 s here), so they are cut
    s = scheduler(15.2, known_costs(5.0, 0.5, 1.0), budget=2048)
    for waiting in (1, 3):
        s.running = [req("d0", 2048, 2048)] + [req(f"p{i}", 2048, 0) for i in range(waiting)]
        # 1 decode row: 6.5 ms; 8.7 ms left at 0.5 ms a row = 17 rows
        assert plan_rows(s) == ([1], [17])


def test_target_off_or_costs_unknown_is_the_token_budget_alone():
    for s in (scheduler(0, known_costs(5.0, 0.5, 1.0)), scheduler(30)):
        s.running = [req(f"d{i}", 10, 10) for i in range(10)] + [req("p0", 300, 0), req("p1", 300, 0)]
        assert plan_rows(s) == ([1] * 10, [300, 202])


def test_several_prompts_share_what_the_target_leaves():
    s = scheduler(30, known_costs(5.0, 0.5, 1.0))
    s.running = [req(f"d{i}", 10, 10) for i in range(6)] + [req("p0", 8, 0), req("p1", 128, 0)]
    decodes, chunks = plan_rows(s)
    # 6 decode rows: 14 ms; p0 ends its prompt (8 rows + its sample: 5 ms), p1 gets 11 ms = 22 rows
    assert decodes == [1] * 6 and chunks == [8, 22]
    plan = s.schedule()
    assert plan.shape == StepShape(6 + 8 + 22, 6 + 1, sum(11 for _ in range(6)) + 36 + 22 * 23 // 2)


def scored(rid: str, prompt_len: int, computed: int) -> Request:
    """A prefilling request that asked for prompt logprobs."""
    r = req(rid, prompt_len, computed)
    r.sampling = SamplingParams(temperature=0.0, prompt_logprobs=5)
    return r


def test_prompt_logprob_rows_per_step_are_capped_whatever_the_prompt_length():
    s = Scheduler(None, Limits(64, 2048, 4096, None, 0.0, max_logit_rows=100), ("decode_loop",))
    s.running = [scored("a", 2000, 0), scored("b", 2000, 0), req("plain", 500, 0)]
    plan = s.schedule()
    # a takes the step's 100 logit rows; b waits for the next step; the plain prompt goes whole
    assert [(e.request.request_id, e.rows) for e in plan.entries] == [("a", 100), ("plain", 500)]
    assert plan.shape.sampled == 100 + 1  # a's rows all go through the head; plain samples its last row
    s.running = [scored("a", 2000, 1950), scored("b", 2000, 0)]
    plan = s.schedule()
    # a's last 50 rows: 49 predict a prompt token, the 50th samples; b gets the other 50
    assert [(e.request.request_id, e.rows) for e in plan.entries] == [("a", 50), ("b", 50)]
    assert plan.shape.sampled == 49 + 1 + 50


def test_a_time_target_counts_prompt_logprob_rows_as_head_rows():
    costs = known_costs(5.0, 0.5, 1.0)  # ms: a scored row costs 1.5, a plain one 0.5
    s = scheduler(60, costs)
    s.running = [req(f"d{i}", 10, 10) for i in range(10)] + [scored("p", 128, 0)]
    decodes, chunks = plan_rows(s)
    # 10 decode rows: 5 + 15 = 20 ms; 40 ms left = 26 scored rows (39 ms), not 80 plain ones
    assert decodes == [1] * 10 and chunks == [26]


# -- the engine: the same tokens, whatever the chunks ----------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("sched") / "llama")


def run(spec, model, prompts, max_tokens, target_ms, costs=None, arrive_late=()):
    pools, kv, eng = tiny_engine(spec, model, 128, 64, target_ms * MS)
    kv.debug = True
    if costs is not None:
        eng.scheduler.costs = costs

    def add(i, ids):
        ppo = spec.process_prompt(PromptRequest(ids))
        caps = spec.clamp_caps(spec.get_loop_caps(max_tokens, prompt_len=len(ids)))
        refs, _ = pack_tensors(ppo.new_input_tensors)
        eng.add(NewRequest(f"r{i}", "", refs, SamplingParams(temperature=0.0, ignore_eos=True), "", len(ids),
                           max_tokens, ppo.kv_layout, caps, spec.kv_configs(ppo.kv_layout, caps, pools),
                           metadata=ppo.metadata),
                ppo.new_input_tensors)

    for i, ids in enumerate(prompts):
        if i not in arrive_late:
            add(i, ids)
    toks: dict[str, list[int]] = {}
    chunks: list[int] = []
    observe = eng.scheduler.observe
    eng.scheduler.observe = lambda plan, seconds: (chunks.extend(e.rows for e in plan.entries if not e.decode),
                                                   observe(plan, seconds))
    steps = 0
    while eng.has_work or len(toks) < len(prompts):
        if steps == 3:
            for i in arrive_late:
                add(i, prompts[i])
        res = eng.step()
        steps += 1
        assert not res.errors, res.errors
        for _, o in res.outputs:
            toks.setdefault(o.request_id, []).extend(o.token_ids)
    assert kv.used_pages() == 0 and kv.footprint_overruns == 0
    return toks, chunks


PROMPTS = [list(range(20, 61)), [7, 8, 9] * 10 + [40, 41], list(range(100, 150)), [3, 4], list(range(200, 240))]


def test_the_same_tokens_with_the_target_on_and_off(llama):
    spec, model = llama
    plain, plain_chunks = run(spec, model, PROMPTS, 12, 0, arrive_late=(3, 4))
    # costs that leave room for only a few prompt rows beside the 3 decode rows the late 2 find
    tight = known_costs(5.0, 0.5, 1.0)
    timed, timed_chunks = run(spec, model, PROMPTS, 12, 12, costs=tight, arrive_late=(3, 4))
    assert timed == plain
    assert all(len(t) == 12 for t in timed.values())
    assert max(timed_chunks) > MIN_PREFILL_ROWS  # the first prompts went at the full budget (idle engine)
    assert len(timed_chunks) > len(plain_chunks)  # the late ones were cut smaller beside decode rows


def test_warm_up_calibration_learns_a_usable_model(llama):
    spec, model = llama
    pools, kv, eng = tiny_engine(spec, model, 64, 64, 0.03)
    with kv.untracked():
        costs = calibrate(eng, spec, pools, 64, 8)
    assert costs.ready and costs.prior is not None and (costs.coef >= 0).all()
    assert costs.predict(StepShape(64, 1, 64 * 65 // 2)) >= costs.predict(StepShape(1, 1, 10)) > 0
    assert not eng.running and not eng.waiting and kv.used_pages() == 0


def test_calibration_covers_a_long_prompt_where_the_budget_allows():
    from types import SimpleNamespace

    from services.gpu_worker.step_costs import calibration_groups

    groups = calibration_groups(SimpleNamespace(max_seq_len=8192), 2048, 64)
    assert groups[0] == [(256, 4)] and groups[-1] == [(1024, 2)]  # ~0.5 M keys: a long history's late chunks
    assert calibration_groups(SimpleNamespace(max_seq_len=8192), 600, 64)[-1] == [(599, 2)]
    short = calibration_groups(SimpleNamespace(max_seq_len=200), 2048, 64)
    assert all(n <= 192 for group in short for n, _ in group) and len(short) == 3


def test_calibration_skips_a_shape_a_small_pool_cannot_hold(llama):
    spec, model = llama
    pools, kv, eng = tiny_engine(spec, model, 8, 512, 0.03)  # 128 rows: the 256-row calibration prompt cannot fit
    with kv.untracked():
        costs = calibrate(eng, spec, pools, 512, 8)
    assert costs.ready and not eng.running and not eng.waiting and kv.used_pages() == 0


# -- bidirectional blocks (Gemma 3's image tokens) ----------------------------------------


def test_whole_blocks_cuts_a_chunk_before_a_block_it_would_split():
    from services.gpu_worker.scheduler import whole_blocks

    blocks = ((4, 8), (10, 30))
    assert whole_blocks((), 0, 6, True) == 6  # no blocks: as it was
    assert whole_blocks(blocks, 0, 6, True) == 4  # stops before the block
    assert whole_blocks(blocks, 0, 8, True) == 8  # ends where it ends
    assert whole_blocks(blocks, 4, 3, False) == 0  # a block that does not fit waits ...
    assert whole_blocks(blocks, 4, 3, True) == 4  # ... unless it is the step's first chunk: whole
    assert whole_blocks(blocks, 10, 16, True) == 20  # longer than the budget: the whole chunk
    assert whole_blocks(blocks, 8, 16, True) == 2  # text up to the next block


class _Blocks:
    """A request's KV state as the scheduler reads it: its blocks alone (no state snapshots)."""

    def __init__(self, blocks: tuple[tuple[int, int], ...]) -> None:
        self.blocks = blocks
        self.snapshot_rows: tuple[int, ...] = ()


def test_the_scheduler_never_ends_a_chunk_inside_a_block():
    s = scheduler(0, budget=6)
    a, b = req("a", 40, 0), req("b", 40, 0)
    a.kv, b.kv = _Blocks(((4, 9), (20, 24))), _Blocks(((2, 12),))
    s.running = [a, b]
    ends = {"a": [], "b": []}
    while not all(r.decoding for r in s.running):
        plan = s.schedule()
        for e in plan.entries:
            if not e.decode:
                e.request.num_computed += e.rows
                ends[e.request.request_id].append(e.request.num_computed)
    assert all(not (lo < end < hi) for rid, r in (("a", a), ("b", b)) for end in ends[rid] for lo, hi in r.kv.blocks)
    assert 12 in ends["b"] and 2 in ends["b"]  # the 10-row block, longer than the budget, ran whole
    assert ends["a"][:4] == [4, 10, 16, 20]  # stops before each block it would split
