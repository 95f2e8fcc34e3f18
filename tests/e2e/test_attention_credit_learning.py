"""algo=attention_credit (arXiv 2510.13554) on the tiny quickstart-style task: every step reads the actor's attention,
boosts the strategy's tokens and logs how many and the mean weight; over 20 steps the task is learnt."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from roll_core.testing import reward_curve, tiny_overrides
from roll_core.testing import run_pipeline as run

sys.path.insert(0, str(Path(__file__).parent))  # shifted_reward, as test_learning.py
SHIFTED = "env.reward._target_=shifted_reward.ShiftedMathReward"  # rewards + 1: a forgotten baseline does not learn


def credit_run(data: Path, out: Path, steps: int, *extra: str) -> list[dict]:
    """Anchor credit (x2 on the top third of each response's tokens by FAI); checks every step's metrics."""
    _, history = run(
        tiny_overrides(
            data,
            out,
            SHIFTED,
            "algo=attention_credit",
            "algo.attention_credit=anchor",
            "algo.attention_credit_gamma=2",
            "algo.attention_credit_ratio=0.34",
            "algo.lr=3e-3",
            "pipeline.save_every=0",
            f"pipeline.max_steps={steps}",
            *extra,
        )
    )
    logged = [h for h in history if h["step"] > 0]
    assert len(logged) == steps
    for h in logged:
        frac, mean = h["actor/attention_credit/boosted_fraction"], h["actor/attention_credit/weight_mean"]
        # Responses of 1..6 tokens, ceil(.34 n) of each boosted: between a third and all of them.
        assert 0.33 < frac <= 1, frac
        assert mean == pytest.approx(1 + frac, abs=1e-6)  # gamma 2 on the boosted, 1 elsewhere
        assert h["perf/time_attention_credit"] > 0
    return history


def test_attention_credit_boosts_and_logs_every_step(seven_task: Path, tmp_path: Path) -> None:
    history = credit_run(seven_task, tmp_path, 2)
    assert any(h["actor/grad_norm"] > 0 for h in history if h["step"] > 0)


# 20 steps cost as much as test_learning's GRPO run (about 50 CPU-seconds): beyond CI's budget; CI runs the 2 steps
# above, the preset's 3 steps (test_algorithms.py) and the engine's and the algorithm's unit tests.
@pytest.mark.full_matrix
def test_attention_credit_learns(seven_task: Path, tmp_path: Path) -> None:
    r = reward_curve(credit_run(seven_task, tmp_path, 20))
    first, last = sum(r[:4]) / 4, sum(r[-4:]) / 4
    assert last > first + 0.25, f"reward did not rise enough: first {first:.3f}, last {last:.3f}, curve {r}"
