"""Benchmark: programs per second through the code reward's sandbox (bubblewrap), at parallelism 1..4.

Workload: the built-in code problems (`env=code`, 48 problems of 5 tests each), scored by `CodeReward` in
`all_pass` mode: N correct programs (the reference solutions: every test runs, 5 sandboxes each) and N failing
ones (a wrong answer: the first test fails, 1 sandbox each). Each test is a fresh sandbox (bwrap + Python start
+ the program). The baseline, in the same run, is the reward's unsandboxed mode: the same child process with the
same resource limits and no bwrap, so the ratio is the sandbox's own cost. Prints the CPU model, programs/s and
sandbox runs/s; `--no-baseline` skips the baseline.

    python bench/bench_sandbox.py            # N = 48, parallelism 1..4
    python bench/bench_sandbox.py --n 24 --max-parallelism 2
"""

from __future__ import annotations

import argparse
import os
import time

from bench_rollout import cpu_name  # one CPU-name probe for every bench script

from roll_envs.rewards.code import CodeReward
from roll_envs.sandbox import PythonSandbox
from roll_envs.tasks.code import CodeTask


def measure(reward: CodeReward, responses: list[str], answers: list[str], expect: float) -> tuple[float, float]:
    """Seconds to score all responses, and the mean score (checked against `expect`)."""
    start = time.perf_counter()
    res = reward.score(responses, answers)
    seconds = time.perf_counter() - start
    mean = sum(res.correct) / len(res.correct)
    if mean != expect:
        raise RuntimeError(f"expected accuracy {expect}, got {mean}: {res.counters}")
    return seconds, mean


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=48, help="correct and failing programs each")
    ap.add_argument("--max-parallelism", type=int, default=4)
    ap.add_argument("--no-baseline", action="store_true", help="skip the unsandboxed baseline")
    args = ap.parse_args()

    task = CodeTask(CodeReward(parallelism=1))  # builds the problems (and checks that the sandbox works)
    problems = (task.train_set() + task.eval_set()) * (args.n // 48 + 1)
    problems = problems[: args.n]
    answers = [p.answer for p in problems]
    correct = [f"```python\n{task.reference_solution(p)}```" for p in problems]
    failing = ["```python\nprint(-1)\n```"] * len(problems)
    tests = 5
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores); uid {os.geteuid()}; {len(problems)} programs of each kind")
    print(f"{'mode':<12} {'par':>3} {'correct prog/s':>15} {'failing prog/s':>15} {'sandbox runs/s':>15}")
    modes = [("bwrap", False)] + ([] if args.no_baseline else [("unsandboxed", True)])
    results: dict[tuple[str, int], float] = {}
    for mode, unsandboxed in modes:
        for par in range(1, args.max_parallelism + 1):
            reward = CodeReward(parallelism=par)
            if unsandboxed:  # our own reference programs: safe to run without the sandbox
                reward.sandbox = PythonSandbox(reward.sandbox.limits, unsandboxed=True)
            t_ok, _ = measure(reward, correct, answers, 1.0)
            t_bad, _ = measure(reward, failing, answers, 0.0)
            runs = len(problems) * (tests + 1) / (t_ok + t_bad)
            results[(mode, par)] = runs
            print(
                f"{mode:<12} {par:>3} {len(problems) / t_ok:>15.1f} {len(problems) / t_bad:>15.1f} {runs:>15.1f}",
                flush=True,
            )
    if not args.no_baseline:
        for par in range(1, args.max_parallelism + 1):
            ratio = results[("bwrap", par)] / results[("unsandboxed", par)]
            print(f"parallelism {par}: bwrap runs/s / unsandboxed runs/s = {ratio:.2f}")


if __name__ == "__main__":
    main()
