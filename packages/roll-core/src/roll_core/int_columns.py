"""Integer columns with nulls, read back as integers: in the rows every data file is read into, the RL tasks'
(roll_envs.tasks.dataset's `_rows`: env=file, instruct, code, openai_agent) and post-training's
(roll_core.posttrain.rows: SFT, preference, distillation). Pure Python; `float_columns` reads an Arrow schema.

pandas has no null in an integer column: it makes the column float64 (3 becomes 3.0, a null NaN), and the Parquet, JSON
lines and `datasets` folders written from such a frame hold floats. An RL task's answer column reads such a value as the
integer it stands for ("3", roll_envs.tasks.dataset's `_plain_number`); the row's other columns (its metadata, which
rewards, environments and judge templates read; a post-training row's `prompt_id`, which groups a prompt's rollout rows
and must be text or an integer) held 3.0. A column is read as integers when it is one such column: a floating-point
column (in a Parquet file or a `datasets` folder: by its Arrow type; in JSON: every value in it a number) whose values
are all whole numbers or null, with one null (None or NaN) at least: each whole value becomes its int and each NaN None.
A float column stays float: one holding a non-whole value (0.5) or infinity, text, or no null (`[1.0, 2.0]`: written as
floats, not made floats by a null).

A field of a struct column (a nested object: `{"meta": {"id": 3}}`, its path `meta.id`) is a column of its own, by
the same rule, at any depth of structs: the dicts pandas builds from a frame with such a column (`{"id": 3.0}`,
`{"id": nan}`) are written as a struct of floats, and read as 3.0 and NaN before. A path whose value is an object in
one row and a number in another is no column. Values in lists and maps are left as they are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

#: A column's state while scanning: it has a null, it has a whole float, it cannot be an integer column.
_NULL, _WHOLE, _NOT = 1, 2, 4

#: A column: the keys from the row down to the field (`("level",)`, `("meta", "id")`).
Path = tuple[str, ...]


def restore_int_columns(
    rows: list[tuple[int, Any]], floating: Iterable[str | Path] | None = None
) -> list[tuple[int, Any]]:
    """`rows` ((row number, row) pairs; rows that are no dict are skipped) with each integer column with nulls
    (module docstring), top-level or a struct's field, as ints and None, changed in place. `floating`: the columns
    whose Arrow type is floating point (Parquet, `datasets`: a name, or a struct field's path); None for JSON rows,
    whose columns are judged by their values."""
    allowed = None if floating is None else {(c,) if isinstance(c, str) else tuple(c) for c in floating}
    if allowed is not None and not allowed:
        return rows
    inner = None if allowed is None else {p[:i] for p in allowed for i in range(1, len(p))}
    state: dict[Path, int] = {}
    for _, row in rows:
        if isinstance(row, dict):
            _scan(row, (), allowed, inner, state)
    columns = [p for p, s in state.items() if s == _NULL | _WHOLE]
    for _, row in rows:
        if isinstance(row, dict):
            for path in columns:
                _restore(row, path)
    return rows


def _scan(
    obj: dict[str, Any], at: Path, allowed: set[Path] | None, inner: set[Path] | None, state: dict[Path, int]
) -> None:
    """Fold what each field of `obj` (at path `at`) says of its column into `state`, into nested dicts too."""
    for key, value in obj.items():
        path = (*at, key)
        if isinstance(value, dict):
            if inner is None or path in inner:
                _scan(value, path, allowed, inner, state)
            state[path] = state.get(path, 0) | _NOT  # an object here: this path is no number column
        elif allowed is None or path in allowed:
            state[path] = state.get(path, 0) | _kind(value)


def _restore(row: dict[str, Any], path: Path) -> None:
    """The value at `path` in `row` (when the row has it) as an int or None."""
    obj: Any = row
    for key in path[:-1]:
        obj = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(obj, dict) and path[-1] in obj:
        obj[path[-1]] = _as_int(obj[path[-1]])


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


def float_columns(schema: Any) -> list[Path]:
    """The floating-point columns of an Arrow schema, top-level or a field of structs (`("meta", "id")`), as
    `restore_int_columns` reads them (values in lists and maps are not columns)."""
    import pyarrow.types as pat

    def floating(path: Path, t: Any) -> list[Path]:
        if pat.is_struct(t):
            return [p for i in range(t.num_fields) for p in floating((*path, t.field(i).name), t.field(i).type)]
        return [path] if pat.is_floating(t) else []

    return [p for f in schema for p in floating((f.name,), f.type)]
