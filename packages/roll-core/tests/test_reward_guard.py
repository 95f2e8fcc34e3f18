"""The reward guard and the forked worker under it: rows whose reward raises, returns NaN/inf or hangs score the
error value and are counted; the other rows keep their scores; nothing raises or hangs."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence

import pytest

from roll_core.cluster.reward_guard import (
    GuardedReward,
    RewardFailureBudget,
    RewardFailureError,
    all_rows_failed,
)
from roll_core.interfaces import RewardResult
from roll_core.isolation import CallTimeout, ChildDied, ChildError, ForkedWorker


class RowFaults:
    """Scores 1 per row, except rows "raise" (raises), "nan"/"inf" (non-finite) and "hang" (sleeps a minute)."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        scores = []
        for r in responses:
            if r == "raise":
                raise ValueError("a reward bug")
            if r == "hang":
                time.sleep(60)
            scores.append({"nan": float("nan"), "inf": float("inf")}.get(r, 1.0))
        n = len(responses)
        return RewardResult(scores=scores, correct=[1.0] * n, formatted=[1.0] * n, counters={"seen": n})


def _guard(**kwargs) -> GuardedReward:
    return GuardedReward(RowFaults(), **{"timeout_s": 0.5, "batch_timeout_s": 1.0, **kwargs})


#: Clocks for the tests where a row hangs: after the kill every row is served by a freshly forked child, and the row
#: pass is bounded by batch + 3 x row timeout (reward_guard's hung_after): at 1.0 + 3 x 0.5 s a loaded machine (load
#: 17 on 2 cores under pytest-xdist) ran out of it and the healthy rows after the hang counted as timeouts.
HANG_CLOCKS = {"timeout_s": 1.5, "batch_timeout_s": 2.0}


def test_healthy_batch_is_scored_in_one_call_with_zero_counters() -> None:
    res = _guard().score(["a", "b"], ["1", "1"])
    assert res.scores == [1.0, 1.0]
    assert res.counters == {
        "seen": 2,
        **dict.fromkeys(("errors", "timeouts", "nonfinite", "failed_rows", "failed_errors", "failed_timeouts"), 0),
        "failed_nonfinite": 0,
        "failed_unscored": 0,
        "rows": 2,
    }


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_rows_that_raise_score_the_error_value_and_are_counted(
    isolation: str, caplog: pytest.LogCaptureFixture
) -> None:
    guard = _guard(isolation=isolation, error_score=-1.0)
    with caplog.at_level(logging.WARNING):
        res = guard.score(["a", "raise", "b", "raise"], ["1"] * 4)
        guard.score(["raise"], ["1"])
    assert res.scores == [1.0, -1.0, 1.0, -1.0]
    assert res.correct == [1.0, 0.0, 1.0, 0.0]
    assert res.counters["errors"] == 2 and res.counters["seen"] == 2  # the healthy rows' own counters are kept
    first = [r for r in caplog.records if "counted in reward/errors" in r.getMessage()]
    assert len(first) == 1 and "a reward bug" in first[0].getMessage()  # logged once, with the error


def test_nonfinite_scores_are_replaced_and_counted() -> None:
    res = _guard(isolation="inline").score(["nan", "a", "inf"], ["1"] * 3)
    assert res.scores == [0.0, 1.0, 0.0]
    assert res.counters["nonfinite"] == 2 and res.counters["errors"] == 0


