"""Estimators of `roll-eval`: pass@k, majority vote and per-group summaries of sampled responses. Pure Python.

Contract:
- `pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code"): the probability that at least one of k responses drawn without replacement from the n sampled ones is
  correct, given c of the n are, `1 - C(n-c, k) / C(n, k)`. Computed as the product `prod_{i=n-c+1}^{n} (1 - k/i)`,
  which never forms the huge binomials (exact for n in the thousands). Averaged over problems it is an unbiased
  estimate of the model's pass@k. `k > n` is an error (there are not k responses to draw).
- `majority_vote(answers, same_answer=None)`: the most frequent extracted answer among a problem's samples. Samples
  without an extracted answer (None) do not vote (a problem where none has one scores 0 in maj@n). Ties go to the
  answer that appears first in sample order (the lowest sample index), so the answer returned depends only on the
  samples, never on hashing or dict order; maj@n does not score a tie by that answer (see `summarize`: which tied
  answer was sampled first is chance). Answers are keyed after stripping surrounding whitespace; the task's
  extractor gives one spelling per value where it can (the math reward's: `1/2`, `0.5`, `\\dfrac12` all `0.5`), so
  most equal answers already share a key.
- Answer equivalence (`vote_keys`): what a key cannot tell apart (`\\frac{\\sqrt2}{2}` and `\\frac{1}{\\sqrt{2}}`,
  `x=2` and `2`) the task's grader can: `same_answer(first, other) -> bool` (the task's or reward's own, found by
  roll_core.evaluate next to `extract_answer`; the math reward's is its symbolic check) merges distinct keys into
  one vote. Cheap for n up to 64: first the keys, then pairwise checks only between distinct keys, each against one
  representative per group (the group's most frequent key, the earliest on ties), keys taken most frequent first
  (so `first` is the commoner spelling), and stopped as soon as no remaining key could change the winner (the
  leading group ahead of the second by more than the votes left to place: a clear majority checks nothing), and
  at most `MAX_CHECKS` checks per problem (the math reward's symbolic check takes 4-19 ms, measured, mostly in
  sympy's simplify; 64 distinct answers would need 2016 of them): past it the keys not yet placed keep their own
  vote (a warning says how many). A group's answer is its representative. A check that raises counts as
  "different" (a warning says how often). Within the budget the result is the one of placing every key (the
  brute-force grouping): the early stop changes no winner, and a key it left unplaced still counts as the
  winner's when grading it (`summarize`'s maj@n) if placing it would have put it there.
- `summarize(rows, ks, same_answer=None)`: every metric of a list of sample records (one per sampled response, as
  `samples.jsonl` holds them): accuracy (each problem's mean correctness, averaged over problems: pass@1, whatever
  the problems' sample counts; never pooled over samples, which would weigh a problem by how many samples it kept),
  pass@k (per problem, then averaged; None for a k above the smallest sample count of a problem: computed over only
  the problems with k samples it would be another problem set's number), maj@n (the mean over problems of whether
  the majority answer is correct; a problem whose vote ties between several answers scores the fraction of the tied
  answers that are correct, the expected score of a tie broken at random, and is counted in `maj_ties`: a tie
  between a right and a wrong answer counts 1/2, never 1 or 0 by which was sampled first; None when no sample
  carried an extracted answer field), and, as means over samples (pooled: rates of responses, not of problems), the
  response length in tokens, truncation rate (finish reason "length"), format rate and reward; and the counts.
  `failed` counts the samples that were never graded (a row's `failed`: "reward" when the reward could not score it,
  "engine" when the engine refused to finish it): they count as wrong in accuracy and pass@k, as in a training run's
  eval/accuracy, and `failed` says by how much that lowers them. A failed sample's extracted answer still votes, but
  whether the majority answer is right is read from the graded samples giving it (none: wrong), never from a
  failed one, 0 whatever it answered: the majority of their grades, half right where they split evenly. Samples
  of one answer group can disagree (a math-verify timeout grading one copy of a right answer wrong; a `same_answer`
  merging answers the grader tells apart): the grade of whichever was sampled first would make maj@n 1 or 0 by
  sampling order; `maj_split_grades` counts the problems where a scored group's grades disagreed (a warning says
  so). `failure(refused, unscored)` gives a row's `failed` field and `counted_correct(row)` its correctness in
  these metrics; a training run's eval/accuracy counts with both. `breakdown(rows, key, ks, same_answer=None)` is
  `summarize` per value of a row field (domain, difficulty); `problem_scores` gives each problem's own scores, the
  values `summarize` averages (what roll_core.eval_paired pairs between models).
- Uncertainty: `summarize` gives `accuracy_stderr`, `pass@k_stderr` and `maj_stderr`, the standard error of each
  mean over the P problems, `std_error(x) = s / sqrt(P)` with `s = sqrt(sum((x_i - mean)^2) / (P - 1))` the sample
  standard deviation of the per-problem scores x_i (a problem's mean correctness, its pass@k, its majority vote's
  0/1, or its share of right answers after a tie). Per problem, not per response: a problem's n responses are not
  independent draws from the task (an easy problem makes all of them right), and the held-out problems are the
  sample that decides how far the number can move. For 0/1 scores it is `sqrt(p (1 - p) / (P - 1))` (scores 1, 0,
  1, 1: 0.75 +- 0.25). None with one problem. Problems with different sample counts are allowed (a warning says how
  many fall short of the largest count). A graded sample's `correct` must be 0 or 1 (the RewardResult contract:
  pass@k reads it as pass/fail, accuracy would average it): one that is no grade (`is_grade`: partial credit 0.5,
  NaN) is a failed sample (`graded_row`: `failed` "reward", `correct` 0), counted in `failed` and in
  `invalid_correct` (a warning says so), as a training run's eval/accuracy counts it and the reward guard flags it;
  roll-eval refused the whole evaluation for one such row, so the same rows gave no number where training gave one.
  `rate_stderr(rate, n)` is the same standard error for a rate of n 0/1 outcomes kept only as the rate (an agentic
  evaluation's success rate over its n held-out episodes, one per seed: `success_rate_stderr`, `accuracy_stderr`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

#: The value a breakdown gives rows without the field (a benchmark row without `difficulty` / `level`).
UNKNOWN = "unknown"
#: A task's answer equivalence for majority vote: whether `other` is the same answer as `first` (as its grader would
#: grade `other` against a truth of `first`). Takes two vote keys (stripped extracted answers).
SameAnswer = Callable[[str, str], bool]
#: Most `same_answer` checks per problem (module docstring): the 16 most voted distinct answers are checked pairwise
#: in full (120 checks), a few seconds of symbolic checks at worst.
MAX_CHECKS = 128


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct out of `n` samples: 1 - C(n-c, k) / C(n, k)."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k takes integers, got n={n!r}, c={c!r}, k={k!r}")
    if n < 1 or k < 1:
        raise ValueError(f"pass@k needs n >= 1 samples and k >= 1, got n={n}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}: sample more or lower k")
    if not 0 <= c <= n:
        raise ValueError(f"correct count c={c} must be within [0, n={n}]")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) as a product of c factors, each in (0, 1)
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """Mean pass@k over problems given as (n, c) pairs (each problem may have its own n)."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("mean_pass_at_k of no problems")
    return sum(values) / len(values)


