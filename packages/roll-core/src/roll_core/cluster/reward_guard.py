"""A reward that never ends the run: errors, NaN/inf scores and hangs become counted rows scoring a fixed value.

`GuardedReward(reward, ...)` wraps any `roll_core.interfaces.Reward` for the reward role. Its `score()`:
1. scores the whole batch in one call (the reward sees the batch it was written for), within `batch_timeout_s`;
2. if that call raised, hung, died or returned the wrong number of rows, rescores row by row, each row within
   `timeout_s`: a row that raises scores `error_score` and counts in `errors`, a row that hangs is cut off, scores
   `error_score` and counts in `timeouts`; the other rows keep their own scores. The row-by-row pass is bounded
   too: it stops after `hung_after` row timeouts in a row (the reward is taken to be hung), and once it has taken
   batch_timeout_s + hung_after x timeout_s; the rows it did not reach score `error_score` and count in
   `timeouts`. So a reward that always hangs costs batch_timeout_s + hung_after x timeout_s per call (6.5 minutes
   with the defaults) instead of batch_timeout_s + rows x timeout_s (37 minutes for 64 rows), and any reward at
   most 2 x batch_timeout_s + hung_after x timeout_s;
3. checks every row's result: a score that is not a finite number, or a `correct`/`formatted` that is not a grade
   (0, 1, a bool, or None, which is 0: no claim), fails the row: it scores `error_score`, its invalid grades 0
   (its valid ones are kept), it is flagged `failed`, and it counts once, by its first bad field (score, correct,
   formatted): NaN/inf in `nonfinite`, any other value (0.5, "yes") in `errors`, as a malformed result. A NaN
   `correct` became 0 unflagged before, a wrong answer in the accuracy; now it is a failed row, never graded.
The counters are added to the reward's own (`RewardResult.counters`), which the pipeline logs as `reward/<name>`
(a math reward's own `errors`/`timeouts` for malformed answers add to the same keys: rows whose scoring failed).
Apart from those, the guard reports what it had to replace, whatever the reward counts itself (FAILURE_COUNTERS):
`rows` scored, `failed_rows` the rows the result flags `failed`, split by cause into `failed_errors`,
`failed_timeouts` and `failed_nonfinite` (replaced by `error_score`) plus `failed_unscored`: rows the reward itself
flags in `RewardResult.failed` (a remote verifier that failed, which scores such rows with its own fallback
instead of raising; a flagged row whose result is also invalid counts once, by the guard's cause). So
`failed_rows` is always the number of rows flagged `failed`, and a row counts in one cause at most.
A reward may also report such rows only by its counter `unscored`. The guard marks which rows only where that is
determinable: when the count covers every row the reward did not flag, those are all flagged. Otherwise (3 rows
counted, 1 flagged, which 2 of the other 9 unknown) the result is refused as malformed, like a wrong row count:
the batch is rescored row by row, where a single row's count says which row it is. A count without flags is never
added to `failed_rows` without flagging its rows (roll-eval's rows and its `failed` count would disagree).
`all_rows_failed(counters)` says a call (or a step's sum of calls) learned nothing, and `RewardFailureBudget` stops
a run after `pipeline.max_reward_failure_steps` such steps in a row.
The first failure of each kind is logged once per worker with its traceback; later ones are only counted.

Isolation: `process` (default) runs the reward in a forked child (roll_core.isolation.ForkedWorker), so a hang is
cut off by killing the child, which is forked again for the next call; `inline` runs it in the worker's own
thread: errors and NaN are handled, but a hang cannot be cut off (for rewards that need a CUDA context created
before a fork, such as a reward model on a GPU).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from roll_core.interfaces import Reward, RewardResult
from roll_core.interfaces.tasks import reward_kwargs
from roll_core.isolation import CallTimeout, ChildDied, ChildError, ForkedWorker

log = logging.getLogger(__name__)

ISOLATIONS = ("process", "inline")
#: Counters every guarded result carries (0 when nothing failed), so the metrics are continuous.
GUARD_COUNTERS = ("errors", "timeouts", "nonfinite")
#: What the guard itself replaced, never mixed with the reward's own counters (also carried at 0).
FAILURE_COUNTERS = ("rows", "failed_rows", "failed_errors", "failed_timeouts", "failed_nonfinite", "failed_unscored")
#: The counter a reward reports rows it could not score under (it gave them a fallback score).
UNSCORED = "unscored"


class GuardedReward:
    """`reward` scored so that no row can raise, hang or return NaN into the run (see the module docstring)."""

    def __init__(
        self,
        reward: Reward,
        *,
        timeout_s: float = 30.0,
        batch_timeout_s: float = 300.0,
        error_score: float = 0.0,
        isolation: str = "process",
        name: str = "reward",
        hung_after: int = 3,
    ) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"reward isolation {isolation!r} is not one of {', '.join(ISOLATIONS)}")
        if timeout_s <= 0 or batch_timeout_s <= 0:
            raise ValueError(f"reward timeouts must be > 0, got {timeout_s} (row) and {batch_timeout_s} (batch)")
        if hung_after < 1:
            raise ValueError(f"hung_after must be >= 1, got {hung_after}")
        if not math.isfinite(error_score):
            raise ValueError(f"the reward error score must be a finite number, got {error_score}")
        self.reward, self.name = reward, name
        self.timeout_s, self.batch_timeout_s, self.error_score = timeout_s, batch_timeout_s, error_score
        # Row timeouts in a row after which the reward is taken to be hung and the rest of the batch is not tried.
        self.hung_after = hung_after
        self._child = ForkedWorker(self._score_inline, name=name) if isolation == "process" else None
        self._logged: set[str] = set()
        #: The first failure of the latest `score()` call, as one line (None: nothing failed).
        self.last_failure: str | None = None

    def _score_inline(self, responses: list[str], answers: list[str], context: dict[str, Any]) -> RewardResult:
        return self.reward.score(responses, answers, **reward_kwargs(self.reward, **context))

    def _call(self, responses: list[str], answers: list[str], context: dict[str, Any], timeout: float) -> RewardResult:
        # A reward that declares time_budget_s returns what it has before the cut-off (which loses every score).
        context = {**context, "time_budget_s": budget_within(timeout)}
        if self._child is None:
            return self._score_inline(responses, answers, context)
        return self._child.call(responses, answers, context, timeout=timeout)

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        *,
        prompts: Sequence[str] | None = None,
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """Scores of every row; never raises for anything the wrapped reward does. `prompts` / `metadata` reach the
        reward when its `score` declares them (roll_core.interfaces.tasks.reward_kwargs)."""
        responses, answers = list(responses), list(answers)
        context: dict[str, Any] = {"prompts": None if prompts is None else list(prompts)}
        context["metadata"] = None if metadata is None else [dict(m) for m in metadata]
        for key, rows in context.items():
            if rows is not None and len(rows) != len(responses):
                raise ValueError(f"{len(responses)} responses but {len(rows)} {key}")
        counters = dict.fromkeys(GUARD_COUNTERS + FAILURE_COUNTERS, 0)
        counters["rows"] = len(responses)
        self.last_failure = None
        failure: Exception | None = None
        try:
            res = self._call(responses, answers, context, self.batch_timeout_s)
            _check_rows(res, len(responses))
            res = _flag_unscored(res)
        except Exception as exc:
            failure = exc
        if failure is not None:
            self._log_once(
                "batch",
                "%s failed on a batch of %d rows (%s); rescoring row by row, each within %ss (logged once)",
                self.name,
                len(responses),
                _describe(failure),
                self.timeout_s,
            )
            res = self._row_by_row(responses, answers, context, counters)
        return self._sanitise(res, counters)

    def _row_by_row(
        self, responses: list[str], answers: list[str], context: dict[str, Any], counters: dict[str, int]
    ) -> RewardResult:
        scores, correct, formatted, failed = [], [], [], []
        own: dict[str, int] = {}
        # A reward that hangs on every row (or every other one) must not cost rows x timeout_s: see the docstring.
        deadline = time.monotonic() + self.batch_timeout_s + self.hung_after * self.timeout_s
        hung = 0  # row timeouts in a row
        for i, (response, answer) in enumerate(zip(responses, answers)):
            left = deadline - time.monotonic()
            if hung >= self.hung_after or left <= 0:
                rest = len(responses) - i
                why = f"{hung} rows in a row timed out" if hung >= self.hung_after else "the batch's time is up"
                counters["timeouts"] += rest
                counters["failed_timeouts"] += rest
                self._note(f"row {i}: not tried ({why})")
                self._log_once(
                    "gave_up",
                    "%s: %s; the remaining %d row(s) of the batch are not tried: scored %s, counted in "
                    "reward/timeouts (logged once)",
                    self.name,
                    why,
                    rest,
                    self.error_score,
                )
                scores += [self.error_score] * rest
                correct += [0.0] * rest
                formatted += [0.0] * rest
                failed += [True] * rest
                break
            try:
                row = {k: None if v is None else [v[i]] for k, v in context.items()}
                one = self._call([response], [answer], row, min(self.timeout_s, left))
                _check_rows(one, 1)
                one = _flag_unscored(one)
                hung = 0
                failed.append(bool(one.failed[0]) if one.failed else False)
            except CallTimeout:
                hung += 1
                counters["timeouts"] += 1
                counters["failed_timeouts"] += 1
                self._note(f"row {i}: no answer within {min(self.timeout_s, left):.3g}s")
                self._log_once(
                    "timeout",
                    "%s did not score row %d within %ss: cut off, scored %s, counted in reward/timeouts (logged once)",
                    self.name,
                    i,
                    self.timeout_s,
                    self.error_score,
                )
                one = _constant(self.error_score)
                failed.append(True)
            except Exception as exc:  # raised, died, or a malformed result: the row fails, the batch goes on
                hung = 0
                counters["errors"] += 1
                counters["failed_errors"] += 1
                self._note(f"row {i}: {_describe(exc)}")
                self._log_once(
                    "error",
                    "%s failed on row %d: %s; scored %s, counted in reward/errors (logged once)%s",
                    self.name,
                    i,
                    _describe(exc),
                    self.error_score,
                    f"\n{exc.details}" if isinstance(exc, ChildError) and exc.details else "",
                    exc_info=not isinstance(exc, ChildError),
                )
                one = _constant(self.error_score)
                failed.append(True)
            scores += one.scores
            correct += one.correct
            formatted += one.formatted
            for k, v in one.counters.items():
                own[k] = own.get(k, 0) + v
        return RewardResult(scores=scores, correct=correct, formatted=formatted, counters=own, failed=failed)

    def _sanitise(self, res: RewardResult, counters: dict[str, int]) -> RewardResult:
        flags = list(res.failed) if res.failed is not None else [False] * len(res.scores)
        scores, correct, formatted, failed = [], [], [], []
        for i, (s, c, f) in enumerate(zip(res.scores, res.correct, res.formatted)):
            bad = _invalid_field(s, c, f)
            # Only the invalid grades become 0: a valid one is kept beside the failed flag, which the accuracy reads.
            correct.append(_grade(c) or 0.0)
            formatted.append(_grade(f) or 0.0)
            if bad is None:
                scores.append(float(s))
                failed.append(bool(flags[i]))
                continue
            field, value, kind = bad
            what = repr(value) if field == "score" else f"{field}={value!r}"
            counters[kind] += 1
            counters[f"failed_{kind}"] += 1
            self._note(f"row {i}: the reward returned {what}")
            self._log_once(
                kind if field == "score" else f"{kind} {field}",
                "%s returned %s for row %d: scored %s, counted in reward/%s (logged once)",
                self.name,
                what,
                i,
                self.error_score,
                kind,
            )
            scores.append(self.error_score)
            failed.append(True)
        # Every row the guard replaced is flagged; the other flagged rows are the reward's own (module docstring).
        replaced = counters["failed_errors"] + counters["failed_timeouts"] + counters["failed_nonfinite"]
        counters["failed_rows"] = sum(failed)
        counters["failed_unscored"] = counters["failed_rows"] - replaced
        if counters["failed_unscored"]:
            n = counters["failed_unscored"]
            self._note(f"{self.name} could not score {n} of {len(scores)} rows itself (see its counters)")
        # FAILURE_COUNTERS are the guard's alone: a reward's own counter of the same name is dropped.
        merged = {k: v for k, v in res.counters.items() if k not in FAILURE_COUNTERS}
        for k, v in counters.items():
            merged[k] = merged.get(k, 0) + v
        return RewardResult(
            scores=scores,
            correct=correct,
            formatted=formatted,
            counters=merged,
            failed=failed,  # per row: the score is error_score (or the reward's fallback)
        )

    def _note(self, failure: str) -> None:
        if self.last_failure is None:
            self.last_failure = failure

    def _log_once(self, kind: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args, exc_info=exc_info)

    def close(self) -> None:
        """Stop the child process (if any)."""
        if self._child is not None:
            self._child.close()


def _flag_unscored(res: RewardResult) -> RewardResult:
    """`res` with its `failed` flags and its `unscored` counter in agreement (module docstring): a count beyond the
    flags flags the unflagged rows when it covers them all; a count of some of them is a ValueError (which rows is
    not known: the caller rescores row by row, where it is). The counter is raised to the flags' count."""
    n = len(res.scores)
    flags = [bool(f) for f in res.failed] if res.failed is not None else [False] * n
    count = max(0, int(res.counters.get(UNSCORED, 0) or 0))  # not a number: ValueError/TypeError, a malformed result
    flagged = sum(flags)
    unflagged = n - flagged
    if count > flagged and count - flagged < unflagged:
        raise ValueError(
            f"the reward counts {count} rows {UNSCORED!r} but flags {flagged} in RewardResult.failed: which "
            f"{count - flagged} of the other {unflagged} rows is not known"
        )
    if count > flagged:  # every unflagged row is one the reward could not score
        flags = [True] * n
    counters = res.counters if sum(flags) == count else {**res.counters, UNSCORED: sum(flags)}
    return dataclasses.replace(res, failed=flags if any(flags) else res.failed, counters=counters)


