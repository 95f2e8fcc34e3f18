"""The CPU platform's memory is the container's where a memory cgroup limits it (cgroup v1, v2, hybrid, nested).

Each case writes a cgroup tree under tmp_path and points `roll_hw.cpu` at it; /proc/meminfo stays the real host's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_hw import cpu
from roll_hw.cpu import CpuPlatform

GiB = 2**30
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 reports without a limit


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def cgroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Write `/proc/self/cgroup` and the cgroup files (relative to the mount root) of a fake machine."""

    def make(proc_self_cgroup: str, files: dict[str, str]) -> None:
        _write(tmp_path / "fs", files)
        (tmp_path / "fs").mkdir(exist_ok=True)
        (tmp_path / "self_cgroup").write_text(proc_self_cgroup)
        monkeypatch.setattr(cpu, "CGROUP_ROOT", str(tmp_path / "fs"), raising=False)  # (absent before the fix)
        monkeypatch.setattr(cpu, "PROC_SELF_CGROUP", str(tmp_path / "self_cgroup"), raising=False)

    return make


def test_a_v2_container_limit_is_the_cpu_platforms_memory(cgroup) -> None:
    """A pod limited to 2 GiB on a bigger host reported the host's memory (MemTotal/MemAvailable)."""
    cgroup(
        "0::/kubepods/pod1/ctr\n",
        {
            "kubepods/pod1/ctr/memory.max": "max\n",  # the limit is set one level up, on the pod
            "kubepods/pod1/memory.max": f"{2 * GiB}\n",
            "kubepods/memory.max": "max\n",
            "kubepods/pod1/ctr/memory.current": f"{GiB // 2 + GiB // 4}\n",
            "kubepods/pod1/ctr/memory.stat": f"anon 1\ninactive_file {GiB // 4}\nactive_file 7\n",
        },
    )
    mem = CpuPlatform.memory_stats()
    assert mem.total == 2 * GiB
    if cpu._meminfo()["MemAvailable"] > 2 * GiB:  # the host has more free than the pod: the pod's decides
        assert mem.free == 2 * GiB - GiB // 2
    assert mem.free <= 2 * GiB - GiB // 2
    assert cpu.cgroup_memory() == (2 * GiB, GiB // 2)  # usage leaves out the reclaimable inactive file cache


def test_a_v1_hierarchical_limit_is_used(cgroup) -> None:
    cgroup(
        "12:pids:/\n4:memory:/docker/abc\n0::/\n",  # hybrid: v1 memory beside a v2 hierarchy
        {
            "memory/docker/abc/memory.limit_in_bytes": f"{V1_UNLIMITED}\n",  # its own: none; its parent's applies
            "memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n",
            "memory/docker/abc/memory.stat": (
                f"cache 5\nhierarchical_memory_limit {3 * GiB}\ntotal_inactive_file {GiB // 2}\n"
            ),
        },
    )
    mem = CpuPlatform.memory_stats()
    assert mem.total == 3 * GiB and 0 <= mem.free <= 3 * GiB - GiB // 2
    assert cpu.cgroup_memory() == (3 * GiB, GiB // 2)


def test_a_cgroup_namespace_reads_the_mount_root(cgroup) -> None:
    """Inside a cgroup namespace /proc/self/cgroup may name a path the container's mount does not have."""
    cgroup("0::/../../host/slice\n", {"memory.max": f"{4 * GiB}\n", "memory.current": f"{GiB}\n"})
    assert CpuPlatform.memory_stats().total == 4 * GiB
    assert cpu.cgroup_memory() == (4 * GiB, GiB)


@pytest.mark.parametrize(
    ("proc", "files"),
    [
        ("0::/user.slice\n", {"user.slice/memory.max": "max\n", "user.slice/memory.current": "5\n"}),
        ("4:memory:/\n", {"memory/memory.limit_in_bytes": f"{V1_UNLIMITED}\n"}),
        ("1:cpu:/\n", {}),  # no memory controller at all
    ],
    ids=["v2-max", "v1-unlimited", "no-memory-controller"],
)
def test_no_limit_leaves_the_hosts_memory(cgroup, proc: str, files: dict[str, str]) -> None:
    cgroup(proc, files)
    assert cpu.cgroup_memory() is None
    info = cpu._meminfo()
    assert CpuPlatform.memory_stats().total == info["MemTotal"]


def test_no_cgroup_file_leaves_the_hosts_memory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu, "PROC_SELF_CGROUP", str(tmp_path / "missing"), raising=False)
    assert cpu.cgroup_memory() is None


def test_this_machines_memory_is_plausible() -> None:
    """Whatever this machine's cgroup says, the answer stays consistent."""
    mem = CpuPlatform.memory_stats()
    assert 0 < mem.free <= mem.total <= cpu._meminfo()["MemTotal"]
