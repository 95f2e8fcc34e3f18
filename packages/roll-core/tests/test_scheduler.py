"""RolloutScheduler: the budget keeps rollout at most k batches ahead, no trained group is older than k versions,
the default order waits for the oldest group instead of dropping it, order "deadline" waits only for due groups and
trains every group by its deadline (reserving slots when k >= 2), partial rollout loses and duplicates no token,
episodes keep every turn and observation, and tail groups only stand in for slow ones (order "ready")."""

from __future__ import annotations

import itertools

import pytest

from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.scheduling import fill_and_submit as _fill


class _Problem:
    def __init__(self, i: int) -> None:
        self.id, self.answer = f"p{i}", "7"


def _finish(s: RolloutScheduler, rids: list[str], n_tokens: int = 2) -> None:
    for rid in rids:
        s.on_result(rid, [5] * n_tokens, [-0.5] * n_tokens, "stop")


@pytest.mark.parametrize("k", [0, 1, 2])
def test_the_budget_runs_at_most_k_batches_ahead_and_batches_are_never_staler_than_k(k: int) -> None:
    s = RolloutScheduler(batch_groups=3, group_size=2, max_new_tokens=8, async_ratio=k)
    ids = itertools.count()
    for _ in range(6):
        rids = _fill(s, ids)
        assert len(s.groups) == (k + 1) * 3  # exactly k batches beyond the one being trained
        _finish(s, rids)
        batch = s.take(3)
        assert len(batch) == 3
        assert all(s.version - g.min_version <= k for g in batch)
        assert s.begin_update() == []  # no partial rollout: running requests continue across the update
        assert s.finish_update() == []
    assert s.counters["stale_groups"] == 0


def test_in_start_order_a_slow_group_is_waited_for_and_trained_within_the_bound() -> None:
    s = RolloutScheduler(batch_groups=2, group_size=2, max_new_tokens=8, async_ratio=1)
    ids = itertools.count()
    rids = _fill(s, ids)  # 4 groups at version 0
    slow = rids[:2]  # group 0 stays running
    _finish(s, rids[2:])
    assert s.take(2) == []  # groups 1-3 are complete, but group 0 is the oldest: wait for it
    _finish(s, slow)
    assert [g.gid for g in s.take(2)] == [0, 1]
    assert s.finish_update() == []  # version 1
    _fill(s, ids)  # groups 4-5, admitted at version 1
    assert [(g.gid, s.version - g.min_version) for g in s.take(2)] == [(2, 1), (3, 1)]
    assert s.counters["stale_groups"] == 0 and s.counters["stale_tokens"] == 0


def test_a_slow_group_past_the_bound_is_aborted_and_never_taken_in_ready_order() -> None:
    s = RolloutScheduler(batch_groups=2, group_size=2, max_new_tokens=8, async_ratio=1, order="ready")
    ids = itertools.count()
    rids = _fill(s, ids)  # 4 groups at version 0
    slow = rids[:2]  # group 0 stays running
    _finish(s, rids[2:])
    batch = s.take(2)
    assert [g.gid for g in batch] == [1, 2]  # oldest complete first; the running one is carried
    assert s.finish_update() == []  # version 1: group 0 is 1 version old, still allowed
    _finish(s, _fill(s, ids))
    assert [g.gid for g in s.take(2)] == [3, 4]
    doomed = s.finish_update()  # version 2: group 0 (version 0) can never be trained on
    assert sorted(doomed) == sorted(slow) and 0 not in s.groups and s.counters["stale_groups"] == 1
    assert s.counters["stale_tokens"] == 0  # it had generated nothing yet
    assert s.on_result(slow[0], [9], [-1.0], "stop") is None  # its late result is ignored
    rids = _fill(s, ids)  # its budget went to a fresh group (plus a batch for the new version)
    assert len(s.groups) == 4 and len(rids) == 3 * 2


