"""A stale group is restarted, not dropped, in orders "start" and "deadline" (roll_core.scheduling.scheduler
`finish_update`, roll_core.scheduling._stale_update): with the staleness bound exceeded (async_ratio 0: the refill of
a discarded group runs across the weight update) the group was dropped (`stale_groups`) and its prompt lost from the
epoch: the data position was past it and a checkpoint no longer listed it as pending. Now its generated tokens (old
weights) are thrown away and counted (`stale_tokens`), its running requests aborted, and the same prompt starts again
from scratch at the new version (`restarted_groups`), last in start order, on the budget it held. Fake engines, no
Ray, no fixed sleeps."""

from __future__ import annotations

import time
import types
from collections.abc import Callable

import pytest

from roll_core.cluster.reward_guard import RewardFailureBudget
from roll_core.interfaces import SamplingParams
from roll_core.pipelines.collectors.prompts_async import AsyncPromptCollector
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.held_requests import HeldRequestEngine

WITHIN_S = 60  # generous: a loaded machine may take seconds to schedule a thread


def _wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WITHIN_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_stale_group_restarts_from_scratch_at_the_new_version_its_tokens_thrown_away_and_counted() -> None:
    """async_ratio 0, one group of two samples at version 0: sample 0 finished (3 tokens), sample 1 runs across the
    update (request r1). Before: dropped (stale_groups 1), its prompt gone, its budget drawing a new prompt. Now r1
    is returned to abort, both samples start again with the full token budget at version 1 under a new group of the
    same payload and prompt, and the 3 + 2 old tokens (r1's late result too) are counted in stale_tokens."""
    s = RolloutScheduler(batch_groups=1, group_size=2, max_new_tokens=4, async_ratio=0)
    g = s.start("p0", [9, 9], mm="pictures")
    (s0, _, _), (s1, _, _) = list(s.pending())
    s.submitted(s0, "r0")
    s.submitted(s1, "r1")
    assert s.on_result("r0", [1, 2, 3], [-0.5] * 3, "stop") is None
    assert s.finish_update() == ["r1"]
    ((gid, again),) = s.groups.items()
    assert gid != g.gid and again is not g
    assert (again.payload, again.prompt_ids, again.mm, again.start_version) == ("p0", [9, 9], "pictures", 1)
    assert [(smp.index, ids, left, smp.submitted_version) for smp, ids, left in s.pending()] == [
        (0, [9, 9], 4, 1),
        (1, [9, 9], 4, 1),
    ]
    assert s.counters["stale_groups"] == 0 and s.counters["restarted_groups"] == 1
    assert s.counters["stale_tokens"] == 3
    assert s.on_result("r1", [4, 5], [-0.5] * 2, "abort") is None  # the aborted request's late result: ignored
    assert s.counters["stale_tokens"] == 5 and not s.expects_result("r1")
    assert s.capacity() == 0 and s.in_flight() == 1 and s.complete() == 0  # on the budget it held
    for smp, _, _ in list(s.pending()):
        s.submitted(smp, f"n{smp.index}")
        s.on_result(f"n{smp.index}", [7], [-0.25], "stop")
    (taken,) = s.take(1)
    assert taken is again and [smp.tokens for smp in taken.samples] == [[7], [7]]
    assert [seg.version for smp in taken.samples for seg in smp.segments] == [1, 1]


@pytest.mark.parametrize("order", ["start", "deadline"])
def test_restarted_groups_follow_the_groups_kept_so_admission_versions_stay_in_start_order(order: str) -> None:
    """async_ratio 1, two groups per batch; groups 0, 1 at version 0 and groups 2, 3 at version 1 all run (the
    trainer took nothing). At version 2 groups 0 and 1 are stale: they restart after 2 and 3 (admission versions
    1, 1, 2, 2 in start order, gids increasing: `_slow`, order "deadline"'s reservations and `untake` rely on it),
    the budget is unchanged (no new prompt starts), and every prompt is still pending (p0..p3)."""
    s = RolloutScheduler(batch_groups=2, group_size=1, max_new_tokens=4, async_ratio=1, order=order)
    for version in (0, 1):
        for i in (2 * version, 2 * version + 1):
            s.start(f"p{i}", [i])
        for smp, _, _ in list(s.pending()):
            s.submitted(smp, f"r{smp.group.gid}")
        if version == 0:
            assert s.finish_update() == []
    assert s.capacity() == 0
    assert s.finish_update() == ["r0", "r1"]
    assert [(g.payload, g.start_version) for g in s.groups.values()] == [("p2", 1), ("p3", 1), ("p0", 2), ("p1", 2)]
    assert list(s.groups) == sorted(s.groups) and s._slow()  # groups 2, 3 of version 1 still run
    assert s.capacity() == 0 and s.counters["restarted_groups"] == 2 and s.counters["stale_groups"] == 0
    assert [smp.group.payload for smp, _, _ in s.pending()] == ["p0", "p1"]
    for gid in (2, 3):  # the kept groups finish; the restarted ones are submitted again
        s.on_result(f"r{gid}", [5], [-0.5], "stop")
    for smp, _, _ in list(s.pending()):
        s.submitted(smp, f"again{smp.group.gid}")
        s.on_result(f"again{smp.group.gid}", [6], [-0.5], "stop")
    batch = s.take(2)
    assert [g.payload for g in batch] == ["p2", "p3"]
    s.untake(batch)  # back in start order: before the restarted groups
    assert [g.payload for g in s.groups.values()] == ["p2", "p3", "p0", "p1"]
    assert [g.payload for g in s.take(2)] == ["p2", "p3"]


