"""shared/trace.py's per-hop stamps (MSTAR_TRACE) and bench.ttft_hops' table of them."""

from __future__ import annotations

from bench import ttft_hops
from shared import trace


def test_stamps_are_written_only_under_mstar_trace_and_read_back_per_request(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "_DIR", "")
    monkeypatch.setattr(trace, "_file", None)
    trace.stamp("r1", "api.arrive")
    assert not trace.enabled() and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(trace, "_DIR", str(tmp_path / "t"))
    trace.stamp("r1", "gpu.step", 10.0)
    trace.stamp("r1", "gpu.step", 12.5)
    trace.stamp("r2", "api.arrive")
    trace._file.close()  # type: ignore[union-attr]
    got = trace.read(str(tmp_path / "t"))
    assert got["r1"] == {"gpu.step": [10.0, 12.5]} and list(got["r2"]) == ["api.arrive"]


def test_the_hop_table_takes_each_hops_first_stamp_and_counts_the_prefill_steps():
    t = {hop: [float(i)] for i, hop in enumerate(ttft_hops.HOPS)}
    step = ttft_hops.HOPS.index("gpu.step")
    t["gpu.step"] = [float(step), step + 0.5, 100.0]  # two steps before the first output, one after
    rows = {name: median for name, median, _ in ttft_hops.rows({"a": t, "partial": {"api.arrive": [0.0]}})}
    assert rows["gpu.step -> gpu.send"] == 1.0 and rows["TTFT"] == len(ttft_hops.HOPS) - 1
    assert rows["prefill steps"] == 2