def test_partial_rollout_resumes_with_the_prefix_and_keeps_every_token_once() -> None:
    s = RolloutScheduler(batch_groups=1, group_size=2, max_new_tokens=6, async_ratio=1, partial_rollout=True)
    ids = itertools.count()
    first = _fill(s, ids)[:2]  # group 0's two samples
    assert sorted(s.begin_update()) == sorted(s.running_requests())
    s.on_result(first[0], [7, 8], [-0.1, -0.2], "abort")  # 2 tokens at version 0
    s.on_result(first[1], [], [], "abort")  # aborted before its first token
    s.finish_update()  # version 1
    pending = {smp.index: (prompt, remaining) for smp, prompt, remaining in s.pending() if smp.group.gid == 0}
    assert pending[0] == ([1, 2, 3, 7, 8], 4)  # prompt + prefix, the remaining budget
    assert pending[1] == ([1, 2, 3], 6)
    g0 = s.groups[0]
    for smp in g0.samples:
        s.submitted(smp, f"resume-{smp.index}")
    s.on_result("resume-0", [9], [-0.3], "stop")
    s.on_result("resume-1", [4, 4], [-0.4, -0.4], "length")
    assert g0.samples[0].tokens == [7, 8, 9] and g0.samples[0].logprobs == [-0.1, -0.2, -0.3]
    assert (g0.samples[0].min_version, g0.samples[0].max_version) == (0, 1)
    assert g0.samples[1].tokens == [4, 4] and g0.samples[1].min_version == 1  # no token of version 0
    assert s.counters["resumed_requests"] == 1  # sample 1 had no prefix: a fresh request, not a resume
    assert s.take(1)[0] is g0


def test_a_partial_sample_that_used_its_budget_finishes_as_length() -> None:
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=3, async_ratio=1, partial_rollout=True)
    rid = _fill(s, itertools.count())[0]
    s.on_result(rid, [1, 2, 3], [-1.0] * 3, "abort")
    assert s.groups[0].samples[0].finish == "length" and not list(s.pending())


def test_discarded_groups_return_their_budget() -> None:
    s = RolloutScheduler(batch_groups=2, group_size=2, max_new_tokens=4, async_ratio=0)
    ids = itertools.count()
    _finish(s, _fill(s, ids))
    taken = s.take(2)
    assert s.capacity() == 0
    s.discard(taken[0])  # no reward variance: sample another prompt instead
    assert s.capacity() == 1 and s.counters["discarded_groups"] == 1


@pytest.mark.parametrize("order", ["start", "deadline"])
def test_a_short_batch_does_not_keep_extra_groups_in_flight_for_good(order: str) -> None:
    """Dynamic sampling at its refill cap trains a batch of fewer than B groups. The budget counted versions only,
    so the groups that batch did not train stayed in flight for good: (k + 1) B + 1 of them, one more than the
    batches can train within the bound, and a group went stale (generated, then thrown away) every few versions
    forever (4 in 12 versions here). Now the short batch lowers the budget: only the due group it left behind goes
    stale, once (restarted at the next version, its prompt kept: scheduler `finish_update`). A group discarded in its
    own batch's version (refilled at once) is no shortfall."""
    b, k = 4, 1
    s = RolloutScheduler(batch_groups=b, group_size=1, max_new_tokens=4, async_ratio=k, order=order)
    ids = itertools.count()
    for v in range(12):
        _finish(s, _fill(s, ids))
        assert len(s.groups) <= (k + 1) * b
        got = s.take(b - 1 if v == 1 else b)  # version 1: a short batch
        if v == 3:  # dynamic sampling drops one group and refills the batch in the same version
            s.discard(got.pop())
            _finish(s, _fill(s, ids))
            got += s.take(1)
        assert len(got) == (b - 1 if v == 1 else b)
        assert all(s.version - g.start_version <= k for g in got)
        s.finish_update()
    assert s.counters["restarted_groups"] == 1 and s.counters["stale_groups"] == 0


