"""Native bf16 decides `dtype=auto`: emulated bf16 (V100, T4; `torch.cuda.is_bf16_supported()` says yes) must not.

torch's device queries are monkeypatched, so these run on any machine (no GPU needed).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from roll_hw.cuda import CudaPlatform
from roll_hw.rocm import RocmPlatform, rocm_arch_has_bf16

torch = pytest.importorskip("torch")


@pytest.fixture
def cuda_device(monkeypatch: pytest.MonkeyPatch):
    """Pretend the current CUDA device has a given compute capability; torch's own bf16 answer says yes, as it
    does on every CUDA device from sm_53 on when emulation counts."""

    def set_capability(major: int, minor: int) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    return set_capability


@pytest.mark.parametrize(("capability", "native"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_cuda_bf16_needs_compute_capability_8(cuda_device, capability: tuple[int, int], native: bool) -> None:
    cuda_device(*capability)
    assert CudaPlatform.supports_bf16() is native


def test_auto_dtype_on_v100_is_float32_and_bf16_is_downgraded(cuda_device) -> None:
    cuda_device(7, 0)
    cfg = SimpleNamespace(dtype="auto")
    CudaPlatform.check_and_update_config(cfg)
    assert cfg.dtype == "float32"  # the platform rule: bf16 where native, else fp32 (fp16 would need loss scaling)
    explicit = SimpleNamespace(dtype="bfloat16")
    changes = CudaPlatform.check_and_update_config(explicit)
    assert explicit.dtype == "float32" and any("bfloat16 -> float32" in c for c in changes)


def test_auto_dtype_on_a100_is_bfloat16(cuda_device) -> None:
    cuda_device(8, 0)
    cfg = SimpleNamespace(dtype="auto")
    CudaPlatform.check_and_update_config(cfg)
    assert cfg.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("arch", "native"),
    [
        ("gfx906:sramecc+:xnack-", False),  # MI50 / MI60: no bf16 matrix instructions
        ("gfx908:sramecc+:xnack-", True),  # MI100
        ("gfx90a:sramecc+:xnack-", True),  # MI200
        ("gfx942:sramecc+:xnack-", True),  # MI300
        ("gfx950", True),  # MI350
        ("gfx90c", False),  # Vega APU
        ("gfx1030", False),  # RDNA2
        ("gfx1100", True),  # RDNA3 (WMMA)
        ("", False),
    ],
)
def test_rocm_bf16_by_architecture(monkeypatch: pytest.MonkeyPatch, arch: str, native: bool) -> None:
    assert rocm_arch_has_bf16(arch) is native
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(gcnArchName=arch))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # ROCm: always
    # gfx906 and gfx90a both report capability 9.0: the capability cannot decide on ROCm.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert RocmPlatform.supports_bf16() is native
    cfg = SimpleNamespace(dtype="auto")
    RocmPlatform.check_and_update_config(cfg)
    assert cfg.dtype == ("bfloat16" if native else "float32")


@pytest.mark.parametrize(
    ("flags", "kind", "auto", "explicit"),
    [
        ({"avx2", "fma"}, None, "float32", "float32"),  # AVX2 only: bf16 is emulated, an explicit request too
        ({"avx512f", "avx512_bf16"}, "avx512_bf16", "float32", "bfloat16"),  # Zen 4: native dot products
        ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "amx_bf16", "bfloat16", "bfloat16"),  # Sapphire Rapids
    ],
    ids=["avx2", "avx512_bf16", "amx"],
)
def test_cpu_bf16_follows_the_instructions(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], kind: str | None, auto: str, explicit: str
) -> None:
    """`dtype=auto` is bf16 only with AMX (training is fast there); an explicit bf16 runs wherever the CPU computes
    bf16 natively (AVX512-BF16 included: low-precision rollout) and becomes fp32 where it would be emulated."""
    from roll_hw import cpu
    from roll_hw.cpu import CpuPlatform

    monkeypatch.setattr(cpu, "_cpu_flags", lambda: flags)
    assert cpu.cpu_bf16_instructions() == kind
    cfg = SimpleNamespace(dtype="auto")
    CpuPlatform.check_and_update_config(cfg)
    assert cfg.dtype == auto
    asked = SimpleNamespace(dtype="bfloat16")
    changes = CpuPlatform.check_and_update_config(asked)
    assert asked.dtype == explicit
    assert bool(changes) is (explicit == "float32")  # a downgrade is said, an honoured request is not
    assert ("emulated" in CpuPlatform.bf16_note()) is (kind is None)


@pytest.mark.parametrize(
    ("cap", "kind"),
    [
        (None, "amx_bf16"),
        ("ALL", "amx_bf16"),
        ("AVX512_CORE_AMX", "amx_bf16"),
        ("avx512_core_bf16", "avx512_bf16"),
        ("AVX10_1_512", "avx512_bf16"),
        ("AVX10_2_512", "avx512_bf16"),  # after AVX10_1_512 in oneDNN's order, but without AMX
        ("AVX10_2", "avx512_bf16"),
        ("AVX10_2_512_AMX_2", "amx_bf16"),
        ("AVX512_CORE_AMX_FP16", "amx_bf16"),
        ("AVX512_CORE_VNNI", None),
        ("AVX2", None),
        ("NOT_AN_ISA", "amx_bf16"),
    ],
)
def test_a_onednn_isa_cap_lowers_the_native_bf16(
    monkeypatch: pytest.MonkeyPatch, cap: str | None, kind: str | None
) -> None:
    """torch's bf16 matmuls run in oneDNN: an AMX CPU held to AVX2 by ONEDNN_MAX_CPU_ISA (as the AVX2 emulation in
    bench/RESULTS.md does) emulates bf16, so an explicit bf16 must become fp32 there; /proc/cpuinfo alone said
    native. An unknown value is ignored, as oneDNN ignores it."""
    from roll_hw import cpu
    from roll_hw.cpu import CpuPlatform

    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if cap is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert cpu.cpu_bf16_instructions() == kind
    asked = SimpleNamespace(dtype="bfloat16")
    CpuPlatform.check_and_update_config(asked)
    assert asked.dtype == ("float32" if kind is None else "bfloat16")


def test_cpu_flags_are_read_from_cpuinfo() -> None:
    """The probe reads this machine's flags (every x86-64 Linux CPU lists sse2)."""
    import platform

    from roll_hw import cpu

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("reads /proc/cpuinfo flags of an x86-64 Linux machine")
    assert "sse2" in cpu._cpu_flags()


