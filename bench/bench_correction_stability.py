"""Benchmark: does a run stay stable with an off-policy correction where it drifts without one?

Runs the same GRPO configuration once per (correction, seed), each in its own process, and prints per run the
reward curve's summary (mean of the first and last quarter of the steps, the peak and the final value, the steps
spent below half the peak after it), the train/infer log-prob gap (mean, and its growth from the first quarter to
the last) and the fraction of tokens a masking correction dropped. A run *drifts* when its last-quarter reward
falls below half of its peak; the table counts drifting seeds per correction.

The mismatch under test is set by the overrides (default: the tiny model on the constant-answer task, bf16 rollout
with an fp32 trainer, three batches generated ahead of the trainer (`pipeline.async_ratio=3`) and a learning rate
where updates are large, so that the behaviour policy differs from the trained one by rounding and by staleness).

    python bench/bench_correction_stability.py                                   # none vs token vs icepop, 3 seeds
    python bench/bench_correction_stability.py --corrections none token --seeds 1 2 3 4 --steps 60
    python bench/bench_correction_stability.py --set algo.lr=5e-3 pipeline.async_ratio=4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _cells import emit, run_cell

DEFAULT_SET = ["infer_engine.dtype=bfloat16", "pipeline.async_ratio=3", "algo.lr=1e-2"]


def one_run(steps: int, seed: int, correction: str, extra: list[str]) -> dict:
    """One pipeline run in this process; returns its curves (see the module docstring for the summary)."""
    from roll_core.testing import constant_answer_task, reward_curve, run_pipeline, tiny_overrides

    # the run's folder goes when it ends: the table needs its history only
    with tempfile.TemporaryDirectory(prefix="roll-stability-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        data = constant_answer_task(root / "seven.jsonl")
        overrides = tiny_overrides(data, root / "run", f"pipeline.max_steps={steps}", f"pipeline.seed={seed}", *extra)
        if correction != "none":
            overrides.append(f"algo.off_policy_correction={correction}")
        _, history = run_pipeline(overrides)
    steps_rows = [h for h in history if h["step"] > 0]
    return {
        "reward": reward_curve(history),
        "gap": [h.get("actor/train_infer_logprob_diff") for h in steps_rows],
        "masked": [h.get("actor/correction/masked_fraction") for h in steps_rows],
    }


def summarise(curves: dict) -> dict:
    """The table's numbers for one run's curves."""
    r = curves["reward"]
    q = max(1, len(r) // 4)
    peak_at = max(range(len(r)), key=r.__getitem__)
    gaps = [g for g in curves["gap"] if g is not None]
    gq = max(1, len(gaps) // 4)
    masked = [m for m in curves["masked"] if m is not None]
    last = statistics.fmean(r[-q:])
    return {
        "first": statistics.fmean(r[:q]),
        "last": last,
        "peak": r[peak_at],
        "final": r[-1],
        "below_half_after_peak": sum(x < r[peak_at] / 2 for x in r[peak_at:]),
        "drift": last < r[peak_at] / 2,
        "gap_mean": statistics.fmean(gaps) if gaps else None,
        "gap_growth": (statistics.fmean(gaps[-gq:]) / max(statistics.fmean(gaps[:gq]), 1e-12)) if gaps else None,
        "masked": statistics.fmean(masked) if masked else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corrections", nargs="+", default=["none", "token", "icepop"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--set", nargs="*", default=None, help=f"overrides (default: {' '.join(DEFAULT_SET)})")
    ap.add_argument("--json", help="also write every run's curves to this file")
    ap.add_argument("--run", help=argparse.SUPPRESS)  # "seed:correction": one run, print JSON
    args = ap.parse_args()
    extra = DEFAULT_SET if args.set is None else args.set
    if args.run:
        seed, correction = args.run.split(":")
        emit(one_run(args.steps, int(seed), correction, extra))
        return
    print(f"tiny model, constant-answer task, {args.steps} steps; overrides: {' '.join(extra)}\n")
    print(
        f"{'correction':<14} {'seed':>4} {'first':>6} {'peak':>6} {'last q':>6} {'final':>6} {'<peak/2':>8} "
        f"{'gap mean':>9} {'gap x':>7} {'masked':>7}  drift"
    )
    runs, drifting = [], {c: 0 for c in args.corrections}
    for correction in args.corrections:
        for seed in args.seeds:
            cmd = [
                sys.executable,
                __file__,
                "--run",
                f"{seed}:{correction}",
                "--steps",
                str(args.steps),
                "--set",
                *extra,
            ]
            curves, why = run_cell(cmd)
            if curves is None:
                print(f"{correction:<14} {seed:>4} {why}")
                continue
            s = summarise(curves)
            drifting[correction] += s["drift"]
            runs.append({"correction": correction, "seed": seed, **curves, **s})
            gap = f"{s['gap_mean']:9.2e}" if s["gap_mean"] is not None else f"{'-':>9}"
            growth = f"{s['gap_growth']:7.1f}" if s["gap_growth"] is not None else f"{'-':>7}"
            masked = f"{s['masked']:7.2%}" if s["masked"] is not None else f"{'-':>7}"
            print(
                f"{correction:<14} {seed:>4} {s['first']:6.2f} {s['peak']:6.2f} {s['last']:6.2f} {s['final']:6.2f} "
                f"{s['below_half_after_peak']:>8} {gap} {growth} {masked}  {'DRIFT' if s['drift'] else 'stable'}",
                flush=True,
            )
    print("\ndrifting seeds: " + ", ".join(f"{c} {n}/{len(args.seeds)}" for c, n in drifting.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
