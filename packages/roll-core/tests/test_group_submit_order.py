"""Two threads calling one multi-rank group on the Ray path: every rank gets the calls in the same order.

Ray runs one caller's calls on a sequential actor in the order they were sent, so a group call whose sends to its
ranks interleave with another thread's (an async run's trainer `train` beside an engine restore's
`publish_weights`, a collective over the trainer ranks) had rank 0 run [train, publish] and rank 1 [publish, train]:
their collectives mismatched. Here the actors are fakes that log, per rank, the calls in the order sent (no Ray
cluster: `_start_ray` and `_restart` are replaced, and `ray` by a fake for the wait of a call's results). Rank 0's
send of the first call pauses until the second thread has sent its call, or is seen waiting for the group's submit
lock (bounded by `PAUSE_S`), so the interleaving the old code allowed happens every time.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import pytest

from roll_core.cluster.group import WorkerGroup
from roll_core.cluster.worker import Dispatch, Worker, dispatch

#: The most rank 0's paused send waits for the second thread (it is released as soon as that thread sent or waits).
PAUSE_S = 2.0


class Trainer(Worker):
    """Two broadcasts standing for a training step and a weight publish (collectives over the ranks)."""

    @dispatch(Dispatch.BROADCAST)
    def train(self) -> int:
        return self.rank

    @dispatch(Dispatch.BROADCAST)
    def publish_weights(self) -> int:
        return self.rank


class _Ref:
    """A fake object ref: its value, and whether it ever becomes ready (a hung call's does not)."""

    def __init__(self, value: Any, ready: bool) -> None:
        self.value, self.ready = value, ready


class _Actor:
    """A fake actor handle of one rank's incarnation: `actor.method.remote()` logs the send in the group's `sent`."""

    def __init__(self, group: FakeRayGroup, rank: int, incarnation: int) -> None:
        self._group, self._rank, self._incarnation = group, rank, incarnation

    def __getattr__(self, method: str) -> types.SimpleNamespace:
        def remote(*args: Any, **kwargs: Any) -> _Ref:
            self._group.sent[self._rank].append((self._incarnation, method))
            hook = self._group.on_send
            if hook is not None:
                hook(self._rank, self._incarnation, method)
            return _Ref(self._rank, ready=self._incarnation not in self._group.hung_incarnations)

        return types.SimpleNamespace(remote=remote)


class FakeRayGroup(WorkerGroup[Trainer]):
    """A `ray` group over fake actors; a restart gives the ranks new fakes (the next incarnation), nothing else."""

    restartable = True

    def _start_ray(self, cls: type, world_size: int, opts: Any, kwargs: dict[str, Any]) -> list[Any]:
        self.sent: list[list[tuple[int, str]]] = [[] for _ in range(world_size)]
        self.on_send: Any = None
        self.hung_incarnations: set[int] = set()
        return [_Actor(self, r, 0) for r in range(world_size)]

    def _restart(self, ranks: list[int], reason: str) -> None:
        self.restarts += len(ranks)
        with self._state_lock:
            for r in ranks:
                self._incarnation[r] += 1
                self.workers[r] = _Actor(self, r, self._incarnation[r])


class _WatchedLock:
    """The group's submit lock, noting (`waiting`) when a thread finds it held and waits for it."""

    def __init__(self, waiting: threading.Event) -> None:
        self._lock, self._waiting = threading.Lock(), waiting

    def __enter__(self) -> bool:
        if not self._lock.acquire(blocking=False):
            self._waiting.set()
            self._lock.acquire()
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _fake_ray() -> types.ModuleType:
    """What `_collect` uses of Ray: `wait` (the ready refs; a hung ref never is), `get` and the error types."""
    ray = types.ModuleType("ray")

    def wait(refs: list[_Ref], num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
        ready = [r for r in refs if r.ready][:num_returns]
        return ready, [r for r in refs if r not in ready]

    class RayTaskError(Exception):
        pass

    class RayActorError(Exception):
        pass

    ray.wait, ray.get = wait, lambda ref: ref.value  # type: ignore[attr-defined]
    ray.exceptions = types.SimpleNamespace(RayTaskError=RayTaskError, RayActorError=RayActorError)  # type: ignore[attr-defined]
    return ray


def _second_thread_sends_while_rank0_send_pauses(group: FakeRayGroup, incarnation: int) -> list[threading.Thread]:
    """Arm the group: when rank 0 (of `incarnation`) is sent `train`, another thread submits `publish_weights` to
    the group, and rank 0's send waits until that thread has sent it, or waits for the submit lock."""
    passed = threading.Event()  # the second thread sent its call, or waits for the submit lock
    group._submit_lock = _WatchedLock(passed)  # type: ignore[assignment]  # (unused by a group without one)
    threads: list[threading.Thread] = []

    def publish() -> None:
        group.submit(Trainer.publish_weights)
        passed.set()

    def on_send(rank: int, inc: int, method: str) -> None:
        if (rank, inc, method) == (0, incarnation, "train") and not threads:
            threads.append(threading.Thread(target=publish, daemon=True))
            threads[0].start()
            passed.wait(PAUSE_S)

    group.on_send = on_send
    return threads


def _orders(group: FakeRayGroup, incarnation: int) -> list[list[str]]:
    return [[m for inc, m in sent if inc == incarnation] for sent in group.sent]


def test_two_threads_calling_one_group_send_their_calls_to_every_rank_in_the_same_order() -> None:
    group = FakeRayGroup(Trainer, 2, "ray")
    threads = _second_thread_sends_while_rank0_send_pauses(group, incarnation=0)
    group.submit(Trainer.train)
    assert len(threads) == 1
    threads[0].join(10)
    assert not threads[0].is_alive()
    # Interleaved, rank 0 ran [train, publish] and rank 1 [publish, train]: their collectives mismatched.
    assert _orders(group, 0) == [["train", "publish_weights"]] * 2


def test_the_reruns_after_a_restart_are_sent_to_every_rank_in_the_same_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", _fake_ray())
    group = FakeRayGroup(Trainer, 2, "ray", call_timeout_s=60.0, max_restarts=2)
    group.hung_incarnations.add(0)  # both ranks hang in `train`: both are restarted and `train` is rerun on both
    threads = _second_thread_sends_while_rank0_send_pauses(group, incarnation=1)
    assert group.call(Trainer.train) == [0, 1]
    assert (group.restarts, group.timeouts) == (2, 2)
    assert len(threads) == 1
    threads[0].join(10)
    assert not threads[0].is_alive()
    assert _orders(group, 1) == [["train", "publish_weights"]] * 2
