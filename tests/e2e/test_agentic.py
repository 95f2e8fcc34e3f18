"""The agentic pipeline end to end on the tiny model: token-in-token-out trajectories whose log-probs the trainer
reproduces on every assistant token, multi-turn GRPO and GiGPO that learn, and environments that fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from roll_core.testing import reward_curve, run_pipeline

sys.path.insert(0, str(Path(__file__).parent))  # agentic_toy: env=py:agentic_toy:<Class>
from agentic_toy import SAY_DIGIT_OVERRIDES


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [
        *SAY_DIGIT_OVERRIDES,
        "env.eval_size=8",
        "algo=grpo",
        "algo.group_size=8",
        "algo.lr=1e-2",
        "pipeline.rollout_batch_size=4",
        "pipeline.max_steps=20",
        "pipeline.eval_every=0",
        "pipeline.progress=false",
        f"pipeline.output_dir={tmp_path}",
        "train_engine.micro_batch_size=16",
        *extra,
    ]


@pytest.mark.parametrize("estimator", ["grpo", "gigpo", "turn_grpo"])
def test_multi_turn_rl_learns_and_trains_on_exactly_the_sampled_tokens(
    tmp_path: Path, estimator: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # 16 steps: the reward takes off at steps 10-13; measured over seeds 42, 1 (and 2 for grpo) the last 4 steps beat
    # the first 4 by >= 0.57 at step 16 (0.2 needed; >= 0.32 at step 14), and the step-8 checkpoint already scores
    # success 1.0 in roll-eval (the base 0.0).
    _, history = run_pipeline(_overrides(tmp_path, f"algo.adv_estimator={estimator}", "pipeline.max_steps=16"))
    steps = [h for h in history if h["step"] > 0]
    r = reward_curve(history)
    assert sum(r[-4:]) / 4 > sum(r[:4]) / 4 + 0.2, r
    # The trainer's recomputed log-probs equal the engine's on every assistant token of every turn (token-in,
    # token-out: observations were appended as ids, never re-tokenised), and nothing else is trained.
    assert max(h["actor/train_infer_logprob_diff"] for h in steps) < 1e-4
    assert all(h["episode/turns_mean"] > 1.5 for h in steps)  # both turns ran
    assert steps[-1]["episode/success_rate"] > steps[0]["episode/success_rate"]
    if estimator == "grpo":  # roll-eval on the saved checkpoint: held-out success beats the initial model's
        ckpt = max((tmp_path / "checkpoints").iterdir())
        trained, base = _roll_eval(str(ckpt), tmp_path, capsys), _roll_eval("builtin:tiny", tmp_path, capsys)
        assert trained["success"] >= base["success"] + 0.5 and trained["n"] == 8, (trained, base)
        assert trained["turns"] == pytest.approx(2.0)


def _roll_eval(model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, float]:
    import re

    from roll_core.cli import eval_main

    overrides = [o for o in _overrides(tmp_path) if not o.startswith(("model=", "pipeline.output_dir"))]
    capsys.readouterr()
    assert eval_main([model, "model=tiny", *overrides]) == 0
    out = capsys.readouterr().out
    m = re.search(
        r"success rate ([\d.]+) on (\d+) held-out seeds of \S+ \((?:± ([\d.]+) standard error over episodes, )?"
        r"mean reward .* mean turns ([\d.]+), invalid",
        out,
    )
    assert m, out
    p, n = float(m.group(1)), int(m.group(2))
    # the standard error over the episodes (one per seed) of a 0/1 outcome: sqrt(p (1 - p) / (n - 1))
    assert m.group(3) is not None and float(m.group(3)) == pytest.approx((p * (1 - p) / (n - 1)) ** 0.5, abs=1e-4), out
    return {"success": p, "n": n, "turns": float(m.group(4))}


@pytest.mark.parametrize("policy", ["score", "drop"])
def test_failing_environments_end_their_episode_not_the_run(tmp_path: Path, policy: str) -> None:
    """Every episode's environment step raises or hangs: counted, and per env.on_failure trained with
    env.failure_reward on the failing turn (score) or left out of the batch (drop)."""
    steps_n = 2 if policy == "score" else 1
    overrides = [o for o in _overrides(tmp_path) if not o.startswith("pipeline.eval_every=")]
    _, history = run_pipeline(
        [
            *overrides,
            "env.env=py:agentic_toy:Flaky",
            "env.step_timeout_s=1",
            f"pipeline.max_steps={steps_n}",
            "pipeline.eval_every=1",
            f"env.on_failure={policy}",
            "env.failure_reward=-0.5",
        ]
    )
    steps = [h for h in history if h["step"] > 0]
    assert len(steps) == steps_n
    # each step's env counters hold its own 32 episodes' failures, the held-out episodes' are eval's (8)
    failures = [
        (h["env/env_errors"] + h["env/env_timeouts"], h.get("eval/env_errors", 0) + h.get("eval/env_timeouts", 0))
        for h in steps
    ]
    assert all(f == (32, 8) for f in failures), failures
    errors = sum(h.get("env/env_errors", 0) for h in steps)
    timeouts = sum(h.get("env/env_timeouts", 0) for h in steps)
    assert errors > 0 and timeouts > 0, [
        {k: v for k, v in h.items() if k.startswith(("episode/", "env/", "data/"))} for h in steps
    ]
    # every episode ended by its environment's failure, counted, and every step finished
    assert all(h.get("episode/end_env_error", 0) + h.get("episode/end_env_timeout", 0) == 1.0 for h in steps)
    # Flaky fails on the first step: scored, the episode's reward is the failure reward; dropped, it has no outcome
    # (left unscored and out of the reward metrics: no episode is left to average, so no reward/mean is logged)
    means = [h.get("reward/mean") for h in steps]
    assert means == ([pytest.approx(-0.5)] * steps_n if policy == "score" else [None] * steps_n), means
    # held out, a failed episode is an unsuccessful attempt whatever on_failure says (8 seeds, none succeeds)
    evals = [(h["eval/n"], h["eval/accuracy"], h["eval/dropped_episodes"]) for h in steps]
    assert evals == [(8.0, 0.0, 0.0 if policy == "score" else 8.0)] * steps_n, evals
    dropped = [h["data/dropped_episodes"] for h in steps]
    assert dropped == ([0] * steps_n if policy == "score" else [32] * steps_n), dropped
    trained = [h for h in steps if "actor/pg_loss" in h]
    assert len(trained) == (steps_n if policy == "score" else 0), [sorted(h) for h in steps]


def test_env_workers_give_the_same_episodes_as_in_process_envs(tmp_path: Path) -> None:
    """env.num_workers=2 (workers in-process on cluster=local) changes where environments run, not the run."""
    runs = []
    for workers in (0, 2):
        _, history = run_pipeline(
            _overrides(tmp_path / str(workers), f"env.num_workers={workers}", "pipeline.max_steps=2")
        )
        runs.append([(h["reward/mean"], h["episode/turns_mean"]) for h in history if h["step"] > 0])
    assert runs[0] == runs[1]


# CI time (~30 s): env workers in processes (test_env_workers_give_the_same_episodes_as_in_process_envs) and
# failing environments (test_failing_environments_end_their_episode_not_the_run) stay in the README test command;
# `nox -s full_matrix` runs the workers as Ray actors.
@pytest.mark.full_matrix
@pytest.mark.ray
@pytest.mark.slow
def test_env_workers_on_ray_end_failing_episodes_and_count_them(ray_cluster, tmp_path: Path) -> None:
    """Environments on two Ray actors: a raise or a hang on a worker ends that episode on the controller."""
    _, history = run_pipeline(
        _overrides(
            tmp_path,
            "cluster=ray",
            "env.num_workers=2",
            "env.env=py:agentic_toy:Flaky",
            "env.step_timeout_s=1",
            "pipeline.max_steps=1",
        )
    )
    steps = [h for h in history if h["step"] > 0]
    assert len(steps) == 1
    assert steps[0]["env/env_errors"] > 0 and steps[0]["env/env_timeouts"] > 0, steps