def test_tail_groups_start_only_while_groups_of_an_earlier_version_run() -> None:
    s = RolloutScheduler(batch_groups=2, group_size=1, max_new_tokens=4, async_ratio=1, tail_groups=2)
    ids = itertools.count()
    rids = _fill(s, ids)
    assert len(s.groups) == 4  # nothing is slow yet: no tail groups
    _finish(s, rids[1:])  # group 0 stays running
    s.take(2)
    s.finish_update()  # version 1, group 0 (version 0) still runs: it is slow
    new = _fill(s, ids)
    assert len(new) == 2 + 2  # the batch budget plus the tail
    _finish(s, [rids[0], *new])
    s.take(2)
    s.finish_update()
    assert s.capacity() + len(s.groups) == 2 * 2  # nothing slow: no tail, (k + 1) batches in the pool


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="async_ratio"):
        RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=1, async_ratio=-1)
    with pytest.raises(ValueError, match="order='start' waits"):
        RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=1, tail_groups=1, order="start")
    with pytest.raises(ValueError, match="expected one of"):
        RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=1, order="fifo")
    assert RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=1, tail_groups=1).order == "ready"
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=1, async_ratio=0)
    s.start(_Problem(0), [1])
    with pytest.raises(RuntimeError, match="no capacity"):
        s.start(_Problem(1), [1])
    with pytest.raises(ValueError, match="was not taken"):
        s.discard(s.groups[0])  # a live group's budget must not be freed twice


def test_an_engine_side_abort_resumes_even_without_partial_rollout() -> None:
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=1)
    rid = _fill(s, itertools.count())[0]
    assert s.on_result(rid, [1], [-1.0], "abort") is None  # e.g. the engine preempted it
    [(sample, prompt, remaining)] = list(s.pending())
    assert prompt == [1, 2, 3, 1] and remaining == 3
    s.submitted(sample, "again")
    assert s.on_result("again", [2, 3, 4], [-1.0] * 3, "length") is s.groups[0]
    assert s.groups[0].samples[0].tokens == [1, 2, 3, 4]


def test_an_episode_keeps_its_turns_and_observations_across_an_aborted_turn() -> None:
    """Turn 1 ends, the environment observes, turn 2 is aborted at a weight update and resumed under the new
    weights; the episode keeps turn 1, the observation (masked) and the partial turn 2."""
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=20, async_ratio=1, partial_rollout=True)
    rid, other = _fill(s, itertools.count())  # groups 0 and 1 (k=1)
    _finish(s, [other])
    assert s.on_result(rid, [10, 11], [-0.1, -0.2], "stop", final=False) is None
    smp = s.groups[0].samples[0]
    assert smp.awaiting_env and not list(s.pending())  # the environment answers next, no request yet
    assert s.observe(smp, [90, 91, 92], done=False) is None
    [(_, prompt, remaining)] = list(s.pending())
    assert prompt == [1, 2, 3, 10, 11, 90, 91, 92] and remaining == 15
    s.submitted(smp, "turn2")
    assert s.begin_update() == ["turn2"]  # group 1 is complete: nothing else runs
    s.on_result("turn2", [12], [-0.3], "abort", final=False)  # aborted mid-turn: resumed, not handed to the env
    s.finish_update()
    [(_, prompt, _)] = list(s.pending())
    assert prompt[-1] == 12 and not smp.awaiting_env
    s.submitted(smp, "turn2b")
    s.on_result("turn2b", [13], [-0.4], "stop", final=False)
    assert s.observe(smp, [], done=True) is s.groups[0]
    assert smp.tokens == [10, 11, 90, 91, 92, 12, 13] and smp.mask == [1, 1, 0, 0, 0, 1, 1]
    assert smp.logprobs == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3, -0.4]
    assert (smp.min_version, smp.max_version, smp.finish) == (0, 1, "stop")  # observations carry no version
    assert s.counters["resumed_requests"] == 1  # turn 2's continuation; turn 2 itself was a new request
    with pytest.raises(ValueError, match="not waiting for the environment"):
        s.observe(smp, [1], done=True)


def test_an_observation_that_fills_the_budget_ends_the_episode_as_length() -> None:
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=0)
    [rid] = _fill(s, itertools.count())
    s.on_result(rid, [1, 2], [-1.0, -1.0], "stop", final=False)
    smp = s.groups[0].samples[0]
    assert s.observe(smp, [7, 7], done=False) is s.groups[0] and smp.finish == "length"


