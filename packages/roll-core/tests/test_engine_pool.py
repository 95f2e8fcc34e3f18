"""EnginePool (roll_core.scheduling.pool): routing over engines that leave and rejoin while requests run (ROLL's
partial-GPU mode). With the real RolloutScheduler, requests of a removed engine are re-queued with their prefix and
finish elsewhere: every trained sample holds each of its tokens exactly once, no request lands on a removed engine,
and a removed engine is drained before it may rejoin."""

from __future__ import annotations

import itertools
import random

import pytest

from roll_core.scheduling.pool import EnginePool, NoActiveEngine
from roll_core.scheduling.scheduler import RolloutScheduler


def test_least_loaded_with_ties_to_the_first_and_sticky_homes():
    pool = EnginePool(["a", "b", "c"])
    assert [pool.assign(f"r{i}") for i in range(4)] == ["a", "b", "c", "a"]
    assert pool.assign("s0", key=(0, 0)) == "b"  # b and c hold 1; b is listed first
    pool.release("s0")
    assert pool.assign("s1", key=(0, 0)) == "b"  # its home, though c is as loaded
    assert [pool.load(e) for e in "abc"] == [2, 2, 1]
    assert pool.assign("s2", key=(0, 1)) == "c"
    pool.forget((0, 0))
    pool.release("s1")
    assert pool.assign("s3", key=(0, 0)) == "b"  # home forgotten: least loaded (a=2, b=1, c=2)


def test_shrink_returns_the_running_requests_and_rehomes_their_samples():
    pool = EnginePool(range(4))
    placed = {f"r{i}": pool.assign(f"r{i}", key=i) for i in range(8)}
    running = pool.shrink([2, 3])
    assert sorted(running) == sorted(r for r, e in placed.items() if e in (2, 3)) and len(running) == 4
    assert pool.active == [0, 1] and sorted(pool.draining([2, 3])) == sorted(running)
    with pytest.raises(ValueError, match="still drain"):
        pool.expand([2])  # its requests are not collected yet
    for rid in running:
        assert pool.release(rid) in (2, 3)
        assert pool.assign(rid + "-resumed", key=int(rid[1:])) in (0, 1)  # home was on a removed engine
    assert pool.draining([2, 3]) == []
    pool.expand([2, 3])
    assert pool.assign("new") == 2 and pool.counters["shrunk_requests"] == 4


def test_expand_with_rebalance_moves_the_newest_requests_of_loaded_engines():
    plain = EnginePool(range(4), active=[0, 1])
    pool2 = EnginePool(range(4), active=[0, 1])
    for i in range(8):
        plain.assign(f"r{i}", key=i)
        pool2.assign(f"r{i}", key=i)  # r0, r2, r4, r6 on 0; the odd ones on 1
    assert plain.expand([2, 3]) == []
    moved = pool2.expand([2, 3], rebalance=True)
    assert sorted(moved) == ["r4", "r5", "r6", "r7"]  # down to the mean load of 2, the newest first
    for rid in moved:
        pool2.release(rid)
        pool2.assign(rid + "-moved", key=int(rid[1:]))  # its home on 0 or 1 is forgotten
    assert [pool2.load(e) for e in range(4)] == [2, 2, 2, 2] and pool2.counters["moved_requests"] == 4


def test_a_second_expand_before_the_first_moves_land_moves_other_requests():
    """Two engines join one after the other before the first expand's aborts are collected: the second rebalance
    returned the requests the first one already moved (they still count on their engine until released), so it
    moved nothing new onto its engine and counted those moves twice."""
    pool = EnginePool([0, 1, 2], active=[0])
    for i in range(6):
        pool.assign(f"r{i}")
    first = pool.expand([1], rebalance=True)
    assert first == ["r5", "r4", "r3"]  # down to ceil(6 / 2)
    second = pool.expand([2], rebalance=True)  # r3-r5 are leaving: engine 0 keeps 3, ceil(6 / 3) = 2
    assert second == ["r2"] and pool.counters["moved_requests"] == 4
    for rid in first + second:  # the aborts land; the continuations go to the least-loaded engines
        pool.release(rid)
        pool.assign(rid + "'")
    assert [pool.load(e) for e in (0, 1, 2)] == [2, 2, 2]


def test_errors():
    pool = EnginePool([0, 1], active=[0])
    assert pool.assign("a") == 0 and pool.assign("b") == 0  # engine 1 is not active
    pool.shrink([0])
    with pytest.raises(NoActiveEngine):
        pool.assign("c")
    with pytest.raises(ValueError, match="not active"):
        pool.shrink([1])
    with pytest.raises(ValueError, match="unknown"):
        pool.expand([7])
    pool.expand([1])
    with pytest.raises(ValueError, match="already placed"):
        pool.assign("a")
    pool.release("a")
    with pytest.raises(KeyError, match="released twice"):
        pool.release("a")
    with pytest.raises(ValueError, match="repeats"):
        EnginePool([0, 0])


