"""RolloutScheduler: the budget keeps rollout at most k batches ahead, no trained group is older than k versions,
partial rollout loses and duplicates no token, and tail groups only stand in for slow ones."""

from __future__ import annotations

import itertools

import pytest

from roll_core.scheduling.scheduler import RolloutScheduler


class _Problem:
    def __init__(self, i: int) -> None:
        self.id, self.answer = f"p{i}", "7"


def _fill(s: RolloutScheduler, ids: itertools.count) -> list[str]:
    """Start groups up to the budget and submit every pending sample; returns the new request ids."""
    while s.capacity() > 0:
        s.start(_Problem(next(ids)), [1, 2, 3])
    out = []
    for sample, _prompt, _remaining in list(s.pending()):
        rid = f"r{next(ids)}"
        s.submitted(sample, rid)
        out.append(rid)
    return out


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


def test_a_slow_group_past_the_bound_is_aborted_and_never_taken() -> None:
    s = RolloutScheduler(batch_groups=2, group_size=2, max_new_tokens=8, async_ratio=1)
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
