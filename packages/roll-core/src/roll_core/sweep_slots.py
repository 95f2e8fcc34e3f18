"""Sweep slots: the bound on a Ray sweep's jobs at once (`cluster.max_concurrent`), held as leases in one
detached Ray actor per sweep (`JobSlots`, named by `slots_name`, found by every job of the sweep).

Contract: `job_slot(name, permits)` holds one of `permits` slots while its block runs and yields the seconds spent
waiting; the lease is renewed by a daemon thread, so a job that dies frees its slot after `lease_s`. A lapsed lease
is reclaimed only once its job's process is gone (Ray says so for an object that process put): a live job that
missed its renewals (a long GC pause, a loaded machine) keeps its slot, so no more than `permits` jobs ever run. A
job interrupted while it asked for a slot gives back the slot it may have been granted. Without Ray (a local
multirun) or with `permits <= 0` the block runs at once. roll_core.sweep removes the actor when the sweep ends
(`remove_slots`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
SLOTS_NAMESPACE = "roll-sweeps"


class JobSlots:
    """A counting semaphore of leases as a Ray actor (created once per sweep, found by name by every job).

    A holder gives `owner`: `[ref]`, a Ray object its job's process put. A lease not renewed for `lease_s` is
    reclaimed only when that object is lost with its owner (Ray's OwnerDiedError): a lapse alone cannot tell a
    dead job from a paused one, and reclaiming a paused job's slot let `permits + 1` jobs run. A holder without an
    `owner` is reclaimed on the lapse alone."""

    check_s = 2.0  # how long a lapsed holder's process may take to answer before it is taken as alive (loaded)

    def __init__(self, permits: int, lease_s: float = 60.0) -> None:
        self.permits, self.lease_s = permits, lease_s
        self.leases: dict[str, float] = {}  # holder -> last renewal (monotonic seconds)
        self.owners: dict[str, list[Any]] = {}  # holder -> [an object its process put]: whether it is alive
        self.expired = 0

    def _alive(self, owner: list[Any]) -> bool:
        """Whether the process that put `owner[0]` still runs: Ray answers a get of it while it does."""
        import ray

        try:
            ray.get(owner[0], timeout=self.check_s)
        except ray.exceptions.GetTimeoutError:  # before RayError, its base: a process too loaded to answer lives
            return True
        except ray.exceptions.RayError:  # OwnerDiedError (its process died), ObjectLostError (its node was lost)
            return False
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        for holder, t in list(self.leases.items()):
            if now - t <= self.lease_s:
                continue
            owner = self.owners.get(holder)
            if owner is not None and self._alive(owner):  # paused, not dead: its job still runs in the slot
                log.warning("sweep slot lease %s lapsed (%.0fs unrenewed) but its job lives: kept", holder, now - t)
                self.leases[holder] = now
                continue
            del self.leases[holder]  # its job died without releasing: the slot is free again
            self.owners.pop(holder, None)
            self.expired += 1

    def try_acquire(self, holder: str, owner: list[Any] | None = None) -> bool:
        self._expire()
        if len(self.leases) < self.permits:
            self.leases[holder] = time.monotonic()
            if owner is not None:
                self.owners[holder] = owner
            return True
        return False

    def renew(self, holder: str, owner: list[Any] | None = None) -> bool:
        """Renew `holder`'s lease; False when it had been reclaimed (its process was taken for dead, Ray could not
        say): it is taken back at once, even over `permits`, since its job runs anyway. No slot is handed out
        until the jobs running are under `permits` again."""
        held = holder in self.leases
        self.leases[holder] = time.monotonic()
        if owner is not None:
            self.owners[holder] = owner
        return held

    def release(self, holder: str) -> None:
        self.leases.pop(holder, None)
        self.owners.pop(holder, None)

    def stats(self) -> dict[str, int]:
        self._expire()
        return {"held": len(self.leases), "permits": self.permits, "expired": self.expired}


@contextmanager
def job_slot(
    name: str, permits: int, poll_s: float = 1.0, lease_s: float = 60.0, timeout_s: float | None = None
) -> Iterator[float]:
    """Hold one of `permits` slots named `name` while the block runs; yields the seconds spent waiting.

    The slot is a lease renewed every `lease_s / 4` seconds by a daemon thread; if this process dies, the lease
    lapses after `lease_s` and another job takes the slot (not while it lives: see `JobSlots`). `timeout_s`: give
    up waiting (TimeoutError).
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
    # Owned by this process: the actor reclaims a lapsed lease only once Ray reports this object lost with it
    owner = [ray.put(holder)]
    t0 = time.perf_counter()
    try:
        while not ray.get(actor.try_acquire.remote(holder, owner)):
            if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"no free sweep slot in {name} after {timeout_s}s: {ray.get(actor.stats.remote())}")
            time.sleep(poll_s)
    except BaseException:
        # Interrupted (a stop signal, a Ray cancel) while the actor may have granted the slot: give it back, or it
        # stayed held while this process lives. Submitted, not awaited: one caller's actor calls run in order.
        try:
            actor.release.remote(holder)
        except Exception as exc:
            log.warning("could not give back sweep slot %s: %s", name, exc)
        raise
    waited = time.perf_counter() - t0
    done = threading.Event()

    def renew() -> None:
        while not done.wait(lease_s / 4):
            try:
                if not ray.get(actor.renew.remote(holder, owner)):
                    log.error("sweep slot lease %s had been reclaimed while this job ran: taken back", holder)
            except Exception as exc:  # keep the job running; a lapsed lease stays its own while this process lives
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