def _partial_gpu_run(seed: int, partial_rollout: bool, steps: int = 12) -> dict[str, int]:
    """Asynchronous rollout (k = 1) on 2 inference engines plus 2 engines of the training devices that join while
    the trainer waits (taking over requests of the loaded engines) and leave when it trains; every request advances
    0-6 tokens per tick; an abort's result arrives one tick later (the engine generates one more step meanwhile).
    Checks every trained sample (its tokens are exactly its response positions) and that no request lands on a
    removed engine."""
    rng = random.Random(seed)
    s = RolloutScheduler(
        batch_groups=3, group_size=4, max_new_tokens=48, async_ratio=1, partial_rollout=partial_rollout
    )
    lent = ["t0", "t1"]
    pool = EnginePool(["i0", "i1", *lent])
    target: dict[tuple[int, int], int] = {}
    running: dict[str, list] = {}  # rid -> [sample, offset, generated]
    aborting: dict[str, list] = {}  # aborted, result not yet collected
    rids = itertools.count()
    stats = {"steps": 0, "shrunk": 0, "moved": 0, "trained_tokens": 0}
    batch: list = []
    training = 0  # ticks left of the current train step

    def collect(rid: str, r: list, finish: str) -> None:
        smp, offset, gen = r
        pool.release(rid)
        s.on_result(rid, list(range(offset, offset + gen)), [0.0] * gen, finish)
        if smp.finish is not None:
            pool.forget((smp.group.gid, smp.index))

    for _ in range(10_000):
        while s.capacity() > 0:
            g = s.start(None, [1, 2, 3])
            for smp in g.samples:
                target[g.gid, smp.index] = rng.randint(1, 48)
        pending_now = {id(smp) for smp, _, _ in s.pending()}
        assert not any(id(r[0]) in pending_now for r in [*running.values(), *aborting.values()]), "pending twice"
        if pool.active:
            for smp, ids, _budget in list(s.pending()):
                rid = f"r{next(rids)}"
                eng = pool.assign(rid, key=(smp.group.gid, smp.index))
                assert eng in pool.active, f"{rid} routed to the removed engine {eng}"
                s.submitted(smp, rid)
                running[rid] = [smp, len(ids) - 3, 0]
        for rid, r in list(aborting.items()):  # the abort lands: partial output reported
            del aborting[rid]
            collect(rid, r, "abort")
        for rid, r in list(running.items()):
            smp, offset, gen = r
            r[2] = min(gen + rng.randint(0, 6), target[smp.group.gid, smp.index] - offset)
            if offset + r[2] == target[smp.group.gid, smp.index]:
                del running[rid]
                collect(rid, r, "length" if offset + r[2] == s.max_new else "stop")
        if training:
            training -= 1
            if training == 0:  # train step done: weight sync, then the training devices rejoin the rollout
                for rid in s.begin_update():
                    aborting[rid] = running.pop(rid)
                for rid, r in list(aborting.items()):
                    del aborting[rid]
                    collect(rid, r, "abort")
                s.finish_update()
                assert pool.draining(lent) == []
                for rid in pool.expand(lent, rebalance=True):  # move requests onto the rejoined engines
                    aborting[rid] = running.pop(rid)
                    stats["moved"] += 1
            continue
        batch += s.take(s.batch_groups - len(batch))
        if len(batch) < s.batch_groups:
            continue
        for g in batch:  # the batch: exact tokens, within the staleness bound
            assert s.version - g.min_version <= s.k
            for smp in g.samples:
                assert smp.tokens == list(range(target[g.gid, smp.index])), "tokens lost or duplicated"
                stats["trained_tokens"] += len(smp.tokens)
        batch = []
        stats["steps"] += 1
        if stats["steps"] == steps:
            return stats
        shrunk = pool.shrink(lent)  # take the training devices back: abort what they run
        stats["shrunk"] += len(shrunk)
        for rid in shrunk:
            aborting[rid] = running.pop(rid)
            aborting[rid][2] = min(aborting[rid][2] + 1, target[aborting[rid][0].group.gid, aborting[rid][0].index])
        training = rng.randint(1, 4)
    raise AssertionError(f"no progress: {stats}, {len(running)} running")


@pytest.mark.parametrize("partial_rollout", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_partial_gpu_rollout_loses_and_duplicates_no_token(seed: int, partial_rollout: bool):
    stats = _partial_gpu_run(seed, partial_rollout)
    assert stats["steps"] == 12 and stats["shrunk"] > 0  # requests were taken off the training devices
    # requests running across the update are moved onto the rejoined engines (with partial rollout all were
    # aborted at the update and resume on the least-loaded engines anyway)
    assert (stats["moved"] > 0) != partial_rollout
