"""The gpu worker's arrival gather: an idle engine's first step waits for a burst to land."""

from __future__ import annotations

import pytest

from services.gpu_worker import worker
from services.gpu_worker.worker import GATHER_MAX_S, GATHER_QUIET_S, RECENT_END_S, Gather


@pytest.fixture()
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(worker.time, "monotonic", lambda: now[0])
    return now


def test_a_busy_engine_never_waits(clock):
    g = Gather(budget=2048)
    g.arrived(idle=False, rows=128)
    assert g.wait_s() == 0.0


def test_an_idle_engine_waits_until_arrivals_pause(clock):
    g = Gather(budget=2048)
    g.arrived(idle=True, rows=1)
    assert g.wait_s() == pytest.approx(GATHER_QUIET_S)
    clock[0] += GATHER_QUIET_S / 2
    g.arrived(idle=True, rows=1)  # a second request of the burst: the quiet window starts again
    assert g.wait_s() == pytest.approx(GATHER_QUIET_S)
    clock[0] += GATHER_QUIET_S
    assert g.wait_s() == 0.0
    assert g.wait_s() == 0.0  # done: the next step runs at once


def test_a_steady_stream_waits_no_longer_than_the_cap(clock):
    g = Gather(budget=2048)
    g.arrived(idle=True, rows=1)
    waited = 0.0
    while g.wait_s():
        clock[0] += GATHER_QUIET_S / 2
        waited += GATHER_QUIET_S / 2
        g.arrived(idle=True, rows=1)
    assert waited == pytest.approx(GATHER_MAX_S, abs=GATHER_QUIET_S)


def test_a_burst_that_fills_the_step_budget_starts_at_once(clock):
    g = Gather(budget=2048)
    for _ in range(15):
        g.arrived(idle=True, rows=128)
    assert g.wait_s() == pytest.approx(GATHER_QUIET_S)
    g.arrived(idle=True, rows=128)  # 16 x 128 rows: one full step
    assert g.wait_s() == 0.0
    g.arrived(idle=True, rows=128)  # more of the burst, before the step ran: no new wait
    assert g.wait_s() == 0.0
    g.stepped()
    g.arrived(idle=True, rows=128)  # idle again after a step: a new burst is gathered
    assert g.wait_s() == pytest.approx(GATHER_QUIET_S)


def test_one_request_after_another_starts_at_once(clock):
    """A client that sends as its request ends (a c1 closed loop): the one request that
    ended is the burst, so the next step does not wait for a quiet."""
    g = Gather(budget=2048)
    g.ended(1)
    clock[0] += 0.005
    g.arrived(idle=True, rows=896)
    assert g.wait_s() == 0.0
    g.arrived(idle=True, rows=16)  # an unexpected one before the step: no new gather
    assert g.wait_s() == 0.0
    g.stepped()
    clock[0] += RECENT_END_S  # nothing ended lately: a cold start waits for the quiet
    g.arrived(idle=True, rows=896)
    assert g.wait_s() == pytest.approx(GATHER_QUIET_S)


def test_a_wave_that_ended_together_is_waited_for_whole(clock):
    g = Gather(budget=2048)
    g.ended(15)
    clock[0] += 0.003
    g.ended(1)  # (a request that ended a step later counts too)
    for _ in range(15):
        clock[0] += 0.001
        g.arrived(idle=True, rows=64)
        assert g.wait_s() == pytest.approx(GATHER_QUIET_S)
    g.arrived(idle=True, rows=64)
    assert g.wait_s() == 0.0
