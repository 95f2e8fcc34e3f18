"""One process at a time writes a run folder: an advisory lock on `<run folder>/.roll.lock`.

Why: two processes in one run folder (a requeued preempted job while the old one still lives, `pipeline.resume=true`
launched twice) deleted each other's `step_N.tmp` staging folders, pruned (`pipeline.keep_last`) the checkpoint the
other resumed from, and interleaved metrics.jsonl.

Contract:
- `hold_run_folder(folder)` takes `fcntl.flock(LOCK_EX | LOCK_NB)` on `<folder>/.roll.lock` (creating the folder) and
  writes the holder's pid, host and start time into it; the pipeline's driver takes it when the run is built, before
  it writes anything, and gives it back at shutdown (`RunLock.release`, also run at garbage collection and at exit).
  `roll-train` takes it earlier, on the run (or sweep) folder Hydra is about to use, before Hydra writes .hydra/ and
  the job log into it (roll_core.run_folder), so a refused run leaves a running run's folder as it is.
- `claim_fresh_folder(base)` takes a folder no other process has: `base`, or `base_2`, `base_3`, ... when it exists
  (an exclusive mkdir decides between processes racing for one name), and locks it: for time-stamped run folders,
  which two runs started in the same second shared.
- Another process asking for a held folder gets a `ConfigError` naming the holder (pid, host, start) and the ways on:
  wait, stop the holder, or choose another `pipeline.output_dir`. It never waits.
- The kernel drops a flock when its process dies (SIGKILL, the OOM killer): no stale lock is ever left. The file stays
  (deleting it would let a late opener lock an orphaned inode while a newcomer locks a new file of the same name);
  its content means something only while it is locked.
- Re-entrant within a process: a run restart (`run_control.run_with_restarts`), or a second pipeline of the same folder
  in one process, shares the held lock (`RunLock.share`); it is released when its last handle is. A forked child does
  not inherit it: its copies are closed at fork (a child outliving a killed driver would otherwise keep the folder
  locked), and a child never unlocks its parent's lock.
- A filesystem without flock (some NFS mounts: ENOLCK, EOPNOTSUPP, ...) gets a warning and an unlocked run.
- Readers of a run folder (`roll-eval`, reports, sweep summaries) never take it.
Does not cover: hosts sharing a filesystem whose flock is local to each client (older NFS clients emulate it).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import itertools
import json
import logging
import os
import socket
import threading
import time
import weakref
from pathlib import Path

from roll_core.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = ".roll.lock"

#: flock errors that mean "this filesystem cannot lock", not "someone holds it".
_UNSUPPORTED = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})
_BUSY = frozenset({errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES})


@dataclasses.dataclass
class _Held:
    path: Path
    fd: int | None  # None: the filesystem cannot lock; the run goes on unlocked
    handles: int = 1


_held: dict[str, _Held] = {}  # the locks this process holds, by the folder's real path
_mutex = threading.Lock()


class RunLock:
    """A handle on a held run-folder lock; `release()` (idempotent) gives this handle back."""

    def __init__(self, key: str, held: _Held) -> None:
        self.key, self.path = key, held.path
        self.locked = held.fd is not None
        self._finalizer = weakref.finalize(self, _drop, key)

    def share(self) -> RunLock:
        """Another handle on the same lock: the lock stays held until every handle is released."""
        with _mutex:
            held = _held.get(self.key)
            if held is None or not self._finalizer.alive:
                raise RuntimeError(f"{self.path}: the run-folder lock was already released")
            held.handles += 1
            return RunLock(self.key, held)

    def release(self) -> None:
        self._finalizer()


def hold_run_folder(folder: str | Path) -> RunLock:
    """Lock `folder` for this process (see the module docstring); raises ConfigError when another process holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(folder)
    path = folder / LOCK_NAME
    with _mutex:
        held = _held.get(key)
        if held is not None:
            held.handles += 1
            return RunLock(key, held)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _BUSY:
                holder = _read_holder(fd)
                os.close(fd)
                raise ConfigError(busy_message(folder, holder)) from None
            os.close(fd)
            if exc.errno not in _UNSUPPORTED:
                raise
            log.warning(
                "%s: this filesystem does not support flock (%s): the run folder is not locked; make sure no other "
                "roll process writes it (two runs in one folder delete each other's checkpoints)",
                path,
                os.strerror(exc.errno or 0),
            )
            fd = None
        if fd is not None:
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        held = _held[key] = _Held(path, fd)
        return RunLock(key, held)


def claim_fresh_folder(base: str | Path) -> tuple[Path, RunLock]:
    """A new folder for one run: `base`, or `base_2`, `base_3`, ... when it exists, created by this process (an
    exclusive mkdir: of processes racing for a name exactly one creates it) and locked; returns it and its lock."""
    base = Path(base)
    base.parent.mkdir(parents=True, exist_ok=True)
    for i in itertools.count(1):
        folder = base if i == 1 else base.with_name(f"{base.name}_{i}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder, hold_run_folder(folder)
    raise AssertionError("unreachable")


def busy_message(folder: Path, holder: dict[str, str]) -> str:
    """The error of a run refused `folder`, which the process described by `holder` (pid, host, started) locks."""
    pid, host = holder.get("pid", "unknown"), holder.get("host", "unknown host")
    who = f"pid {pid} on {host}, started {holder.get('started', 'at an unknown time')}"
    return (
        f"{folder} is in use by another roll process ({who}; lock {folder / LOCK_NAME}): two processes in one run "
        "folder delete each other's checkpoints and interleave metrics.jsonl. Wait for it to finish, stop it "
        f"(`kill {pid}` on {host} saves a checkpoint and exits; pipeline.resume=true then continues the run), or give "
        "this run another pipeline.output_dir"
    )


def _read_holder(fd: int) -> dict[str, str]:
    """The holder's record, or {} while it is still being written (or unreadable)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return {k: str(v) for k, v in info.items()} if isinstance(info, dict) else {}


def _drop(key: str) -> None:
    with _mutex:
        held = _held.get(key)
        if held is None:
            return
        held.handles -= 1
        if held.handles > 0:
            return
        del _held[key]
        if held.fd is None:
            return
        try:
            os.ftruncate(held.fd, 0)  # the record names a holder only while one holds it
        except OSError:
            pass
        # closing the last descriptor of the open file releases the flock (no explicit LOCK_UN needed)
        os.close(held.fd)


def _forget_in_child() -> None:
    """A forked child closes its copies of the parent's lock descriptors (closing does not unlock the parent's)."""
    global _mutex
    _mutex = threading.Lock()  # the fork may have copied it held by another thread
    for held in _held.values():
        if held.fd is not None:
            try:
                os.close(held.fd)
            except OSError:
                pass
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)
