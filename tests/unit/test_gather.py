"""The gpu worker's arrival gather: an idle engine's first step waits for a burst to land."""

from __future__ import annotations

import pytest

from services.gpu_worker import worker
from services.gpu_worker.worker import GATHER_MAX_S, GATHER_QUIET_S, Gather


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