class NanForFailedRows:
    """Marks rows "broken" failed (not scored) and gives them NaN as the fallback score."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        bad = [r == "broken" for r in responses]
        scores = [float("nan") if b else 1.0 for b in bad]
        return RewardResult(scores, [0.0 if b else 1.0 for b in bad], [1.0] * len(bad), failed=bad)


@pytest.mark.parametrize("row_by_row", [False, True])
def test_a_failed_row_scored_nan_counts_once(row_by_row: bool) -> None:
    """A row the reward marks failed and scores NaN is one failed row, not two: counted as nonfinite and as
    unscored, one bad row of two read as a batch that failed on every row (and three such steps stopped the run)."""
    reward = NanForFailedRows()
    if row_by_row:  # a wrong row count sends the guard row by row; the rows themselves are the same
        reward.score = lambda r, a, s=reward.score: s(r, a) if len(r) == 1 else RewardResult([], [], [])
    res = GuardedReward(reward, isolation="inline").score(["broken", "ok"], ["1", "1"])
    assert res.scores == [0.0, 1.0] and res.failed == [True, False]
    assert (res.counters["failed_nonfinite"], res.counters["failed_unscored"], res.counters["failed_rows"]) == (1, 0, 1)
    assert not all_rows_failed(res.counters)
    res = GuardedReward(reward, isolation="inline").score(["broken", "broken"], ["1", "1"])
    assert res.counters["failed_rows"] == 2 and all_rows_failed(res.counters)


def test_a_hanging_row_is_cut_off_per_row_and_counted() -> None:
    guard = _guard(**HANG_CLOCKS)
    t0 = time.monotonic()
    res = guard.score(["a", "hang", "b", "nan", "raise"], ["1"] * 5)
    seconds = time.monotonic() - t0
    assert res.scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert (res.counters["timeouts"], res.counters["nonfinite"], res.counters["errors"]) == (1, 1, 1)
    assert seconds < 10, f"the hang was not cut off ({seconds:.1f}s)"
    assert guard.score(["a"], ["1"]).scores == [1.0]  # a fresh child serves the next batch


def test_guard_works_from_a_thread() -> None:
    """Ray actors serving several calls at once run them in threads: the deadline does not need the main thread."""
    out: dict[str, RewardResult] = {}
    t = threading.Thread(target=lambda: out.update(r=_guard(**HANG_CLOCKS).score(["hang", "a"], ["1", "1"])))
    t.start()
    t.join(30)
    assert out["r"].scores == [0.0, 1.0] and out["r"].counters["timeouts"] == 1


def test_a_reward_returning_the_wrong_number_of_rows_is_rescored_row_by_row() -> None:
    class Short(RowFaults):
        def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
            res = super().score(responses, answers)
            return res if len(responses) == 1 else RewardResult([1.0], [1.0], [1.0])

    res = GuardedReward(Short(), isolation="inline").score(["a", "b", "nan"], ["1"] * 3)
    assert res.scores == [1.0, 1.0, 0.0] and res.counters["nonfinite"] == 1


def test_forked_worker_reports_errors_timeouts_and_deaths() -> None:
    def fn(x: str) -> int:
        if x == "raise":
            raise KeyError("missing")
        if x == "hang":
            time.sleep(60)
        if x == "die":
            os._exit(3)
        if x == "segfault":
            # without pytest's faulthandler: a deliberate crash printed "Fatal Python error" into every CI log
            __import__("faulthandler").disable()
            os.kill(os.getpid(), signal.SIGSEGV)
        return os.getpid()

    worker = ForkedWorker(fn, name="test")
    pid = worker.call("ok", timeout=10)
    assert pid != os.getpid() and worker.call("ok", timeout=10) == pid  # one child serves call after call
    with pytest.raises(ChildError, match="KeyError") as info:
        worker.call("raise", timeout=10)
    assert "missing" in info.value.details
    with pytest.raises(CallTimeout, match=r"no answer within 0\.3s"):
        worker.call("hang", timeout=0.3)
    with pytest.raises(ChildDied, match=r"died \(exit code 3\)"):
        worker.call("die", timeout=10)
    with pytest.raises(ChildDied, match=r"died \(killed by SIGSEGV\)"):  # what killed it, for the log
        worker.call("segfault", timeout=10)
    assert worker.call("ok", timeout=10) not in (pid, os.getpid()) and worker.forks == 4
    worker.close()


class AlwaysFails:
    """A reward broken for every row: raises, hangs, or returns NaN, whatever the batch."""

    def __init__(self, how: str) -> None:
        self.how = how

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        if self.how == "raise":
            raise KeyError("answer_field")
        if self.how == "hang":
            time.sleep(60)
        n = len(responses)
        return RewardResult(scores=[float("nan")] * n, correct=[0.0] * n, formatted=[0.0] * n, counters={"rows": 99})


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_a_reward_failing_on_every_row_reports_all_rows_failed_and_why(how: str) -> None:
    guard = GuardedReward(AlwaysFails(how), timeout_s=5, batch_timeout_s=5)
    res = guard.score(["a", "b", "c"], ["1"] * 3)
    kind = {"raise": "failed_errors", "nan": "failed_nonfinite"}[how]
    assert res.counters["rows"] == 3 and res.counters["failed_rows"] == 3 and res.counters[kind] == 3
    assert all_rows_failed(res.counters)  # the reward's own "rows" counter (99) never replaces the guard's
    why = {"raise": "KeyError: 'answer_field'", "nan": "the reward returned nan"}[how]
    assert guard.last_failure == f"row 0: {why}"
    healthy = _guard().score(["a", "raise"], ["1", "1"])
    assert healthy.counters["failed_rows"] == 1 and not all_rows_failed(healthy.counters)


def test_a_reward_that_always_hangs_is_given_up_after_a_few_rows_not_waited_on_row_by_row() -> None:
    """Before: batch_timeout_s + rows x timeout_s per call (37 minutes for 64 rows with the defaults)."""
    guard = GuardedReward(AlwaysFails("hang"), timeout_s=0.3, batch_timeout_s=0.5, hung_after=2)
    t0 = time.monotonic()
    res = guard.score([f"r{i}" for i in range(30)], ["1"] * 30)
    seconds = time.monotonic() - t0
    assert res.scores == [0.0] * 30 and res.counters["failed_timeouts"] == res.counters["timeouts"] == 30
    assert all_rows_failed(res.counters)
    # 0.5 s batch + 2 rows x 0.3 s, plus forks on a loaded machine (6.6 s seen with CI beside seven helpers);
    # waiting on every row would take 9.5 s unloaded.
    assert seconds < 8.0, f"{seconds:.1f}s: the hanging rows were each waited on"
    assert guard.last_failure == "row 0: no answer within 0.3s"


def test_the_failure_budget_stops_after_n_steps_whose_rows_all_failed_and_totals_them() -> None:
    broken = GuardedReward(AlwaysFails("raise"), isolation="inline")
    budget = RewardFailureBudget(max_steps=2)
    failing = broken.score(["a", "b"], ["1", "1"]).counters
    budget.update(1, failing)
    budget.update(2, _guard(isolation="inline").score(["a", "raise"], ["1", "1"]).counters)  # a healthy row: resets
    budget.update(3, failing)
    with pytest.raises(RewardFailureError) as err:
        budget.update(4, failing, broken.last_failure)
    msg = str(err.value)
    assert "step 4: the reward failed on every row for 2 steps in a row" in msg
    assert "pipeline.max_reward_failure_steps=2" in msg
    assert "2 raised, 0 timed out, 0 were NaN/inf, 0 unscored by the reward itself" in msg
    assert "first failure: row 0: KeyError: 'answer_field'" in msg
    assert budget.summary() == {
        "reward_rows": 8,
        "reward_failed_rows": 7,
        "reward_failed_errors": 7,
        "reward_failed_timeouts": 0,
        "reward_failed_nonfinite": 0,
        "reward_failed_unscored": 0,
        "reward_all_failed_steps": 3,
    }
    resumed = RewardFailureBudget(max_steps=2)
    resumed.load_state_dict(budget.state_dict())
    assert resumed.summary() == budget.summary() and resumed.streak == 2
    never = RewardFailureBudget(max_steps=0)
    for step in range(10):
        never.update(step, failing)  # 0: never stops, still counts
    assert never.summary()["reward_all_failed_steps"] == 10
    with pytest.raises(ValueError, match="max_reward_failure_steps=-1"):
        RewardFailureBudget(max_steps=-1)


class _Contextual:
    """Scores len(prompt) + metadata["bonus"]; fails on a row whose metadata says so (to force row-by-row)."""

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict] | None = None,
    ) -> RewardResult:
        assert prompts is not None and metadata is not None, "context not passed"
        if len(responses) > 1 and any(m.get("fail_batch") for m in metadata):
            raise RuntimeError("batch call fails")
        s = [len(p) + m["bonus"] for p, m in zip(prompts, metadata)]
        return RewardResult(s, [1.0] * len(s), [1.0] * len(s))


class _Kwargs:
    def score(self, responses: Sequence[str], answers: Sequence[str], **context: object) -> RewardResult:
        return RewardResult([float(len(context))] * len(responses), [0.0] * len(responses), [0.0] * len(responses))


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_prompts_and_metadata_reach_rewards_that_declare_them(isolation: str) -> None:
    from roll_core.interfaces.tasks import reward_kwargs

    meta = [{"bonus": 1.0}, {"bonus": 2.0, "fail_batch": True}]
    guard = GuardedReward(_Contextual(), isolation=isolation)
    try:
        # The batch call fails, the row-by-row pass gives each row its own prompt and metadata.
        res = guard.score(["a", "b"], ["x", "y"], prompts=["pp", "qqq"], metadata=meta)
        assert res.scores == [3.0, 5.0] and res.counters["failed_rows"] == 0
    finally:
        guard.close()
    # A reward written for score(responses, answers) gets neither; **kwargs gets both; None is never passed.
    plain = GuardedReward(RowFaults(), isolation="inline")
    assert plain.score(["1"], ["1"], prompts=["p"], metadata=[{}]).counters["failed_rows"] == 0
    assert reward_kwargs(RowFaults(), prompts=["p"], metadata=[{}]) == {}
    # time_budget_s only to a score that names it: a **kwargs reward may forward its kwargs to one that does not
    assert reward_kwargs(_Kwargs(), prompts=["p"], metadata=None, time_budget_s=1.0) == {"prompts": ["p"]}
    assert GuardedReward(_Kwargs(), isolation="inline").score(["r"], ["a"], prompts=["p"], metadata=[{}]).scores == [
        2.0
    ]
    with pytest.raises(ValueError, match="2 responses but 1 prompts"):
        guard.score(["a", "b"], ["x", "y"], prompts=["p"])


#: The values BadGrades returns, by the name a response gives.
GRADES = {"nan": float("nan"), "inf": float("inf"), "0.5": 0.5, "'yes'": "yes", "'1'": "1", "None": None, "True": True}


class BadGrades:
    """Scores 1 per row; a response "correct=<v>" / "formatted=<v>" returns GRADES[v] (or int(v)) there."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        grades = {"correct": [1.0] * len(responses), "formatted": [1.0] * len(responses)}
        for i, r in enumerate(responses):
            if "=" in r:
                field, value = r.split("=")
                grades[field][i] = GRADES[value] if value in GRADES else int(value)
        return RewardResult([1.0] * len(responses), grades["correct"], grades["formatted"])


