"""The environment contract of agentic RL: text environments in the GEM / Gymnasium shape.

An `Env` is one episode at a time: `reset(seed)` starts a seeded, reproducible instance and returns the first
observation (text) and an info dict; `step(action)` takes the model's whole reply (text) and returns the next
observation, the reward of that step, `terminated` (the episode reached a terminal state: solved or failed),
`truncated` (stopped by a limit of the environment) and info.
An observation is text, or text with pictures for vision-language policies: `{"text": str, "images": [...]}`
(PIL images, uint8 arrays, bytes or paths; `<image>` markers in the text place them, else they come first; see
roll_core.agentic.observation and roll_envs' `visual_frozen_lake`).

Info keys roll reads (all optional):
- `invalid_action` (bool): the reply could not be parsed as an action; the environment did not change state and the
  observation says what a valid action looks like (the episode goes on);
- `success` (bool): the episode's goal was reached (success-rate metrics);
- `state` (str): a canonical key of the environment state *before* the next action (GiGPO groups steps of a
  group's trajectories that share it); defaults to the observation text and a digest of each of its pictures'
  pixels (roll_core.agentic.observation.state_key: states that differ only in their pictures stay apart); another
  value keys as its text, with any NumPy array or tensor in it keyed by a digest of its bytes (`info_state_key`);
- `tool_calls` (int): tool calls made in this step;
- the counters of `INFO_COUNTERS` (int >= 0 each, this step's count): `tool_errors` (a tool raised),
  `ignored_tool_calls` (calls after the first of one reply, not run) and `tool_error_outputs` (a tool answered
  a failure: its `ToolText` flag, else text starting `error: `; roll_envs.agentic.tool_env). Roll sums each over
  an episode (`Trajectory.counters`) and logs its mean
  per episode as `episode/<name>_mean` (`eval/<name>_mean` for held-out episodes), as it does `tool_calls`
  (`episode/tool_calls_mean`). A count (these or `tool_calls`) that is not a whole number >= 0 (a bool counts as
  0/1, None as 0) is a ValueError naming the key: the env manager fails the step as an env_error.

Contract: the same seed gives the same instance, and the environment never raises for a malformed action (a
raising or hanging environment is the env manager's problem: it ends that trajectory and counts it). Environments
are plain Python objects; roll's env managers may run many of them per worker and step them concurrently.
Optional `close()` (no arguments): releases what the instance holds (connections, processes, files); roll's env
manager calls it once when it drops the instance (it failed) and for every instance when the run's environments
close, possibly on an instance that was never reset. A close that raises is logged and counted, not fatal.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol, runtime_checkable

#: Numeric info keys summed over an episode and logged per episode (module docstring). A new counter of an
#: environment reaches the run's metrics by being named here.
INFO_COUNTERS: tuple[str, ...] = ("tool_errors", "ignored_tool_calls", "tool_error_outputs")


def info_count(info: Any, key: str) -> int:
    """The count `info[key]` of one step (0 when absent or None): a whole number >= 0, else a ValueError naming the
    key (a string or a negative count added to an episode's sum would be a wrong metric, silently)."""
    value = info.get(key) if hasattr(info, "get") else None
    if value is None:
        return 0
    count: int | None = None
    # bool and NumPy integers are Integral; a NumPy bool scalar is not (dtype kind "b", no dimensions)
    numpy_bool = getattr(getattr(value, "dtype", None), "kind", "") == "b" and getattr(value, "ndim", 1) == 0
    if isinstance(value, numbers.Integral) or numpy_bool:
        count = int(value)
    elif isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        count = int(value)
    if count is None or count < 0:
        raise ValueError(f"info[{key!r}] must be a whole number >= 0 (a count of this step), got {value!r}")
    return count


@runtime_checkable
class Env(Protocol):
    """A text environment (GEM-compatible)."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an episode; returns (observation, info)."""
        ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply the model's reply; returns (observation, reward, terminated, truncated, info)."""
        ...


@runtime_checkable
class EnvWithInstructions(Env, Protocol):
    """An environment that describes its rules and action format (used as the system prompt)."""

    def instructions(self) -> str:
        """Rules, the action format, and what a reply should end with."""
        ...
