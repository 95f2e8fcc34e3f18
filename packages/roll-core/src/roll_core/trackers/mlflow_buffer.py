"""What the MLflow backend (roll_core.trackers.mlflow) buffers for its server: the sample tables' format, and the
bound on the buffer while the server is away.

Points the server has not accepted wait in memory, in the order they were logged, and are resent once it answers.
A server away for hours would let them grow without end, so past a bound the oldest are dropped: what arrives when
the server is back is the newest, and the dropped ones stay in the run folder's metrics.jsonl / samples.jsonl
(the caller counts them and says so).

When `close()` stops waiting for a server that does not answer (`tracking.mlflow.close_timeout_s`), what was not
sent is counted the same way (`Dropped`): the buffer, and the calls still queued for the backend's worker thread
(`Backlog`: their points are not in the buffer yet).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from roll_core.trackers.mlflow_keys import MAX_TAG_VALUE

#: A buffered metric point: MLflow name, value, timestamp (ms), step.
Point = tuple[str, float, int, int]
#: The sample-table artifacts' folder (`samples/step_000002.json`).
SAMPLES_DIR = "samples/"
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"  # what mlflow.log_table maintains for the UI's table views


@dataclass
class Dropped:
    """What one outage dropped so far: metric points, their first and last step (-1: none), sample tables."""

    points: int = 0
    first_step: int = -1
    last_step: int = -1
    tables: int = 0

    def __bool__(self) -> bool:
        return bool(self.points or self.tables)

    def add(self, steps: Sequence[int], tables: int = 0) -> None:
        """Count one point at each of `steps` (a step per point) and `tables` sample tables."""
        if steps:
            first = min(steps)
            self.first_step = first if self.first_step < 0 else min(self.first_step, first)
            self.last_step = max(self.last_step, max(steps))
            self.points += len(steps)
        self.tables += tables


class Backlog:
    """The `log` / `samples` calls queued for the backend's worker thread that it has not begun, with their step
    and how many points and sample tables each carries.

    The training thread numbers each call it queues (`add`); the worker marks the call it begins (`begin`; the calls
    run in order): a begun call's points are in the buffer (or sent) from then on. Only the training thread changes
    the list, so `unsent` may be read while the worker runs.
    """

    def __init__(self) -> None:
        self._calls: deque[tuple[int, int, int, int]] = deque()  # number, step, points, tables
        self._next = 0
        self.begun = -1  # the number of the call the worker began last (set by the worker only)

    def add(self, step: int, points: int = 0, tables: int = 0) -> int:
        """Note a call about to be queued; its number (for `begin`). Forgets the calls begun since."""
        number, self._next = self._next, self._next + 1
        while self._calls and self._calls[0][0] <= self.begun:
            self._calls.popleft()
        if points or tables:
            self._calls.append((number, step, points, tables))
        return number

    def begin(self, number: int) -> None:
        """(The worker) call `number` begins."""
        self.begun = number

    def unsent(self, into: Dropped) -> None:
        """Add the points and tables of the calls not begun to `into`."""
        begun = self.begun
        for number, step, points, tables in list(self._calls):
            if number > begun:
                into.add([step] * points, tables)


def drop_oldest(
    points: list[Point],
    artifacts: dict[str, str],
    tables: list[dict[str, str]],
    max_points: int,
    max_tables: int,
    dropped: Dropped,
) -> bool:
    """Drop, in place, the oldest of `points` beyond `max_points` and the oldest sample tables of `artifacts`
    (paths under SAMPLES_DIR, in the order they were added) beyond `max_tables`, with their entries in `tables`
    (the UI's list must name only tables the run has); add them to `dropped`. True when anything was dropped."""
    excess = len(points) - max_points
    if excess > 0:
        dropped.add([p[3] for p in points[:excess]])
        del points[:excess]
    buffered = [path for path in artifacts if path.startswith(SAMPLES_DIR)]
    cut = buffered[: max(0, len(buffered) - max_tables)]
    for path in cut:
        del artifacts[path]
        entry = {"path": path, "type": "table"}
        if entry in tables:
            tables.remove(entry)
    dropped.tables += len(cut)
    return excess > 0 or bool(cut)


def tables_tag(tables: list[dict[str, str]]) -> str:
    """LOGGED_ARTIFACTS_TAG's value: the newest of `tables` whose JSON list fits MLflow's tag value limit. All of
    them overflowed it after ~150 steps of samples: MLflow cut the text (invalid JSON: no table listed in the UI,
    and a resume failed reading it back) or, with MLFLOW_TRUNCATE_LONG_VALUES=false, refused it (the run failed)."""
    size, kept = 2, 0  # "[]", then each entry and its ", "
    for entry in reversed(tables):
        size += len(json.dumps(entry)) + (2 if kept else 0)
        if size > MAX_TAG_VALUE:
            break
        kept += 1
    return json.dumps(tables[len(tables) - kept :])


def table(step: int, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Sample rows as MLflow's table artifact format (pandas' "split" orient): columns step, then each row key."""
    columns = ["step", *dict.fromkeys(k for row in rows for k in row if k != "step")]
    return {"columns": columns, "data": [[step, *(row.get(c) for c in columns[1:])] for row in rows]}
