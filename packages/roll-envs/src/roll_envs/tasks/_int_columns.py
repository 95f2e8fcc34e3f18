"""Integer columns with nulls, read back as integers (roll_envs.tasks.dataset's `_rows`, which every file task reads
its rows with: env=file, instruct, code, openai_agent).

pandas has no null in an integer column: it makes the column float64 (3 becomes 3.0, a null NaN), and the Parquet,
JSON lines and `datasets` folders written from such a frame hold floats. The answer column reads such a value as
the integer it stands for ("3", dataset's `_plain_number`); the row's other columns (its metadata, which rewards,
environments and judge templates read) held 3.0. A top-level column is read as integers when it is one such column:
a floating-point column (in a Parquet file or a `datasets` folder: by its Arrow type; in JSON: every value in it a
number) whose values are all whole numbers or null, with one null (None or NaN) at least: each whole value becomes
its int and each NaN None. A float column stays float: one holding a non-whole value (0.5) or infinity, text, or no
null (`[1.0, 2.0]`: written as floats, not made floats by a null). Nested values are left as they are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

#: A column's state while scanning: it has a null, it has a whole float, it cannot be an integer column.
_NULL, _WHOLE, _NOT = 1, 2, 4


def restore_int_columns(rows: list[tuple[int, Any]], floating: Iterable[str] | None = None) -> list[tuple[int, Any]]:
    """`rows` ((row number, row) pairs; rows that are no dict are skipped) with each integer column with nulls
    (module docstring) as ints and None, changed in place. `floating`: the columns whose Arrow type is floating
    point (Parquet, `datasets`); None for JSON rows, whose columns are judged by their values."""
    allowed = None if floating is None else set(floating)
    if allowed is not None and not allowed:
        return rows
    state: dict[str, int] = {}
    for _, row in rows:
        if not isinstance(row, dict):
            continue
        for key, value in row.items():
            if allowed is not None and key not in allowed:
                continue
            state[key] = state.get(key, 0) | _kind(value)
    columns = [k for k, s in state.items() if s == _NULL | _WHOLE]
    for _, row in rows:
        if isinstance(row, dict):
            for key in columns:
                if key in row:
                    row[key] = _as_int(row[key])
    return rows


def _kind(value: Any) -> int:
    """What `value` says of its column: a null, a whole float, an int (nothing), or anything else (`_NOT`)."""
    if value is None:
        return _NULL
    if isinstance(value, float):
        if math.isnan(value):
            return _NULL
        return _WHOLE if value.is_integer() else _NOT  # (infinity is not an integer)
    if isinstance(value, int) and not isinstance(value, bool):
        return 0
    return _NOT


def _as_int(value: Any) -> Any:
    """A whole float as its int, NaN as None; anything else (an int, None) unchanged."""
    if isinstance(value, float):
        return None if math.isnan(value) else int(value)
    return value