def test_the_environment_answer_for_a_dropped_group_is_ignored() -> None:
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=8, async_ratio=0, order="ready")
    [rid] = _fill(s, itertools.count())
    s.on_result(rid, [1, 2, 3], [-1.0] * 3, "stop", final=False)
    smp = s.groups[0].samples[0]
    s.finish_update()  # version 1: the episode (version 0) is stale for k=0
    assert 0 not in s.groups and s.counters["stale_tokens"] == 3
    assert s.observe(smp, [5], done=True) is None


# ---- order "deadline" -----------------------------------------------------------------------------------------
def test_deadline_order_waits_for_due_groups_only_and_fills_with_complete_ones() -> None:
    s = RolloutScheduler(batch_groups=2, group_size=1, max_new_tokens=4, async_ratio=1, order="deadline")
    ids = itertools.count()
    rids = _fill(s, ids)  # groups 0-3 at version 0 (deadline 1)
    _finish(s, rids[1:])  # group 0 stays running
    assert s.due() == 0 and [g.gid for g in s.take(2)] == [1, 2]  # nothing is due yet: skip the slow group
    s.finish_update()  # version 1: groups 0 and 3 are due
    new = _fill(s, ids)  # groups 4-5 (deadline 2)
    _finish(s, new)
    assert s.due() == 2
    assert [g.gid for g in s.take(2)] == [3]  # the other slot is group 0's: complete groups 4-5 may not take it
    assert s.take(1) == []  # still waiting for group 0, however many others are complete
    _finish(s, rids[:1])
    [g0] = s.take(1)
    assert g0.gid == 0 and s.version - g0.start_version == 1 and s.due() == 0
    assert s.counters["stale_groups"] == 0


def test_deadline_order_reserves_slots_for_the_next_deadlines_when_k_is_2() -> None:
    """Taking only the due groups first is not enough for k >= 2: with B = 1, batches 0 and 1 could take the fast
    groups 2 and 3 while groups 0 and 1 (deadline 2) run, and two groups would be due in the one slot of batch 2."""
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=2, order="deadline")
    ids = itertools.count()
    rids = _fill(s, ids)  # groups 0-2 at version 0 (deadline 2)
    _finish(s, rids[2:])
    assert [g.gid for g in s.take(1)] == [2]
    s.finish_update()
    _finish(s, _fill(s, ids))  # group 3 (deadline 3) completes at once
    assert s.take(1) == []  # batch 1's slot is kept for group 0 or 1: batch 2 alone cannot hold both
    _finish(s, rids[1:2])
    assert [g.gid for g in s.take(1)] == [1]
    s.finish_update()
    _fill(s, ids)
    assert s.due() == 1  # group 0 only: it fits
    _finish(s, rids[:1])
    assert [g.gid for g in s.take(1)] == [0] and s.counters["stale_groups"] == 0


@pytest.mark.parametrize("discards", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("batch_groups", [1, 3])
def test_deadline_order_trains_every_group_by_its_deadline_in_batches_of_exactly_b(
    k: int, batch_groups: int, discards: bool
) -> None:
    """Random completion order (and dynamic-sampling discards): at most B groups are ever due, every batch holds
    exactly B groups and every due one, nothing goes stale, the budget holds; and from batch k + 1 on, a batch is
    exactly the groups admitted k versions earlier (the budget leaves no other choice: see the module docstring)."""
    import random

    rng = random.Random(k * 10 + batch_groups + 100 * discards)
    b = batch_groups
    s = RolloutScheduler(batch_groups=b, group_size=1, max_new_tokens=4, async_ratio=k, order="deadline")
    ids = itertools.count()
    running: list[str] = []
    trained = 0
    for _ in range(12):
        assert s.due() <= b
        batch = []
        for _ in range(1000):
            if len(batch) == b:
                break
            running += _fill(s, ids)
            assert trained + len(s.groups) + len(batch) <= (s.version + k + 1) * b  # the budget
            if running and rng.random() < 0.7:
                _finish(s, [running.pop(rng.randrange(len(running)))])
            got = s.take(b - len(batch))
            assert len(got) <= b - len(batch)
            for g in got:
                if discards and rng.random() < 0.15:  # no reward variance: its slot and budget go to a new group
                    s.discard(g)
                else:
                    batch.append(g)
        assert len(batch) == b, "the batch never filled"
        assert s.due() == 0  # every due group is in this batch
        assert all(s.version - g.start_version <= k for g in batch)
        if s.version > k and not discards:
            assert {g.start_version for g in batch} == {s.version - k}
        trained += len(batch)
        s.finish_update()
    assert s.counters["stale_groups"] == 0 and s.counters["stale_tokens"] == 0


def test_deadline_order_refuses_tail_groups() -> None:
    with pytest.raises(ValueError, match="order='deadline' waits"):
        RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=1, tail_groups=1, order="deadline")


