"""roll_algos.schedules.lr_multiplier against hand-computed values: the one LR schedule rule of the train engines
(roll_engines.train._optim.lr_lambda) and of the driver's resume message (roll_core.pipelines._resume_schedule).
W = warmup_steps, T = total_steps; the warm-up gives (s + 1) / W, then p = (s - W) / (T - W) capped at 1."""

from __future__ import annotations

import math

import pytest

import roll_algos
from roll_algos.schedules import LR_SCHEDULES, check_lr_schedule, lr_multiplier

COS_QUARTER = 0.5 * (1 + math.sqrt(0.5))  # 0.5 (1 + cos(pi / 4)) = 0.8535533905932737
COS_3QUARTERS = 0.5 * (1 - math.sqrt(0.5))  # 0.5 (1 + cos(3 pi / 4)) = 0.14644660940672624


def _values(schedule: str, warmup: int, total: int, steps: range) -> list[float]:
    return [lr_multiplier(schedule, warmup, total, s) for s in steps]


def test_constant_warms_up_then_holds_one() -> None:
    # W = 3: 1/3, 2/3, 3/3 over steps 0..2; step == W and far beyond T: 1
    assert _values("constant", 3, 10, range(5)) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0])
    assert lr_multiplier("constant", 3, 10, 10) == 1.0 and lr_multiplier("constant", 3, 10, 50) == 1.0
    assert _values("constant", 0, 4, range(6)) == [1.0] * 6  # no warm-up


def test_linear_decays_to_zero_at_total_and_stays_there() -> None:
    # W = 2, T = 6: warm-up 1/2, 2/2; then p = 0, 1/4, 2/4, 3/4 at steps 2..5 -> 1 - p
    assert _values("linear", 2, 6, range(6)) == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    assert lr_multiplier("linear", 2, 6, 6) == 0.0  # step == T: the end
    assert lr_multiplier("linear", 2, 6, 9) == 0.0  # beyond T: capped at the end, never negative


def test_cosine_decays_by_half_a_cosine() -> None:
    # W = 2, T = 6: p = 0, 1/4, 1/2, 3/4, 1 at steps 2..6 -> 0.5 (1 + cos(pi p))
    assert _values("cosine", 2, 6, range(7)) == pytest.approx(
        [0.5, 1.0, 1.0, COS_QUARTER, 0.5, COS_3QUARTERS, 0.0], abs=1e-15
    )
    assert lr_multiplier("cosine", 2, 6, 100) == pytest.approx(0.0, abs=1e-15)  # beyond T: the end
    assert lr_multiplier("cosine", 2, 6, 2) == 1.0  # step == W: the full LR exactly


def test_no_warm_up_starts_at_the_full_lr() -> None:
    # W = 0: step 0 is already past the warm-up (p = 0), T = 4 -> p = s / 4
    assert _values("linear", 0, 4, range(5)) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert _values("cosine", 0, 4, range(5)) == pytest.approx([1.0, COS_QUARTER, 0.5, COS_3QUARTERS, 0.0], abs=1e-15)


@pytest.mark.parametrize("schedule", LR_SCHEDULES)
def test_a_run_no_longer_than_its_warm_up_holds_one_after_it(schedule: str) -> None:
    # T == W = 4: the warm-up, then 1 (no decay to do); T < W (W = 2, T = 1): the warm-up still runs its course
    assert _values(schedule, 4, 4, range(7)) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])
    assert _values(schedule, 2, 1, range(4)) == pytest.approx([0.5, 1.0, 1.0, 1.0])
    assert lr_multiplier(schedule, 0, 0, 0) == 1.0 and lr_multiplier(schedule, 0, 0, 5) == 1.0


@pytest.mark.parametrize("schedule", ["Linear", "cosin", "", "warmup_cosine"])
def test_an_unknown_schedule_is_refused_at_any_step(schedule: str) -> None:
    """Also inside the warm-up, where the formula never reads the schedule."""
    match = f"unknown lr schedule {schedule!r}; choose one of constant, cosine, linear"
    with pytest.raises(ValueError, match=match):
        check_lr_schedule(schedule)
    for step in (0, 3, 20):
        with pytest.raises(ValueError, match=match):
            lr_multiplier(schedule, 4, 10, step)


def test_exported_from_the_package() -> None:
    assert "schedules" in roll_algos.__all__ and roll_algos.schedules.lr_multiplier is lr_multiplier
    assert LR_SCHEDULES == ("constant", "cosine", "linear")
    for name in LR_SCHEDULES:
        check_lr_schedule(name)  # no error
