"""The CPU quota read from a cgroup tree as the kernel lays it out, v1 and v2, made here in a temporary folder."""

from __future__ import annotations

from mhaserve.server.cores import cpu_quota


def tree(tmp_path, proc_cgroup: str, files: dict[str, str]):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "cgroup").write_text(proc_cgroup)
    root = tmp_path / "sys"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return tmp_path / "proc" / "cgroup", root


def test_v2_the_smallest_quota_along_the_ancestors_counts(tmp_path):
    proc, root = tree(tmp_path, "0::/kubepods/pod1/c1\n", {
        "kubepods/cpu.max": "max 100000\n",
        "kubepods/pod1/cpu.max": "150000 100000\n",  # the pod's limit: 1.5 CPUs
        "kubepods/pod1/c1/cpu.max": "max 100000\n",
    })  # fmt: skip
    assert cpu_quota(proc, root) == 1.5


def test_v2_without_a_quota_anywhere_is_none(tmp_path):
    proc, root = tree(tmp_path, "0::/user.slice\n", {"user.slice/cpu.max": "max 100000\n"})
    assert cpu_quota(proc, root) is None


def test_v1_the_cpu_controllers_quota_over_its_period(tmp_path):
    proc, root = tree(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    assert cpu_quota(proc, root) == 2.5


def test_v1_in_a_container_without_a_cgroup_namespace_reads_its_own_mount(tmp_path):
    # /proc/self/cgroup names the host's path; the container's mount is its own cgroup.
    proc, root = tree(tmp_path, "2:cpu:/docker/abc\n", {
        "cpu/cpu.cfs_quota_us": "200000\n",
        "cpu/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    assert cpu_quota(proc, root) == 2.0


def test_nothing_readable_is_none(tmp_path):
    assert cpu_quota(tmp_path / "absent", tmp_path) is None
    proc, root = tree(tmp_path, "1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(proc, root) is None
