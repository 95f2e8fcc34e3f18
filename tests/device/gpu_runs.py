"""Full-stack runs on an accelerator: Hydra config -> pipeline -> engines, `cluster=local`, the built-in tiny model.

    python tests/device/gpu_runs.py --hw cuda               # hf, fsdp2, megatron; fp32 and bf16; then a resume check
    python tests/device/gpu_runs.py --hw cpu --only hf      # the same code path on the CPU (a smoke of this script)

check_accelerator.py drives the engines directly; this drives them the way `roll-train hw=cuda` does (config
composition, the platform chosen by `hw`, the trainer loop, checkpoints), which is what most users run. Each run is
GRPO on the constant-answer task (every answer is 7), which the random tiny model learns within 20 steps; a run
passes when its reward rises by at least 0.2, the trainer's and the engine's log-probs of the sampled tokens agree
(fp32: < 1e-3, bf16: < 5e-2 mean absolute difference) and the run's checkpoint is on disk. The resume check stops a
run at step 4 and resumes it to step 8: the weights equal those of an uninterrupted 8-step run.
Needs roll's packages installed (their entry points register the engines and configs): where no registry answers,
tests/device/lent_machine.sh installs them from wheels built beforehand. Prints a table; exit 1 when a run failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ENGINES = {
    "hf": [],
    "fsdp2": ["train_engine=fsdp2", "train_engine.world_size=1"],  # one GPU: FSDP2 over a mesh of one
    "megatron": ["train_engine=megatron", "train_engine.use_distributed_optimizer=false"],
}
GAP_LIMIT = {"float32": 1e-3, "bfloat16": 5e-2}


def _run(overrides: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from roll_core.testing import run_pipeline

    return run_pipeline(overrides)


def learning_run(hw: str, engine: str, dtype: str, data: Path, out: Path) -> str:
    """One 20-step GRPO run; returns the table's detail or raises AssertionError."""
    from roll_core.testing import reward_curve, tiny_overrides

    overrides = tiny_overrides(data, out, f"hw={hw}", f"model.dtype={dtype}", *ENGINES[engine])
    t0 = time.perf_counter()
    _, history = _run(overrides)
    wall = time.perf_counter() - t0
    rewards = reward_curve(history)
    gaps = [h["actor/train_infer_logprob_diff"] for h in history if "actor/train_infer_logprob_diff" in h]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    detail = f"reward {first:.2f} -> {last:.2f}; max log-prob gap {max(gaps):.1e}; {wall:.0f} s"
    assert last - first >= 0.2, f"reward did not rise: {detail}"
    assert max(gaps) < GAP_LIMIT[dtype], f"trainer/engine log-probs disagree: {detail}"
    assert any((out / "checkpoints").glob("step_*")), f"no checkpoint under {out}/checkpoints: {detail}"
    return detail


def resume_run(hw: str, data: Path, root: Path) -> str:
    """Stopped at step 4 and resumed to 8 equals an uninterrupted 8-step run (hf engine, fp32)."""
    import torch
    from safetensors.torch import load_file

    from roll_core.testing import tiny_overrides

    common = ["pipeline.save_every=4", f"hw={hw}"]
    whole, part = root / "whole", root / "part"
    _run(tiny_overrides(data, whole, "pipeline.max_steps=8", *common))
    _run(tiny_overrides(data, part, "pipeline.max_steps=4", *common))
    _run(tiny_overrides(data, part, "pipeline.max_steps=8", "pipeline.resume=true", *common))

    def weights(run: Path) -> dict[str, torch.Tensor]:
        files = sorted((run / "checkpoints" / "step_000008" / "actor" / "model").glob("*.safetensors"))
        assert files, f"no step-8 model in {run}"
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(f))
        return out

    a, b = weights(whole), weights(part)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst == 0.0 or (hw != "cpu" and worst < 1e-6), f"resumed weights differ by {worst:.1e}"
    return f"stop at 4, resume to 8 equals 8 uninterrupted (max |dw| {worst:.1e})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hw", default="cuda", choices=["cuda", "rocm", "npu", "cpu"])
    ap.add_argument("--only", nargs="*", default=[], help="substrings of run names (hf/bfloat16, resume, ...)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    from roll_core.testing import constant_answer_task

    root = Path(tempfile.mkdtemp(prefix="roll-gpu-runs-"))
    data = constant_answer_task(root / "seven.jsonl")
    runs: list[tuple[str, Any]] = [
        (f"{e}/{d}", lambda e=e, d=d: learning_run(args.hw, e, d, data, root / f"{e}-{d}"))
        for e in ENGINES
        for d in args.dtypes
    ]
    runs.append(("resume (hf/float32)", lambda: resume_run(args.hw, data, root / "resume")))
    rows = []
    for name, fn in runs:
        if args.only and not any(s in name for s in args.only):
            continue
        t0 = time.perf_counter()
        try:
            status, detail = "ok", fn()
        except Exception as exc:  # one run's failure must not hide the others'
            traceback.print_exc()
            status, detail = "FAILED", f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append({"run": name, "status": status, "seconds": round(time.perf_counter() - t0, 1), "detail": detail})
        print(f"  {name:22s} {status:7s} {rows[-1]['seconds']:6.1f}s  {detail}", flush=True)
    print(f"\nfull-stack runs on {args.hw} (cluster=local, model=tiny):")
    for r in rows:
        print(f"  {r['run']:22s} {r['status']:7s} {r['seconds']:6.1f}s  {r['detail']}")
    failed = sum(r["status"] != "ok" for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if failed:
        print(f"the runs' folders are kept for a look: {root}")
    else:  # each run keeps checkpoints: do not leave them behind on a shared machine
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
