"""Sandboxed programs run with a fixed string hash, and still see none of the host's Python environment.

- The interpreter started with `-I`, which ignores PYTHONHASHSEED: every run drew a random hash seed, so
  `print(*set("apple pear fig kiwi".split()))` printed 5 different orders in 6 runs, and a program whose output
  follows a set's order scored differently from test to test of one grading and from run to run of one seed.
  Now every run's interpreter reads PYTHONHASHSEED=0 (`bwrap.PROGRAM_ENV`) and prints what
  `PYTHONHASHSEED=0 python` prints on the host.
- To read it the interpreter starts with `-s -P` instead of `-I` (= `-E -s -P`): its environment is then the
  sandbox's own, in both modes; a hostile host environment (PYTHONSTARTUP, PYTHONPATH with a sitecustomize,
  PYTHONINSPECT, PYTHONHOME, a different PYTHONHASHSEED) changes nothing in a run.

Tests of the bwrap mode skip, with the reason, where bubblewrap cannot run (install roll-envs[code]); the
unsandboxed fallback runs everywhere.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from roll_envs.sandbox import OK, PythonSandbox, SandboxLimits, SandboxUnavailableError, bwrap, runner

LIMITS = SandboxLimits(timeout_s=30.0)
WORDS = "apple pear fig kiwi plum lime date yuzu sloe quince grape mango melon lemon".split()
# A set of 14 strings: its order under two random hash seeds agrees by chance far less than once in a million.
SET_PROGRAM = f"print(*set({WORDS!r}))\n"
# The same from an interpreter the program starts itself (a subprocess inherits the run's environment).
CHILD_PROGRAM = f"import subprocess, sys\nsubprocess.run([sys.executable, '-S', '-c', {SET_PROGRAM!r}], check=True)\n"


@pytest.fixture(scope="module", params=["bwrap", "unsandboxed"])
def sandbox(request: pytest.FixtureRequest) -> PythonSandbox:
    try:
        return PythonSandbox(LIMITS, unsandboxed=request.param == "unsandboxed")
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


def _host_order() -> str:
    """What `PYTHONHASHSEED=0 python -c SET_PROGRAM` prints on the host (same interpreter as the sandbox's)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [bwrap.default_python(), "-S", "-c", SET_PROGRAM], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_set_of_strings_prints_the_same_order_in_every_run(sandbox: PythonSandbox) -> None:
    """Old code: 4 runs printed 4 different orders (a random seed per run)."""
    outputs = [sandbox.run(SET_PROGRAM) for _ in range(4)]
    assert all(res.status == OK for res in outputs), outputs
    assert len({res.stdout for res in outputs}) == 1, [res.stdout for res in outputs]
    # Reproducible outside roll: the order `PYTHONHASHSEED=0 python main.py` prints.
    assert outputs[0].stdout == _host_order()
    # An interpreter the program starts inherits the seed (a `spawn` pool's workers agree with their parent).
    child = sandbox.run(CHILD_PROGRAM)
    assert child.status == OK and child.stdout == outputs[0].stdout, child


def test_the_interpreter_flags_keep_isolation_but_read_the_seed(sandbox: PythonSandbox) -> None:
    """No `-I`/`-E` (they hide PYTHONHASHSEED), but `-s` (no user site) and, on 3.11+, `-P` (no working folder on
    `sys.path`): what `-I` gave besides ignoring the environment."""
    argv = sandbox._python_argv("/tmp/main.py", 3, None, None, LIMITS)
    flags = argv[1 : argv.index("-c")]
    assert "-I" not in flags and "-E" not in flags and "-s" in flags and "-S" in flags
    assert ("-P" in flags) == (runner._version_tuple(sandbox._interp.version) >= (3, 11))
    res = sandbox.run("import sys, os\nprint(sys.flags.hash_randomization, sys.flags.no_user_site, '' in sys.path)")
    assert res.status == OK and res.stdout.split() == ["0", "1", "False"], res


def test_bwrap_sets_exactly_the_program_environment() -> None:
    """The bwrap command line clears the environment, then sets PROGRAM_ENV and HOME: nothing else."""
    interp = bwrap.interpreter()
    argv = bwrap.bwrap_argv(
        "/usr/bin/bwrap", interp, as_root=False, tmp_bytes=1 << 20, shm_bytes=1 << 20, code_fd=3, status_fd=4
    )
    assert "--clearenv" in argv
    set_env = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--setenv"}
    assert argv.index("--clearenv") < min(i for i, a in enumerate(argv) if a == "--setenv")
    assert set_env == {**bwrap.PROGRAM_ENV, "HOME": "/tmp"} and set_env["PYTHONHASHSEED"] == "0"


@pytest.fixture
def hostile_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The host's environment set against the sandbox: each variable, if it reached the interpreter, prints LEAK,
    fails the run (PYTHONWARNINGS=error) or changes the hash order (PYTHONHASHSEED). PYTHONHOME (which would stop
    the interpreter's start, hiding the rest) is the test's to add."""
    startup = tmp_path / "startup.py"
    startup.write_text("print('LEAK startup')\n")
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "sitecustomize.py").write_text("print('LEAK sitecustomize')\n")
    (lib / "usercustomize.py").write_text("print('LEAK usercustomize')\n")
    (lib / "leakmod.py").write_text("print('LEAK leakmod')\n")
    monkeypatch.setenv("PYTHONSTARTUP", str(startup))
    monkeypatch.setenv("PYTHONPATH", str(lib))
    monkeypatch.setenv("PYTHONINSPECT", "1")
    monkeypatch.setenv("PYTHONHASHSEED", "12345")
    monkeypatch.setenv("PYTHONWARNINGS", "error")
    monkeypatch.setenv("PYTHONUSERBASE", str(lib))
    yield monkeypatch


# Does not read stdin: an interpreter left in interactive mode (PYTHONINSPECT) would run it as Python afterwards.
PROBE = (
    "import os, sys, importlib.util, warnings\n"
    "for name in ('sitecustomize', 'usercustomize', 'leakmod'):\n"
    "    if importlib.util.find_spec(name) is not None:\n"
    "        __import__(name)\n"
    "warnings.warn('a warning, not an error')\n"
    "print(sorted(k for k in os.environ if k.startswith('PYTHON')), sys.flags.inspect)\n"
    f"print(*set({WORDS!r}))\n"
)


def test_a_hostile_host_environment_reaches_no_run(
    sandbox: PythonSandbox, hostile_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """PYTHONSTARTUP, PYTHONPATH (a sitecustomize, a module), PYTHONINSPECT, PYTHONHOME, PYTHONWARNINGS and a
    different PYTHONHASHSEED in the host's environment: none of them reaches the program (`-E` is gone, so only
    the sandbox's own environment keeps them out)."""
    for home in (None, str(tmp_path / "no-such-prefix")):  # then PYTHONHOME too: a Python that would not start
        if home is not None:
            hostile_env.setenv("PYTHONHOME", home)
        res = sandbox.run(PROBE, "print('LEAK inspect')\n")
        assert res.status == OK, res
        assert "LEAK" not in res.stdout and "LEAK" not in res.stderr, res
        lines = res.stdout.splitlines()
        assert lines[0] == "['PYTHONHASHSEED', 'PYTHON_CPU_COUNT'] 0", res.stdout
        assert lines[1] + "\n" == _host_order()


def test_no_working_folder_on_sys_path_without_dash_p(monkeypatch: pytest.MonkeyPatch) -> None:
    """An interpreter older than 3.11 gets no `-P`; `-c` then puts '' (the working folder) first on `sys.path`,
    which `-I` used to keep off: `_child.py` drops it before importing anything (seen here by pretending the
    interpreter is 3.10, so the flag is left out)."""
    sandbox = PythonSandbox(LIMITS, unsandboxed=True)
    sandbox._interp = dataclasses.replace(sandbox._interp, version="3.10.14")
    assert "-P" not in sandbox._python_argv("/tmp/main.py", 3, None, None, LIMITS)
    res = sandbox.run("import sys\nprint('' in sys.path, sys.flags.safe_path)\n")
    assert res.status == OK and res.stdout.split() == ["False", "False"], res
