"""Which inference engines take new requests: a set that shrinks and grows while requests run.

This is what ROLL's partial-GPU mode needs from the rollout side. In disaggregated asynchronous training the
training devices idle while the trainer waits for its next batch; in partial-GPU mode they wake an inference
engine (after the weight sync, at the current weights) and join the inference group (`expand`), and when the
batch is ready they are taken back (`shrink`): the requests they run are aborted, their generated prefixes kept and
resumed on the engines that stay, then those devices offload the engine and train. Like `scheduler`, this module is
pure bookkeeping (no engines, no threads, no clock): the same code routes for the real driver and for the cluster
simulator (`bench/async_sim`).

Contract:
- `assign(request_id, key)` places a new request: on the home engine of `key` (sticky routing: a sample's later
  turns and resumed requests go where its prefix cache is) while that engine is active, else on the least-loaded
  active engine (load = requests assigned and not yet released; ties go to the engine listed first), which becomes
  the key's home. A request id can be placed once; with no active engine it raises `NoActiveEngine` (the driver
  stops submitting until an `expand`).
- `release(request_id)` when the request's result (finished or aborted) is collected, exactly once.
- `shrink(engines)` deactivates engines: they get no new request, the homes on them are forgotten (their prefix
  caches go with the engine), and it returns the requests still placed there. The driver aborts each and reports
  its partial output to `RolloutScheduler.on_result(..., finish="abort")`, which keeps the generated tokens and
  makes the sample pending again, so the next `assign` puts the continuation on an engine that stays. No request of
  a removed engine is lost (every one is returned, and stays listed by `draining` until released) and none is
  duplicated (the sample is pending again only once its partial result is recorded; a request id placed twice is
  refused). The devices may be freed once `draining(engines)` is empty.
- `expand(engines)` activates engines (their weights must be the current version); an engine that still drains
  requests from an earlier shrink cannot rejoin (the offload/reload of one device must not overlap). New engines
  start empty while the others may be full, so with `rebalance=True` it also returns requests to move: the most
  recently placed ones (queued or with the least generated, the cheapest to move) of every engine above the mean
  load, down to it. The driver aborts and reports them like a shrink's; their homes are forgotten, so the
  continuations go to the least-loaded engines, the new ones. Moving costs a prefill of the moved context. A
  request returned by a shrink or expand is never returned by a later expand (it is leaving: its abort has not
  landed yet), and does not count as load staying on its engine.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable


class NoActiveEngine(RuntimeError):
    """Every engine of the pool is shrunk away: nothing can take a request until an expand."""


class EnginePool:
    """Routing over a shrinking and growing set of engines (see the module docstring).

    Args:
        engines: every engine (any hashable: ranks, names), in tie-break order.
        active: the engines taking requests at first (default: all).
    """

    def __init__(self, engines: Iterable[Hashable], active: Iterable[Hashable] | None = None) -> None:
        self.engines = list(engines)
        if not self.engines or len(set(self.engines)) != len(self.engines):
            raise ValueError(f"engines must be a non-empty list without repeats, got {self.engines}")
        self._order = {e: i for i, e in enumerate(self.engines)}
        self._load = dict.fromkeys(self.engines, 0)
        self._placed: dict[str, Hashable] = {}  # request id -> engine, until released (in placement order)
        self._key_of: dict[str, Hashable] = {}  # request id -> its routing key
        self._home: dict[Hashable, Hashable] = {}  # key -> engine (sticky routing)
        self._active: set[Hashable] = set()
        self._moving: set[str] = set()  # returned by shrink/expand to be aborted, not yet released
        self._heap: list[tuple[int, int, Hashable]] = []  # (load, order, engine); stale entries skipped lazily
        self.counters = {"assigned": 0, "shrunk_requests": 0, "moved_requests": 0, "shrinks": 0, "expands": 0}
        self._activate(self.engines if active is None else self._known(active))

    # ---- state --------------------------------------------------------------------------------------------
    @property
    def active(self) -> list[Hashable]:
        """The engines taking new requests, in the pool's order."""
        return [e for e in self.engines if e in self._active]

    def load(self, engine: Hashable) -> int:
        """Requests placed on `engine` and not yet released."""
        return self._load[engine]

    def engine_of(self, request_id: str) -> Hashable | None:
        return self._placed.get(request_id)

    def draining(self, engines: Iterable[Hashable]) -> list[str]:
        """Requests still placed on `engines` (after a shrink: aborted, result not yet collected)."""
        wanted = set(self._known(engines))
        return [rid for rid, e in self._placed.items() if e in wanted]

    # ---- requests -----------------------------------------------------------------------------------------
    def assign(self, request_id: str, key: Hashable | None = None) -> Hashable:
        """Place a new request (sticky on `key`'s home while active, else least loaded); returns its engine."""
        if request_id in self._placed:
            raise ValueError(f"request {request_id} is already placed on engine {self._placed[request_id]}")
        eng = self._home.get(key) if key is not None else None
        if eng is None or eng not in self._active:
            eng = self._least_loaded()
            if key is not None:
                self._home[key] = eng
        self._placed[request_id] = eng
        if key is not None:
            self._key_of[request_id] = key
        self._load[eng] += 1
        self._push(eng)
        self.counters["assigned"] += 1
        return eng

    def release(self, request_id: str) -> Hashable:
        """The request's result was collected (finished or aborted); returns the engine it ran on."""
        eng = self._placed.pop(request_id, None)
        if eng is None:
            raise KeyError(f"request {request_id} is not placed (released twice, or never assigned)")
        self._key_of.pop(request_id, None)
        self._moving.discard(request_id)
        self._load[eng] -= 1
        self._push(eng)
        return eng

    def forget(self, key: Hashable) -> None:
        """A sample is finished: drop its home."""
        self._home.pop(key, None)

    # ---- shrinking and growing ----------------------------------------------------------------------------
    def shrink(self, engines: Iterable[Hashable]) -> list[str]:
        """Stop routing to `engines`; returns the requests placed there (abort them and report their partial
        output: the scheduler re-queues each sample with its prefix)."""
        gone = self._known(engines)
        idle = [e for e in gone if e not in self._active]
        if idle:
            raise ValueError(f"engines {idle} are not active: only active engines can be shrunk away")
        self._active.difference_update(gone)
        for key in [k for k, e in self._home.items() if e in gone]:
            del self._home[key]
        running = self.draining(gone)
        self._moving.update(running)
        self.counters["shrinks"] += 1
        self.counters["shrunk_requests"] += len(running)
        return running

    def expand(self, engines: Iterable[Hashable], *, rebalance: bool = False) -> list[str]:
        """Route to `engines` again (their weights are the current version). With `rebalance`, returns the
        requests to move onto them (abort and report each: its sample resumes on a least-loaded engine)."""
        new = self._known(engines)
        bad = [e for e in new if e in self._active or self._load[e]]
        if bad:
            raise ValueError(f"engines {bad} are active or still drain requests: they cannot join (again) yet")
        old = self.active
        self._activate(new)
        self.counters["expands"] += 1
        if not rebalance or not old:
            return []
        keep = -(-sum(self._load[e] for e in old) // len(self._active))  # ceil of the mean load after the expand
        # Requests an earlier shrink/expand returned are leaving already (their aborts not yet collected): they
        # are neither moved twice nor counted as staying, or a second expand before the first one's aborts land
        # returned those again and moved nothing onto its engines.
        staying = dict.fromkeys(old, 0)
        for rid, e in self._placed.items():
            if e in staying and rid not in self._moving:
                staying[e] += 1
        excess = {e: n - keep for e, n in staying.items() if n > keep}
        moved: list[str] = []
        for rid in reversed(self._placed):  # the most recently placed first
            e = self._placed[rid]
            if excess.get(e, 0) > 0 and rid not in self._moving:
                excess[e] -= 1
                moved.append(rid)
                key = self._key_of.get(rid)
                if key is not None and self._home.get(key) == e:
                    del self._home[key]
        self._moving.update(moved)
        self.counters["moved_requests"] += len(moved)
        return moved

    # ---- internals ----------------------------------------------------------------------------------------
    def _known(self, engines: Iterable[Hashable]) -> list[Hashable]:
        out = list(engines)
        unknown = [e for e in out if e not in self._order]
        if unknown:
            raise ValueError(f"unknown engines {unknown}; the pool has {self.engines}")
        return out

    def _activate(self, engines: list[Hashable]) -> None:
        self._active.update(engines)
        for e in engines:
            self._push(e)

    def _push(self, eng: Hashable) -> None:
        if eng in self._active:
            heapq.heappush(self._heap, (self._load[eng], self._order[eng], eng))
            if len(self._heap) > 4 * len(self.engines) + 64:  # drop stale entries (amortized O(1) per push)
                self._heap = [(self._load[e], self._order[e], e) for e in self._active]
                heapq.heapify(self._heap)

    def _least_loaded(self) -> Hashable:
        while self._heap:
            load, _, eng = self._heap[0]
            if eng in self._active and self._load[eng] == load:
                return eng
            heapq.heappop(self._heap)
        raise NoActiveEngine(f"no active engine among {len(self.engines)}: expand the pool before submitting")