def budget_within(timeout: float) -> float:
    """The time budget a reward is given for a call cut off after `timeout` seconds: a margin for the reply's
    return (10 %, at most 5 s)."""
    return max(0.05, timeout - min(5.0, 0.1 * timeout))


def all_rows_failed(counters: Mapping[str, float]) -> bool:
    """Whether every row of a call (or of a step's summed calls) had its score replaced: the reward raised, hung or
    returned NaN/inf on all of them, so the batch carries no learning signal. False for an empty batch."""
    rows = counters.get("rows", 0)
    return rows > 0 and counters.get("failed_rows", 0) >= rows


class RewardFailureError(RuntimeError):
    """The reward failed on every row for `pipeline.max_reward_failure_steps` steps in a row: the run stops."""


class RewardFailureBudget:
    """Stops a run whose reward keeps failing on every row, and totals reward failures for the run summary.

    The loop calls `update(step, scored.meta["reward_counters"], scored.meta.get("reward_failure"))` once per
    training step (not for evaluation), `summary()` for the run summary, and `state_dict()` / `load_state_dict()`
    with its checkpoint. `max_steps=0` never stops (the totals are still kept).
    """

    def __init__(self, max_steps: int = 3) -> None:
        if max_steps < 0:
            raise ValueError(f"pipeline.max_reward_failure_steps={max_steps} must be >= 0 (0: never stop)")
        self.max_steps = max_steps
        self.streak = 0  # steps in a row whose rows all failed
        self.totals = dict.fromkeys(FAILURE_COUNTERS, 0)
        self.failed_steps = 0

    def update(self, step: int, counters: Mapping[str, float], failure: str | None = None) -> None:
        """Count step `step`'s reward counters; raise `RewardFailureError` when the budget is spent.

        Args:
            step: the training step (named in the message).
            counters: the step's summed reward counters (FAILURE_COUNTERS; other keys are ignored).
            failure: one line describing a failure of the step, e.g. the first error (quoted in the message).
        """
        for k in FAILURE_COUNTERS:
            self.totals[k] += int(counters.get(k, 0))
        if not all_rows_failed(counters):
            self.streak = 0
            return
        self.streak += 1
        self.failed_steps += 1
        if self.max_steps and self.streak >= self.max_steps:
            rows = int(counters.get("rows", 0))
            causes = ", ".join(
                f"{int(counters.get(f'failed_{k}', 0))} {label}"
                for k, label in (
                    ("errors", "raised"),
                    ("timeouts", "timed out"),
                    ("nonfinite", "were NaN/inf"),
                    ("unscored", "unscored by the reward itself"),
                )
            )
            raise RewardFailureError(
                f"step {step}: the reward failed on every row for {self.streak} steps in a row "
                f"(pipeline.max_reward_failure_steps={self.max_steps}); the last step's {rows} rows: {causes}"
                + (f"; first failure: {failure}" if failure else "")
                + ". Nothing was learned from them: fix the reward (run it on a few rows by hand), or raise "
                "pipeline.reward_timeout_s / pipeline.reward_batch_timeout_s if it is only slow"
            )

    def summary(self) -> dict[str, int]:
        """Run totals: `reward_rows`, `reward_failed_rows`, `reward_failed_errors`, `reward_failed_timeouts`,
        `reward_failed_nonfinite`, `reward_failed_unscored`, and `reward_all_failed_steps` (steps whose rows all
        failed)."""
        return {f"reward_{k}": v for k, v in self.totals.items()} | {"reward_all_failed_steps": self.failed_steps}

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "totals": dict(self.totals), "failed_steps": self.failed_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
        self.totals = {k: int(state.get("totals", {}).get(k, 0)) for k in FAILURE_COUNTERS}
        self.failed_steps = int(state.get("failed_steps", 0))


