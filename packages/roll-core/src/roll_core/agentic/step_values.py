"""The values an environment's step returns, checked: one rule for roll's env manager and the third-party adapters
(roll_envs.agentic.gem_adapter, skyrl_adapter), so an environment is read the same way whichever route it takes.

- `checked_reward(value, env)`: a finite real number, as a float. `float()` read the string "1.0" as a reward, and
  NaN or None failed later, far from the environment that returned it.
- `checked_flag(value, name, env)`: a bool, 0/1 or a NumPy bool (`real=True`: also 0.0/1.0, Gymnasium's float
  `is_success`), as a bool. `bool()` read the string "False", or None, as True.

NumPy scalars and one-element arrays (or tensors) are read through their `item()`: third-party environments return
`np.float32` rewards and `np.bool_` flags. Anything else is a ValueError naming the environment (`env`, when given)
and the value.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["checked_flag", "checked_reward"]


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
        where = f"{env}: " if env else ""
        raise ValueError(f"{where}step returned the reward {value!r:.80}; rewards must be finite real numbers")
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
    where = f"{env}: " if env else ""
    raise ValueError(f"{where}step returned the {name} flag {value!r:.80}; it must be a bool (or 0/1)")
