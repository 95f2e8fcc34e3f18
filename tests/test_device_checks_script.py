"""`nox -s device` on a bare machine: the accelerator checks (tests/device/check_accelerator.py) run with a Python
that holds only torch and transformers (.venvs/bare, built by `nox -s tests` or `nox -s bare_venv`), through the
session's no-registry path; and the session fails, never skips, when the requested device is absent.

A real venv, not hidden modules: hiding modules of the dev venv let an import of tensordict (through
roll_core.cluster.group) slip into the NCCL check, which then died at import on a two-GPU machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BARE = Path(os.environ.get("ROLL_BARE_PYTHON") or ROOT / ".venvs" / "bare" / "bin" / "python")
# What a lent accelerator machine lacks: none of these may be importable in the bare venv (else it proves nothing).
NOT_ON_DEVICE_MACHINES = ["tensordict", "ray", "hydra", "omegaconf", "pytest", "math_verify", "roll_core", "nox"]
# Every module a check imports, each alone in a fresh process of the bare venv (the checks import lazily: a check
# skipped on CPU, like NCCL with one GPU or CUDA IPC, would otherwise never import its modules here).
CHECK_IMPORTS = [
    "roll_core.cluster.ports",
    "roll_core.cluster.buckets",
    "roll_core.interfaces",
    "roll_core.models",
    "roll_core.pipelines.objectives",
    "roll_core.sequences",
    "roll_core.testing.batches",
    "roll_algos.advantages",
    "roll_engines.train.hf",
    "roll_engines.infer.hf",
    "roll_engines.train.megatron",  # imported only when megatron-core is installed: must not need more than it
    "roll_engines.infer.vllm",
]
SRC = os.pathsep.join(
    str(ROOT / "packages" / p / "src") for p in ("roll-hw", "roll-algos", "roll-core", "roll-engines")
)

needs_bare = pytest.mark.skipif(
    not BARE.exists(),
    reason=f"{BARE} is absent: `nox -s tests` builds it (or `nox -s bare_venv`: torch + transformers only)",
)


def _nox(hw: str, *args: str, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m nox -s device -- <hw> ...` from the dev venv, offline, with the bare venv as the machine's Python."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "ROLL_CACHE_DIR": str(tmp_path / "cache"),
        "ROLL_DEVICE_OFFLINE": "1",
        "ROLL_DEVICE_PYTHON": str(BARE),
    }
    cmd = [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", "device", "--", hw]
    return subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, stdin=subprocess.DEVNULL
    )


@needs_bare
def test_bare_venv_is_bare_and_every_check_module_imports() -> None:
    code = (
        "import importlib, importlib.util, sys\n"
        f"present = [m for m in {NOT_ON_DEVICE_MACHINES!r} if importlib.util.find_spec(m) is not None]\n"
        "assert not present, f'the bare venv is not bare: {present}'\n"
        f"sys.path[:0] = {SRC!r}.split({os.pathsep!r})\n"
        "failed = {}\n"
        "for m in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as exc:\n"
        "        failed[m] = f'{type(exc).__name__}: {exc}'\n"
        "assert not failed, failed\n"
    )
    # -I: no user site, no PYTHONPATH; the check modules come from the source folders, as in the script.
    proc = subprocess.run([str(BARE), "-I", "-c", code, *CHECK_IMPORTS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@needs_bare
def test_device_session_runs_the_checks_on_a_bare_python(tmp_path: Path) -> None:
    # bf16 and GRPO run; CUDA IPC skips with a reason on CPU; the NCCL check's code runs over gloo in 2 processes.
    proc = _nox("cpu", "--only=bf16,GRPO,CUDA IPC,NCCL", tmp_path=tmp_path, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "no package registry: running with the machine's own Python" in out
    table = out.split("accelerator checks on cpu", 1)[-1]
    row = re.compile(r"^  (.+?)\s{2,}(ok|skipped|FAILED)\s+[\d.]+s  (.*)$", re.M)
    rows = {name.strip(): (status, detail) for name, status, detail in row.findall(table)}
    assert rows["bf16 step, fp32 master weights"][0] == "ok", rows
    assert rows["3-step GRPO loop"][0] == "ok", rows
    assert rows["weight sync: CUDA IPC"] == ("skipped", "CUDA IPC needs a CUDA device"), rows
    assert rows["weight sync: NCCL broadcast"][0] == "ok" and "over GLOO" in rows["weight sync: NCCL broadcast"][1]
    assert "3 passed, 0 failed, 1 skipped" in table.splitlines()
    assert "Session device was successful" in out


@needs_bare
def test_device_session_fails_when_the_device_is_absent(tmp_path: Path) -> None:
    proc = _nox("cuda", tmp_path=tmp_path, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "no cuda device" in out, out[-3000:]
    assert "skipped" not in out.lower() and "accelerator checks on" not in out  # failed up front, ran nothing


def test_device_session_fails_without_a_device_on_the_registry_path(tmp_path: Path) -> None:
    # With a registry the session would build a CUDA venv: on a machine with no NVIDIA device it stops before that.
    if Path("/dev/nvidiactl").exists() or any(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("this machine shows an NVIDIA device")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ROLL_DEVICE_OFFLINE": "0"}
    cmd = [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-s", "device", "--", "cuda"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no cuda device" in out, out[-3000:]
    assert "pip install" not in out  # it stopped before installing anything


def test_check_script_exits_nonzero_without_cuda() -> None:
    # The script alone (in this venv, CPU torch): --device cuda without CUDA is an error, not a table of skips.
    if _cuda_here():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests/device/check_accelerator.py"), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no cuda device" in proc.stderr and "passed" not in proc.stdout


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def test_gpu_runs_script_on_cpu(tmp_path: Path) -> None:
    """tests/device/gpu_runs.py (roll-train's path on a lent machine) on the CPU: fsdp2 under cluster=local starts
    a process group of one and learns; the resume run equals the uninterrupted one; rows are written as JSON."""
    import json

    rows_file = tmp_path / "runs.json"
    cmd = [sys.executable, str(ROOT / "tests/device/gpu_runs.py"), "--hw", "cpu", "--dtypes", "float32"]
    cmd += ["--only", "fsdp2", "resume", "--json", str(rows_file)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(rows_file.read_text())
    assert [r["run"] for r in rows] == ["fsdp2/float32", "resume (hf/float32)"]
    assert all(r["status"] == "ok" for r in rows), rows
    first, last = (float(x) for x in re.search(r"reward ([\d.]+) -> ([\d.]+)", rows[0]["detail"]).groups())
    assert last - first >= 0.2
    assert "max |dw| 0.0e+00" in rows[1]["detail"]
    assert "2 passed, 0 failed" in proc.stdout
