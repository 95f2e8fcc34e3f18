"""RolloutScheduler's ids of requests of dropped (stale) groups: a result that arrives is still thrown away and its
tokens counted in stale_tokens; one that never arrives does not stay for good: the caller's `lost` forgets it, and
failing that `finish_update` forgets it `dropped_ttl` versions after the drop (counted in pruned_requests), so the
kept ids stay bounded over a run of any length (they grew by every unanswered abort, run-long)."""

from __future__ import annotations

import itertools
import logging

import pytest

from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.scheduling import fill_and_submit as _fill


def _doomed_group(**kw: int) -> tuple[RolloutScheduler, list[str]]:
    """A scheduler (k=0, one group of two samples) whose running group went stale at version 1: its two running
    request ids, aborted by the caller, results not yet arrived."""
    s = RolloutScheduler(batch_groups=1, group_size=2, max_new_tokens=8, async_ratio=0, order="ready", **kw)
    running = _fill(s, itertools.count())
    doomed = s.finish_update()
    assert sorted(doomed) == sorted(running) and s.counters["stale_groups"] == 1
    assert s.dropped_requests() == 2
    return s, doomed


def test_a_result_that_arrives_is_still_discarded_and_its_tokens_counted_once() -> None:
    s, (a, b) = _doomed_group()
    assert s.on_result(a, [4, 4, 4], [-1.0] * 3, "abort") is None  # the abort's partial output: thrown away
    assert s.counters["stale_tokens"] == 3 and s.dropped_requests() == 1
    assert s.on_result(a, [4], [-1.0], "abort") is None  # reported twice: counted once
    assert s.counters["stale_tokens"] == 3
    assert s.lost([a]) == 0 and s.counters["lost_requests"] == 0  # already over: nothing to forget
    assert s.on_result(b, [5, 5], [-1.0] * 2, "stop") is None
    assert s.counters["stale_tokens"] == 5 and s.dropped_requests() == 0
    assert s.counters["pruned_requests"] == 0


def test_a_dropped_request_reported_lost_is_forgotten_and_a_late_result_ignored() -> None:
    """The engine running `a` restarted: its result never comes. `lost` forgets it at once (it stayed for good)."""
    s, (a, b) = _doomed_group()
    assert s.lost([a, "never-submitted"]) == 1
    assert s.dropped_requests() == 1 and s.counters["lost_requests"] == 1
    assert s.on_result(a, [4, 4], [-1.0] * 2, "abort") is None  # a result after all: ignored, not counted
    assert s.counters["stale_tokens"] == 0
    assert s.on_result(b, [4], [-1.0], "abort") is None  # the other one still books its tokens
    assert s.counters["stale_tokens"] == 1 and s.dropped_requests() == 0


def test_a_live_request_reported_lost_resumes_its_sample_with_the_prefix_kept() -> None:
    s = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=8, async_ratio=1)
    ids = itertools.count()
    [rid] = _fill(s, ids)[:1]
    s.on_result(rid, [7, 7], [-0.5] * 2, "abort")  # preempted after 2 tokens: resumed
    [(sample, prompt, remaining)] = [p for p in s.pending() if p[0].group.gid == 0]
    s.submitted(sample, "resume")
    assert s.lost(["resume"]) == 1 and s.counters["lost_requests"] == 1
    assert "resume" not in s.running_requests()
    [(again, prompt, remaining)] = [p for p in s.pending() if p[0].group.gid == 0]
    assert again is sample and prompt == [1, 2, 3, 7, 7] and remaining == 6  # nothing lost, nothing twice


def test_ids_whose_results_never_arrive_are_pruned_after_dropped_ttl_versions(caplog: pytest.LogCaptureFixture) -> None:
    s, doomed = _doomed_group(dropped_ttl=2)  # dropped at version 1
    assert s.finish_update() == [] and s.dropped_requests() == 2  # version 2: one version, still waited for
    with caplog.at_level(logging.WARNING, logger="roll_core.scheduling.scheduler"):
        s.finish_update()  # version 3 = 1 + dropped_ttl: forgotten
    assert s.dropped_requests() == 0 and s.counters["pruned_requests"] == 2
    assert "2 aborted request(s) of stale groups never returned" in caplog.text
    assert s.on_result(doomed[0], [4], [-1.0], "abort") is None and s.counters["stale_tokens"] == 0


def test_unanswered_aborts_stay_bounded_over_a_long_run() -> None:
    """k = 0, one group of 3 per batch, every group goes stale and none of the aborts is ever answered: 200
    versions drop 600 requests, yet at most dropped_ttl versions' worth (4 x 3) are kept."""
    s = RolloutScheduler(batch_groups=1, group_size=3, max_new_tokens=8, async_ratio=0, order="ready")
    ids = itertools.count()
    most = 0
    for _ in range(200):
        _fill(s, ids)
        s.finish_update()  # the running group is stale: dropped, its requests aborted, never answered
        most = max(most, len(s._dropped_requests))  # the store itself: it kept all 600 ids
    assert s.counters["stale_groups"] == 200
    assert most == 4 * 3 and s.dropped_requests() == 4 * 3
    assert s.counters["pruned_requests"] == 600 - 4 * 3


def test_dropped_ttl_must_be_at_least_one_version() -> None:
    with pytest.raises(ValueError, match="dropped_ttl=0"):
        RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=1, dropped_ttl=0)