def _check_rows(res: Any, n: int) -> None:
    if not isinstance(res, RewardResult):
        raise TypeError(f"the reward returned {type(res).__name__}, not a RewardResult")
    if len(res.scores) != n:
        raise ValueError(f"the reward returned {len(res.scores)} scores for {n} responses")


def _constant(score: float) -> RewardResult:
    return RewardResult(scores=[score], correct=[0.0], formatted=[0.0])


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(float(x))
    except (TypeError, ValueError, OverflowError):
        return False


def _grade(x: Any) -> float | None:
    """A `correct`/`formatted` value as 0.0 or 1.0 (None is 0.0: no claim); None when it is no grade."""
    if x is None:
        return 0.0
    if isinstance(x, (str, bytes)) or not _finite(x):  # float("1") parses, but a string is no grade
        return None
    value = float(x)
    return value if value in (0.0, 1.0) else None


def _invalid_field(score: Any, correct: Any, formatted: Any) -> tuple[str, Any, str] | None:
    """The first invalid field of a row's result: (its name, its value, the counter it fails the row under)."""
    if not _finite(score):
        return "score", score, "nonfinite"
    for field, value in (("correct", correct), ("formatted", formatted)):
        if _grade(value) is None:
            nonfinite = not isinstance(value, (str, bytes)) and _is_number(value) and not _finite(value)
            return field, value, "nonfinite" if nonfinite else "errors"
    return None


def _is_number(x: Any) -> bool:
    try:
        float(x)
    except (TypeError, ValueError, OverflowError):
        return False
    return True


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (ChildError, ChildDied, CallTimeout)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