def majority_vote(answers: Sequence[str | None], same_answer: SameAnswer | None = None) -> tuple[str | None, int]:
    """(the majority answer, the index of its first sample); (None, -1) when no sample has an answer. Ties: the
    answer seen first wins; `same_answer` merges equal answers (see the module docstring). The index is the first
    sample in the winner's group, an equal answer the early stop left unplaced included (it gave the first sample
    of the winner's own spelling: ["A", "a", "a"] with a case-blind check answered index 1, not 0)."""
    keys = [_vote_key(a) for a in answers]
    groups = _Groups(keys, same_answer, MAX_CHECKS)
    answer, _ = _majority(groups.votes(keys))
    if answer is None:
        return None, -1
    return answer, next(i for i, k in enumerate(keys) if k is not None and groups.in_group(k, answer))


def vote_keys(
    answers: Sequence[str | None], same_answer: SameAnswer | None = None, max_checks: int = MAX_CHECKS
) -> list[str | None]:
    """The answer each sample votes for: its stripped answer, or with `same_answer` the representative of the group
    of equal answers it belongs to, found with at most `max_checks` calls of `same_answer` (module docstring:
    "Answer equivalence"); None: no vote."""
    keys = [_vote_key(a) for a in answers]
    return _Groups(keys, same_answer, max_checks).votes(keys)


