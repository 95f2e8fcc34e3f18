"""Integer columns with nulls, read back as integers: moved to roll_core.int_columns (post-training's row reader,
roll_core.posttrain.rows, needs it too, and roll-core cannot import roll-envs); this name stays for the task
loaders and their tests."""

from __future__ import annotations

from roll_core.int_columns import float_columns, restore_int_columns

__all__ = ["float_columns", "restore_int_columns"]