class _Data:
    """`next_group`: payloads `rows[0]`, `rows[1]`, ... (one object each: a checkpoint maps them to indices) with
    prompts [0], [1], ...; `drawn`: the prompts drawn."""

    def __init__(self) -> None:
        self.rows = [types.SimpleNamespace(id=f"p{i}") for i in range(8)]
        self.drawn: list[int] = []

    def next_group(self) -> tuple:
        prompt = len(self.drawn)
        self.drawn.append(prompt)
        return (self.rows[prompt], [prompt])


def _checkpointer(driver: AsyncRollout, data: _Data) -> AsyncPromptCollector:
    """The asynchronous prompts collector with what its `state_dict` reads (the driver, its scheduler, the data
    rows' indices), as a checkpoint calls it."""
    c = AsyncPromptCollector.__new__(AsyncPromptCollector)
    c.driver, c.sched, c._replay, c._version_base = driver, driver.sched, [], 0
    c._index = {id(row): i for i, row in enumerate(data.rows)}
    c.sampler = types.SimpleNamespace(state_dict=dict)
    c.reward_budget, c.reward_model, c._data_fingerprint = RewardFailureBudget(3), None, "data"
    return c


def test_a_discarded_groups_refill_that_runs_across_the_update_is_restarted_and_its_prompt_stays_pending() -> None:
    """async_ratio 0, one group per batch, no partial rollout. The trainer takes group 0 and discards it (dynamic
    sampling); its budget draws prompt 1, whose request async-1 runs across the weight update. Before: the group was
    dropped as stale at finish_update (stale_groups 1), a checkpoint right after no longer listed prompt 1 as
    pending, and the next batch held prompt 2: prompt 1 was skipped from the epoch. Now async-1 is aborted (what it
    generated, token 7, is thrown away and counted), the checkpoint lists prompt 1, whose request is submitted again
    from scratch (prompt [1], not [1, 7]) and trained at version 1."""
    data = _Data()
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    sched = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=0)
    driver = AsyncRollout(engine, sched, data.next_group, SamplingParams(max_new_tokens=4), timeout_s=WITHIN_S)
    checkpoint = _checkpointer(driver, data)
    try:
        driver.start()
        assert engine.wait_running(1) == ["async-0"]
        engine.serve()
        (g0,) = driver.take(1)
        driver.discard(g0)  # no reward variance: its budget starts prompt 1
        assert engine.wait_running(1) == ["async-1"]
        driver.begin_update()  # no partial rollout: async-1 runs on across the update
        driver.finish_update()
        assert checkpoint.state_dict()["pending"] == [1]  # prompt 1 is not lost from the epoch
        with engine.lock:
            assert engine.aborts == ["async-1"]
        assert engine.wait_running(1) == ["async-2"]
        assert engine.requests[-1].prompt_ids == [1]  # from scratch: the old weights' token 7 is not kept
        engine.serve()
        (g1,) = driver.take(1)
        assert g1.payload is data.rows[1] and g1.start_version == 1
        assert [seg.version for seg in g1.samples[0].segments] == [1] and g1.samples[0].tokens == [8]
        _wait(lambda: driver.sched.dropped_requests() == 0, "the aborted request's result was not booked")
        stats = driver.stats()
        assert stats["async/stale_groups"] == 0 and stats["async/restarted_groups"] == 1
        assert stats["async/stale_tokens"] == 1 and stats["async/started_groups"] == 2
        assert data.drawn == [0, 1]  # no prompt skipped, none drawn for the restart
    finally:
        driver.close()
        engine.release()


def test_a_prompt_restarted_max_restarts_times_is_dropped_then_and_its_budget_draws_a_new_prompt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A group that never completes within the staleness bound (here: its request runs across every update) was
    restarted at every update for ever, holding its budget. After MAX_RESTARTS restarts it is dropped (stale_groups,
    dropped_restarts, one warning) and its budget starts a new prompt."""
    from roll_core.scheduling._stale_update import MAX_RESTARTS

    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=0)
    s.start("p0", [9])
    for n in range(MAX_RESTARTS + 1):
        ((smp, _, _),) = list(s.pending())
        s.submitted(smp, f"r{n}")  # it runs across the update: stale
        with caplog.at_level("WARNING"):
            assert s.finish_update() == [f"r{n}"]
        if n < MAX_RESTARTS:
            assert s.counters["restarted_groups"] == n + 1 and s.counters["stale_groups"] == 0
            ((again,),) = [list(s.groups.values())]
            assert again.payload == "p0" and again.restarts == n + 1
    assert s.counters["restarted_groups"] == MAX_RESTARTS
    assert s.counters["stale_groups"] == s.counters["dropped_restarts"] == 1
    assert not s.groups and s.capacity() == 1  # the budget draws a new prompt
    assert sum("restarted 3 times as stale and is dropped" in r.getMessage() for r in caplog.records) == 1