class _Groups:
    """The groups of equal answers among one problem's vote keys (module docstring: "Answer equivalence").

    `group` maps each placed key to its group's representative; `size` holds each group's votes, in the order the
    groups were opened (the order a key is checked against them). `stopped` holds the keys the early stop left
    unplaced: they cannot change the winner, but one may belong to its group (`in_group`)."""

    def __init__(self, keys: Sequence[str | None], same_answer: SameAnswer | None, max_checks: int) -> None:
        self.same, self.max_checks = same_answer, max_checks
        self.checks = self.failures = 0
        self.group: dict[str, str] = {}
        self.size: dict[str, int] = {}
        self.stopped: set[str] = set()
        self._member: dict[tuple[str, str], bool] = {}
        counts, first = _tally(keys)
        if same_answer is None or len(counts) < 2:
            self.group = {k: k for k in counts}
            return
        order = sorted(counts, key=lambda k: (-counts[k], first[k]))  # most frequent first, then earliest
        left = sum(counts.values())  # votes not yet placed in a group
        for at, key in enumerate(order):
            top = [*sorted(self.size.values(), reverse=True)[:2], 0, 0]
            if top[0] > top[1] + left:  # nothing left can overtake the leader: the rest keep their own keys
                self.stopped = set(order[at:])
                break
            # this key's checks would pass the budget: it and the rest stay apart
            if self.checks + len(self.size) > max_checks:
                log.warning(
                    "majority vote: %d distinct answers need more than %d equivalence checks; the %d least voted "
                    "keep their own vote",
                    len(order),
                    max_checks,
                    len(order) - len(self.group),
                )
                break
            left -= counts[key]
            for rep in self.size:  # representatives in the order their groups were opened (most frequent first)
                if self._check(rep, key):
                    self.group[key] = rep
                    self.size[rep] += counts[key]
                    break
            else:
                self.group[key], self.size[key] = key, counts[key]  # a group of its own
        self._warn()

    def _check(self, rep: str, key: str) -> bool:
        """`same_answer(rep, key)`, counted; one that raises is "different" (counted, logged)."""
        self.checks += 1
        try:
            return bool(self.same(rep, key))  # type: ignore[misc]
        except Exception as exc:  # a task's checker choking on an answer: counted as different, logged
            self.failures += 1
            log.debug("same_answer(%r, %r) raised: %s", rep, key, exc)
            return False

    def _warn(self) -> None:
        if self.failures:
            what = "majority vote: the answer check raised %d time(s); those answers were kept apart"
            log.warning(what, self.failures)
            self.failures = 0

    def votes(self, keys: Sequence[str | None]) -> list[str | None]:
        """The vote of each key: its group's representative, or itself where it was not placed (None: no vote)."""
        return [None if k is None else self.group.get(k, k) for k in keys]

    def in_group(self, key: str, rep: str) -> bool:
        """Whether `key` belongs to `rep`'s group as placing every key would have put it: a placed key by its group;
        a key the early stop left unplaced by the checks its placement would have made, against the groups in the
        order they were opened, up to `rep`'s (a group opened later never had an earlier claim), within the budget
        (past it: not a member, as a key past the budget keeps its own vote)."""
        if key not in self.stopped:
            return self.group.get(key, key) == rep
        if (key, rep) not in self._member:
            member = False
            for opened in self.size:
                if self.checks >= self.max_checks:
                    log.warning("majority vote: the equivalence check budget (%d) is spent", self.max_checks)
                    break
                if self._check(opened, key):
                    member = opened == rep  # it joins the first group whose representative equals it
                    break
                if opened == rep:
                    break
            self._warn()
            self._member[(key, rep)] = member
        return self._member[(key, rep)]


