"""Paired differences between the models of one `roll-eval` call: how far each model is from the first one.

Contract:
- `paired_differences(results, ks)`: for every model after the first (the baseline: the call's first model, the
  earliest checkpoint of a run folder), one record with, per metric (accuracy, pass@k for each k, maj@n), the mean
  over problems of `model's score - baseline's score` and its standard error `std_error(d)` of those per-problem
  differences d (roll_core.eval_metrics.std_error: `s / sqrt(m)`, s the sample standard deviation of the m
  differences). The scores are each problem's own (roll_core.eval_metrics.problem_scores, the values the comparison
  table averages). Paired, not the two tables' errors combined: the models are scored on the same problems with the
  same seeds, so a problem hard for one is mostly hard for the other, and `sqrt(se_a^2 + se_b^2)` overstates how far
  the difference can move (a right and b right on the same 2 of 4 problems, b also on a third: +0.25 with a paired
  error of 0.25, where the combined one is 0.38). Only the problems both models were scored on (`index`, the
  problem's place in the call's one problem list) are paired (`problems`); those only one side has (a prompt over
  one tokenizer's limit) are counted (`only_model`, `only_baseline`), never scored against a missing answer. A
  metric one side lacks on a paired problem (pass@k above its sample count, maj@n without extracted answers) is
  None. With one paired problem the errors are None; with none every difference is.
- `paired_table(paired, ks, n)`: those records as a Markdown table, `difference ± standard error`;
  `paired_section` the same under its heading (comparison.md, report.md; nothing for one model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from roll_core.eval_metrics import problem_scores, std_error


def _scores(result: dict[str, Any], ks: Sequence[int]) -> dict[Any, dict[str, float | None]]:
    """A model's per-problem scores: the ones roll-eval computed with the task's answer equivalence (`per_problem`,
    roll_core.evaluate), else from its rows (maj@n then votes by key alone)."""
    given = result.get("per_problem")
    return given if given is not None else problem_scores(result["rows"], ks)


def paired_differences(results: Sequence[tuple[Any, dict[str, Any]]], ks: Sequence[int]) -> list[dict[str, Any]]:
    """One record per model after the first: its label, the baseline's, the paired problem counts and each metric's
    mean difference with its standard error (module docstring). [] for fewer than two models."""
    if len(results) < 2:
        return []
    metrics = ["accuracy", *(f"pass@{k}" for k in ks), "maj"]
    base_target, base_result = results[0]
    base = _scores(base_result, ks)
    out = []
    for target, result in results[1:]:
        mine = _scores(result, ks)
        common = [i for i in base if i in mine]
        record: dict[str, Any] = {
            "model": target.label,
            "baseline": base_target.label,
            "problems": len(common),
            "only_model": len(mine.keys() - base.keys()),
            "only_baseline": len(base.keys() - mine.keys()),
        }
        for name in metrics:
            pairs = [(mine[i].get(name), base[i].get(name)) for i in common]
            if not pairs or any(a is None or b is None for a, b in pairs):
                record[name] = record[f"{name}_stderr"] = None
                continue
            diffs = [a - b for a, b in pairs]  # type: ignore[operator]
            record[name] = sum(diffs) / len(diffs)
            record[f"{name}_stderr"] = std_error(diffs)
        out.append(record)
    return out


def _signed(value: float | None, se: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:+.4f}" + ("" if se is None else f" ± {se:.4f}")


def paired_table(paired: Sequence[dict[str, Any]], ks: Sequence[int], n: int) -> str:
    """`paired_differences` as a Markdown table: one row per model, each metric `difference ± standard error`."""
    names = ["accuracy", *(f"pass@{k}" for k in ks), "maj"]
    head = ["model", "problems", *(f"maj@{n}" if c == "maj" else c for c in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in paired:
        cells = [_signed(p[c], p[f"{c}_stderr"]) for c in names]
        lines.append("| " + " | ".join([p["model"], str(p["problems"]), *cells]) + " |")
    return "\n".join(lines)


def paired_section(paired: Sequence[dict[str, Any]], ks: Sequence[int], n: int) -> list[str]:
    """The Markdown lines of comparison.md's and report.md's paired differences (none for a single model)."""
    if not paired:
        return []
    head = f"## Paired differences: each model minus {paired[0]['baseline']}, over the problems both were scored on"
    return [head, "", paired_table(paired, ks, n), ""]
