"""Built-in platforms: conformance suite, detection order, ROLL_PLATFORM, and the doctor."""

from __future__ import annotations

import subprocess
import sys

import pytest

import roll_hw
from roll_hw import PlatformUnavailableError, resolve_platform
from roll_hw.cpu import CpuPlatform
from roll_hw.cuda import CudaPlatform
from roll_hw.npu import NpuPlatform
from roll_hw.rocm import RocmPlatform
from roll_hw.testing import PlatformTestSuite


class TestCpuPlatform(PlatformTestSuite):
    platform = CpuPlatform


class TestCudaPlatform(PlatformTestSuite):
    platform = CudaPlatform


class TestRocmPlatform(PlatformTestSuite):
    platform = RocmPlatform


class TestNpuPlatform(PlatformTestSuite):
    platform = NpuPlatform


def test_platform_facts() -> None:
    assert (CudaPlatform.ray_resource, CudaPlatform.visible_devices_env, CudaPlatform.dist_backend) == (
        "GPU",
        "CUDA_VISIBLE_DEVICES",
        "nccl",
    )
    assert (RocmPlatform.device_type, RocmPlatform.visible_devices_env) == ("cuda", "HIP_VISIBLE_DEVICES")
    assert (NpuPlatform.ray_resource, NpuPlatform.visible_devices_env, NpuPlatform.dist_backend) == (
        "NPU",
        "ASCEND_RT_VISIBLE_DEVICES",
        "hccl",
    )
    assert (CpuPlatform.ray_resource, CpuPlatform.dist_backend) == (None, "gloo")


def test_auto_detection_matches_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    expected = next(p for p in (CudaPlatform, RocmPlatform, NpuPlatform, CpuPlatform) if p.is_available())
    plugins_active = [p for p in roll_hw.detect.plugin_platforms().values() if p.is_available()]
    assert resolve_platform() is (plugins_active[0] if plugins_active else expected)


def test_builtins_are_roll_hw_entry_points_in_probe_order() -> None:
    from importlib.metadata import entry_points

    declared = {ep.name: ep.value for ep in entry_points(group="roll.platforms") if ep.dist.name == "roll-hw"}
    assert roll_hw.detect.builtin_names() == ["cuda", "rocm", "npu", "cpu"]  # pyproject lists cpu first
    assert set(declared) == set(roll_hw.detect.builtin_names())
    for name, cls in zip(("cuda", "rocm", "npu", "cpu"), (CudaPlatform, RocmPlatform, NpuPlatform, CpuPlatform)):
        assert roll_hw.detect.get_platform_class(name) is cls and cls.name == name


def test_source_checkout_reads_the_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    """roll-hw on PYTHONPATH without being installed (the bare device machine) has no entry-point metadata."""
    from importlib.metadata import PackageNotFoundError

    from roll_hw import detect

    def not_installed(name: str) -> None:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(detect, "entry_points", lambda group: [])
    monkeypatch.setattr(detect, "distribution", not_installed)
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    detect.clear_cache()
    try:
        assert detect.builtin_names() == ["cuda", "rocm", "npu", "cpu"]
        assert detect.get_platform_class("npu") is NpuPlatform
        assert detect.resolve_platform() is next(
            p for p in (CudaPlatform, RocmPlatform, NpuPlatform, CpuPlatform) if p.is_available()
        )
        monkeypatch.setattr(detect, "_source_entry_points", lambda: [])  # neither metadata nor a pyproject
        detect.clear_cache()
        with pytest.raises(PlatformUnavailableError, match=r"roll-hw declares no roll.platforms entry points"):
            detect.resolve_platform()
    finally:
        monkeypatch.undo()
        detect.clear_cache()


def test_forced_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_PLATFORM", "cpu")
    assert resolve_platform() is CpuPlatform


def test_forced_npu_without_torch_npu_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if NpuPlatform.is_available():
        pytest.skip("this machine has an NPU")
    monkeypatch.setenv("ROLL_PLATFORM", "npu")
    with pytest.raises(PlatformUnavailableError, match=r"ROLL_PLATFORM=npu.*torch_npu.*roll-hw\[npu\]"):
        resolve_platform()


def test_unknown_platform_lists_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_PLATFORM", "tpu9000")
    with pytest.raises(
        PlatformUnavailableError, match=r"unknown platform 'tpu9000'; installed platforms: cuda, rocm, npu, cpu"
    ):
        resolve_platform()


