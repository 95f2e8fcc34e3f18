"""The runner under a busy trainer: concurrent first runs, high descriptor numbers, errors while a run is watched.

Each case once went wrong: concurrent first runs of a sandbox unpickled in a reward worker cached "no cgroup" for the
whole process (no run memory or process cap from then on); a trainer with descriptors past 1023 got a ValueError
from select() instead of a verdict; and an error while a run was watched left the program running. Skips, with the
reason, where bubblewrap cannot run (install roll-envs[code]).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from roll_envs.sandbox import (
    CHILD_MARKER,
    SANDBOX_ERROR,
    PythonSandbox,
    SandboxLimits,
    SandboxUnavailableError,
    cgroup,
    process,
    runner,
)


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    try:
        return PythonSandbox(SandboxLimits(timeout_s=30))
    except SandboxUnavailableError as exc:
        pytest.skip(f"no working bubblewrap sandbox here (install roll-envs[code]): {exc}")


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """The cgroup probe forgotten, as in a new reward worker; forgotten again afterwards (the next caller re-probes)."""
    if cgroup._layout() is None:
        pytest.skip("no writable cgroup here: nothing to probe")
    cgroup._probe_layout.cache_clear()
    yield
    cgroup._probe_layout.cache_clear()


def test_concurrent_first_runs_all_get_a_run_cgroup(fresh_probe: None) -> None:
    threads = 4
    barrier = threading.Barrier(threads)
    made: list[cgroup.RunCgroup | None] = []

    def first_run() -> None:
        barrier.wait()
        made.append(cgroup.RunCgroup.create(96 << 20, 11))

    workers = [threading.Thread(target=first_run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    try:
        assert len(made) == threads and all(group is not None for group in made), made
        assert cgroup._layout() is not None  # and every later run of the process gets one too
    finally:
        for group in made:
            if group is not None:
                group.close()


@pytest.fixture
def high_descriptors() -> Iterator[None]:
    """This process holds descriptors up to past 1100, as a busy trainer (sockets, many concurrent runs) does: the
    next ones a run opens are numbered above 1023."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200) if soft != resource.RLIM_INFINITY else soft, hard))
    held = [os.open(os.devnull, os.O_RDONLY)]
    try:
        while held[-1] < 1100:
            held.append(os.dup(held[0]))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_start_deadline_with_high_descriptors_is_a_sandbox_error(
    sandbox: PythonSandbox, high_descriptors: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A start budget the sandbox cannot meet (a loaded machine): the runner checks the ready pipe, now numbered > 1023.
    monkeypatch.setattr(sandbox, "limits", dataclasses.replace(sandbox.limits, start_timeout_s=0.002))
    assert sandbox.run("print(input())", "hi\n").status == SANDBOX_ERROR
    monkeypatch.undo()
    assert sandbox.run("print(input())", "hi\n").stdout == "hi\n"


def _programs_with(needle: str) -> list[int]:
    """Pids of sandboxed interpreters whose command line holds `needle`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if CHILD_MARKER.encode() in cmdline and needle.encode() in cmdline:
            found.append(int(pid))
    return found


def test_an_error_while_a_run_is_watched_kills_the_run(sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anything unforeseen while the runner watches a run (here an interrupt as bwrap's status arrives) reaches the
    caller, and the run dies with it, even where no run cgroup would kill it afterwards."""
    # An address-space limit no other run has: it marks this run's command line among other tests' sandboxes.
    memory_mb = 300 + secrets.randbelow(200)
    needle = f"RLIMIT_AS={memory_mb * 1024 * 1024}:"
    monkeypatch.setattr(sandbox, "limits", dataclasses.replace(sandbox.limits, memory_mb=memory_mb))
    monkeypatch.setattr(runner.RunCgroup, "create", classmethod(lambda cls, *args: None))
    seen = threading.Event()

    def interrupted(self: process._Namespace, chunk: bytes) -> bool:
        # Wait until the program runs, so that only the runner, not a slow start, can end it.
        deadline = time.monotonic() + 60
        while not _programs_with(needle) and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.set()
        raise KeyboardInterrupt

    monkeypatch.setattr(process._Namespace, "feed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sandbox.run("import time\ntime.sleep(120)\n")
    assert seen.is_set()
    deadline = time.monotonic() + 20
    while (left := _programs_with(needle)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"the program outlived its run: {left}"
