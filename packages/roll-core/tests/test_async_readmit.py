"""A group that generated nothing is not stale (roll_core.scheduling.scheduler `finish_update`, `readmitted_groups`; the
other stale groups are restarted, test_async_restart): with async_ratio 0 a group whose data the driver's data thread
drew during a weight update was started at the old version and dropped as stale at `finish_update` without having
generated a token (`stale_groups`), its prompt lost from the epoch (the data position was past it, and a checkpoint's
pending groups no longer listed it). Now it starts at the new version and is trained. Fake engines, no Ray, no fixed
sleeps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from roll_core.interfaces import SamplingParams
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.held_requests import HeldRequestEngine

WITHIN_S = 60  # generous: a loaded machine may take seconds to schedule a thread
HOLD_S = 3 * WITHIN_S  # how long a blocked draw waits for its release at most (the test's waits end first)


class _BlockingData:
    """`next_group`: prompts [0], [1], ...; the draw of prompt `block_at` waits for `release` (`entered`: it began)."""

    def __init__(self, block_at: int) -> None:
        self.block_at = block_at
        self.entered, self.release = threading.Event(), threading.Event()
        self.drawn: list[int] = []

    def next_group(self) -> tuple:
        prompt = len(self.drawn)
        self.drawn.append(prompt)
        if prompt == self.block_at:
            self.entered.set()
            self.release.wait(HOLD_S)
        return (f"p{prompt}", [prompt])


def _wait(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WITHIN_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_group_drawn_during_an_update_with_async_ratio_0_starts_at_the_new_version_and_is_trained() -> None:
    """async_ratio 0, one group per batch. The trainer takes group 0 and discards it (dynamic sampling), so its
    budget draws group 1, whose draw blocks; the trainer begins the weight update, then the data comes (during the
    update). Before: group 1 started at version 0 and was dropped as stale at `finish_update` (stale_groups 1), never
    generated; its prompt was skipped (the next take got prompt 2). Now it is pending through the update (a checkpoint
    lists it), starts at version 1, is generated there and reaches take()."""
    data = _BlockingData(block_at=1)
    engine = HeldRequestEngine(abort_tokens=[7], serve_tokens=[8])
    sched = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=0)
    driver = AsyncRollout(engine, sched, data.next_group, SamplingParams(max_new_tokens=4), timeout_s=WITHIN_S)
    try:
        driver.start()
        assert engine.wait_running(1) == ["async-0"]
        engine.serve()
        (g0,) = driver.take(1)
        assert g0.prompt_ids == [0]
        driver.discard(g0)  # no reward variance: its budget starts a new group
        assert data.entered.wait(WITHIN_S)
        driver.begin_update()
        data.release.set()
        _wait(lambda: sched.counters["started_groups"] == 2, "the group drawn during the update started")
        driver.finish_update()
        with driver.held():  # what a checkpoint lists as pending: the group drawn during the update
            assert [g.prompt_ids for g in sched.groups.values()] == [[1]]
        assert engine.wait_running(1) == ["async-1"]
        assert engine.requests[-1].prompt_ids == [1]
        engine.serve()
        (g1,) = driver.take(1)
        assert g1.prompt_ids == [1] and g1.start_version == 1
        assert [seg.version for seg in g1.samples[0].segments] == [1]  # generated at the new version
        stats = driver.stats()
        assert stats["async/stale_groups"] == 0 and stats["async/stale_tokens"] == 0
        assert stats["async/readmitted_groups"] == 1 and stats["async/started_groups"] == 2
        assert data.drawn == [0, 1]  # no prompt skipped
    finally:
        data.release.set()
        driver.close()
        engine.release()


def test_finish_update_readmits_the_stale_groups_that_generated_nothing_and_restarts_the_others() -> None:
    """async_ratio 0, two groups per batch, three groups started at version 0 (the batch discarded one): group 0's
    request runs across the update (stale: its request aborted, the group restarted from scratch at version 1 as a
    new group after the others, its prompt kept: scheduler `finish_update`); group 1's request was aborted before its
    first token (partial rollout) and group 2 was never submitted: neither generated, both start again at version 1
    in place (before: both dropped, stale_groups 3). A group that generated only an aborted prefix is restarted too
    (its token thrown away, counted); order "ready" still drops the stale groups that generated."""
    s = RolloutScheduler(batch_groups=3, group_size=1, max_new_tokens=4, async_ratio=0)
    _, g1, g2 = (s.start(f"p{i}", [i]) for i in range(3))
    for sample, _, _ in list(s.pending())[:2]:
        s.submitted(sample, f"r{sample.group.gid}")
    s.on_result("r1", [], [], "abort")  # aborted before its first token: pending again
    doomed = s.finish_update()
    assert doomed == ["r0"]
    assert list(s.groups) == [g1.gid, g2.gid, 3] and g1.start_version == g2.start_version == 1
    assert (s.groups[3].payload, s.groups[3].prompt_ids, s.groups[3].start_version) == ("p0", [0], 1)
    assert s.counters["stale_groups"] == 0 and s.counters["readmitted_groups"] == 2
    assert s.counters["restarted_groups"] == 1
    pending = sorted((smp.group.gid, ids, smp.submitted_version) for smp, ids, _ in s.pending())
    assert pending == [(1, [1], 1), (2, [2], 1), (3, [0], 1)]

    t = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=0)
    h = t.start("p", [0])
    ((sample, _, _),) = list(t.pending())
    t.submitted(sample, "r0")
    t.on_result("r0", [5], [-0.5], "abort")  # a prefix generated at version 0: stale at version 1
    assert t.finish_update() == [] and h.gid not in t.groups and h.start_version == 0
    ((again, ids, left),) = list(t.pending())  # the same prompt, from scratch at version 1
    assert (again.group.payload, ids, left, again.group.start_version) == ("p", [0], 4, 1)
    assert t.counters["stale_groups"] == 0 and t.counters["stale_tokens"] == 1 and t.counters["restarted_groups"] == 1

    r = RolloutScheduler(batch_groups=3, group_size=1, max_new_tokens=4, async_ratio=0, order="ready")
    _, r1, r2 = (r.start(f"p{i}", [i]) for i in range(3))
    for sample, _, _ in list(r.pending())[:1]:
        r.submitted(sample, "r0")
    assert r.finish_update() == ["r0"] and list(r.groups) == [r1.gid, r2.gid]
    assert r.counters["stale_groups"] == 1 and r.counters["restarted_groups"] == 0
    assert r.counters["readmitted_groups"] == 2
