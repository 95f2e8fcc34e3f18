"""Sweep slots: the bound on a Ray sweep's jobs at once (`cluster.max_concurrent`), held as leases in one
detached Ray actor per sweep (`JobSlots`, named by `slots_name`, found by every job of the sweep).

Contract: `job_slot(name, permits)` holds one of `permits` slots while its block runs and yields the seconds spent
waiting; the lease is renewed by a daemon thread, so a job that dies frees its slot after `lease_s`. Without Ray
(a local multirun) or with `permits <= 0` the block runs at once. roll_core.sweep removes the actor when the sweep
ends (`remove_slots`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)
SLOTS_NAMESPACE = "roll-sweeps"


class JobSlots:
    """A counting semaphore of leases as a Ray actor (created once per sweep, found by name by every job)."""

    def __init__(self, permits: int, lease_s: float = 60.0) -> None:
        self.permits, self.lease_s = permits, lease_s
        self.leases: dict[str, float] = {}  # holder -> last renewal (monotonic seconds)
        self.expired = 0

    def _expire(self) -> None:
        now = time.monotonic()
        for holder, t in list(self.leases.items()):
            if now - t > self.lease_s:  # its job died without releasing: the slot is free again
                del self.leases[holder]
                self.expired += 1

    def try_acquire(self, holder: str) -> bool:
        self._expire()
        if len(self.leases) < self.permits:
            self.leases[holder] = time.monotonic()
            return True
        return False

    def renew(self, holder: str) -> bool:
        if holder in self.leases:
            self.leases[holder] = time.monotonic()
            return True
        return False

    def release(self, holder: str) -> None:
        self.leases.pop(holder, None)

    def stats(self) -> dict[str, int]:
        self._expire()
        return {"held": len(self.leases), "permits": self.permits, "expired": self.expired}


@contextmanager
def job_slot(
    name: str, permits: int, poll_s: float = 1.0, lease_s: float = 60.0, timeout_s: float | None = None
) -> Iterator[float]:
    """Hold one of `permits` slots named `name` while the block runs; yields the seconds spent waiting.

    The slot is a lease renewed every `lease_s / 4` seconds by a daemon thread; if this process dies, the lease
    lapses after `lease_s` and another job takes the slot. `timeout_s`: give up waiting (TimeoutError).
    Without Ray (a local multirun) or with `permits <= 0` the block runs immediately: the basic launcher already
    runs jobs one at a time.
    """
    try:
        import ray
    except ImportError:
        ray = None
    if permits <= 0 or ray is None or not ray.is_initialized():
        yield 0.0
        return
    # Detached: a non-detached actor dies with the job that happened to create it, while others still queue.
    # `SweepSummaryCallback` removes it when the sweep ends.
    actor = (
        ray.remote(JobSlots)
        .options(name=name, get_if_exists=True, num_cpus=0, namespace=SLOTS_NAMESPACE, lifetime="detached")
        .remote(permits, lease_s)
    )
    import threading
    import uuid

    holder = uuid.uuid4().hex
    t0 = time.perf_counter()
    while not ray.get(actor.try_acquire.remote(holder)):
        if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"no free sweep slot in {name} after {timeout_s}s: {ray.get(actor.stats.remote())}")
        time.sleep(poll_s)
    waited = time.perf_counter() - t0
    done = threading.Event()

    def renew() -> None:
        while not done.wait(lease_s / 4):
            try:
                if not ray.get(actor.renew.remote(holder)):
                    log.warning("sweep slot lease %s lapsed (this job was too slow to renew it)", holder)
            except Exception as exc:  # keep the job running; the lease may lapse and another job may start
                log.warning("could not renew sweep slot %s: %s", name, exc)

    threading.Thread(target=renew, name="roll-sweep-lease", daemon=True).start()
    try:
        yield waited
    finally:
        done.set()
        try:
            ray.get(actor.release.remote(holder))
        except Exception as exc:  # the job's own result matters more than the slot bookkeeping
            log.warning("could not release sweep slot %s: %s", name, exc)


def slots_name(sweep_dir: str | Path, sweep_id: str | None = None) -> str:
    """A stable name per sweep (str hash() is salted per process): every job of the sweep finds the same actor.
    With the sweep's id, a sweep run again into the same folder gets its own actor, never the one an aborted
    sweep left behind (detached, with that sweep's permits and its dead jobs' leases)."""
    key = f"{Path(sweep_dir).resolve()}:{sweep_id or ''}"
    return "slots-" + hashlib.sha1(key.encode()).hexdigest()[:16]