def test_current_platform_is_lazy_and_swappable() -> None:
    roll_hw.set_current_platform(None)
    assert roll_hw._current is None  # importing resolved nothing
    first = roll_hw.current_platform
    assert roll_hw._current is first
    roll_hw.set_current_platform(NpuPlatform)
    try:
        assert roll_hw.current_platform is NpuPlatform
    finally:
        roll_hw.set_current_platform(None)


def test_cpu_memory_stats_are_plausible() -> None:
    mem = CpuPlatform.memory_stats()
    assert mem.total > 2**30 and 0 < mem.free <= mem.total and mem.allocated > 0


def test_cpu_config_hook_forces_fp32_without_amx() -> None:
    from types import SimpleNamespace

    cfg = SimpleNamespace(dtype="auto", dist_backend="")
    CpuPlatform.check_and_update_config(cfg)
    assert cfg.dtype == ("bfloat16" if CpuPlatform.supports_bf16() else "float32")
    assert cfg.dist_backend == "gloo"


def test_import_does_not_import_torch() -> None:
    code = "import sys, roll_hw; from roll_hw import detect, doctor, interface; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_doctor_prints_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "roll_hw"], check=True, capture_output=True, text=True, env=_env(ROLL_PLATFORM="cpu")
    ).stdout
    assert "detected platform" in out and "| cpu" in out
    assert "platform probes" in out and "optional engines" in out
    for name in ("cuda", "rocm", "npu", "vllm", "sglang", "torch_npu"):
        assert name in out
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        assert "gloo" in out  # the CPU build of torch has gloo
    else:
        import re

        assert re.search(r"^torch\s+\| no \(not installed\)", out, re.M)


def test_doctor_fails_clearly_on_forced_unavailable_platform() -> None:
    if NpuPlatform.is_available():
        pytest.skip("this machine has an NPU")
    proc = subprocess.run(
        [sys.executable, "-m", "roll_hw"], capture_output=True, text=True, env=_env(ROLL_PLATFORM="npu")
    )
    assert proc.returncode == 1
    assert "ERROR: platform 'npu' forced by ROLL_PLATFORM=npu is unavailable" in proc.stdout


def _env(**extra: str) -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.update(extra)
    return env


def test_a_broken_plugin_stops_auto_detection_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin whose module does not import (its vendor SDK missing on this node) is reported, with its name, when
    the platform is auto-detected; a run that names a platform (hw.platform=cpu, ROLL_PLATFORM=cuda) loads only
    that one and goes on (every run failed); a plugin whose probe raises is named too (a bare driver error)."""
    from importlib.metadata import EntryPoint

    from roll_hw import detect
    from roll_hw.detect import PlatformPluginError

    real = detect.entry_points
    broken = EntryPoint(name="acme", value="roll_acme_missing_sdk:AcmePlatform", group="roll.platforms")
    monkeypatch.setattr(detect, "entry_points", lambda group: [*real(group=group), broken])
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    detect.clear_cache()
    try:
        assert detect.resolve_platform("cpu") is CpuPlatform and detect.get_platform_class("npu") is NpuPlatform
        with pytest.raises(PlatformPluginError, match=r"roll.platforms:acme .*No module named 'roll_acme_missing_sdk'"):
            detect.resolve_platform()

        class Raising(CpuPlatform):
            @classmethod
            def is_available(cls) -> bool:
                raise OSError("libacme_driver.so: cannot open shared object file")

        monkeypatch.setattr(detect, "plugin_platforms", lambda: {"acme": Raising})
        with pytest.raises(PlatformPluginError, match=r"probe of platform plugin 'acme' .* raised OSError: libacme"):
            detect.resolve_platform()
    finally:
        monkeypatch.undo()
        detect.clear_cache()


def test_seeding_a_platform_this_host_lacks_seeds_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only Ray head with hw.platform=npu seeds its host (it crashed: torch has no `npu` without torch_npu);
    the workers seed their own devices."""
    import random

    import torch

    monkeypatch.delattr(torch, "npu", raising=False)
    NpuPlatform.seed_everything(123)
    first = (random.random(), float(torch.rand(1)))
    NpuPlatform.seed_everything(123)
    assert (random.random(), float(torch.rand(1))) == first


