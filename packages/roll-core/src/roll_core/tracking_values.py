"""What the run's tracker (roll_core.tracking.Tracker) takes as a metric, and how sample values are written as JSON.

Contract of a step's metrics (`MetricValues.record`), checked before anything of the step is recorded:
- a key is a `str`; any other key (an int, a tuple, None, a bool) is a TypeError naming it and its type. A key is
  refused, not converted: `str(1)` and `"1"` would be one metric, and json, the history and the backends each
  converted (or refused) a key their own way (metrics.jsonl said "1", the history and the backends kept 1, and
  MLflow's worker raised TypeError at the next call; a tuple key raised out of json after the record was in the
  history);
- a value is a number: Python's, numpy's, or a one-element numpy array or torch tensor. Integers stay ints (a numpy
  count is `3`, not `3.0`), bools are 0.0/1.0, other numbers floats; None stays None. NaN/inf, and an int past a
  float's range (a double's: what every backend stores; it raised OverflowError), are None, the latter warned
  about once per key;
- any other value (a text, a list, a dict, a many-element array) is not a metric: left out of the record and of
  what backends get, and warned about once per key, naming the value's type (it was left out without a word).

Sample rows (`json_value`) are written as strict JSON: numbers as above (an int past a float's range kept whole,
as JSON holds any int; NaN/inf as None), bools as bools, containers item by item, anything else as it is.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping
from typing import Any

#: The tracker's logger: these warnings read as the tracker's.
log = logging.getLogger("roll_core.tracking")

#: What `number` returns for a value that is not a number.
NOT_A_NUMBER: Any = object()


class MetricValues:
    """A run's metrics as recorded: checks keys, converts values, and warns once per key (see the module
    docstring). One per Tracker: it remembers which keys it warned about."""

    def __init__(self) -> None:
        self.too_large: set[str] = set()  # keys warned about: an int past a float's range
        self.not_numbers: set[str] = set()  # keys warned about: a value that is not a number

    def record(self, metrics: Mapping[Any, Any]) -> dict[str, int | float | None]:
        """`metrics` as a step's record holds them: {key: int, float or None (not finite)}, values that are not
        numbers left out (warned once per key).

        Raises:
            TypeError: a key is not a str (nothing is recorded: the caller checks before writing).
        """
        bad = [k for k in metrics if not isinstance(k, str)]
        if bad:
            said = ", ".join(f"{k!r} ({type(k).__name__})" for k in bad)
            raise TypeError(f"metric keys must be strings; not {said}: name each metric with a str")
        out: dict[str, int | float | None] = {}
        for key, value in metrics.items():
            v = number(value)
            if v is NOT_A_NUMBER:
                if key not in self.not_numbers:
                    self.not_numbers.add(key)
                    log.warning(
                        "metric %r: a %s value is not a number and is left out (warned once per metric)",
                        key,
                        type(value).__name__,
                    )
                continue
            out[key] = v if finite(key, v, self.too_large) else None
        return out


def number(v: Any) -> Any:
    """A metric value as a Python int/float (None stays None), or NOT_A_NUMBER for anything else.

    Integers stay integers whatever their type (Python, numpy, a 0-d or one-element numpy array or torch tensor):
    a numpy count was written as `3.0`, unlike the same count as a Python int, and a reader that takes the value as
    an int (a count, an index) got a float. Bools (Python's, numpy's, a bool tensor's) are 0.0/1.0 as documented."""
    if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)):
        return v
    if hasattr(v, "numel") and hasattr(v, "item"):  # a torch tensor: one element, else not a metric
        return _scalar(v.item()) if v.numel() == 1 else NOT_A_NUMBER
    if isinstance(v, (bool, numbers.Real)):  # numpy scalars register as numbers.Real (numpy's bool does not)
        return _scalar(v.item() if hasattr(v, "item") else v)
    if hasattr(v, "dtype") and hasattr(v, "item") and getattr(v, "size", None) == 1:  # numpy: np.bool_, 0-d, [x]
        return _scalar(v.item())
    return NOT_A_NUMBER


def finite(key: str, v: int | float | None, warned: set[str]) -> bool:
    """Whether a metric's value is a finite number. An int past a float's range (a double's: what every backend
    stores) is not: it raised OverflowError into the training loop; it is null, as inf is, warned about once per
    metric (`warned`: the metrics warned about)."""
    try:
        return v is not None and math.isfinite(v)
    except OverflowError:
        if key not in warned:
            warned.add(key)
            log.warning("metric %r: an int past a float's range is logged as null (as inf is)", key)
        return False


def _scalar(item: Any) -> Any:
    """A Python scalar as a metric: an int as it is, a bool or other real number as a float, else NOT_A_NUMBER."""
    if isinstance(item, int) and not isinstance(item, bool):
        return int(item)
    return float(item) if isinstance(item, (bool, numbers.Real)) else NOT_A_NUMBER


def json_value(v: Any) -> Any:
    """A sample value as strict JSON: bools (numpy's and torch's too) as bools, numbers through `number` (ints as
    ints, NaN/inf: None), lists, tuples and dicts item by item (an agentic episode's task row, a list of scores: a
    NaN inside was written as a bare NaN token and a numpy number inside raised TypeError into the training loop),
    anything else as it is."""
    if isinstance(v, str) or v is None:
        return v
    if isinstance(v, dict):
        return {k: json_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if is_bool(v):  # JSON has booleans: a row's `correct: true` was written 1.0
        return bool(v.item() if hasattr(v, "item") else v)
    n = number(v)
    if n is NOT_A_NUMBER or isinstance(n, int):  # (JSON holds any int: one past a float's range too)
        return v if n is NOT_A_NUMBER else n
    return None if n is not None and not math.isfinite(n) else n


def is_bool(v: Any) -> bool:
    """Whether `v` is one boolean: Python's, numpy's (np.bool_, a 0-d or one-element bool array), a torch bool."""
    if isinstance(v, bool):
        return True
    dtype = getattr(v, "dtype", None)
    if dtype is None or not hasattr(v, "item"):
        return False
    one = v.numel() == 1 if hasattr(v, "numel") else getattr(v, "size", None) == 1
    return one and (getattr(dtype, "kind", None) == "b" or str(dtype) == "torch.bool")
