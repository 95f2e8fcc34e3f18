"""env.reward is the chosen reward's own node (roll_envs.config): built-in rewards keep their typed keys, a reward
class of your own takes its own options (env/reward=custom), and a replaced `_target_` never receives keys it does
not take. Composed with Hydra and built as a run builds the task."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.config import ConfigError, load_config
from roll_core.config.build import build

PLUGIN = '''
from roll_envs.rewards.base import RewardResult
from roll_envs.rewards.math import MathReward


class Shifted(MathReward):
    """The math reward plus one: it takes the math reward's keys."""

    def score(self, responses, answers):
        res = super().score(responses, answers)
        res.scores = [s + 1.0 for s in res.scores]
        return res


class Threshold:
    """1 when the response's last number is at least `threshold`."""

    def __init__(self, threshold: float, bonus: float = 0.0) -> None:
        self.threshold, self.bonus = threshold, bonus

    def score(self, responses, answers):
        scores = [float(float(r.split()[-1]) >= self.threshold) + self.bonus for r in responses]
        return RewardResult(scores=scores, correct=scores, formatted=[1.0] * len(scores))
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_rewards.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards.Threshold"


def _task(*overrides: str):
    cfg = load_config(["model=tiny", "env=arithmetic", "env.train_size=20", "env.eval_size=5", *overrides])
    return cfg, build(cfg.env)


def test_a_custom_reward_takes_its_own_options(plugin: str) -> None:
    cfg, task = _task("env/reward=custom", f"env.reward._target_={plugin}", "+env.reward.threshold=5")
    assert cfg.env.reward == {"_target_": plugin, "threshold": 5}  # none of the math reward's keys
    assert type(task.reward).__name__ == "Threshold" and task.reward.threshold == 5
    assert task.reward.score(["so 4", "so 7"], ["", ""]).scores == [0.0, 1.0]


def test_a_custom_reward_refuses_keys_it_does_not_take_and_names_its_own(plugin: str) -> None:
    with pytest.raises(ConfigError, match=r"does not take env\.reward\.thresold; it takes: threshold, bonus"):
        _task("env/reward=custom", f"env.reward._target_={plugin}", "+env.reward.thresold=5")
    with pytest.raises(ConfigError, match=r"Missing mandatory value: _target_\n\s*full_key: env\.reward\._target_"):
        _task("env/reward=custom")  # no class named


def test_built_in_reward_nodes_keep_their_keys_and_refuse_unknown_ones() -> None:
    cfg, task = _task("env.reward.format_weight=0.1")
    assert type(task.reward).__name__ == "MathReward" and task.reward.format_weight == 0.1
    with pytest.raises(ConfigError, match=r"Key 'threshold' not in 'MathRewardConfig'"):
        _task("+env.reward.threshold=5")
    cfg, _ = _task("env/reward=countdown")  # another built-in's node, whole: its keys only
    assert type(cfg.env.reward).__name__ == "CountdownRewardConfig"


def test_a_replaced_target_gets_only_the_keys_it_takes(plugin: str) -> None:
    """`env.reward._target_=...` alone, on the built-in node (tests/e2e use it for subclasses of the math reward)."""
    # A subclass of the built-in (the usual case) takes the node as it is.
    _, task = _task("env.reward._target_=my_rewards.Shifted", "env.reward.format_weight=0.2")
    assert type(task.reward).__name__ == "Shifted" and task.reward.format_weight == 0.2
    # Another class: the math keys it does not take are dropped while they hold their defaults ...
    # so a required option of its own is what is missing, and the message says how to give it.
    with pytest.raises(ConfigError, match=r"my_rewards\.Threshold needs threshold: env/reward=custom .*\+env\.reward"):
        _task(f"env.reward._target_={plugin}")
    # ... and refused, naming the way to give it its own node, once the user set one.
    with pytest.raises(ConfigError, match=r"does not take env\.reward\.correct_weight=2\.0 .*env/reward=custom"):
        _task(f"env.reward._target_={plugin}", "env.reward.correct_weight=2")