def test_arm_bf16_is_read_from_the_features_line(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Arm's /proc/cpuinfo lists its extensions on `Features` (Graviton 3: bf16, svebf16): an explicit bf16 runs
    natively there (it was turned into fp32, 'emulated')."""
    import builtins

    from roll_hw import cpu
    from roll_hw.cpu import CpuPlatform

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 svebf16 i8mm\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: real_open(info if f == "/proc/cpuinfo" else f, *a, **k))
    assert cpu.cpu_bf16_instructions() == "bf16" and CpuPlatform.runs_bf16() and not CpuPlatform.supports_bf16()
    asked = SimpleNamespace(dtype="bfloat16")
    CpuPlatform.check_and_update_config(asked)
    assert asked.dtype == "bfloat16" and "Arm BF16" in CpuPlatform.bf16_note()


@pytest.mark.parametrize("soc_has_bf16", [True, False])
def test_npu_bf16_is_torch_npus_answer(monkeypatch: pytest.MonkeyPatch, soc_has_bf16: bool) -> None:
    """Ascend 910A / 910Pro / 310P have no bf16 (torch_npu: SoC >= 910B1): an explicit bf16 becomes fp32 there and
    auto picks fp32 (the platform always claimed native bf16)."""
    from roll_hw.npu import NpuPlatform

    monkeypatch.setattr(NpuPlatform, "_torch_npu", classmethod(lambda cls: SimpleNamespace()))
    monkeypatch.setattr(torch, "npu", SimpleNamespace(is_bf16_supported=lambda: soc_has_bf16), raising=False)
    assert NpuPlatform.supports_bf16() is soc_has_bf16
