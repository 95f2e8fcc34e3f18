"""Post-training beside RL on the quickstart model, on CPU: rollout-only -> SFT on the correct samples -> DPO on
correct-vs-incorrect pairs, and context distillation; prints one markdown table of held-out boxed accuracy.

    python bench/posttrain_chain.py --out /tmp/posttrain [--steps-sft 28 --steps-dpo 24 --steps-distill 12]

Every stage is a plain `roll-train` command (printed before it runs) on SmolLM2-135M-Instruct and the quickstart's
1-digit addition task (env=arithmetic, one worked example in the prompt, 64 held-out problems, greedy
evaluation). Context distillation (`experiment=context_distill`): the student sees no worked example
(env.examples=0); the teacher is the same model shown one in its prompt (distill.teacher_prompt). Runs whose
folder already holds metrics and checkpoints are not rerun (delete the folder to rerun a stage).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["experiment=quickstart", "pipeline.progress=false", "pipeline.eval_size=64", "pipeline.eval_temperature=0.0"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(name: str, out: Path, overrides: list[str]) -> list[dict]:
    folder = out / name
    metrics = folder / "metrics.jsonl"
    common = [
        c for c in COMMON if not (c.startswith("experiment=") and any(o.startswith("experiment=") for o in overrides))
    ]
    cmd = ["roll-train", *common, *overrides, f"pipeline.output_dir={folder}"]
    print("$", " ".join(cmd), flush=True)
    if not (metrics.exists() and (folder / "checkpoints").exists()):
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        exe = Path(sys.executable).parent / "roll-train"
        subprocess.run([str(exe), *cmd[1:]], check=True, env=env, cwd=ROOT)
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def evals(history: list[dict], key: str = "eval/accuracy") -> list[tuple[int, float]]:
    return [(h["step"], h[key]) for h in history if h.get(key) is not None]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/posttrain"))
    ap.add_argument("--prompts", type=int, default=192)
    ap.add_argument("--steps-sft", type=int, default=28)
    ap.add_argument("--steps-dpo", type=int, default=24)
    ap.add_argument("--steps-distill", type=int, default=12)
    args = ap.parse_args()
    out = args.out
    rows = out / "rollout" / "rollout.jsonl"
    table: list[tuple[str, str, str]] = []

    hist = run(
        "rollout",
        out,
        [
            "pipeline=rollout",
            "pipeline.max_steps=1000000",
            "pipeline.rollout_batch_size=16",
            f"rollout.max_prompts={args.prompts}",
            "rollout.samples_per_prompt=4",
            "pipeline.eval_every=0",
        ],
    )
    samples = [json.loads(line) for line in rows.read_text().splitlines()]
    correct = sum(bool(r["correct"]) for r in samples)
    share = f"{correct / len(samples):.1%} correct"
    table.append(("rollout-only", f"{len(samples)} samples of {args.prompts} prompts", share))

    hist = run(
        "sft",
        out,
        [
            "pipeline=sft",
            "algo=sft",
            "algo.lr=1e-5",
            f"data.path={rows}",
            "data.min_score=1",
            f"pipeline.max_steps={args.steps_sft}",
            "pipeline.rollout_batch_size=16",
            f"pipeline.eval_every={max(args.steps_sft // 2, 1)}",
        ],
    )
    acc = evals(hist)
    table.append(("SFT on the correct samples", f"{correct} rows, {args.steps_sft} steps x 16", _curve(acc)))

    hist = run(
        "dpo",
        out,
        [
            "pipeline=dpo",
            "algo=dpo",
            "algo.lr=5e-6",
            f"data.path={rows}",
            "data.format=rollout",
            f"pipeline.max_steps={args.steps_dpo}",
            "pipeline.rollout_batch_size=8",
            f"pipeline.eval_every={max(args.steps_dpo // 2, 1)}",
        ],
    )
    acc = evals(hist)
    pairs = next((h.get("data/rows") for h in hist if h.get("data/rows") is not None), None)
    data = f"{pairs or '?'} pairs, {args.steps_dpo} steps x 8"
    table.append(("DPO on correct-vs-incorrect pairs", data, _curve(acc)))

    hist = run(
        "distill",
        out,
        [
            "experiment=context_distill",
            f"pipeline.max_steps={args.steps_distill}",
            "pipeline.rollout_batch_size=4",
            f"pipeline.eval_every={max(args.steps_distill // 3, 1)}",
        ],
    )
    acc = evals(hist)
    kl = [h["distill/reverse_kl"] for h in hist if h.get("distill/reverse_kl") is not None]
    table.append(
        (
            "context distillation (student without the example)",
            f"{args.steps_distill} steps x 4 prompts x 8; reverse KL {kl[0]:.3f} -> {kl[-1]:.3f}" if kl else "",
            _curve(acc),
        )
    )

    print(f"\nCPU: {cpu_model()}, {os.cpu_count()} cores; held-out boxed accuracy (64 problems, greedy)\n")
    print("| stage | data | held-out accuracy (step: value) |\n|---|---|---|")
    for stage, data, result in table:
        print(f"| {stage} | {data} | {result} |")


def _curve(points: list[tuple[int, float]]) -> str:
    return " -> ".join(f"{s}: {v:.1%}" for s, v in points) or "no evaluation"


if __name__ == "__main__":
    main()
