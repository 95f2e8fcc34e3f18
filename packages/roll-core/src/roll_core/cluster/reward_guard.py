"""A reward that never ends the run: errors, NaN/inf scores and hangs become counted rows scoring a fixed value.

`GuardedReward(reward, ...)` wraps any `roll_core.interfaces.Reward` for the reward role. Its `score()`:
1. scores the whole batch in one call (the reward sees the batch it was written for), within `batch_timeout_s`;
2. if that call raised, hung, died or returned the wrong number of rows, rescores row by row, each row within
   `timeout_s`: a row that raises scores `error_score` and counts in `errors`, a row that hangs is cut off, scores
   `error_score` and counts in `timeouts`; the other rows keep their own scores;
3. replaces a NaN/inf score with `error_score` (counted in `nonfinite`), and NaN/inf `correct`/`formatted` with 0.
The counters are added to the reward's own (`RewardResult.counters`), which the pipeline logs as `reward/<name>`
(a math reward's own `errors`/`timeouts` for malformed answers add to the same keys: rows whose scoring failed).
The first failure of each kind is logged once per worker with its traceback; later ones are only counted.

Isolation: `process` (default) runs the reward in a forked child (roll_core.isolation.ForkedWorker), so a hang is
cut off by killing the child, which is forked again for the next call; `inline` runs it in the worker's own
thread: errors and NaN are handled, but a hang cannot be cut off (for rewards that need a CUDA context created
before a fork, such as a reward model on a GPU).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from roll_core.interfaces import Reward, RewardResult
from roll_core.isolation import CallTimeout, ChildDied, ChildError, ForkedWorker

log = logging.getLogger(__name__)

ISOLATIONS = ("process", "inline")
#: Counters every guarded result carries (0 when nothing failed), so the metrics are continuous.
GUARD_COUNTERS = ("errors", "timeouts", "nonfinite")


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
    ) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"reward isolation {isolation!r} is not one of {', '.join(ISOLATIONS)}")
        if timeout_s <= 0 or batch_timeout_s <= 0:
            raise ValueError(f"reward timeouts must be > 0, got {timeout_s} (row) and {batch_timeout_s} (batch)")
        self.reward, self.name = reward, name
        self.timeout_s, self.batch_timeout_s, self.error_score = timeout_s, batch_timeout_s, error_score
        self._child = ForkedWorker(reward.score, name=name) if isolation == "process" else None
        self._logged: set[str] = set()

    def _call(self, responses: list[str], answers: list[str], timeout: float) -> RewardResult:
        if self._child is None:
            return self.reward.score(responses, answers)
        return self._child.call(responses, answers, timeout=timeout)

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        """Scores of every row; never raises for anything the wrapped reward does."""
        responses, answers = list(responses), list(answers)
        counters = dict.fromkeys(GUARD_COUNTERS, 0)
        failure: Exception | None = None
        try:
            res = self._call(responses, answers, self.batch_timeout_s)
            _check_rows(res, len(responses))
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
            res = self._row_by_row(responses, answers, counters)
        return self._sanitise(res, counters)

    def _row_by_row(self, responses: list[str], answers: list[str], counters: dict[str, int]) -> RewardResult:
        scores, correct, formatted = [], [], []
        own: dict[str, int] = {}
        for i, (response, answer) in enumerate(zip(responses, answers)):
            try:
                one = self._call([response], [answer], self.timeout_s)
                _check_rows(one, 1)
            except CallTimeout:
                counters["timeouts"] += 1
                self._log_once(
                    "timeout",
                    "%s did not score row %d within %ss: cut off, scored %s, counted in reward/timeouts (logged once)",
                    self.name,
                    i,
                    self.timeout_s,
                    self.error_score,
                )
                one = _constant(self.error_score)
            except Exception as exc:  # raised, died, or a malformed result: the row fails, the batch goes on
                counters["errors"] += 1
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
            scores += one.scores
            correct += one.correct
            formatted += one.formatted
            for k, v in one.counters.items():
                own[k] = own.get(k, 0) + v
        return RewardResult(scores=scores, correct=correct, formatted=formatted, counters=own)

    def _sanitise(self, res: RewardResult, counters: dict[str, int]) -> RewardResult:
        scores = []
        for i, s in enumerate(res.scores):
            if _finite(s):
                scores.append(float(s))
                continue
            counters["nonfinite"] += 1
            self._log_once(
                "nonfinite",
                "%s returned %r for row %d: scored %s, counted in reward/nonfinite (logged once)",
                self.name,
                s,
                i,
                self.error_score,
            )
            scores.append(self.error_score)
        merged = dict(res.counters)
        for k, v in counters.items():
            merged[k] = merged.get(k, 0) + v
        return RewardResult(
            scores=scores,
            correct=[float(c) if _finite(c) else 0.0 for c in res.correct],
            formatted=[float(f) if _finite(f) else 0.0 for f in res.formatted],
            counters=merged,
        )

    def _log_once(self, kind: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args, exc_info=exc_info)

    def close(self) -> None:
        """Stop the child process (if any)."""
        if self._child is not None:
            self._child.close()


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
    except (TypeError, ValueError):
        return False


def _describe(exc: BaseException) -> str:
    if isinstance(exc, (ChildError, ChildDied, CallTimeout)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
