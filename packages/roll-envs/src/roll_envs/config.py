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


@dataclass
class AgenticEnvConfig:
    """A multi-turn environment (roll_envs.agentic): its name and options, seeds, and episode limits."""

    _target_: str = "roll_envs.agentic.task.AgenticTask"
    # Environment: sokoban | frozen_lake | guess_number | tool_math | gem:<id> | gym:<id>.
    env: str = MISSING
    # Display name (logs); null: the environment's name.
    name: str | None = None
    # Keyword arguments of the environment (board size, boxes, slipperiness, ...).
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    # Assistant turns per episode at most.
    max_turns: int = 8
    # Tokens of a whole trajectory (prompt, responses, observations) at most.
    max_context_length: int = 2048
    # Tokens one assistant turn may generate.
    max_tokens_per_turn: int = 128
    # Seconds an environment reset or step may take before its episode ends (counted as env_timeout).
    step_timeout_s: float = 30.0
    # Threads stepping environments concurrently (per env worker).
    env_threads: int = 16
    # Env workers hosting the environments (roll_core.agentic.env_workers); 0: in the controller's process.
    num_workers: int = 0
    # Held-out environment seeds (disjoint from training seeds).
    eval_size: int = 32
    eval_seed_offset: int = 1_000_000
    # System prompt; null: the environment's instructions.
    system_prompt: str | None = None
    # Solved episodes played by the environment's expert, shown before every episode (a worked example).
    demonstrations: int = 0

    def __post_init__(self) -> None:
        if min(self.max_turns, self.max_context_length, self.max_tokens_per_turn, self.eval_size) < 1:
            raise ValueError("env.max_turns, max_context_length, max_tokens_per_turn and eval_size must be >= 1")
        if self.max_tokens_per_turn >= self.max_context_length:
            raise ValueError("env.max_tokens_per_turn must be below env.max_context_length")
        if self.step_timeout_s <= 0:
            raise ValueError("env.step_timeout_s must be > 0")
        if self.num_workers < 0:
            raise ValueError("env.num_workers must be >= 0")
        if self.demonstrations < 0:
            raise ValueError("env.demonstrations must be >= 0")


def register_configs() -> None:
    """Store the env schemas under the `env` group."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(group="env", name="arithmetic_schema", node=ArithmeticEnvConfig)
    cs.store(group="env", name="countdown_schema", node=CountdownEnvConfig)
    cs.store(group="env", name="file_schema", node=FileEnvConfig)
    cs.store(group="env", name="agentic_schema", node=AgenticEnvConfig)
