"""The accelerator platforms on machines we do not have: which devices the probes see under the visibility
variables, their unavailable reasons, memory queries, a broken torch_npu, and what importing them costs.

torch's own parsing runs (`torch.cuda.device_count()` -> `_parse_visible_devices`, UUID matching); only what it reads
from the driver is faked: NVML's (or amd-smi's) device count and UUIDs, and `torch.version`. The device-context
entry points (`torch.cuda._lazy_init`, `torch._C._cuda_getDeviceCount`) are made to fail the test if a probe
reaches them: probes must stay fork-safe and context-free.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from roll_hw import MemoryStats, PlatformUnavailableError, resolve_platform
from roll_hw.cpu import CpuPlatform
from roll_hw.cuda import CudaPlatform
from roll_hw.npu import NpuPlatform
from roll_hw.rocm import RocmPlatform

torch = pytest.importorskip("torch")

UUIDS = [f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}" for i in range(8)]
VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")


@pytest.fixture
def gpu_node(monkeypatch: pytest.MonkeyPatch):
    """An 8-GPU node seen by a CUDA ("cuda") or ROCm ("hip") build of torch; returns the calls that would have
    initialised the driver (torch's fallback when NVML cannot answer)."""
    driver_calls: list[str] = []

    def no_context() -> None:
        raise AssertionError("a probe initialised CUDA (torch.cuda._lazy_init)")

    def driver_count() -> int:
        driver_calls.append("cudaGetDeviceCount")
        return 1

    def make(build: str) -> list[str]:
        for var in VARS:
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", driver_count, raising=False)  # a CUDA-compiled torch
        monkeypatch.setattr(torch.cuda, "_lazy_init", no_context)
        monkeypatch.setattr(torch.cuda, "_initialized", False)
        monkeypatch.setattr(torch.cuda, "_cached_device_count", None)
        monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 8)
        monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", lambda: list(UUIDS))
        monkeypatch.setattr(torch.cuda, "_raw_device_count_amdsmi", lambda: 8)
        monkeypatch.setattr(torch.cuda, "_raw_device_uuid_amdsmi", lambda: [u[4:] for u in UUIDS])
        version = SimpleNamespace(**vars(torch.version))
        version.cuda, version.hip = ("12.8", None) if build == "cuda" else (None, "6.4.43482")
        monkeypatch.setattr(torch, "version", version)
        return driver_calls

    return make


@pytest.mark.parametrize(
    ("visible", "count"),
    [
        (None, 8),
        ("", 0),  # Ray's value in a worker that asked for no GPU
        ("-1", 0),
        ("0", 1),
        ("3,5", 2),  # what Ray sets in an actor given two GPUs: they are cuda:0 and cuda:1 there
        ("1,-1,2", 1),  # a negative id ends the list
        ("0,0", 0),  # a repeated id hides everything
        ("9", 0),  # a device this node does not have
        (UUIDS[2], 1),
        (f"{UUIDS[2][:8]},{UUIDS[5]}", 2),  # an unambiguous UUID prefix is enough
        ("GPU-ffff", 0),  # a stale UUID (another node's)
    ],
)
def test_cuda_probe_follows_cuda_visible_devices(gpu_node, monkeypatch, visible: str | None, count: int) -> None:
    driver_calls = gpu_node("cuda")
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert CudaPlatform.is_available() is (count > 0) and CudaPlatform.device_count() == count
    assert not RocmPlatform.is_available()  # a CUDA build is never ROCm
    assert driver_calls == []  # NVML answered: no CUDA initialisation, forks stay safe
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    assert resolve_platform() is (CudaPlatform if count else CpuPlatform)
    if not count:
        monkeypatch.setenv("ROLL_PLATFORM", "cuda")
        with pytest.raises(PlatformUnavailableError) as err:
            resolve_platform()
        assert f"no device visible with CUDA_VISIBLE_DEVICES={visible!r}" in str(err.value)


def test_cuda_mig_uuids_are_counted_by_the_driver(gpu_node, monkeypatch) -> None:
    """torch's NVML path skips MIG UUIDs and asks the CUDA driver (cudaGetDeviceCount): the probe still answers,
    at the cost of initialising the driver in this process (torch's behaviour; vLLM's probe shares it)."""
    driver_calls = gpu_node("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-8d4a1b2c-0000-0000-0000-000000000000")
    assert CudaPlatform.is_available() and driver_calls == ["cudaGetDeviceCount"]


def test_cuda_unavailable_reason_without_visibility_variable(gpu_node, monkeypatch) -> None:
    gpu_node("cuda")
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 0)  # a node without GPUs
    assert CudaPlatform.unavailable_reason() == "no device visible (CUDA_VISIBLE_DEVICES not set: check the driver)"


