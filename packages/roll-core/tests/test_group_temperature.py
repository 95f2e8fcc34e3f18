"""A near-greedy sampling temperature with a group-relative estimator (GRPO, RLOO, ...) is warned about at
composition: every response of a prompt is then the same one, every group's advantages zero (exactly 0 is refused)."""

from __future__ import annotations

import logging

import pytest

from roll_core.config import load_config

WARNED = "group-relative advantages zero"


def _warnings(caplog: pytest.LogCaptureFixture, overrides: list[str]) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="roll_core.config.engines"):
        load_config(overrides)
    return [r.getMessage() for r in caplog.records if WARNED in r.getMessage()]


@pytest.mark.parametrize("where", ["infer_engine.temperature", "model.generation.temperature"])
@pytest.mark.parametrize("value", ["1e-5", "0.01"])
def test_grpo_near_greedy_is_warned_about(caplog: pytest.LogCaptureFixture, where: str, value: str) -> None:
    warned = _warnings(caplog, [f"{where}={value}"])  # grpo, group_size 8 by default
    assert len(warned) == 1
    assert f"infer_engine.temperature={float(value):g}" in warned[0] and "adv_estimator=grpo" in warned[0]


@pytest.mark.parametrize(
    "overrides",
    [
        ["infer_engine.temperature=0.05"],  # at the threshold (GROUP_TEMPERATURE_WARN)
        ["infer_engine.temperature=1.0"],
        ["algo=ppo", "infer_engine.temperature=1e-5"],  # GAE: a critic's baseline, no group comparison
        ["algo.adv_estimator=reinforce_pp", "algo.group_size=1", "infer_engine.temperature=1e-5"],
    ],
)
def test_no_warning_without_a_near_greedy_group(caplog: pytest.LogCaptureFixture, overrides: list[str]) -> None:
    assert _warnings(caplog, overrides) == []


def test_the_threshold_is_the_documented_one() -> None:
    from roll_core.config.engines import GROUP_TEMPERATURE_WARN

    assert GROUP_TEMPERATURE_WARN == 0.05  # the cases above sit on both sides of it