def _tally(keys: Sequence[str | None]) -> tuple[dict[str, int], dict[str, int]]:
    """(votes per key, index of each key's first sample), None keys left out."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
            first.setdefault(key, i)
    return counts, first


def _majority(votes: Sequence[str | None]) -> tuple[str | None, int]:
    """(the most voted answer, its first sample's index) of `vote_keys`' output; ties: the earliest first sample."""
    counts, first = _tally(votes)
    if not counts:
        return None, -1
    best = max(counts, key=lambda a: (counts[a], -first[a]))  # most votes, then earliest first appearance
    return best, first[best]


def std_error(values: Sequence[float]) -> float | None:
    """Standard error of the mean of `values`: s / sqrt(m), s the sample standard deviation (divisor m - 1) of the
    m values; None for fewer than two (no spread to estimate)."""
    m = len(values)
    if m < 2:
        return None
    mean = sum(values) / m
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (m - 1) / m)


def rate_stderr(rate: float, n: int) -> float | None:
    """`std_error` of n 0/1 outcomes of which a fraction `rate` are 1, from the rate alone: sqrt(rate (1 - rate) /
    (n - 1)) (the sample variance of such values is n rate (1 - rate) / (n - 1)); None for n < 2."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"a rate of 0/1 outcomes must be within [0, 1], got {rate}")
    if n < 2:
        return None
    return math.sqrt(rate * (1.0 - rate) / (n - 1))


def _vote_key(answer: str | None) -> str | None:
    """The key an extracted answer votes under (None: no vote)."""
    if answer is None:
        return None
    return str(answer).strip() or None


def parse_ks(text: str | Sequence[int] | None, n: int) -> list[int]:
    """The k values of pass@k: `text` ("1,4,8") or, when None, 1, 2, 4, ... up to n and n itself; each must be
    within [1, n] (k > n: there are not k samples to draw)."""
    if text is None:
        ks, k = [], 1
        while k < n:
            ks.append(k)
            k *= 2
        return [*ks, n]
    if isinstance(text, str):
        try:
            ks = [int(p) for p in text.replace(" ", "").split(",") if p]
        except ValueError:
            raise ValueError(f"--k {text!r}: expected comma-separated integers such as 1,4,8") from None
    else:
        ks = [int(k) for k in text]
    if not ks:
        raise ValueError("--k names no k")
    bad = [k for k in ks if k < 1 or k > n]
    if bad:
        raise ValueError(
            f"--k {','.join(map(str, ks))}: pass@k needs 1 <= k <= n samples per problem (--n {n}); "
            f"{','.join(map(str, bad))} is out of range: raise --n or drop it"
        )
    return sorted(set(ks))


def _group(rows: Sequence[Mapping[str, Any]]) -> dict[Any, list[Mapping[str, Any]]]:
    """Rows by problem (the `index` field: the problem's position in the evaluated list), in sample order."""
    problems: dict[Any, list[Mapping[str, Any]]] = {}
    for r in rows:
        problems.setdefault(r["index"], []).append(r)
    for samples in problems.values():
        samples.sort(key=lambda r: r["sample"])
    return problems


def failure(refused: bool, unscored: bool) -> str | None:
    """A sample's `failed` field: "engine" when the engine refused to finish it, "reward" when the reward could not
    score it, None when it was graded. roll-eval's records and a training run's eval/accuracy both take it from
    here, so that they count the same samples as failed."""
    return "engine" if refused else "reward" if unscored else None


def counted_correct(row: Mapping[str, Any]) -> float:
    """A sample's correctness in the metrics: 0 for a failed one whatever its `correct` says (a row the engine
    refused can hold a cut response the reward graded right; a reward failure's grade is not one). roll-eval's
    accuracy and pass@k and a training run's eval/accuracy (roll_core.pipelines.rollout.evaluate) count with it."""
    return 0.0 if row.get("failed") else float(row["correct"])


def _majority_hit(samples: Sequence[Mapping[str, Any]], same_answer: SameAnswer | None) -> tuple[float, bool, bool]:
    """(one problem's maj@n score, whether its vote tied, whether a scored group's grades split). The score is the
    winning group's grade (`_group_grade`: the majority of its graded samples' grades, module docstring). Several
    answers tied at the most votes: the fraction of them that are right (a tie broken at random), not the grade of
    the one sampled first. A sample the early stop of the vote left unplaced still counts as the winner's when
    placing it would have put it there (`_Groups.in_group`): its own key is no evidence that it answered otherwise
    ('b' and 'B' equal, 'b' graded right, both 'B' rows failed: right, not wrong). The early stop only fires once one
    group leads every other outright, so a tie never involves an unplaced answer."""
    keys = [_vote_key(r.get("extracted")) for r in samples]
    groups = _Groups(keys, same_answer, MAX_CHECKS)
    counts, _ = _tally(groups.votes(keys))
    if not counts:  # no sample answered: wrong
        return 0.0, False, False
    most = max(counts.values())
    tied = [answer for answer, votes in counts.items() if votes == most]
    graded = [_group_grade(samples, keys, groups, answer) for answer in tied]
    grades = [grade for grade, _ in graded]
    return sum(grades) / len(grades), len(tied) > 1, any(split for _, split in graded)


def _group_grade(
    samples: Sequence[Mapping[str, Any]], keys: Sequence[str | None], groups: _Groups, answer: str
) -> tuple[float, bool]:
    """(whether the answer group `answer` is right, whether its grades split). Its graded samples (failed ones give
    no grade) vote: 1.0 when most are right, 0.0 when most are wrong, 0.5 when they split evenly (the fraction
    right, as a tie between answers scores), 0.0 when every sample giving it failed; never the grade of whichever
    was sampled first (module docstring)."""
    right = wrong = 0
    for row, key in zip(samples, keys):
        if key is not None and not row.get("failed") and groups.in_group(key, answer):
            if float(row["correct"]) > 0:
                right += 1
            else:
                wrong += 1
    split = right > 0 and wrong > 0
    if right == wrong:
        return (0.5 if right else 0.0), split
    return float(right > wrong), split


def is_grade(correct: Any) -> bool:
    """Whether a sample's `correct` is a grade: 0 or 1 (a bool included). 0.5, NaN or text is none (nor is None
    here: the reward guard writes a None grade as 0 before any row holds it): roll-eval's `summarize` (`graded_row`)
    and a training run's eval/accuracy (roll_core.pipelines.rollout.evaluate) count such a graded sample as a failed
    one, as roll's reward guard (roll_core.cluster.reward_guard) flags it."""
    if isinstance(correct, (str, bytes)) or correct is None:
        return False
    try:
        return float(correct) in (0.0, 1.0)
    except (TypeError, ValueError):
        return False


def graded_row(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """`row` as the metrics count it: a graded row (no `failed`) whose `correct` is no grade (`is_grade`) becomes a
    failed one (`failed` "reward", `correct` 0, `invalid_correct` True), as a training run's eval/accuracy
    (roll_core.pipelines.rollout.evaluate: `invalid_correct`) counts it; any other row as it is."""
    if row.get("failed") or is_grade(row["correct"]):
        return row
    return {**row, "failed": failure(False, True), "correct": 0.0, "invalid_correct": True}


def summarize(
    rows: Sequence[Mapping[str, Any]], ks: Sequence[int], same_answer: SameAnswer | None = None, *, warn: bool = True
) -> dict[str, Any]:
    """Every metric of `rows` (sample records: index, sample, correct, reward, length, finish_reason, formatted,
    and `extracted` when the task can extract answers, `failed` when a row was never graded); `same_answer`: the
    task's answer equivalence for maj@n; see the module docstring. pass@k for a k above a problem's sample count is
    left out for that group. `warn`: log the rows whose `correct` is no grade (`breakdown`, summing up the same
    rows again per group, does not)."""
    if not rows:
        raise ValueError("no samples to summarize")
    rows = [graded_row(r) for r in rows]  # a `correct` that is no grade: a failed row (module docstring)
    invalid = sum(bool(r.get("invalid_correct")) for r in rows)
    if invalid and warn:
        log.warning(
            "%d of %d samples have a correct that is not 0 or 1 (the reward's grade must be 0/1): counted as "
            "failed samples (wrong), in `invalid_correct`",
            invalid,
            len(rows),
        )
    problems = _group(rows)
    counts = [(len(s), int(sum(counted_correct(r) > 0 for r in s))) for s in problems.values()]
    n = len(rows)
    per_problem = [sum(counted_correct(r) for r in s) / len(s) for s in problems.values()]
    largest = max(c[0] for c in counts)
    short = sum(c[0] < largest for c in counts)
    if short:
        log.warning(
            "%d of %d problems have fewer than %d samples: accuracy weighs every problem equally, pass@k above a "
            "problem's count is not reported",
            short,
            len(counts),
            largest,
        )
    out: dict[str, Any] = {
        "problems": len(problems),
        "samples": n,
        "accuracy": sum(per_problem) / len(per_problem),  # per problem, then averaged (module docstring)
        "accuracy_stderr": std_error(per_problem),  # over problems (module docstring)
        "reward": sum(float(r["reward"]) for r in rows) / n,
        "length_mean": sum(float(r["length"]) for r in rows) / n,
        "truncation_rate": sum(r["finish_reason"] == "length" for r in rows) / n,
        "format_rate": sum(float(r["formatted"]) for r in rows) / n,
        "failed": sum(bool(r.get("failed")) for r in rows),
        "invalid_correct": invalid,  # graded samples whose correct was no grade, counted in `failed` (docstring)
    }
    smallest = min(c[0] for c in counts)
    for k in ks:
        values = [pass_at_k(size, c, k) for size, c in counts] if k <= smallest else None
        out[f"pass@{k}"] = sum(values) / len(values) if values else None
        out[f"pass@{k}_stderr"] = std_error(values) if values else None
    if any("extracted" in r for r in rows):
        hits, ties, splits = [], 0, 0  # per problem: 1 when its majority answer is right (a tie: the fraction right)
        for samples in problems.values():
            hit, tied, split = _majority_hit(samples, same_answer)
            hits.append(hit)
            ties += tied
            splits += split
        if splits:
            log.warning(
                "maj@n: in %d of %d problems the samples giving a scored answer were graded both right and wrong "
                "(a grader timeout?): the group counts by the majority of its grades",
                splits,
                len(problems),
            )
        out["maj"] = sum(hits) / len(problems)
        out["maj_stderr"] = std_error(hits)
        out["maj_ties"] = ties
        out["maj_split_grades"] = splits
    else:
        out["maj"] = out["maj_stderr"] = out["maj_ties"] = out["maj_split_grades"] = None
    return out


def problem_scores(
    rows: Sequence[Mapping[str, Any]], ks: Sequence[int], same_answer: SameAnswer | None = None
) -> dict[Any, dict[str, float | None]]:
    """Each problem's own scores, keyed by its `index`: the values `summarize` averages over problems, counted as it
    counts them (`graded_row`, `counted_correct`): "accuracy" (its mean correctness), "pass@k" per k (None for a k
    above its sample count) and "maj" (its majority vote's score, a tie's share of right answers; None when no row
    carries an extracted answer field). What paired differences between models read (roll_core.eval_paired)."""
    rows = [graded_row(r) for r in rows]
    votes = any("extracted" in r for r in rows)
    out: dict[Any, dict[str, float | None]] = {}
    for index, samples in _group(rows).items():
        size, right = len(samples), sum(counted_correct(r) > 0 for r in samples)
        scores: dict[str, float | None] = {"accuracy": sum(counted_correct(r) for r in samples) / size}
        scores.update({f"pass@{k}": pass_at_k(size, right, k) if k <= size else None for k in ks})
        scores["maj"] = _majority_hit(samples, same_answer)[0] if votes else None
        out[index] = scores
    return out


def breakdown(
    rows: Sequence[Mapping[str, Any]], key: str, ks: Sequence[int], same_answer: SameAnswer | None = None
) -> dict[str, dict[str, Any]]:
    """`summarize` per value of the rows' `key` field (missing or null: UNKNOWN), values in first-seen order."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        value = r.get(key)
        groups.setdefault(UNKNOWN if value is None else str(value), []).append(r)
    return {value: summarize(g, ks, same_answer, warn=False) for value, g in groups.items()}


def memoized(same_answer: SameAnswer) -> SameAnswer:
    """`same_answer` remembering its results, so that `summarize` and each `breakdown` of one evaluation check a
    pair of answers once (the math reward's symbolic check takes tens of milliseconds)."""
    seen: dict[tuple[str, str], bool] = {}

    def check(first: str, other: str) -> bool:
        if (first, other) not in seen:
            seen[(first, other)] = bool(same_answer(first, other))
        return seen[(first, other)]

    return check


def difficulty_of(metadata: Mapping[str, Any] | None) -> str:
    """A benchmark row's difficulty: its metadata's `difficulty`, else `level`, else UNKNOWN."""
    for key in ("difficulty", "level"):
        value = (metadata or {}).get(key)
        if value is not None and str(value).strip():
            return str(value).strip()
    return UNKNOWN
