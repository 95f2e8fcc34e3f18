"""Hostile programs against the code reward's verdict and the sandbox's exposure, run for real in bubblewrap.

- Time budget (fraction mode): a program that hangs on every test used up the call's `time_budget_s` and its row
  came back `unfinished`, flagged `failed` (not judged, never trained on as wrong) while an honest wrong program
  scored 0: hanging dodged the score. A row whose program timed out on a test is now judged when the budget runs
  out (the tests it did not run count as failed); other cut rows stay `unfinished` (the budget is the batch's: a
  row the pool started late must not be scored on tests it had no time for).
- The interpreter's folders: the sandbox shows the interpreter's prefixes read-only, so a Python whose prefix is a
  home or project folder (`./configure --prefix=$HOME`) exposed `.netrc`, `.ssh`, `.aws` or a `.env` beside it to
  every program. Such a prefix is now refused (a ValueError: a
  configuration error, which must not make `make_sandbox` fall back to running programs unsandboxed).

Tests that run programs need a working bubblewrap (`roll-envs[code]`); they skip with the reason otherwise.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from roll_envs.rewards.code import CodeReward, CodeTest, encode_tests
from roll_envs.sandbox import PythonSandbox, SandboxLimits, SandboxUnavailableError
from roll_envs.sandbox.bwrap import default_python, find_bwrap

TESTS = encode_tests([CodeTest(f"{i}\n", f"{i}\n") for i in range(6)])
BUDGET_S = 2.5  # room for two or three tests of 0.5 s: never all six


@pytest.fixture(scope="module")
def slow_clock() -> CodeReward:
    """A program clock far above the slow programs' 0.3 s (a loaded machine must not turn them into timeouts), with
    a budget (SLOW_BUDGET_S) that cuts the row after a test or two of its six."""
    try:
        return CodeReward(score_mode="fraction", timeout_s=3.0, parallelism=1)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


SLOW_BUDGET_S = 1.0 + 3.0 + 0.5  # the start allowance and one program clock, plus room for a test or two


@pytest.fixture(scope="module")
def fraction() -> CodeReward:
    try:
        return CodeReward(score_mode="fraction", timeout_s=0.5, parallelism=1)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def fenced(code: str) -> str:
    return f"Here.\n```python\n{code}\n```\n"


def test_a_program_hanging_on_every_test_is_judged_not_unfinished(fraction: CodeReward) -> None:
    res = fraction.score([fenced("while True: pass")], [TESTS], time_budget_s=BUDGET_S)
    # Before: scores [0.0], failed [True], counters {"unfinished": 1}: the row was never trained on as wrong.
    assert res.failed == [False] and res.scores == [0.0] and res.correct == [0.0]
    assert res.counters["program_timeouts"] == 1 and res.counters["unfinished"] == 0


def test_passing_the_example_then_hanging_scores_its_passed_share(fraction: CodeReward) -> None:
    # The prompt shows the first test: a program may print its answer and hang on the hidden ones.
    program = fenced("n = input()\nif n == '0':\n    print(0)\nelse:\n    while True:\n        pass")
    res = fraction.score([program], [TESTS], time_budget_s=BUDGET_S)
    assert res.failed == [False] and res.scores == [pytest.approx(1 / 6)] and res.correct == [0.0]
    assert res.counters["program_timeouts"] == 1 and res.counters["unfinished"] == 0


def test_a_slow_wrong_program_under_its_clock_stays_unfinished(slow_clock: CodeReward) -> None:
    # Under the program clock (no timeout), wrong: only its own timeout judges a cut row (the budget is the batch's).
    program = fenced("import time\ntime.sleep(0.3)\nprint('x')")
    res = slow_clock.score([program], [TESTS], time_budget_s=SLOW_BUDGET_S)
    assert res.failed == [True] and res.counters["unfinished"] == 1 and res.counters["wrong_answers"] == 0


def test_a_row_started_late_with_a_fast_wrong_test_is_not_scored_on_tests_it_never_ran(
    slow_clock: CodeReward, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Wrong on the first test only, fast: alone it scores 5/6. Started by the pool with room for one test left, it was
    # judged 0.0 (the five unrun tests counted as failed): the batch's time, not the program's, ran out.
    program = fenced("n = input()\nprint(int(n) + 1 if n == '0' else n)")
    assert slow_clock.score([program], [TESTS]).scores == [pytest.approx(5 / 6)]
    run = slow_clock._run

    def run_then_wait(code: str, stdin: str):  # each test also waits 0.3 s (other rows' turns on a busy pool)
        res = run(code, stdin)
        time.sleep(0.3)
        return res

    monkeypatch.setattr(slow_clock, "_run", run_then_wait)
    # Room for exactly one test: the start allowance and one program clock, plus 0.15 s (< the 0.3 s wait).
    deadline = time.monotonic() + 1.0 + 3.0 + 0.15
    _, ok, has_code, kinds = slow_clock._score_one(program, TESTS, deadline)
    assert kinds == {"unfinished"} and not ok and has_code


def test_a_row_that_passed_every_test_it_ran_stays_unfinished(slow_clock: CodeReward) -> None:
    # Right but slow: the caller's budget, not the program, ended it; it is not judged (not scored as wrong).
    program = fenced("import time\ntime.sleep(0.3)\nprint(input())")
    res = slow_clock.score([program], [TESTS], time_budget_s=SLOW_BUDGET_S)
    assert res.failed == [True] and res.counters["unfinished"] == 1 and res.counters["wrong_answers"] == 0


@pytest.fixture
def outside_tmp() -> Iterator[Path]:
    """A scratch folder outside /tmp (the sandbox cannot show an interpreter living under its own /tmp)."""
    try:
        find_bwrap()
        folder = Path(tempfile.mkdtemp(prefix="roll-hostile-", dir="/var/tmp"))
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"needs bubblewrap and a writable /var/tmp: {exc}")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _python_at(prefix: Path) -> str:
    """A Python installed under `prefix` (as `./configure --prefix=PREFIX` would), made of hard links to the running
    interpreter's binary and standard library (no site-packages): no copying. Skips where links cannot be made."""
    base = Path(sys.base_prefix)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    binary = Path(default_python()).resolve()
    stdlib = base / "lib" / version
    if not (stdlib / "os.py").is_file() or binary.parent != base / "bin":
        pytest.skip(f"the interpreter {binary} is not laid out as PREFIX/bin and PREFIX/lib/{version}")
    try:
        (prefix / "bin").mkdir(parents=True)
        os.link(binary, prefix / "bin" / version)
        for folder, dirs, files in os.walk(stdlib):
            dirs[:] = [d for d in dirs if d not in ("site-packages", "__pycache__", "test", "idlelib", "tkinter")]
            target = prefix / "lib" / version / Path(folder).relative_to(stdlib)
            target.mkdir(parents=True, exist_ok=True)
            for name in files:
                os.link(Path(folder) / name, target / name)
    except OSError as exc:  # another file system, or links refused
        pytest.skip(f"cannot hard-link the interpreter under {prefix}: {exc}")
    for shared in base.glob("lib/libpython*.so*"):  # a shared-library build
        os.link(shared, prefix / "lib" / shared.name)
    return str(prefix / "bin" / version)


