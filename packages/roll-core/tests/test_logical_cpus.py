"""`${roll_logical_cpus:}` (the logical CPUs of a Ray instance a sweep starts here: hydra/launcher/ray.yaml) counts
the CPUs this process may use, not the host's: a pod limited to 2 CPUs on a 64-core node advertised 64."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from roll_core.config.schema import logical_cpus, register_configs


def test_logical_cpus_follow_the_usable_cpus_with_a_floor_of_four(monkeypatch: pytest.MonkeyPatch) -> None:
    import roll_hw.cpu

    register_configs()
    cfg = OmegaConf.create({"num_cpus": "${roll_logical_cpus:}"})
    usable = (os.cpu_count() or 1) + 5  # a number os.cpu_count() cannot give
    monkeypatch.setattr(roll_hw.cpu, "usable_cpu_count", lambda: usable)
    assert cfg.num_cpus == usable and logical_cpus() == usable
    monkeypatch.setattr(roll_hw.cpu, "usable_cpu_count", lambda: 2)  # a CPU-limited pod on any host
    assert cfg.num_cpus == 4 and logical_cpus() == 4  # every role's fractional share still fits