def test_an_empty_visibility_variable_says_what_ray_does(gpu_node, monkeypatch) -> None:
    """hw.platform=cuda in a Ray worker that reserved no GPU, where Ray set CUDA_VISIBLE_DEVICES='' (older Ray, or
    Ray 2.60 with RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1)."""
    gpu_node("cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "'' hides every device: Ray sets it in a worker that reserved no GPU" in CudaPlatform.unavailable_reason()


@pytest.mark.parametrize(
    ("env", "count"),
    [
        ({}, 8),
        ({"HIP_VISIBLE_DEVICES": "0,1"}, 2),  # what Ray 2.x sets for an AMD GPU actor
        ({"HIP_VISIBLE_DEVICES": ""}, 0),
        ({"HIP_VISIBLE_DEVICES": "-1"}, 0),
        ({"ROCR_VISIBLE_DEVICES": "0,1,2"}, 3),
        ({"ROCR_VISIBLE_DEVICES": "2,3", "HIP_VISIBLE_DEVICES": "1"}, 1),  # HIP selects among ROCR's
        ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),  # ROCm's torch honours the CUDA variable too
        ({"HIP_VISIBLE_DEVICES": "GPU-3333aaaa"}, 1),
    ],
)
def test_rocm_probe_follows_hip_rocr_and_cuda_visible_devices(gpu_node, monkeypatch, env, count: int) -> None:
    driver_calls = gpu_node("hip")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert RocmPlatform.is_available() is (count > 0) and RocmPlatform.device_count() == count
    assert not CudaPlatform.is_available() and driver_calls == []
    monkeypatch.delenv("ROLL_PLATFORM", raising=False)
    assert resolve_platform() is (RocmPlatform if count else CpuPlatform)


def test_rocm_unavailable_reason_names_the_variable_that_hides_the_devices(gpu_node, monkeypatch) -> None:
    """ROCm's torch counts through HIP_, ROCR_ and CUDA_VISIBLE_DEVICES; the reason pointed at HIP_VISIBLE_DEVICES
    alone ("check the driver and HIP_VISIBLE_DEVICES") when CUDA_VISIBLE_DEVICES=-1 hid every device."""
    gpu_node("hip")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert not RocmPlatform.is_available()
    assert "CUDA_VISIBLE_DEVICES='-1'" in RocmPlatform.unavailable_reason()
    monkeypatch.setenv("ROLL_PLATFORM", "rocm")
    with pytest.raises(PlatformUnavailableError, match=r"'rocm' forced by ROLL_PLATFORM=rocm .*CUDA_VISIBLE_DEV"):
        resolve_platform()


@pytest.mark.parametrize("platform", [CudaPlatform, RocmPlatform])
def test_without_torch_the_reason_names_the_pip_extra(monkeypatch, platform) -> None:
    """ROLL_PLATFORM=cuda (or rocm) on a machine without torch said "torch is not installed", not what to install."""
    from roll_hw import _torch_gpu

    monkeypatch.setattr(_torch_gpu, "torch_importable", lambda: False)
    monkeypatch.setenv("ROLL_PLATFORM", platform.name)
    assert not platform.is_available()
    with pytest.raises(PlatformUnavailableError) as err:
        resolve_platform()
    message = str(err.value)
    assert message == (
        f"platform {platform.name!r} forced by ROLL_PLATFORM={platform.name} is unavailable: torch is not installed; "
        f"install roll-hw[{platform.name}] (a {'CUDA' if platform is CudaPlatform else 'ROCm'} build of torch)"
    )


def test_npu_reason_names_ascend_rt_visible_devices(monkeypatch) -> None:
    monkeypatch.setattr(NpuPlatform, "_torch_npu", classmethod(lambda cls: SimpleNamespace()))
    monkeypatch.setattr(torch, "npu", SimpleNamespace(device_count=lambda: 0), raising=False)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    assert not NpuPlatform.is_available()
    reason = NpuPlatform.unavailable_reason()
    assert "sees no NPU" in reason and "ASCEND_RT_VISIBLE_DEVICES=''" in reason and "no NPU" in reason


_BROKEN_TORCH_NPU = """
import _roll_fake_cann as cann

cann.imports += 1
if cann.backend_renamed:  # what a second import of a half-imported torch_npu meets
    raise RuntimeError("torch.register_privateuse1_backend() has already been set! Current backend: npu")
cann.backend_renamed = True
raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")
"""


