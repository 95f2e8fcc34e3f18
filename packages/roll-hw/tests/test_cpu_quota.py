"""Usable CPUs are the affinity mask lowered to the cgroup CPU quota (cgroup v1 and v2, a limit set on a parent).

Each case writes a cgroup tree under tmp_path, points `roll_hw.cpu` at it and fixes the affinity mask.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from roll_hw import cpu
from roll_hw.cpu import CpuPlatform


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A fake machine: `cpus` in the affinity mask, `/proc/self/cgroup`, and cgroup files under the mount root."""

    def make(cpus: int, proc_self_cgroup: str, files: dict[str, str]) -> None:
        for rel, text in files.items():
            path = tmp_path / "fs" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (tmp_path / "fs").mkdir(exist_ok=True)
        (tmp_path / "self_cgroup").write_text(proc_self_cgroup)
        monkeypatch.setattr(cpu, "CGROUP_ROOT", str(tmp_path / "fs"))
        monkeypatch.setattr(cpu, "PROC_SELF_CGROUP", str(tmp_path / "self_cgroup"))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: 64)

    return make


def test_a_v2_quota_set_on_the_pod_caps_the_usable_cpus(machine) -> None:
    """A Kubernetes pod limited to 2.5 CPUs on a 64-core node: 64 threads were throttled most of every period."""
    machine(
        64,
        "0::/kubepods/pod1/ctr\n",
        {"kubepods/pod1/ctr/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "250000 100000\n"},
    )
    assert cpu.cgroup_cpu_quota() == 2.5
    assert cpu.usable_cpu_count() == 3  # a part-CPU still runs a thread
    assert CpuPlatform.device_name().endswith("(3 of 64 cores usable)")


def test_a_v1_cfs_quota_caps_the_usable_cpus(machine) -> None:
    machine(
        64,
        "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n",
        {"cpu/docker/abc/cpu.cfs_quota_us": "200000\n", "cpu/docker/abc/cpu.cfs_period_us": "100000\n"},
    )
    assert cpu.cgroup_cpu_quota() == 2.0
    assert cpu.usable_cpu_count() == 2


def test_the_affinity_mask_wins_when_smaller_than_the_quota(machine) -> None:
    machine(4, "0::/job\n", {"job/cpu.max": "800000 100000\n"})
    assert cpu.usable_cpu_count() == 4


@pytest.mark.parametrize(
    ("proc", "files"),
    [
        ("0::/user.slice\n", {"user.slice/cpu.max": "max 100000\n"}),
        ("5:cpu,cpuacct:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}),
        ("4:memory:/\n", {}),
    ],
    ids=["v2-max", "v1-unlimited", "no-cpu-controller"],
)
def test_no_quota_leaves_the_affinity_mask(machine, proc: str, files: dict[str, str]) -> None:
    machine(6, proc, files)
    assert cpu.cgroup_cpu_quota() is None
    assert cpu.usable_cpu_count() == 6


def test_a_tiny_quota_still_leaves_one_cpu(machine) -> None:
    machine(8, "0::/\n", {"cpu.max": "10000 100000\n"})
    assert cpu.cgroup_cpu_quota() == 0.1 and cpu.usable_cpu_count() == 1


def test_this_machines_usable_cpus_are_plausible() -> None:
    assert 1 <= cpu.usable_cpu_count() <= (os.cpu_count() or 1)
