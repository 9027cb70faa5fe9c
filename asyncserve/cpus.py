"""How many CPUs this process may use: its affinity mask and its cgroup's CPU quota, whichever is less.

os.cpu_count() is the machine's cores; in a container with a 4-CPU limit on a 64-core node, 64 torch
threads would fight over 4 CPUs' worth of time every step. The quota is cgroup v2's cpu.max
("400000 100000": 4 CPUs; "max 100000": none), read from this process's own cgroup up to the root
(a parent's limit binds too), or cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us (-1: none).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def own_cgroup(proc_cgroup: Path = Path("/proc/self/cgroup")) -> str:
    """This process's cgroup v2 path ("0::/user.slice/..." -> "/user.slice/..."); "/" where unknown."""
    try:
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:] or "/"
    except OSError:
        pass
    return "/"


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, cgroup: str | None = None) -> float | None:
    """The CPU quota in CPUs (4.0, 1.5) binding ``cgroup`` (default: this process's) under the cgroup
    mount ``root``: the least over it and its ancestors; None without one."""
    cgroup = own_cgroup() if cgroup is None else cgroup
    quotas = []
    folder = root / cgroup.strip("/")
    while True:                                         # cgroup v2: the own group, then each parent
        quotas.append(_v2_quota(folder / "cpu.max"))
        if folder == root or root not in folder.parents:
            break
        folder = folder.parent
    for v1 in ("cpu", "cpu,cpuacct"):                   # cgroup v1: the container's own view of the mount
        quotas.append(_v1_quota(root / v1))
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def _v2_quota(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def affinity() -> int:
    """CPUs in this process's affinity mask (taskset, cpuset): all cores where the OS cannot say."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable_cpus(root: Path = CGROUP_ROOT, cgroup: str | None = None, mask: set[int] | None = None) -> int:
    """The CPUs this process may keep busy: the affinity mask's (``mask``, default this process's),
    capped by the cgroup quota under ``root`` rounded down (a 1.5-CPU quota runs one thread at full
    speed, two at three quarters), at least 1."""
    cpus = affinity() if mask is None else len(mask)
    quota = cgroup_cpu_quota(root, cgroup)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def describe() -> str:
    """What usable_cpus() read, for the start-up log."""
    quota = cgroup_cpu_quota()
    limit = "no cgroup CPU quota" if quota is None else f"cgroup CPU quota {quota:g}"
    return f"{affinity()} of {os.cpu_count()} cores in the affinity mask, {limit}"
