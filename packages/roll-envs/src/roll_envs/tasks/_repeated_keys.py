"""JSON objects that name a key twice with different values (`{"answer": "1", "answer": "2"}`).

`json` keeps the last value without a word, so such a row trained on one of two answers (or prompts, or test
lists) and nobody knew which its author meant. Contract: a `RepeatedKeys()` instance is an `object_pairs_hook`
for `json.loads` that builds each object as `json` does and records, in `found`, the key of every object that
repeats one with another value (another type counts: 1 and 1.0); the same value twice is harmless and not
recorded. `repeated_key(value)` names such a key anywhere in a value decoded with the hook (objects nested in
objects and lists), or None. The data loader (roll_envs.tasks.dataset) makes those rows counted skips.
"""

from __future__ import annotations

from typing import Any


class _Repeated(dict):  # type: ignore[type-arg]
    """An object decoded from JSON that repeats `key` with another value (the last value kept, as `json` does)."""

    key: str = ""


class RepeatedKeys:
    """`object_pairs_hook` recording the objects that repeat a key with another value (see the module docstring)."""

    def __init__(self) -> None:
        self.found: list[str] = []

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        row = dict(pairs)
        if len(row) == len(pairs):  # (the common case: no key twice, no more work)
            return row
        first: dict[str, Any] = {}
        for k, v in pairs:
            if k in first and not (type(first[k]) is type(v) and first[k] == v):
                out = _Repeated(row)
                out.key = k
                self.found.append(k)
                return out
            first.setdefault(k, v)
        return row


def repeated_key(value: Any) -> str | None:
    """The key some object in `value` (decoded with a `RepeatedKeys` hook) repeats with another value, or None."""
    todo = [value]
    while todo:  # (a loop, not recursion: a value as deep as json's own limit allows)
        v = todo.pop()
        if isinstance(v, _Repeated):
            return v.key
        if isinstance(v, dict):
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return None


def repeated_reason(key: str) -> str:
    """Why a row repeating `key` is skipped."""
    return f"repeats the key {key!r} with different values (JSON keeps the last one: which was meant is unknown)"
