"""The cores this process may use: what sizes ONNX Runtime's threads, ``--workers 0`` and how workers divide the
threads. ``os.cpu_count()`` is the host's: in a container given two CPUs on a 64-core host (``docker run --cpus``,
Compose's ``cpus``, a Kubernetes CPU limit, a cpuset), threads sized by it spend the quota in a fraction of each
period and the whole process then waits, frozen, for the next one.

The answer is the CPUs the process's affinity allows, fewer where its cgroup's CPU quota (cgroup v2's ``cpu.max``,
v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, the smallest along its cgroup's ancestors) allows less,
rounded down and one at least, as Go's automaxprocs does.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores() -> int:
    """The cores this process may use (see the module doc)."""
    return _cores_within(cpu_quota())


def _cores_within(quota: float | None) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cores = os.cpu_count() or 1
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


def limit_said() -> str | None:
    """One line for the log where the cores this process may use are fewer than the host's: how many, and why."""
    quota = cpu_quota()
    host, usable = os.cpu_count() or 1, _cores_within(quota)
    if usable >= host:
        return None
    why = f"its cgroup's CPU quota of {quota:g} CPUs" if quota is not None and quota < host else "its CPU affinity"
    return f"this server may use {usable} of the host's {host} CPUs ({why}): its threads are sized to {usable}"


def cpu_quota(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The CPUs this process's cgroup may use per period (2.5 for a quota of 250 ms per 100 ms), the smallest along
    its ancestors; None where there is no quota or none can be read."""
    quotas = [quota for _, quota in _quota_folders(proc_cgroup, root)]
    return min(quotas) if quotas else None


def _quota_folders(proc_cgroup: Path, root: Path) -> list[tuple[Path, float]]:
    """The folders of this process's cgroup and its ancestors that set a CPU quota, with their quotas in CPUs."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # cgroup v2's one hierarchy
            found += [(folder, _v2_quota(folder)) for folder in _along(root, path)]
        elif "cpu" in controllers.split(","):  # cgroup v1's cpu controller, mounted on its own
            mount = next((root / name for name in (controllers, "cpu,cpuacct", "cpu") if (root / name).is_dir()), None)
            if mount is not None:
                found += [(folder, _v1_quota(folder)) for folder in _along(mount, path)]
    return [(folder, quota) for folder, quota in found if quota is not None]


def _along(mount: Path, path: str) -> list[Path]:
    """The process's cgroup folder under ``mount`` and each of its ancestors up to the mount. In a container without
    a cgroup namespace the path names the host's hierarchy, which the container sees as its mount: then the mount
    alone."""
    folder = mount / path.strip("/")
    if not folder.is_dir():
        return [mount]
    folders = [folder]
    while folder != mount and mount in folder.parents:
        folder = folder.parent
        folders.append(folder)
    return folders


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None
