"""What an environment's reset and step return, checked: one rule for roll's env manager and the third-party
adapters (roll_envs.agentic.gem_adapter, skyrl_adapter), so an environment is read the same way whichever route it
takes.

- `checked_reset(result, env)`: a reset's (observation, info): a 2-tuple (or list) whose info is a Mapping or None.
  An old-Gym `reset()` returning the observation alone was split into (observation, info) when it had two parts.
- `checked_step(result, env)`: a step's (observation, reward, terminated, truncated, info), Gymnasium's 5 values,
  each checked by the functions below. An old-Gym step's (obs, reward, done, info) is refused: its `done` cannot
  be split into terminated and truncated.
- `checked_observation(obs, env, ended=...)`: an observation that is not None. None reached the model as the text
  "None" (`str(None)`); it is a ValueError, except on a step that ends the episode, where it is the empty
  observation "" (no turn reads it: an environment with nothing left to show may return None there).
- `checked_info(info, env)`: the info as a dict (None is {}). Anything but a Mapping or None is a ValueError: the
  env manager's `dict(info or {})` read a list of pairs as an info and 0, "" or False as {}. Its "success" and
  "invalid_action" are flags (`checked_flag(..., real=True)`, None read as absent): the rollout's `bool()` read
  the string "False" as a success. Its "state" of None is absent (the rollout then keys the anchor state by the
  observation, roll_core.agentic.observation.state_key): read as the text "None", it gave every state of an
  environment that does not track one the same GiGPO anchor key, and every turn of a group one step group.
- `checked_reward(value, env)`: a finite real number, as a float. `float()` read the string "1.0" as a reward, and
  NaN or None failed later, far from the environment that returned it.
- `checked_flag(value, name, env)`: a bool, 0/1 or a NumPy bool (`real=True`: also 0.0/1.0, Gymnasium's float
  `is_success`), as a bool. `bool()` read the string "False", or None, as True.

NumPy scalars and one-element arrays (or tensors) are read through their `item()`: third-party environments return
`np.float32` rewards and `np.bool_` flags. Anything else is a ValueError naming the environment (`env`, when given)
and the value, which the env manager counts as an environment error (`env_error`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = [
    "INFO_FLAGS",
    "checked_flag",
    "checked_info",
    "checked_observation",
    "checked_reset",
    "checked_reward",
    "checked_step",
]

#: The info keys read as flags (a step's success, an invalid reply).
INFO_FLAGS = ("success", "invalid_action")


def _where(env: str | None) -> str:
    return f"{env}: " if env else ""


def _scalar(value: Any) -> Any:
    """`value`, or the Python scalar of a one-element NumPy array or scalar (or tensor)."""
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (str, bytes)):
        try:
            return item()
        except (TypeError, ValueError):  # more than one element: left as it is, refused by the caller
            return value
    return value


def checked_reward(value: Any, env: str | None = None) -> float:
    """A step's reward as a float; ValueError (naming `env`) for anything but a finite real number."""
    reward = _scalar(value)
    try:
        finite = isinstance(reward, numbers.Real) and math.isfinite(reward)
    except OverflowError:  # an int past float's range
        finite = False
    if not finite:
        raise ValueError(f"{_where(env)}step returned the reward {value!r:.80}; rewards must be finite real numbers")
    return float(reward)


def checked_flag(value: Any, name: str, env: str | None = None, *, real: bool = False) -> bool:
    """A flag (`terminated`, `truncated`, an info's `success`) as a bool; ValueError (naming `env`) for anything but
    a bool or 0/1 (`real`: 0.0/1.0 too)."""
    flag = _scalar(value)
    if isinstance(flag, bool):
        return flag
    kind = numbers.Real if real else numbers.Integral
    if isinstance(flag, kind) and flag in (0, 1):
        return bool(flag)
    raise ValueError(f"{_where(env)}step returned the {name} flag {value!r:.80}; it must be a bool (or 0/1)")


def checked_info(info: Any, env: str | None = None) -> dict[str, Any]:
    """A reset's or step's info as a (new) dict, its `INFO_FLAGS` as bools and a "state" of None left out (read as
    absent, as the module docstring says); ValueError (naming `env`) for an info that is not a Mapping or None, or a
    flag that is not a bool or 0/1 (None is kept: read as absent)."""
    if info is not None and not isinstance(info, Mapping):
        raise ValueError(
            f"{_where(env)}its info is {type(info).__name__} {info!r:.80}; it must be a dict (a Mapping) or None"
        )
    out = dict(info or {})
    for key in INFO_FLAGS:
        if out.get(key) is not None:
            out[key] = checked_flag(out[key], f'info["{key}"]', env, real=True)
    if "state" in out and out["state"] is None:
        del out["state"]
    return out


def checked_observation(obs: Any, env: str | None = None, *, call: str = "step", ended: bool = False) -> Any:
    """`obs` unless it is None: then "" when the call `ended` the episode (no turn reads it), else a ValueError
    (naming `env` and the `call`) instead of the model reading the text "None"."""
    if obs is not None:
        return obs
    if ended:
        return ""
    raise ValueError(
        f"{_where(env)}{call} returned the observation None; an observation is text (or a dict of 'text' and "
        "'images') that the model reads next: None would reach it as the text 'None' (None is read as an empty "
        "observation only on the step that ends the episode)"
    )


def checked_reset(result: Any, env: str | None = None) -> tuple[Any, dict[str, Any]]:
    """A reset's (observation, info), the info by `checked_info`; ValueError (naming `env`) for anything else."""
    # a list as well: third-party environments return [obs, info] and worked; an old-Gym observation ending in a dict
    # or None is too unlikely to refuse them for it
    if isinstance(result, (tuple, list)) and len(result) == 2 and (result[1] is None or isinstance(result[1], Mapping)):
        return checked_observation(result[0], env, call="reset"), checked_info(result[1], env)
    raise ValueError(
        f"{_where(env)}reset returned {type(result).__name__} {result!r:.80}; the Env contract (roll_core.interfaces) "
        "is that reset returns a 2-tuple (observation, info dict): an old-Gym environment whose reset returns only "
        "the observation must be wrapped to return (observation, {})"
    )


def checked_step(result: Any, env: str | None = None) -> tuple[Any, float, bool, bool, dict[str, Any]]:
    """A step's (observation, reward, terminated, truncated, info), each checked (module docstring); ValueError
    (naming `env`) for a result that is not Gymnasium's 5 values."""
    if not isinstance(result, (tuple, list)) or len(result) != 5:
        # an old-Gym env's (obs, reward, done, info) has no truncation flag: its `done` cannot be split
        got = f"{len(result)} values" if isinstance(result, (tuple, list)) else type(result).__name__
        raise ValueError(
            f"{_where(env)}step returned {got}; an environment's step returns (observation, reward, terminated, "
            "truncated, info), as Gymnasium's (wrap an old-Gym env in gymnasium's compatibility wrapper)"
        )
    obs, reward, terminated, truncated, info = result
    reward = checked_reward(reward, env)
    terminated = checked_flag(terminated, "terminated", env)
    truncated = checked_flag(truncated, "truncated", env)
    info = checked_info(info, env)
    return checked_observation(obs, env, ended=terminated or truncated), reward, terminated, truncated, info
