"""Value checks shared by the config schemas: each raises ValueError naming the key and saying what it must be."""

from __future__ import annotations

import math
from typing import Any


def one_of(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    # NaN compares false with everything, so `value < 0` alone lets algo.lr=nan through to the optimizer.
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number {'>= 0' if allow_zero else '> 0'}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def positive_or_null(name: str, value: float | None) -> None:
    """Optional thresholds (clips, caps, targets): null disables them; 0 or less would silently zero what they bound."""
    if value is not None:
        positive(name, value)
