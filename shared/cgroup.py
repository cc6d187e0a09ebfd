"""The memory and CPUs this process may use, as its cgroup limits them.

In a container (Docker's `--memory` / `--cpus`, a Kubernetes pod's limits) the host's
/proc/meminfo and os.cpu_count() describe the machine, not what the container may use: a
KV pool sized from MemAvailable gets the worker OOM-killed, and one torch thread per host
core oversubscribes a two-CPU pod. These read the process's cgroup (v2, or v1's memory and
cpu controllers) and every ancestor's, whose limits apply too, and take the tightest.

`root` is the filesystem root the files are read under (tests point it at fake cgroup files).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

#: cgroup v1 writes "no limit" as the largest page-aligned int64
V1_UNLIMITED = 1 << 62


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_paths(root: Path) -> dict[str, str]:
    """Controller -> this process's cgroup path ("" for the v2 unified hierarchy)."""
    paths: dict[str, str] = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2]
    return paths


def _dirs(mount: Path, cgroup_path: str) -> list[Path]:
    """The process's cgroup folder under `mount` and each ancestor up to the mount, those
    that exist. Without a cgroup namespace a container sees its host-side path, which its
    mount does not hold: then the mount itself is the container's cgroup."""
    here = mount / cgroup_path.lstrip("/")
    dirs = [d for d in (here, *here.parents) if d.is_relative_to(mount) and d.is_dir()]
    return dirs or ([mount] if mount.is_dir() else [])


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _inactive_file(stat: str | None, key: str) -> int:
    for line in (stat or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _int(value) or 0
    return 0


def memory_available(root: str | Path = "/") -> int | None:
    """Bytes this process's cgroups still allow: the tightest of limit - usage over its
    cgroup and ancestors, usage less the inactive page cache (reclaimable, as MemAvailable
    counts it and as the kubelet's working set does). None when no cgroup sets a limit."""
    root = Path(root)
    own = _own_paths(root)
    found: list[int] = []
    if "" in own and (root / "sys/fs/cgroup/cgroup.controllers").exists():  # v2
        for d in _dirs(root / "sys/fs/cgroup", own[""]):
            limit, usage = _int(_read(d / "memory.max")), _int(_read(d / "memory.current"))  # "max" reads as None
            if limit is not None and usage is not None:
                cache = _inactive_file(_read(d / "memory.stat"), "inactive_file")
                found.append(limit - (usage - cache))
    elif "memory" in own:  # v1
        for d in _dirs(root / "sys/fs/cgroup/memory", own["memory"]):
            limit, usage = _int(_read(d / "memory.limit_in_bytes")), _int(_read(d / "memory.usage_in_bytes"))
            if limit is not None and limit < V1_UNLIMITED and usage is not None:
                cache = _inactive_file(_read(d / "memory.stat"), "total_inactive_file")
                found.append(limit - (usage - cache))
    return max(0, min(found)) if found else None


def cpu_limit(root: str | Path = "/") -> float | None:
    """CPUs the cgroup quota allows (quota / period, tightest over the ancestors), or None
    when no quota is set."""
    root = Path(root)
    own = _own_paths(root)
    found: list[float] = []
    if "" in own and (root / "sys/fs/cgroup/cgroup.controllers").exists():  # v2: "max 100000" or "200000 100000"
        for d in _dirs(root / "sys/fs/cgroup", own[""]):
            quota_s, _, period_s = (_read(d / "cpu.max") or "max").partition(" ")
            quota, period = _int(quota_s), _int(period_s)  # "max" reads as None
            if quota and period:
                found.append(quota / period)
    else:
        mount = next((root / "sys/fs/cgroup" / m for m in ("cpu", "cpu,cpuacct")
                      if (root / "sys/fs/cgroup" / m).is_dir()), None)
        if "cpu" in own and mount is not None:
            for d in _dirs(mount, own["cpu"]):
                quota, period = _int(_read(d / "cpu.cfs_quota_us")), _int(_read(d / "cpu.cfs_period_us"))
                if quota is not None and quota > 0 and period:
                    found.append(quota / period)
    return min(found) if found else None


def available_cpus(root: str | Path = "/") -> int:
    """CPUs this process may use: its affinity mask (cpusets, taskset), capped by the cgroup
    quota rounded up (a 1.5-CPU pod runs two threads)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cpu_limit(root)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)
