"""Config schemas of roll-envs' tasks and rewards, registered in Hydra's ConfigStore under `env/`.

Each schema's `_target_` names the class it builds; its fields bind to that class's constructor (checked by
tests/configs). The `reward` field is itself a `_target_` node so any installed reward can be swapped in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class MathRewardConfig:
    """Boxed-answer math reward (math-verify)."""

    _target_: str = "roll_envs.rewards.math.MathReward"
    # Score of a verified boxed answer.
    correct_weight: float = 1.0
    # Score when not verified but the last number in the response is right (0 disables).
    last_number_weight: float = 0.0
    # Bonus for any \boxed{} (0 disables).
    format_weight: float = 0.0
    # Per-sample parse/verify timeout, seconds.
    timeout_s: int = 5


@dataclass
class CountdownRewardConfig:
    """Countdown equation checker."""

    _target_: str = "roll_envs.tasks.countdown.CountdownReward"
    # Bonus for any \boxed{}.
    format_weight: float = 0.0


@dataclass
class ArithmeticEnvConfig:
    """Procedurally generated arithmetic."""

    _target_: str = "roll_envs.tasks.arithmetic.ArithmeticTask"
    name: str = "arithmetic"
    # Digits per operand (1: 0-9, 2: 10-99).
    digits: int = 1
    # Operands per problem.
    num_terms: int = 2
    # Operators drawn uniformly.
    ops: list[str] = field(default_factory=lambda: ["+"])
    # Training problems (drawn with replacement once the split is exhausted).
    train_size: int = 2000
    # Held-out problems.
    eval_size: int = 100
    # Fraction of the problem space reserved for held-out problems (by stable hash).
    eval_fraction: float = 0.2
    # Seed of the draw.
    seed: int = 0
    # Appended to each question.
    instruction: str = "Put the final answer in \\boxed{}."
    # Optional system message.
    system_prompt: str | None = None
    # Worked training examples shown before each question (chat turns).
    examples: int = 0
    reward: Any = field(default_factory=MathRewardConfig)


@dataclass
class CountdownEnvConfig:
    """Countdown numbers game."""

    _target_: str = "roll_envs.tasks.countdown.CountdownTask"
    name: str = "countdown"
    num_numbers: int = 3
    max_number: int = 10
    train_size: int = 2000
    eval_size: int = 100
    eval_fraction: float = 0.2
    seed: int = 0
    system_prompt: str | None = None
    reward: Any = field(default_factory=CountdownRewardConfig)


@dataclass
class FileEnvConfig:
    """User data from JSONL / Parquet / a datasets folder."""

    _target_: str = "roll_envs.tasks.dataset.FileTask"
    name: str = "data"
    # Training data file or folder.
    path: str = MISSING
    # Held-out data; null: a stable-hash fraction of `path`.
    eval_path: str | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    eval_fraction: float = 0.1
    eval_size: int = 100
    system_prompt: str | None = None
    reward: Any = field(default_factory=MathRewardConfig)


def register_configs() -> None:
    """Store the env schemas under the `env` group."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(group="env", name="arithmetic_schema", node=ArithmeticEnvConfig)
    cs.store(group="env", name="countdown_schema", node=CountdownEnvConfig)
    cs.store(group="env", name="file_schema", node=FileEnvConfig)
