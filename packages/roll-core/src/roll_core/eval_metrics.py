"""Estimators of `roll-eval`: pass@k, majority vote and per-group summaries of sampled responses. Pure Python.

Contract:
- `pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
  Code"): the probability that at least one of k responses drawn without replacement from the n sampled ones is
  correct, given c of the n are, `1 - C(n-c, k) / C(n, k)`. Computed as the product `prod_{i=n-c+1}^{n} (1 - k/i)`,
  which never forms the huge binomials (exact for n in the thousands). Averaged over problems it is an unbiased
  estimate of the model's pass@k. `k > n` is an error (there are not k responses to draw).
- `majority_vote(answers)`: the most frequent extracted answer among a problem's samples. Samples without an
  extracted answer (None) do not vote. Ties go to the answer that appears first in sample order (the lowest
  sample index), so the result depends only on the samples, never on hashing or dict order. Answers are compared
  after stripping surrounding whitespace; any further equivalence (1/2 vs 0.5) is the extractor's business.
- `summarize(rows, ks)`: every metric of a list of sample records (one per sampled response, as `samples.jsonl`
  holds them): accuracy (mean correctness over all samples; the unbiased pass@1 when every problem has the same
  number of samples, as roll-eval gives them, else pass@1 weighs problems equally and accuracy samples), pass@k,
  maj@n (the fraction of problems whose majority answer is correct; None when no sample carried an extracted
  answer field), mean response length in tokens, truncation rate (finish reason "length"), format rate, mean
  reward, and the counts. `failed` counts the samples that were never graded (a row's `failed`: "reward" when the
  reward could not score it, "engine" when the engine refused to finish it): they count as wrong in accuracy and
  pass@k, as in a training run's eval/accuracy, and `failed` says by how much that lowers them. A failed sample's
  extracted answer still votes, but whether the majority answer is right is read from a graded sample giving it
  (the first in sample order; none: wrong), not from its first sample, which may be a failed one, 0 whatever it
  answered.
  `breakdown(rows, key, ks)` is `summarize` per value of a row field (domain, difficulty).
- Uncertainty: `summarize` gives `accuracy_stderr`, `pass@k_stderr` and `maj_stderr`, the standard error of each
  mean over the P problems, `std_error(x) = s / sqrt(P)` with `s = sqrt(sum((x_i - mean)^2) / (P - 1))` the sample
  standard deviation of the per-problem scores x_i (a problem's mean correctness, its pass@k, its majority vote's
  0/1). Per problem, not per response: a problem's n responses are not independent draws from the task (an easy
  problem makes all of them right), and the held-out problems are the sample that decides how far the number can
  move. For 0/1 scores it is `sqrt(p (1 - p) / (P - 1))` (scores 1, 0, 1, 1: 0.75 +- 0.25). None with one problem.
  (When problems have different response counts, accuracy weighs responses and its standard error is pass@1's.)
  `rate_stderr(rate, n)` is the same standard error for a rate of n 0/1 outcomes kept only as the rate (an agentic
  evaluation's success rate over its n held-out episodes, one per seed: `success_rate_stderr`, `accuracy_stderr`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: The value a breakdown gives rows without the field (a benchmark row without `difficulty` / `level`).
UNKNOWN = "unknown"


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


def majority_vote(answers: Sequence[str | None]) -> tuple[str | None, int]:
    """(the majority answer, the index of its first sample); (None, -1) when no sample has an answer. Ties: the
    answer seen first wins (see the module docstring)."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        key = _vote_key(a)
        if key is None:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
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


def summarize(rows: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[str, Any]:
    """Every metric of `rows` (sample records: index, sample, correct, reward, length, finish_reason, formatted,
    and `extracted` when the task can extract answers, `failed` when a row was never graded); see the module
    docstring. pass@k for a k above a problem's sample count is left out for that group."""
    if not rows:
        raise ValueError("no samples to summarize")
    problems = _group(rows)
    counts = [(len(s), int(sum(float(r["correct"]) > 0 for r in s))) for s in problems.values()]
    n = len(rows)
    per_problem = [sum(float(r["correct"]) for r in s) / len(s) for s in problems.values()]
    out: dict[str, Any] = {
        "problems": len(problems),
        "samples": n,
        "accuracy": sum(float(r["correct"]) for r in rows) / n,
        "accuracy_stderr": std_error(per_problem),  # over problems (module docstring)
        "reward": sum(float(r["reward"]) for r in rows) / n,
        "length_mean": sum(float(r["length"]) for r in rows) / n,
        "truncation_rate": sum(r["finish_reason"] == "length" for r in rows) / n,
        "format_rate": sum(float(r["formatted"]) for r in rows) / n,
        "failed": sum(bool(r.get("failed")) for r in rows),
    }
    smallest = min(c[0] for c in counts)
    for k in ks:
        values = [pass_at_k(size, c, k) for size, c in counts] if k <= smallest else None
        out[f"pass@{k}"] = sum(values) / len(values) if values else None
        out[f"pass@{k}_stderr"] = std_error(values) if values else None
    if any("extracted" in r for r in rows):
        hits = []  # per problem: 1 when its majority answer is right
        for samples in problems.values():
            answer, at = majority_vote([r.get("extracted") for r in samples])
            if at < 0:  # no sample answered: wrong
                hits.append(0.0)
                continue
            graded = [r for r in samples[at:] if not r.get("failed") and _vote_key(r.get("extracted")) == answer]
            hits.append(float(bool(graded) and float(graded[0]["correct"]) > 0))
        out["maj"] = sum(hits) / len(problems)
        out["maj_stderr"] = std_error(hits)
    else:
        out["maj"] = out["maj_stderr"] = None
    return out


def breakdown(rows: Sequence[Mapping[str, Any]], key: str, ks: Sequence[int]) -> dict[str, dict[str, Any]]:
    """`summarize` per value of the rows' `key` field (missing or null: UNKNOWN), values in first-seen order."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        value = r.get(key)
        groups.setdefault(UNKNOWN if value is None else str(value), []).append(r)
    return {value: summarize(g, ks) for value, g in groups.items()}


def difficulty_of(metadata: Mapping[str, Any] | None) -> str:
    """A benchmark row's difficulty: its metadata's `difficulty`, else `level`, else UNKNOWN."""
    for key in ("difficulty", "level"):
        value = (metadata or {}).get(key)
        if value is not None and str(value).strip():
            return str(value).strip()
    return UNKNOWN
