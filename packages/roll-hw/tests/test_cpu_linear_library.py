"""`roll_hw.cpu.fp32_linear_library()`: oneDNN on AMD CPUs with AVX-512 (MKL runs AVX2 there), MKL elsewhere,
`ROLL_CPU_LINEAR` overrides, anything else in it is an error. The CPU is faked through /proc/cpuinfo's readers."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from roll_hw import cpu


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, set[str]], None]:
    monkeypatch.delenv("ROLL_CPU_LINEAR", raising=False)

    def set_cpu(vendor: str, flags: set[str], family: int = 25) -> None:
        monkeypatch.setattr(cpu, "cpu_vendor", lambda: vendor)
        monkeypatch.setattr(cpu, "_cpu_flags", lambda: flags)
        monkeypatch.setattr(cpu, "cpu_family", lambda: family)

    return set_cpu


@pytest.mark.parametrize(
    "vendor, flags, family, want",
    [
        ("AuthenticAMD", {"avx2", "avx512f"}, 25, "onednn"),
        ("AuthenticAMD", {"avx2"}, 23, "onednn"),  # Zen 1-3: emulated on a Zen 5 held to AVX2 in every library
        ("AuthenticAMD", {"avx2"}, 21, "mkl"),  # Excavator: pre-Zen, not measured
        ("AuthenticAMD", {"sse4_2"}, 25, "mkl"),
        ("GenuineIntel", {"avx2", "avx512f", "amx_bf16"}, 6, "mkl"),
        ("", set(), 0, "mkl"),
    ],
)
def test_auto_follows_the_cpu(
    fake_cpu, monkeypatch: pytest.MonkeyPatch, vendor: str, flags: set, family: int, want: str
) -> None:
    fake_cpu(vendor, flags, family)
    assert cpu.fp32_linear_library() == want
    monkeypatch.setenv("ROLL_CPU_LINEAR", "auto")
    assert cpu.fp32_linear_library() == want


def test_the_variable_overrides_and_is_checked(fake_cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu("GenuineIntel", {"avx512f"})
    monkeypatch.setenv("ROLL_CPU_LINEAR", "oneDNN")
    assert cpu.fp32_linear_library() == "onednn"
    fake_cpu("AuthenticAMD", {"avx512f"})
    monkeypatch.setenv("ROLL_CPU_LINEAR", "mkl")
    assert cpu.fp32_linear_library() == "mkl"
    monkeypatch.setenv("ROLL_CPU_LINEAR", "openblas")
    with pytest.raises(ValueError, match="ROLL_CPU_LINEAR='openblas': expected onednn, mkl or auto"):
        cpu.fp32_linear_library()


def test_the_vendor_is_read_from_proc_cpuinfo() -> None:
    vendor = cpu.cpu_vendor()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert vendor == ""
        return
    assert (vendor and f": {vendor}" in text) or "vendor_id" not in text


def test_cpuinfo_lines_without_a_colon_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A /proc/cpuinfo line that starts with the key but has no ':' (a truncated file, an emulator's odd line) raised
    IndexError from every reader (the vendor, the family, the flags, so the platform's bf16 and linear-library
    choices); it is skipped, and the key's real line is read. A longer name that starts with the key is not it."""
    import io

    text = (
        "processor\t: 0\n"
        "vendor_id\n"
        "vendor_id_extra\t: Other\n"
        "vendor_id\t: AuthenticAMD\n"
        "cpu family\n"
        "cpu family\t: 25\n"
        "flags\n"
        "flags\t\t: fpu avx2 avx512f\n"
    )
    monkeypatch.setattr(cpu, "open", lambda path, *a, **k: io.StringIO(text), raising=False)
    assert cpu.cpu_vendor() == "AuthenticAMD"
    assert cpu.cpu_family() == 25
    assert cpu._cpu_flags() == {"fpu", "avx2", "avx512f"}
    monkeypatch.setattr(cpu, "open", lambda path, *a, **k: io.StringIO("vendor_id\nflags\n"), raising=False)
    assert (cpu.cpu_vendor(), cpu.cpu_family(), cpu._cpu_flags()) == ("", 0, set())


def test_the_doctor_names_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_CPU_LINEAR", "onednn")
    assert cpu.CpuPlatform.describe()["fp32 linears (roll engines)"].startswith("onednn (")
    monkeypatch.setenv("ROLL_CPU_LINEAR", "fast")
    assert "expected onednn, mkl or auto" in cpu.CpuPlatform.describe()["fp32 linears (roll engines)"]


def test_onednn_caches_are_bounded_unless_the_user_sized_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "-")  # recorded, so what the call sets is undone after
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "500")
    assert cpu.bound_onednn_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(cpu.ONEDNN_CACHE_ENTRIES)}
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32" and os.environ["LRU_CACHE_CAPACITY"] == "500"
    assert cpu.bound_onednn_caches() == {}  # both set now
