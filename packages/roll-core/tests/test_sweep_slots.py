"""The sweep's slots (roll_core.sweep_slots) without Ray: `JobSlots` with a faked clock and faked liveness of its
holders' processes, `job_slot` with a faked actor. With a real Ray (a killed job's slot, a live job's lapsed lease):
tests/e2e/test_sweep.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from roll_core import sweep_slots
from roll_core.sweep_slots import JobSlots, job_slot


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """sweep_slots' monotonic clock, set by the test (only that module's `time` is replaced)."""
    now = [0.0]
    monkeypatch.setattr(sweep_slots, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=lambda: now[0]))
    return now


def _slots(alive: dict[str, bool], permits: int = 1) -> JobSlots:
    """JobSlots whose holders' processes live while `alive[name]` (the name their owner object holds)."""
    slots = JobSlots(permits, lease_s=60.0)
    slots._alive = lambda owner: alive[owner[0]]  # type: ignore[method-assign]
    return slots


def test_a_live_job_whose_lease_lapsed_keeps_its_slot(clock: list[float]) -> None:
    """A job that could not renew its lease for lease_s (a long GC pause, a loaded machine) only logged a warning
    and ran on, while the actor gave its slot to the next job: max_concurrent + 1 jobs ran at once. Now a lapsed
    lease is reclaimed only once its job's process is gone; a job whose lease was still reclaimed takes it back
    when it renews, and no slot is handed out until the jobs are under max_concurrent again."""
    alive = {"a": True, "b": True, "c": True}
    slots = _slots(alive)
    assert slots.try_acquire("a", ["a"])
    clock[0] = 100.0  # 100 s without a renewal: lapsed, but its process lives
    assert not slots.try_acquire("b", ["b"])
    assert slots.stats() == {"held": 1, "permits": 1, "expired": 0}
    assert slots.renew("a", ["a"])  # it was kept, and it is renewed

    alive["a"] = False  # its process died (Ray: OwnerDiedError)
    clock[0] = 200.0
    assert slots.try_acquire("b", ["b"])
    assert slots.stats() == {"held": 1, "permits": 1, "expired": 1}

    # A holder that gave no owner is reclaimed on the lapse alone; when it renews after all, it takes its slot back,
    # over the bound, and no one else gets one until both are gone
    slots.release("b")
    assert slots.try_acquire("x")
    clock[0] = 300.0
    assert slots.try_acquire("b", ["b"]) and slots.stats()["expired"] == 2
    assert not slots.renew("x")  # reclaimed: taken back
    assert slots.stats()["held"] == 2
    slots.release("b")
    assert not slots.try_acquire("c", ["c"])
    slots.release("x")
    assert slots.try_acquire("c", ["c"])


class _Call:
    """A method of the faked actor: `.remote(...)` runs it at once (as the actor would) and returns its "ref"."""

    def __init__(self, fn: Any, calls: list[str]) -> None:
        self.fn, self.calls = fn, calls

    def remote(self, *args: Any) -> Any:
        self.calls.append(self.fn.__name__)
        return ("ref", self.fn(*args))


def test_an_interrupt_while_a_slot_is_granted_gives_it_back(
    clock: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop signal (or a Ray cancel) reaching the job while it waited for the actor's answer to try_acquire, after
    the actor had granted the slot, left the slot held until its lease ran out (60 s; with a live process, for
    good): now the job gives it back before the interrupt goes on."""
    import ray

    slots = JobSlots(1)
    calls: list[str] = []
    methods = ("try_acquire", "renew", "release", "stats")
    actor = SimpleNamespace(**{m: _Call(getattr(slots, m), calls) for m in methods})
    remote = SimpleNamespace(options=lambda **kw: SimpleNamespace(remote=lambda permits, lease_s: actor))

    def get(ref: Any, timeout: float | None = None) -> Any:
        if calls[-1] == "try_acquire":  # granted; the answer never reaches the job
            raise KeyboardInterrupt()
        return ref[1]

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "remote", lambda cls: remote)
    monkeypatch.setattr(ray, "put", lambda value: value)
    monkeypatch.setattr(ray, "get", get)
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with job_slot("slots-test", permits=1):
            ran.append(True)
    assert ran == [] and calls == ["try_acquire", "release"]
    assert slots.leases == {} and slots.stats()["held"] == 0
