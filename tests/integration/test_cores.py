"""A server sizes ONNX Runtime's threads, and ``--workers 0``, by the cores it may use: its CPU affinity (a cpuset, a
``taskset``) and its cgroup's CPU quota (a container's ``--cpus``, a Kubernetes CPU limit), not the host's count.
Each server here is a process started inside the restriction, as a container's would be."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import pytest

from mhaserve.server.process import ServerProcess

CGROUP_ROOT = Path("/sys/fs/cgroup")

needs_two_cpus = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="the process may use one CPU already: nothing to restrict"
)


def serving_line(server: ServerProcess) -> str:
    return next(line for line in server.lines if "serving model=" in line)


def threads_and_processes(line: str) -> tuple[int, int]:
    threads = int(re.search(r"intra_op_threads=(\d+)", line).group(1))
    processes = re.search(r"processes=(\d+)", line)
    return threads, int(processes.group(1)) if processes else 1


@contextlib.contextmanager
def pinned_to_one_cpu():
    """This thread, and so the processes it starts, on one CPU of those it had."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


@needs_two_cpus
@pytest.mark.parametrize("workers", ["1", "0"])
def test_a_server_pinned_to_one_cpu_runs_one_thread_and_one_process(small_model_dir, workers):
    server = ServerProcess(small_model_dir, "--warmup-runs", "0", "--workers", workers)
    try:
        with pinned_to_one_cpu():
            server.start()
        assert threads_and_processes(serving_line(server)) == (1, 1), serving_line(server)
        assert f"may use 1 of the host's {os.cpu_count()} CPUs (its CPU affinity)" in server.log
    finally:
        server.stop()


def cpu_cgroup_parent() -> Path | None:
    """A cgroup folder in which this test may make a child with a CPU quota (root, and the cpu controller at hand),
    and the quota's file there."""
    if os.geteuid() != 0:
        return None
    for parent, quota_file in ((CGROUP_ROOT / "cpu", "cpu.cfs_quota_us"), (CGROUP_ROOT, "cpu.max")):
        if parent.is_dir() and os.access(parent, os.W_OK):
            if quota_file == "cpu.cfs_quota_us" or "cpu" in (parent / "cgroup.subtree_control").read_text().split():
                return parent
    return None


@contextlib.contextmanager
def cgroup_with_cpus(cpus: float):
    """A cgroup whose processes may use ``cpus`` CPUs per 100 ms period; removed afterwards."""
    parent = cpu_cgroup_parent()
    folder = parent / f"mhaserve-test-{os.getpid()}"
    folder.mkdir()
    try:
        if (folder / "cpu.cfs_quota_us").exists():  # cgroup v1
            (folder / "cpu.cfs_period_us").write_text("100000")
            (folder / "cpu.cfs_quota_us").write_text(str(round(cpus * 100000)))
        else:
            (folder / "cpu.max").write_text(f"{round(cpus * 100000)} 100000")
        yield folder
    finally:
        deadline = time.monotonic() + 10
        while True:  # empty once its processes have ended and been reaped
            try:
                folder.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@needs_two_cpus
@pytest.mark.skipif(
    cpu_cgroup_parent() is None, reason="making a cgroup with a CPU quota needs root and its controller"
)
@pytest.mark.parametrize("workers", ["1", "0"])
def test_a_server_under_a_cpu_quota_of_one_and_a_half_runs_one_thread_and_one_process(small_model_dir, workers):
    with cgroup_with_cpus(1.5) as cgroup:
        server = ServerProcess(small_model_dir, "--warmup-runs", "0", "--workers", workers)
        # Inside the cgroup before anything starts, as a container's process is: the shell moves itself, then execs.
        server.command = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *server.command]
        try:
            server.start()
            assert threads_and_processes(serving_line(server)) == (1, 1), serving_line(server)
            assert "may use 1 of the host's" in server.log and "CPU quota of 1.5 CPUs" in server.log
        finally:
            server.stop()
