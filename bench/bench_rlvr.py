"""Benchmark: N GRPO steps of the quickstart configuration; optionally TRL's GRPOTrainer on the identical setup.

Reports samples/s, rollout tokens/s, train tokens/s, seconds per phase and peak memory (max RSS of the process
that ran the job; each side runs in its own subprocess so the numbers do not mix). With `--trl`, TRL's
`GRPOTrainer` (use_cpu=True, bf16=False, use_vllm=False, loss_type="dapo" = token-mean like roll's default, no
KL term like roll's quickstart) trains the same model on the same prompts (same worked example, same reward),
with the same group size, completion length, temperature and learning rate, and the script prints roll/TRL
ratios. TRL runs at its best settings for a CPU: gradient checkpointing off (GRPOConfig's default is on, which
recomputes every forward in the backward, ~30 % of its step here; the model fits in memory without it), one
micro-batch per step, torch's fused AdamW (its default), and the same host-allocator setting roll's processes get
(`roll_hw.cpu.tune_host_allocator`: a process-wide malloc option, not a roll feature). Usage:

    python bench/bench_rlvr.py --steps 5            # roll only
    python bench/bench_rlvr.py --steps 5 --trl      # roll and TRL, with ratios
    python bench/bench_rlvr.py --quick              # 2 steps of the tiny model (CI smoke)
    python bench/bench_rlvr.py --steps 5 --trl --bf16   # both in bf16 (CPUs with AMX or AVX512-BF16)
    python bench/bench_rlvr.py --steps 5 --roll-extra pipeline.async_ratio=1 algo.off_policy_correction=token

Useful-FLOP utilisation: (6 x params x trained tokens + 2 x params x generated tokens) / step wall time, over the
fp32 matmul rate of this machine measured in the same run (2048^3). Trained tokens count each response once and
each prompt once per group (what the gradient needs), so recomputing shared prompts is not "useful".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def roll_job(args: argparse.Namespace) -> dict:
    """The roll run; its folder (checkpoints) goes when it ends: the table needs its history only."""
    with tempfile.TemporaryDirectory(prefix="roll-bench-", ignore_cleanup_errors=True) as out:
        return _roll_job(args, out)


def _roll_job(args: argparse.Namespace, out: str) -> dict:
    from roll_core.testing import run_pipeline

    overrides = [
        "experiment=quickstart",
        f"model={args.model}",
        f"pipeline.max_steps={args.steps}",
        f"pipeline.rollout_batch_size={args.prompts}",
        f"algo.group_size={args.group}",
        f"algo.lr={args.lr}",
        f"model.max_response_length={args.max_new}",
        "pipeline.eval_every=0",
        "pipeline.progress=false",
        f"pipeline.output_dir={out}",
    ]
    if args.model == "tiny":
        overrides += ["model.max_prompt_length=256"]
    if args.bf16:  # bf16 compute in the trainer (fp32 master weights) and a bf16 rollout engine
        overrides += ["model.dtype=bfloat16", "infer_engine.dtype=bfloat16"]
    overrides += list(args.roll_extra)
    t0 = time.perf_counter()
    _, history = run_pipeline(overrides)
    wall = time.perf_counter() - t0
    # The final checkpoint (~1.6 GiB for SmolLM2) is not part of the measurement; left in the temp folder, every run
    # would leak it. The report, curves and metrics stay.
    shutil.rmtree(Path(out, "checkpoints"), ignore_errors=True)
    print(f"roll run folder (checkpoints removed): {out}", file=sys.stderr)
    steps = [h for h in history if h["step"] > 0]
    timed = steps[1:] or steps  # the first step includes one-time warm-up
    phases = sorted({k for h in timed for k in h if k.startswith("perf/time_")})
    n = len(timed)
    return {
        "framework": "roll",
        "wall_seconds": wall,
        "step_seconds": sum(h["perf/step_seconds"] for h in timed) / n,
        "samples_per_s": sum(h["perf/samples_per_s"] for h in timed) / n,
        "rollout_tokens_per_s": sum(h["perf/rollout_tokens_per_s"] for h in timed) / n,
        "train_tokens_per_s": sum(h["perf/train_tokens_per_s"] for h in timed) / n,
        "phases": {p.removeprefix("perf/time_"): sum(h.get(p, 0.0) for h in timed) / n for p in phases},
        "reward_first": steps[0]["reward/mean"],
        "reward_last": steps[-1]["reward/mean"],
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "useful_gflop_per_step": sum(_useful_gflop(h, args) for h in timed) / n,
    }


def _params(model: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    from roll_core.config import load_config
    from roll_core.models import resolve_model_path

    path = resolve_model_path(load_config([f"model={model}"]).model.path)
    with __import__("torch").device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in m.parameters())  # tied embeddings once: they are the output matmul


def _useful_gflop(h: dict, args: argparse.Namespace) -> float:
    n = _params(args.model)
    gen = h.get("perf/response_tokens", 0.0)
    trained = gen + h.get("perf/unique_prompt_tokens", 0.0)
    return (6 * n * trained + 2 * n * gen) / 1e9


def trl_job(args: argparse.Namespace) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from roll_core.config import load_config
    from roll_core.config.build import build
    from roll_core.models import resolve_model_path
    from roll_hw.cpu import tune_host_allocator

    tune_host_allocator()  # the same malloc settings as roll's engine processes: compare frameworks, not allocators
    cfg = load_config(["experiment=quickstart", f"model={args.model}"])
    task = build(cfg.env)
    path = resolve_model_path(cfg.model.path)
    problems = task.train_set()[: args.prompts * args.steps]
    data = Dataset.from_list([{"prompt": task.messages(p), "answer": p.answer} for p in problems])

    def reward(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return task.reward.score(texts, answer).scores

    step_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            step_times.append(time.perf_counter() - self.t)

    batch = args.prompts * args.group
    conf = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"),
        use_cpu=True,
        bf16=args.bf16,  # accelerate's CPU autocast to bf16 over fp32 weights, as roll's bf16 compute
        use_vllm=False,
        num_generations=args.group,
        per_device_train_batch_size=batch,
        generation_batch_size=batch,
        max_completion_length=args.max_new,
        temperature=1.0,
        learning_rate=args.lr,
        beta=0.0,
        loss_type="dapo",
        gradient_checkpointing=False,  # TRL's default (True) recomputes activations: ~30 % slower on CPU
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=42,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=conf,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(path),
        callbacks=[Timer()],
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    timed = step_times[1:] or step_times
    step_s = sum(timed) / len(timed)
    mean_len = sum(h.get("completions/mean_length", 0.0) for h in logs) / max(len(logs), 1)
    return {
        "framework": "trl",
        "wall_seconds": wall,
        "step_seconds": step_s,
        "samples_per_s": batch / step_s,
        "rollout_tokens_per_s": None,
        "train_tokens_per_s": batch * mean_len / step_s,
        "phases": {},
        "reward_first": logs[0]["reward"] if logs else None,
        "reward_last": logs[-1]["reward"] if logs else None,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def spawn(kind: str, argv: list[str]) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, __file__, "--_job", kind, *argv], capture_output=True, text=True, env=env, check=False
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-5000:])
        raise SystemExit(f"{kind} job failed (exit {proc.returncode})")
    result = json.loads(lines[-1][6:])
    print(f"{kind} done: " + json.dumps(result), flush=True)  # kept if a later job fails or is stopped
    return result


def fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--model", default="smollm2_135m", help="a conf/model preset")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new", type=int, default=48, help="max completion tokens")
    p.add_argument("--lr", type=float, default=5e-6)
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer and print ratios")
    p.add_argument("--quick", action="store_true", help="2 steps of the tiny model (smoke test)")
    p.add_argument(
        "--bf16", action="store_true", help="both sides compute in bf16 (fp32 masters): for CPUs with native bf16"
    )
    p.add_argument("--roll-extra", nargs="*", default=[], help="extra roll-train overrides for roll's side")
    p.add_argument("--_job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.steps, args.model, args.max_new = 2, "tiny", 8
    if args._job:
        result = roll_job(args) if args._job == "roll" else trl_job(args)
        print("BENCH " + json.dumps(result))
        return
    argv = [a for a in sys.argv[1:] if a != "--trl"]
    results = [spawn("roll", argv)]
    if args.trl:
        results.append(spawn("trl", [a for a in argv if a not in args.roll_extra and a != "--roll-extra"]))
    from bench_rollout import best_matmul_gflops, cpu_name  # the same machine, measured now

    peak, peaks = best_matmul_gflops(2048, 2048, 2048, dtype="bfloat16" if args.bf16 else "float32")
    print(f"\nGRPO, model={args.model}, {args.prompts} prompts x {args.group} samples, <= {args.max_new} new tokens")
    print(
        f"{'framework':10} {'s/step':>8} {'samples/s':>10} {'rollout tok/s':>14} {'train tok/s':>12} "
        f"{'peak GiB':>9} {'reward first->last':>19}"
    )
    for r in results:
        print(
            f"{r['framework']:10} {fmt(r['step_seconds']):>8} {fmt(r['samples_per_s']):>10} "
            f"{fmt(r['rollout_tokens_per_s']):>14} {fmt(r['train_tokens_per_s']):>12} {fmt(r['peak_rss_gib']):>9} "
            f"{fmt(r['reward_first']):>10}->{fmt(r['reward_last'])}"
        )
    roll = results[0]
    if roll["phases"]:
        print("roll seconds per phase: " + ", ".join(f"{k} {v:.2f}" for k, v in roll["phases"].items()))
    util = roll["useful_gflop_per_step"] / roll["step_seconds"] / peak
    print(
        f"CPU: {cpu_name()}; {'bf16' if args.bf16 else 'fp32'} matmul peak {peak:.1f} GFLOP/s (2048^3, this run, "
        f"the faster of {', '.join(f'{k} {v:.1f}' for k, v in peaks.items())}); "
        f"roll useful FLOPs "
        f"{roll['useful_gflop_per_step']:.0f} GFLOP/step = {util:.1%} of peak"
    )
    if args.roll_extra:
        print("roll overrides: " + " ".join(args.roll_extra))
    if len(results) == 2:
        trl = results[1]
        print(
            f"ratios roll/TRL: step time {roll['step_seconds'] / trl['step_seconds']:.2f}x "
            f"(< 1 is faster), samples/s {roll['samples_per_s'] / trl['samples_per_s']:.2f}x, "
            f"peak memory {roll['peak_rss_gib'] / trl['peak_rss_gib']:.2f}x"
        )
    Path(tempfile.gettempdir(), "roll-bench-last.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