def _agree(res: RewardResult) -> None:
    """roll-eval's per-row `failed` (from `res.failed`) and the guard's failed_rows count the same rows."""
    assert res.failed is not None and sum(res.failed) == res.counters["failed_rows"]
    causes = ("failed_errors", "failed_timeouts", "failed_nonfinite", "failed_unscored")
    assert sum(res.counters[k] for k in causes) == res.counters["failed_rows"]


@pytest.mark.parametrize("row_by_row", [False, True])
@pytest.mark.parametrize(
    "bad, kind, grade",
    [
        ("correct=nan", "nonfinite", "correct=nan"),
        ("correct=inf", "nonfinite", "correct=inf"),
        ("correct=0.5", "errors", "correct=0.5"),
        ("correct='yes'", "errors", "correct='yes'"),
        ("correct='1'", "errors", "correct='1'"),
        ("formatted=nan", "nonfinite", "formatted=nan"),
    ],
)
def test_a_row_whose_grade_is_no_grade_fails_and_is_counted_like_a_nan_score(
    row_by_row: bool, bad: str, kind: str, grade: str
) -> None:
    """A finite score beside a NaN (or 0.5, or "yes") `correct` was a silent 0: a wrong answer in the accuracy of
    training eval and roll-eval, not flagged failed and not counted. It is a failed row now, scored error_score."""
    reward = BadGrades()
    if row_by_row:  # a wrong row count sends the guard row by row; the rows themselves are the same
        reward.score = lambda r, a, s=reward.score: s(r, a) if len(r) == 1 else RewardResult([], [], [])
    guard = GuardedReward(reward, isolation="inline", error_score=-1.0)
    res = guard.score(["ok", bad, "ok"], ["1"] * 3)
    assert res.scores == [1.0, -1.0, 1.0] and res.failed == [False, True, False]
    assert res.correct[1] == 0.0 or bad.startswith("formatted")  # a valid grade beside a bad one is kept
    assert (res.counters[kind], res.counters[f"failed_{kind}"], res.counters["failed_rows"]) == (1, 1, 1)
    assert guard.last_failure == f"row 1: the reward returned {grade}"
    _agree(res)


