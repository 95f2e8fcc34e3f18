"""Benchmark: the rollout/training gap and the speed for each rollout precision and each off-policy correction.

Runs the quickstart configuration (GRPO, hf engines, cluster=local, fp32 trainer) for `--steps` steps once per
(rollout precision, correction) cell, with the same prompts, seeds and sizes, and prints one table row per cell:

- gap: mean |log pi_old - log pi_behaviour| over response tokens (`actor/train_infer_logprob_diff`), mean over
  steps and at the last step (it grows as the policy sharpens);
- the ratio's p5 / p95 and the fraction of tokens a masking correction dropped;
- rollout tokens/s and the seconds of a whole step (each cell runs in its own process, one after another, so a
  cell's speed is comparable with the cells of the same run only);
- the reward at the first and last steps (is the run still learning).

Precisions: `float32` and `bfloat16` rollout (`infer_engine.dtype`). On a CPU bf16 runs natively with AMX or
AVX512-BF16 (roll_hw.cpu.cpu_bf16_instructions; the header says which); elsewhere the platform turns the request
into fp32 and the script says so. `fp8e`: vLLM's FP8 rollout numerics emulated by the hf engine
(`infer_engine.emulate_fp8=true`: per-tensor e4m3 weights and inputs of the linear layers, computed in fp32): its
gap and what each correction does with it, not FP8's speed (vLLM's FP8 kernels are CUDA's: tests/device).

    python bench/bench_rollout_agreement.py                            # SmolLM2-135M, 6 steps per cell
    python bench/bench_rollout_agreement.py --model tiny --steps 3     # quick look
    python bench/bench_rollout_agreement.py --corrections none icepop --dtypes bfloat16 --steps 20
    python bench/bench_rollout_agreement.py --dtypes fp8e                 # the emulated FP8 rollout's rows
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _cells import emit, run_cell

CORRECTIONS = ("none", "token", "token_mask", "sequence_mask", "icepop", "geo_mask")


def cell(args: argparse.Namespace, dtype: str, correction: str) -> dict:
    """One pipeline run; returns its per-step metrics summarised (runs in a subprocess: see main)."""
    # the run's folder (checkpoints: ~1.6 GB for SmolLM2) goes when the cell ends: the table needs its history only
    with tempfile.TemporaryDirectory(prefix="roll-agreement-", ignore_cleanup_errors=True) as out:
        return _cell(args, dtype, correction, out)


def _cell(args: argparse.Namespace, dtype: str, correction: str, out: str) -> dict:
    from roll_core.testing import run_pipeline

    overrides = [
        "experiment=quickstart",
        f"model={args.model}",
        f"pipeline.max_steps={args.steps}",
        f"pipeline.rollout_batch_size={args.prompts}",
        f"algo.group_size={args.group}",
        f"model.max_response_length={args.max_new}",
        *(["infer_engine.emulate_fp8=true"] if dtype == "fp8e" else [f"infer_engine.dtype={dtype}"]),
        "pipeline.eval_every=0",
        "pipeline.progress=false",
        f"pipeline.output_dir={out}",
    ]
    if args.model == "tiny":
        overrides.append("model.max_prompt_length=256")
    if correction != "none":
        overrides.append(f"algo.off_policy_correction={correction}")
    t0 = time.perf_counter()
    _, history = run_pipeline(overrides)
    wall = time.perf_counter() - t0
    steps = [h for h in history if h["step"] > 0]
    timed = steps[1:] or steps  # the first step holds one-time warm-up

    def mean(key: str, rows: list[dict]) -> float | None:
        vals = [h[key] for h in rows if key in h]
        return statistics.fmean(vals) if vals else None

    return {
        "dtype": dtype,
        "correction": correction,
        "gap_mean": mean("actor/train_infer_logprob_diff", steps),
        "gap_last": steps[-1].get("actor/train_infer_logprob_diff"),
        "ratio_p5": mean("actor/correction/ratio_p5", steps),
        "ratio_p95": mean("actor/correction/ratio_p95", steps),
        "masked": mean("actor/correction/masked_fraction", steps),
        "rollout_tok_s": mean("perf/rollout_tokens_per_s", timed),
        "step_s": mean("perf/step_seconds", timed),
        "reward_first": steps[0]["reward/mean"],
        "reward_last": steps[-1]["reward/mean"],
        "wall_s": wall,
    }


def fmt(x: float | None, spec: str) -> str:
    """`x` formatted by `spec`, or a dash as wide as the spec's field when the metric was not logged."""
    return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0] or 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m", help="a model preset (smollm2_135m, tiny, ...)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "fp8e"], default=["float32", "bfloat16"])
    ap.add_argument("--corrections", nargs="+", choices=CORRECTIONS, default=list(CORRECTIONS))
    ap.add_argument("--cell", help=argparse.SUPPRESS)  # "dtype:correction": run one cell, print JSON
    args = ap.parse_args()
    if args.cell:
        dtype, correction = args.cell.split(":")
        emit(cell(args, dtype, correction))
        return

    import torch

    from roll_hw.cpu import CpuPlatform, cpu_bf16_instructions

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_rollout import cpu_name

    print(
        f"CPU: {cpu_name()} ({os.cpu_count()} cores), bf16: {cpu_bf16_instructions() or 'none'} "
        f"({CpuPlatform.bf16_note()}), torch {torch.__version__}"
    )
    print(
        f"quickstart: model={args.model}, {args.prompts} prompts x {args.group} samples x {args.max_new} tokens, "
        f"{args.steps} steps per cell, fp32 trainer\n"
    )
    head = (
        f"{'rollout':<9} {'correction':<14} {'gap mean':>9} {'gap last':>9} {'r p5':>7} {'r p95':>7} "
        f"{'masked':>7} {'roll tok/s':>10} {'step s':>7} {'reward':>13}"
    )
    print(head)
    rows = []
    for dtype in args.dtypes:
        for correction in args.corrections:
            cmd = [sys.executable, __file__, "--cell", f"{dtype}:{correction}", "--model", args.model]
            cmd += ["--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group)]
            cmd += ["--max-new", str(args.max_new)]
            r, why = run_cell(cmd)
            if r is None:
                print(f"{dtype:<9} {correction:<14} {why}")
                continue
            rows.append(r)
            print(
                f"{dtype:<9} {correction:<14} {fmt(r['gap_mean'], '9.2e')} {fmt(r['gap_last'], '9.2e')} "
                f"{fmt(r['ratio_p5'], '7.4f')} {fmt(r['ratio_p95'], '7.4f')} {fmt(r['masked'], '7.2%')} "
                f"{fmt(r['rollout_tok_s'], '10.1f')} {fmt(r['step_s'], '7.2f')} "
                f"{r['reward_first']:6.3f}->{r['reward_last']:.3f}",
                flush=True,
            )
    speeds = {r["dtype"]: r["rollout_tok_s"] for r in rows if r["correction"] == args.corrections[0]}
    if "float32" in speeds and "bfloat16" in speeds and speeds["float32"]:
        print(f"\nbf16 / fp32 rollout tokens/s ({args.corrections[0]}): {speeds['bfloat16'] / speeds['float32']:.2f}x")


if __name__ == "__main__":
    main()
