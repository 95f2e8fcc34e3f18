"""A cgroup per sandboxed run: the total memory and process count of everything the run starts.

Contract: `RunCgroup.create(memory_bytes, max_pids)` makes a fresh cgroup (v2 `memory.max` + `pids.max`, or the v1
`memory` and `pids` hierarchies) under a `roll-sandbox` parent inside this process's own cgroup (runs never leave
the limits that hold the trainer, e.g. a container's), or returns None where no writable cgroup exists
(the caller then relies on per-process rlimits alone: `available()` says which, once per process).
`enter_argv(argv)` prefixes a command with `/bin/sh` moving itself into the cgroup before it `exec`s the command,
so bwrap and every process of the run are inside from their first instruction; the kernel then OOM-kills inside
the run when all of its processes together exceed the memory limit, and refuses forks past `max_pids`.
`close()` kills whatever is left in the cgroup and removes it: on v2 through `cgroup.kill` (Linux >= 5.14), which
reaches every process of the cgroup whatever its PID namespace; else (v1, older kernels) by SIGKILL to each pid
in `cgroup.procs`, which cannot reach processes of a PID namespace this one cannot see, so such a cgroup stays
(a warning says so).

Sweeping leftovers: a run cgroup is named `run-<creator pid namespace>-<creator pid>-<random>`, the namespace being
the inode of the creator's /proc/self/ns/pid (0 if unreadable). The first `create` of a process sweeps the runs
whose creator is provably gone: same PID namespace as this process, and that pid is not alive (a trainer killed
before it closed them), killing what still runs there, so a crash leaks neither cgroups nor sandboxed processes.
A pid of another PID namespace (a container sharing the cgroup parent, `docker exec`, a trainer under bwrap or a
pid-namespaced launcher) means nothing here, so such runs are never swept, only logged (info): they are left to
a process of their own namespace. Names of older versions, `run-<pid>-<random>`, carry no namespace: when their
pid is not alive here only an empty one is removed, nothing in them is killed. Older versions ignore the new names.

Why a shell prefix: Python's subprocess cannot place a child into a cgroup at spawn (no CLONE_INTO_CGROUP), and a
`preexec_fn` is unsafe in a threaded reward worker. Swap: none on v2; not limited on v1 (memsw needs swap
accounting).
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
PARENT = "roll-sandbox"


@dataclass
class RunCgroup:
    """The cgroup folders of one run (one for v2; memory and pids for v1)."""

    folders: tuple[Path, ...]

    @classmethod
    def create(cls, memory_bytes: int, max_pids: int) -> RunCgroup | None:
        """A new cgroup with these limits, or None where none can be made (see `available`)."""
        layout = _layout()
        if layout is None:
            return None
        sweep_stale()
        name = f"run-{_pid_ns() or 0}-{os.getpid()}-{secrets.token_hex(6)}"
        made: list[Path] = []
        try:
            where = parents()
            if layout == "v2":
                folder = where["v2"] / name
                folder.mkdir()
                made.append(folder)
                (folder / "memory.max").write_text(str(memory_bytes))
                if (folder / "memory.swap.max").exists():  # absent without swap accounting
                    (folder / "memory.swap.max").write_text("0")
                (folder / "pids.max").write_text(str(max_pids))
            else:
                memory, pids = where["memory"] / name, where["pids"] / name
                for folder in (memory, pids):
                    folder.mkdir()
                    made.append(folder)
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                (pids / "pids.max").write_text(str(max_pids))
        except OSError as exc:
            for folder in reversed(made):
                _remove(folder)
            log.warning("could not create a sandbox cgroup (%s): per-process limits only for this run", exc)
            return None
        return cls(tuple(made))

    def enter_argv(self, argv: list[str]) -> list[str]:
        """`argv` run by a shell that first moves itself into this cgroup (exit status 125 if it cannot)."""
        return ["/bin/sh", "-c", _ENTER_EXEC, "sh", *map(str, self.folders), "--", *argv]

    def close(self) -> None:
        """Kill every process still in the cgroup (`cgroup.kill` where the kernel has it, else SIGKILL to each pid
        this PID namespace can see), then remove it."""
        for folder in self.folders:
            if not _kill_all(folder):
                for _ in range(50):  # processes forking while we kill: repeat until the cgroup is empty
                    pids = _pids(folder)
                    if not pids:
                        break
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            _remove(folder)


@functools.lru_cache(maxsize=1)
def sweep_stale() -> int:
    """Once per process: remove the run cgroups whose creating process is provably gone (same PID namespace as this
    process, pid not alive), killing what still runs in them (their results have no reader); runs of other PID
    namespaces are left and logged. Returns how many were removed."""
    removed, foreign, kept_legacy = 0, [], []
    own_ns = _pid_ns()
    for parent in {p for p in parents().values() if p.is_dir()}:
        for folder in parent.iterdir():
            creator = _creator(folder.name)
            if creator is None:
                continue
            ns, pid = creator
            if ns is None:  # an older version's name: the creator's namespace is unknown, its pid may be foreign
                if not _alive(pid):
                    try:  # an empty leftover goes; one holding processes (maybe a live foreign run's) stays
                        folder.rmdir()
                        removed += 1
                    except OSError:
                        kept_legacy.append(folder.name)
                continue
            if own_ns is None or ns != own_ns:  # a pid of another namespace says nothing about its creator
                foreign.append(folder.name)
                log.debug("sandbox run cgroup %s: creator in another PID namespace, left alone", folder)
                continue
            if pid == os.getpid() or _alive(pid):
                continue
            RunCgroup((folder,)).close()
            removed += not folder.exists()
    if removed:
        log.info("removed %d sandbox run cgroups left by processes that are gone", removed)
    if foreign:
        log.info(
            "left sandbox run cgroups of other PID namespaces (their creators cannot be checked from here): %s",
            _listed(foreign),
        )
    if kept_legacy:
        log.info(
            "left sandbox run cgroups named by an older version (no PID namespace in the name) that hold processes: %s",
            _listed(kept_legacy),
        )
    return removed


def _listed(names: list[str]) -> str:
    """Run names for a log line (one per run; at most five, then how many more)."""
    unique = sorted(set(names))
    return ", ".join(unique[:5]) + (f" and {len(unique) - 5} more" if len(unique) > 5 else "")


def _pid_ns() -> int | None:
    """This process's PID namespace: the inode of /proc/self/ns/pid (unique among live namespaces of this host),
    None where it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _creator(name: str) -> tuple[int | None, int] | None:
    """(PID namespace, pid) of a run cgroup's creator from its name `run-<ns>-<pid>-<hex>`, (None, pid) for an
    older version's `run-<pid>-<hex>`, None for any other name."""
    parts = name.split("-")
    if parts[0] != "run" or not all(part.isdigit() for part in parts[1:-1]):
        return None
    if len(parts) == 4:
        return int(parts[1]), int(parts[2])
    return (None, int(parts[1])) if len(parts) == 3 else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# sh -c SCRIPT sh CGROUP... -- ARGV: join each cgroup, drop the arguments up to "--", exec the rest.