def test_doctor_reports_a_platform_that_fails_to_describe_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUs counted by NVML but a driver older than torch's CUDA: the platform probes available, then its
    description raises; roll-doctor reports that instead of crashing (the machine where it is needed most)."""
    from roll_hw import doctor

    class TooOldDriver(CpuPlatform):
        @classmethod
        def describe(cls) -> dict[str, str]:
            raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040).")

    monkeypatch.setattr(doctor, "resolve_platform", lambda *a, **k: TooOldDriver)
    text, ok = doctor.report()
    assert "RuntimeError: The NVIDIA driver on your system is too old" in text and ok


def test_doctor_answers_help_and_refuses_an_unknown_option(capsys: pytest.CaptureFixture[str]) -> None:
    """`roll-doctor --help` printed the whole report and a misspelt option passed silently (exit 0)."""
    from roll_hw import doctor

    with pytest.raises(SystemExit) as help_:
        doctor.main(["--help"])
    assert help_.value.code == 0 and "usage: roll-doctor" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        doctor.main(["--platform=cuda"])
    assert bad.value.code == 2 and "unrecognized arguments: --platform=cuda" in capsys.readouterr().err
    assert doctor.main([]) in (0, 1) and "platform" in capsys.readouterr().out


def test_a_forced_platform_whose_probe_raises_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """ROLL_PLATFORM or hw.platform naming a platform whose probe raises (its driver library missing): the error names
    the platform and where it was forced (it was the bare OSError); a stray space or a typo in ROLL_PLATFORM says it
    came from there."""
    from roll_hw import detect

    class Raising(CpuPlatform):
        @classmethod
        def is_available(cls) -> bool:
            raise OSError("libacme_driver.so: cannot open shared object file")

    real = detect.get_platform_class
    monkeypatch.setattr(detect, "get_platform_class", lambda name: Raising if name == "acme" else real(name))
    monkeypatch.setenv("ROLL_PLATFORM", "acme")
    with pytest.raises(PlatformUnavailableError, match=r"'acme' \(forced by ROLL_PLATFORM=acme\).*raised OSError"):
        resolve_platform()
    with pytest.raises(PlatformUnavailableError, match=r"'acme' \(requested\).*raised OSError: libacme_driver"):
        resolve_platform("acme")
    monkeypatch.setenv("ROLL_PLATFORM", " cpu ")
    assert resolve_platform() is CpuPlatform
    monkeypatch.setenv("ROLL_PLATFORM", "gpu")
    with pytest.raises(PlatformUnavailableError, match=r"unknown platform 'gpu'.*\(forced by ROLL_PLATFORM=gpu\)"):
        resolve_platform()


def test_an_unavailable_plugin_that_replaces_cpu_falls_back_to_roll_hws_cpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A plugin registered as `cpu` (it replaces the built-in) that is unavailable: auto-detection ended in an
    AssertionError ('unreachable'); roll-hw's own CPU platform runs, and the log says why."""
    import logging

    from roll_hw import detect

    class ShadowCpu(CpuPlatform):
        @classmethod
        def is_available(cls) -> bool:
            return False

        @classmethod
        def unavailable_reason(cls) -> str:
            return "its oneAPI extension is missing"

    real = detect.get_platform_class
    monkeypatch.setattr(detect, "get_platform_class", lambda name: ShadowCpu if name == "cpu" else real(name))
    monkeypatch.setattr(detect, "plugin_platforms", lambda: {})
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    if CudaPlatform.is_available() or RocmPlatform.is_available() or NpuPlatform.is_available():
        pytest.skip("an accelerator is detected before cpu here")
    with caplog.at_level(logging.WARNING, logger="roll_hw.detect"):
        assert resolve_platform() is CpuPlatform
    assert "(its oneAPI extension is missing): using roll-hw's own cpu platform" in caplog.text


def test_doctor_reports_without_platform_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """A roll_hw without its roll.platforms entry points (a copied folder, a stale install): the doctor still prints
    its report and exits 1 (it raised from the probes section)."""
    from roll_hw import doctor

    def nothing_declared() -> list[str]:
        raise PlatformUnavailableError("roll-hw declares no roll.platforms entry points here (not even cpu)")

    monkeypatch.setattr(doctor, "resolve_platform", lambda *a, **k: (_ for _ in ()).throw(nothing_declared()))
    monkeypatch.setattr(doctor, "platform_names", nothing_declared)
    text, ok = doctor.report()
    assert not ok and "(platforms)" in text and "declares no roll.platforms entry points" in text
    assert "optional engines" in text  # the rest of the report is there


def test_doctor_says_a_broken_torch_npu_gives_no_hccl(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from roll_hw import doctor

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "torch_npu" else real(n, *a))
    monkeypatch.setattr(NpuPlatform, "_torch_npu", classmethod(lambda cls: None))
    assert "hccl (torch_npu broken)" in doctor._dist_backends()