def test_a_broken_torch_npu_is_imported_once_and_its_first_error_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A torch_npu that fails half-way (a CANN library missing) was imported again by every probe, reason and bf16
    query (seconds of library loading each); a retry after a partial import fails differently, and that second
    error replaced the one that says what is broken."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(textwrap.dedent(_BROKEN_TORCH_NPU))
    cann = SimpleNamespace(imports=0, backend_renamed=False)
    monkeypatch.setitem(sys.modules, "_roll_fake_cann", cann)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(NpuPlatform, "_import_error", None)
    monkeypatch.setattr(NpuPlatform, "_import_failed", False, raising=False)  # (absent before the fix)
    monkeypatch.delattr(torch, "npu", raising=False)
    try:
        assert not NpuPlatform.is_available()
        reason = NpuPlatform.unavailable_reason()
        assert not NpuPlatform.supports_bf16()
        NpuPlatform.seed_everything(1)
        assert "ImportError: libhccl.so: cannot open shared object file" in reason and "already been set" not in reason
        assert cann.imports == 1
    finally:
        sys.modules.pop("torch_npu", None)


_MULTI_LINE_TORCH_NPU = """
raise RuntimeError("Failed to load libascendcl.so\\nTraceback of the loader:\\n  dlopen: undefined symbol: aclInit")
"""


def test_a_multi_line_torch_npu_import_error_is_reported_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A broken CANN install can raise an error whose text is a multi-line log: the reason (the doctor's table, a
    PlatformUnavailableError) is one line, its first, with " ..." for the rest."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(_MULTI_LINE_TORCH_NPU)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(NpuPlatform, "_import_error", None)
    monkeypatch.setattr(NpuPlatform, "_import_failed", False)
    monkeypatch.delattr(torch, "npu", raising=False)
    try:
        reason = NpuPlatform.unavailable_reason()
    finally:
        sys.modules.pop("torch_npu", None)
    assert "\n" not in reason
    assert reason.startswith("torch_npu failed to import: RuntimeError: Failed to load libascendcl.so ...; install ")
    assert "aclInit" not in reason


def test_visible_devices_for_a_plugin_worker() -> None:
    """The variable roll sets for devices Ray does not manage (cluster/launch.py): ids joined, empty for none."""
    assert CudaPlatform.visible_devices_for([2, 3]) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert RocmPlatform.visible_devices_for([]) == {"HIP_VISIBLE_DEVICES": ""}
    assert NpuPlatform.visible_devices_for([7]) == {"ASCEND_RT_VISIBLE_DEVICES": "7"}
    assert CpuPlatform.visible_devices_for([0]) == {}


def test_gpu_memory_stats_map_torchs_free_total_order(gpu_node, monkeypatch) -> None:
    """torch's mem_get_info returns (free, total): the platform's MemoryStats must not swap them."""
    gpu_node("cuda")
    asked: list[int] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (asked.append(i), (30 * 2**30, 80 * 2**30))[1])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 5)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: 7)
    for platform in (CudaPlatform, RocmPlatform):
        mem = platform.memory_stats(1)
        assert (mem.total, mem.free, mem.allocated, mem.reserved) == (80 * 2**30, 30 * 2**30, 5, 7)
    assert asked == [1, 1]


def test_npu_memory_stats_through_torch_npu(monkeypatch) -> None:
    monkeypatch.setattr(NpuPlatform, "_torch_npu", classmethod(lambda cls: SimpleNamespace()))
    fake = SimpleNamespace(
        mem_get_info=lambda i: (10 * 2**30, 64 * 2**30), memory_allocated=lambda i: 1, memory_reserved=lambda i: 2
    )
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    assert NpuPlatform.memory_stats(0) == MemoryStats(total=64 * 2**30, free=10 * 2**30, allocated=1, reserved=2)


@pytest.mark.parametrize("capability", [(7, 0), (7, 5)], ids=["V100", "T4"])
def test_fp16_is_honoured_on_gpus_without_native_bf16(monkeypatch, capability) -> None:
    """V100 / T4: `auto` is fp32 (bf16 is emulated there, and fp16 by default would break Megatron, which refuses
    it, and training without loss scaling); an explicit float16 runs as asked (the hf engine scales the loss)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    auto, asked = SimpleNamespace(dtype="auto"), SimpleNamespace(dtype="float16")
    CudaPlatform.check_and_update_config(auto)
    assert auto.dtype == "float32"
    assert CudaPlatform.check_and_update_config(asked) == [] and asked.dtype == "float16"


def test_loading_every_platform_class_imports_no_torch() -> None:
    """Entry points load platform classes (the doctor, a named hw.platform, the placement on a CPU-only head) without
    importing torch, torch_npu or Ray; only a probe or a device query does."""
    code = (
        "import sys; from roll_hw import detect; import roll_core.devices\n"
        "[detect.get_platform_class(n) for n in detect.platform_names()]\n"
        "heavy = [m for m in ('torch', 'torch_npu', 'ray', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