_ENTER_EXEC = (
    'while [ "$#" -gt 0 ]; do g=$1; shift; [ "$g" = -- ] && break; '
    'echo $$ > "$g/cgroup.procs" || exit 125; done; exec "$@"'
)


def _pids(folder: Path) -> list[int]:
    """Pids of the processes in `folder`, as this process's PID namespace numbers them. v2 lists a process of a PID
    namespace this one cannot see (a sweep of another container's runs) as 0, which must never reach `os.kill`:
    kill(0, SIGKILL) is this process's own process group, the trainer."""
    try:
        return [pid for pid in map(int, (folder / "cgroup.procs").read_text().split()) if pid > 0]
    except (OSError, ValueError):
        return []


def _kill_all(folder: Path) -> bool:
    """SIGKILL every process of the cgroup `folder` and its descendants through v2 `cgroup.kill` (Linux >= 5.14),
    whatever their PID namespace; False where there is no such file (v1, older kernels) or the write is refused."""
    kill = folder / "cgroup.kill"
    if not kill.exists():
        return False
    try:
        kill.write_text("1")
    except OSError as exc:
        log.debug("cgroup.kill of %s refused (%s): killing its pids one by one", folder, exc)
        return False
    return True


def _remove(folder: Path) -> None:
    """Remove the cgroup `folder` once its killed processes have left it; a warning says why where it cannot."""
    for _ in range(100):  # a killed process leaves the cgroup once reaped
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    left = _pids(folder)
    if left:
        why = f"processes {left} are still in it"
    else:  # nothing this namespace can see: v1 leaves them out of cgroup.procs, v2 lists them as 0
        why = (
            "it holds processes of a PID namespace this process cannot see (another container's or launcher's), "
            "which only cgroup.kill (cgroup v2, Linux >= 5.14) can reach"
        )
    log.warning("sandbox cgroup %s could not be removed: %s", folder, why)