def test_an_interpreter_whose_prefix_holds_credentials_is_refused(outside_tmp: Path) -> None:
    token = secrets.token_hex(16)
    home = outside_tmp / "home"  # a Python built with --prefix=$HOME: ~/bin, ~/lib beside ~/.netrc
    python = _python_at(home)
    (home / ".netrc").write_text(f"machine api.wandb.ai login user password {token}\n")
    program = f"print(open({str(home / '.netrc')!r}).read())"
    with pytest.raises(ValueError, match=r"\.netrc"):
        # Before: built, and the program printed the wandb password from inside the sandbox.
        sandbox = PythonSandbox(SandboxLimits(timeout_s=5.0), python=python)
        pytest.fail(f"built; the program printed {sandbox.run(program).stdout!r}")


def test_an_interpreter_without_credentials_beside_it_still_runs(outside_tmp: Path) -> None:
    python = _python_at(outside_tmp / "opt")
    try:
        sandbox = PythonSandbox(SandboxLimits(timeout_s=5.0), python=python)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")
    assert sandbox.run("import sys\nprint(sys.prefix)").stdout.strip() == str(outside_tmp / "opt")


def test_exposed_secrets_names_credentials_and_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_envs.sandbox.bwrap import exposed_secrets

    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".aws").mkdir()
    (home / "lib").mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert exposed_secrets([str(home / "lib")]) == []
    found = exposed_secrets([str(home)])
    assert str(home) in found[0] and any(".ssh" in f for f in found) and any(".aws" in f for f in found)
    (home / "opt").mkdir()
    monkeypatch.setenv("HOME", str(home / "opt" / "me"))  # a prefix above the home folder shows it too
    assert exposed_secrets([str(home / "opt")]) and exposed_secrets([sys.prefix]) == []