def test_an_episode_turn_after_an_empty_observation_is_not_counted_as_resumed() -> None:
    """`resumed_requests` counts continuations of aborted requests; a turn after an empty observation (the last
    segment is then the previous turn's) was counted as one, and a real resume after it still is."""
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=20, async_ratio=0, partial_rollout=True)
    [rid] = _fill(s, itertools.count())
    s.on_result(rid, [10, 11], [-0.1, -0.2], "stop", final=False)
    smp = s.groups[0].samples[0]
    assert s.observe(smp, [], done=False) is None  # the environment answered with no token
    s.submitted(smp, "turn2")
    assert s.counters["resumed_requests"] == 0  # a new turn, not a continuation
    s.on_result("turn2", [12], [-0.3], "abort", final=False)
    s.submitted(smp, "turn2b")
    assert s.counters["resumed_requests"] == 1
    s.on_result("turn2b", [13], [-0.4], "stop", final=False)
    assert s.observe(smp, [], done=True) is s.groups[0] and smp.tokens == [10, 11, 12, 13]


def test_untake_puts_groups_back_in_start_order_and_refuses_others() -> None:
    s = RolloutScheduler(batch_groups=3, group_size=1, max_new_tokens=4, async_ratio=0)
    _finish(s, _fill(s, itertools.count()))
    first = s.take(2)
    assert [g.gid for g in first] == [0, 1] and list(s.groups) == [2]
    s.untake(first)
    assert list(s.groups) == [0, 1, 2] and s.complete() == 3
    with pytest.raises(ValueError, match="were not taken"):
        s.untake(first)
    assert [g.gid for g in s.take(3)] == [0, 1, 2]
    s.finish_update()
    assert s.capacity() == 3  # a full batch: no short batch booked against the budget


def test_stale_tokens_count_what_requests_running_at_the_drop_generate() -> None:
    """A group dropped as stale at `finish_update` throws away its recorded tokens (a finished sample's, an aborted
    request's kept prefix) and what its still-running requests generate until their abort arrives: all of them are
    counted, each result once (it counted only the recorded segments: 3 of 9 here)."""
    s = RolloutScheduler(batch_groups=1, group_size=3, max_new_tokens=8, async_ratio=0, order="ready")
    ids = itertools.count()
    a, b, c = _fill(s, ids)
    s.on_result(a, [1, 2], [-1.0] * 2, "stop")  # sample 0 done: 2 tokens
    s.on_result(b, [3], [-1.0], "abort")  # the engine preempted sample 1 after 1 token: resumed with that prefix
    [(resumed, prompt, _)] = list(s.pending())
    assert prompt == [1, 2, 3, 3]
    s.submitted(resumed, "b2")
    doomed = s.finish_update()  # version 1: group 0 (version 0) is stale for k=0 while b2 and c run
    assert sorted(doomed) == ["b2", c] and s.counters["stale_groups"] == 1
    assert s.counters["stale_tokens"] == 3  # the recorded ones, at the drop
    assert s.on_result(c, [4, 4, 4, 4], [-1.0] * 4, "abort") is None  # the abort's partial result: 4 more
    assert s.on_result("b2", [5, 5], [-1.0] * 2, "stop") is None  # finished before its abort landed: 2 more
    assert s.counters["stale_tokens"] == 9
    s.on_result(c, [4], [-1.0], "abort")  # a result reported twice, and one of a request never submitted
    s.on_result("r-unknown", [4], [-1.0], "stop")
    assert s.counters["stale_tokens"] == 9