def _own_path(controller: str | None) -> str:
    """This process's cgroup path for a v1 `controller` (None: the v2 unified hierarchy), from /proc/self/cgroup."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (controller is None and controllers == "") or (controller in controllers.split(",")):
            return path
    return "/"


def parents() -> dict[str, Path]:
    """Where run cgroups are made: `roll-sandbox` inside this process's own cgroup of each hierarchy, so that the
    runs stay within whatever limits hold this process (a container's memory limit)."""
    return {
        "v2": ROOT / _own_path(None).lstrip("/") / PARENT,
        "memory": ROOT / "memory" / _own_path("memory").lstrip("/") / PARENT,
        "pids": ROOT / "pids" / _own_path("pids").lstrip("/") / PARENT,
    }


# Serialises the first probe: a sandbox unpickled in a reward worker probes at its first runs, which threads start
# together; concurrent probes collided on one probe folder and cached "no cgroup" for the whole process.
_LAYOUT_LOCK = threading.Lock()


def _layout() -> str | None:
    """'v2' or 'v1' where this process can create child cgroups with memory and pids limits, else None (probed once
    per process, by one thread at a time)."""
    with _LAYOUT_LOCK:
        return _probe_layout()


@functools.lru_cache(maxsize=1)
def _probe_layout() -> str | None:
    candidates = []
    where = parents()
    if (ROOT / "cgroup.controllers").exists():
        controllers = (ROOT / "cgroup.controllers").read_text().split()
        if {"memory", "pids"} <= set(controllers):
            candidates.append(("v2", [where["v2"]]))
    if (ROOT / "memory" / "memory.limit_in_bytes").exists() and (ROOT / "pids").is_dir():
        candidates.append(("v1", [where["memory"], where["pids"]]))
    for layout, folders in candidates:
        try:
            for parent in folders:
                parent.mkdir(exist_ok=True)
            if layout == "v2":
                # Children get memory and pids limits only if the parent hands them down (refused when this
                # process's own cgroup holds processes and is not the root: then there is no v2 cgroup for runs).
                (where["v2"] / "cgroup.subtree_control").write_text("+memory +pids")
            # Random too: a process of another PID namespace sharing the parent may have the same pid.
            probe = [parent / f"probe-{os.getpid()}-{secrets.token_hex(4)}" for parent in folders]
            for folder in probe:
                folder.mkdir()
            try:  # a process must be able to join them too (what every run's shell prefix does)
                joined = subprocess.run(RunCgroup(tuple(probe)).enter_argv(["/bin/true"]), timeout=10).returncode
            finally:
                for folder in probe:
                    _remove(folder)
            if joined != 0:
                raise OSError(f"a process could not join a new cgroup (exit status {joined})")
        except (OSError, subprocess.SubprocessError) as exc:
            log.info("sandbox cgroups (%s) unavailable: %s", layout, exc)
            continue
        return layout
    return None


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether runs get a cgroup capping their total memory and processes (a warning, once, where not).

    `PythonSandbox` asks at construction, so a run_memory_mb the kernel cannot enforce is said, not dropped silently.
    """
    layout = _layout()
    if layout is None:
        log.warning(
            "no writable cgroup (v2 with memory+pids, or v1 memory and pids hierarchies): run_memory_mb is NOT "
            "enforced; sandboxed runs have per-process limits only, so one run may hold max_processes x memory_mb, "
            "plus the kernel memory of every file it creates in /tmp (about 1 KiB each, only its clocks bound how "
            "many). Run the trainer where it may create cgroups (e.g. a delegated systemd scope) to cap runs."
        )
    return layout is not None