def test_valid_grades_are_kept_and_a_none_grade_is_zero() -> None:
    res = GuardedReward(BadGrades(), isolation="inline").score(["correct=True", "correct=None", "correct=0"], ["1"] * 3)
    assert res.correct == [1.0, 0.0, 0.0] and res.failed == [False] * 3 and res.counters["failed_rows"] == 0


class CountsUnscored:
    """Scores 1 per row; rows "?" it could not score (fallback 0), reported by its `unscored` counter, and also by
    `failed` flags on the rows "!" (flags=True: on every such row)."""

    def __init__(self, flags: bool = False) -> None:
        self.flags = flags
        self.calls: list[int] = []

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        self.calls.append(len(responses))
        bad = [r in "?!" for r in responses]
        ok = [0.0 if b else 1.0 for b in bad]
        failed = bad if self.flags else [r == "!" for r in responses]
        return RewardResult(ok, ok, ok, counters={"unscored": sum(bad)}, failed=failed if any(failed) else None)


def test_an_unscored_count_flags_its_rows_or_the_batch_is_rescored_to_find_them() -> None:
    """A reward's `unscored` count without per-row flags reached failed_rows while its rows kept `failed: None` in
    roll-eval's rows: the metrics' `failed` count was lower than reward_counters["failed_rows"]."""
    # 2 of 4 counted, 1 flagged: which other row is not known from the batch; row by row, each row says.
    reward = CountsUnscored()
    res = GuardedReward(reward, isolation="inline").score(["a", "?", "!", "b"], ["1"] * 4)
    assert reward.calls == [4, 1, 1, 1, 1]
    assert res.failed == [False, True, True, False] and res.scores == [1.0, 0.0, 0.0, 1.0]
    assert (res.counters["failed_unscored"], res.counters["failed_rows"], res.counters["unscored"]) == (2, 2, 2)
    assert res.counters["failed_errors"] == 0  # the refused batch is no row's failure
    _agree(res)
    # The count covers every row it did not flag: determinable, flagged without rescoring.
    reward = CountsUnscored()
    res = GuardedReward(reward, isolation="inline").score(["?", "!", "?"], ["1"] * 3)
    assert reward.calls == [3] and res.failed == [True] * 3 and res.counters["failed_unscored"] == 3
    assert all_rows_failed(res.counters)
    _agree(res)
    # Flags on every counted row: one call, as before.
    reward = CountsUnscored(flags=True)
    res = GuardedReward(reward, isolation="inline").score(["a", "?", "!", "b"], ["1"] * 4)
    assert reward.calls == [4] and res.failed == [False, True, True, False]
    _agree(res)


