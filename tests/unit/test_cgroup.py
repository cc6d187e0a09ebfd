"""Memory and CPU sizing read the container's cgroup limits (v2 and v1), on fake cgroup
files: the tightest limit over the cgroup and its ancestors, reclaimable cache not counted
as used, no limit read as none, and a container without a cgroup namespace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.gpu_worker import kv_memory
from shared.cgroup import V1_UNLIMITED, available_cpus, cpu_limit, memory_available

GIB = 1 << 30


def _files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_v2_container_limit_less_usage_plus_inactive_cache(tmp_path):
    root = _files(tmp_path, {
        "proc/self/cgroup": "0::/\n",
        "sys/fs/cgroup/cgroup.controllers": "cpu memory\n",
        "sys/fs/cgroup/memory.max": f"{4 * GIB}\n",
        "sys/fs/cgroup/memory.current": f"{3 * GIB}\n",
        "sys/fs/cgroup/memory.stat": f"anon 123\ninactive_file {GIB}\nactive_file 5\n",
        "sys/fs/cgroup/cpu.max": "150000 100000\n",
    })
    assert memory_available(root) == 2 * GIB  # 4 GiB - (3 GiB used - 1 GiB reclaimable)
    assert cpu_limit(root) == 1.5
    assert available_cpus(root) == min(2, len(os.sched_getaffinity(0)))  # 1.5 CPUs run two threads


def test_v2_nested_cgroup_takes_the_tightest_ancestor(tmp_path):
    root = _files(tmp_path, {
        "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
        "sys/fs/cgroup/cgroup.controllers": "cpu memory\n",
        "sys/fs/cgroup/kubepods/pod1/memory.max": f"{2 * GIB}\n",  # the pod's limit
        "sys/fs/cgroup/kubepods/pod1/memory.current": f"{GIB}\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",  # the container sets none
        "sys/fs/cgroup/kubepods/pod1/ctr/memory.current": f"{GIB}\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "400000 100000\n",
    })
    assert memory_available(root) == GIB
    assert cpu_limit(root) == 4.0


def test_v2_without_limits_is_none(tmp_path):
    root = _files(tmp_path, {
        "proc/self/cgroup": "0::/user.slice\n",
        "sys/fs/cgroup/cgroup.controllers": "cpu memory\n",
        "sys/fs/cgroup/user.slice/memory.max": "max\n",
        "sys/fs/cgroup/user.slice/memory.current": "1000\n",
        "sys/fs/cgroup/user.slice/cpu.max": "max 100000\n",
    })
    assert memory_available(root) is None and cpu_limit(root) is None
    assert available_cpus(root) == len(os.sched_getaffinity(0))


def test_v1_without_cgroup_namespace_reads_the_mount(tmp_path):
    """Docker on cgroup v1 without a cgroup namespace: /proc/self/cgroup names the
    host-side path, and the container's own cgroup is mounted at the controller's root."""
    root = _files(tmp_path, {
        "proc/self/cgroup": "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GIB}\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GIB // 2}\n",
        "sys/fs/cgroup/memory/memory.stat": f"cache 1\ntotal_inactive_file {GIB // 4}\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "100000\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert memory_available(root) == GIB // 2 + GIB // 4
    assert cpu_limit(root) == 1.0 and available_cpus(root) == 1


def test_v1_unlimited_and_no_quota_are_none(tmp_path):
    root = _files(tmp_path, {
        "proc/self/cgroup": "5:memory:/a\n1:cpu:/\n",
        "sys/fs/cgroup/memory/a/memory.limit_in_bytes": f"{V1_UNLIMITED * 2 - 4096}\n",
        "sys/fs/cgroup/memory/a/memory.usage_in_bytes": "5000\n",
        "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
    })
    assert memory_available(root) is None and cpu_limit(root) is None


def test_no_cgroup_files_at_all(tmp_path):
    assert memory_available(tmp_path) is None and cpu_limit(tmp_path) is None and available_cpus(tmp_path) >= 1


@pytest.mark.parametrize("limited", [None, 3 * GIB])
def test_kv_pool_sizing_takes_the_cgroup_limit_when_tighter(monkeypatch, limited):
    monkeypatch.setattr(kv_memory, "memory_available", lambda: limited)
    host = kv_memory.available_memory_bytes()
    if limited is None:
        assert host > 0
    else:
        assert host == min(limited, host) and host <= limited
    monkeypatch.setattr(kv_memory, "memory_available", lambda: 1 << 20)  # a 1 MiB container
    assert kv_memory.available_memory_bytes() == 1 << 20
    assert kv_memory.size_pool(0, 0.5, 4096, 1) == 128
