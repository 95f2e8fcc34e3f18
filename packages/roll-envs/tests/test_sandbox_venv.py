"""A virtual environment's interpreter in the sandbox, and what may (and may not) lead to the unsandboxed fallback.

- A venv's `bin/python` (env.reward.python) could not start in the sandbox: run with `-S`, Python 3.11 reports its
  base prefix, so the venv's folder was never bound and bwrap said `execvp .../venv/bin/python: No such file`; with
  the unsandboxed fallback allowed, that configuration silently ran every program without a sandbox. Now the venv's
  folder is bound read-only beside its base prefix (under the same secrets check) and its site-packages are
  importable (also a configured interpreter's run unsandboxed, which `-S` had hidden them from).
- Only a missing or broken bubblewrap (`SandboxUnavailableError`) may lead to the fallback: an interpreter that
  cannot be shown, or that fails inside a working bwrap, is a ValueError naming the fix.
- The fallback's warning says what it gives up (the uid, the run cgroup), and a run whose detached grandchild still
  holds stdout ends with the program (its exit status judged), not at the wall clock as a timeout.

Tests that run programs need a working bubblewrap (`roll-envs[code]`); they skip with the reason otherwise.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from roll_envs.sandbox import OK, PythonSandbox, SandboxLimits, SandboxUnavailableError, bwrap, cgroup, runner
from roll_envs.sandbox.process import run_captured
from roll_envs.sandbox.runner import make_sandbox

LIMITS = SandboxLimits(timeout_s=10.0)


@pytest.fixture(scope="module")
def bubblewrap() -> str:
    try:
        return bwrap.find_bwrap()
    except FileNotFoundError as exc:
        pytest.skip(f"needs bubblewrap: {exc}")


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A folder outside /tmp (the sandbox hides the host's /tmp, so a venv there cannot be shown)."""
    try:
        folder = Path(tempfile.mkdtemp(prefix="roll-venv-", dir="/var/tmp"))
    except OSError as exc:
        pytest.skip(f"needs a writable /var/tmp: {exc}")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _venv(where: Path, module_value: int) -> str:
    """A real venv (`python -m venv`, no pip) whose site-packages holds `tinymod` with VALUE = `module_value`."""
    subprocess.run([bwrap.default_python(), "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = where / "lib" / version / "site-packages"
    assert site.is_dir(), list(where.rglob("site-packages"))
    (site / "tinymod.py").write_text(f"VALUE = {module_value}\n")
    return str(where / "bin" / "python")


def test_a_venv_interpreter_runs_sandboxed_with_its_site_packages(
    bubblewrap: str, outside_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    python = _venv(outside_tmp / "venv", 4242)
    program = "import sys, tinymod\nprint(tinymod.VALUE, input())\nprint(sys.executable)\n"
    with caplog.at_level(logging.WARNING):
        # Before: falls back to unsandboxed (the check said `execvp ...venv/bin/python: No such file`).
        made = make_sandbox(LIMITS, python=python, allow_unsandboxed=True)
    assert made.mode == "bwrap" and "UNSANDBOXED" not in caplog.text, caplog.text
    res = made.run(program, "hi\n")
    assert res.status == OK and res.stdout.splitlines() == ["4242 hi", python], res
    # The venv is shown read-only, like the interpreter's other folders.
    wrote = made.run(f"open({str(outside_tmp / 'venv' / 'x')!r}, 'w')\n")
    assert wrote.status != OK and "Read-only file system" in wrote.stderr, wrote
    # The default interpreter still sees the standard library only.
    assert PythonSandbox(LIMITS).run("import tinymod\n").status != OK


def test_a_venv_holding_credentials_is_refused(bubblewrap: str, outside_tmp: Path) -> None:
    python = _venv(outside_tmp / "venv", 1)
    (outside_tmp / "venv" / ".env").write_text("WANDB_API_KEY=secret\n")
    with pytest.raises(ValueError, match=r"\.env"):  # before: SandboxUnavailableError (the venv never started)
        make_sandbox(LIMITS, python=python, allow_unsandboxed=True)


def test_a_venv_the_sandbox_cannot_show_is_refused_not_run_unsandboxed(bubblewrap: str, tmp_path: Path) -> None:
    python = _venv(tmp_path / "venv", 1)  # in the host's /tmp, which the sandbox replaces with its own
    with pytest.raises(ValueError, match=r"cannot expose.*python -m venv"):
        # Before: SandboxUnavailableError, so make_sandbox fell back to running programs unsandboxed.
        sandbox = make_sandbox(LIMITS, python=python, allow_unsandboxed=True)
        pytest.fail(f"built a {sandbox.mode} sandbox for an interpreter in /tmp")


def test_an_interpreter_failing_inside_a_working_bwrap_is_a_configuration_error(
    bubblewrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The interpreter fails in the sandbox only (sandboxed runs have no parent pid argument), as one whose
    # libraries live outside the folders the sandbox shows would; unsandboxed it runs.
    fail = '    if parent == "-":\n        raise SystemExit("no libfoo.so")\n'
    broken = runner.CHILD_SOURCE.replace('    if parent != "-":\n', fail + '    if parent != "-":\n')
    assert broken != runner.CHILD_SOURCE
    monkeypatch.setattr(runner, "CHILD_SOURCE", broken)
    with pytest.raises(ValueError, match=r"bubblewrap works here.*no libfoo\.so.*env\.reward\.python"):
        sandbox = make_sandbox(LIMITS, allow_unsandboxed=True)  # before: fell back to unsandboxed
        pytest.fail(f"built a {sandbox.mode} sandbox")


def test_a_broken_bwrap_still_falls_back_where_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bwrap.bwrap_argv
    monkeypatch.setattr(bwrap, "bwrap_argv", lambda *a, **k: [*real(*a, **k), "--no-such-option"])
    with pytest.raises(SandboxUnavailableError):
        PythonSandbox(LIMITS)
    assert make_sandbox(LIMITS, allow_unsandboxed=True).mode == "unsandboxed"


def test_the_fallback_warning_says_what_it_gives_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cgroup, "_layout", lambda: None)
    cgroup.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=runner.__name__):
            PythonSandbox(LIMITS, unsandboxed=True)
    finally:
        cgroup.available.cache_clear()
    text = " ".join(r.getMessage() for r in caplog.records if r.name == runner.__name__)
    assert "UNSANDBOXED CODE EXECUTION" in text and "setsid" in text and "outlives the run" in text, text
    assert ("ROOT" in text) == (os.geteuid() == 0), text


def _state(pid: int) -> str | None:
    """The process's state letter, None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_a_detached_grandchild_holding_stdout_does_not_make_a_timeout(tmp_path: Path) -> None:
    """Without bwrap or a cgroup: the program prints its answer and exits 0; a grandchild in its process group and
    one in a session of its own keep its stdout open. Before: `timeout` after the whole wall clock, and the
    same-group child lived on. Now: `ok` at once, and the program's process group is killed."""
    program = (
        "import subprocess, sys\n"
        "cmd = [sys.executable, '-c', 'import time; time.sleep(120)']\n"
        "same = subprocess.Popen(cmd)\n"
        "away = subprocess.Popen(cmd, start_new_session=True)\n"
        "print('answer', same.pid, away.pid, flush=True)\n"
    )
    ready_r, ready_w = os.pipe()
    os.write(ready_w, b"1")
    with open(os.devnull, "rb") as stdin:
        start = time.monotonic()
        res = run_captured(
            [sys.executable, "-c", program],
            stdin_fd=stdin.fileno(),
            ready_fd=ready_r,
            pass_fds=(ready_w,),
            timeout_s=30.0,
            max_output_bytes=1 << 16,
        )
        took = time.monotonic() - start
    os.close(ready_r)
    words = res.stdout.split()
    pids = [int(w) for w in words[1:3]] if len(words) == 3 else []
    try:
        assert res.status == OK and words[:1] == ["answer"] and took < 20, (res, took)
        deadline = time.monotonic() + 20
        while _state(pids[0]) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(pids[0]) in (None, "Z"), "the program's own process group outlived the run"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