def test_a_row_flagged_and_nan_counts_once_and_flags_agree_with_counts() -> None:
    res = GuardedReward(NanForFailedRows(), isolation="inline").score(["broken", "ok", "broken"], ["1"] * 3)
    assert res.counters["failed_nonfinite"] == 2 and res.counters["failed_unscored"] == 0
    _agree(res)
    res = _guard(**HANG_CLOCKS).score(["a", "hang", "nan", "raise", "b"], ["1"] * 5)
    assert res.failed == [False, True, True, True, False]
    _agree(res)


@pytest.mark.parametrize("flag", ["false", "True", 0.5, None, float("nan")])
def test_a_failed_flag_that_is_not_a_bool_is_refused(flag: object) -> None:
    """`RewardResult.failed` entries were read with bool(): a reward's string "false" counted its row as failed."""
    with pytest.raises(ValueError, match="each entry must be a bool"):
        RewardResult([1.0, 0.0], [1.0, 0.0], [1.0, 0.0], failed=[False, flag])  # type: ignore[list-item]
    # bools, NumPy bools and 0/1 are flags
    import numpy as np

    assert RewardResult([1.0], [1.0], [1.0], failed=[np.bool_(True)]).failed == [np.bool_(True)]
    assert RewardResult([1.0, 0.0], [1.0, 0.0], [1.0, 0.0], failed=[0, 1]).failed == [0, 1]
