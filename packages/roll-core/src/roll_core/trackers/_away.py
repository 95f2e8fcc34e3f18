"""Which tracker backends were away while a run folder's steps were redone: `<run>/trackers.json`.

A run may drop a backend on a resume and add it back on a later one (run 1 with `tensorboard`, run 2 without it,
run 3 with it again). When run 2 redoes steps (it resumed from a checkpoint before run 1's last step, or started
afresh), the backend's store still holds run 1's values of those steps, and its own record says it holds them: on
run 3's resume it kept them (TensorBoard's purge starts after the checkpoint; W&B and MLflow continued their run),
so the curve showed the abandoned values where metrics.jsonl holds the redone ones. The run folder's own files drop
such steps (`Tracker.truncate`, and a fresh run's start); this record makes the backends follow the same rule.

`trackers.json` holds {"stale_after": {name: step or null}} for every backend name that has run in the folder:
null when the backend saw every truncation, else the lowest step a truncation kept while it was away (-1: a fresh
run replaced the folder's history). On a resume with that backend, `Tracker.truncate(last_step)` truncates it to
that step instead, resends the steps after it from the run folder's files, and marks it null again. A backend whose
class says `keeps_records = False` (the `jsonl` backend: the core files are its record) is not recorded. A folder
from before this record has none: such a backend is trusted, as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The record's file in the run folder.
RECORD = "trackers.json"


def keeps_records(backend: Any) -> bool:
    """Whether a backend holds its own copy of the steps (False for `jsonl`: it records nothing itself)."""
    return bool(getattr(type(backend), "keeps_records", True))


class AwayRecord:
    """The run folder's `trackers.json` (see the module docstring); `active` are this run's recorded backends."""

    def __init__(self, run_dir: Path, active: Sequence[str], resume: bool) -> None:
        """Read the record and note this run's start: a fresh run (not `resume`) replaced the folder's history, so
        every recorded backend not in `active` holds nothing valid (-1); `active` ones start in step (null)."""
        self.path = Path(run_dir) / RECORD
        self.active = list(active)
        self.stale_after: dict[str, int | None] = self._read() if resume else {}
        if not resume:
            self.stale_after = {name: -1 for name in self._read() if name not in self.active}
        for name in self.active:
            self.stale_after.setdefault(name, None)
        self._save()

    def _read(self) -> dict[str, int | None]:
        if not self.path.exists():
            return {}
        try:
            raw = json.loads(self.path.read_text())["stale_after"]
            return {str(k): None if v is None else int(v) for k, v in raw.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # the record only makes a resume resend more; without it the backends are trusted, as before it existed
            log.warning("%s is unreadable (%s): tracker backends that were away are trusted", self.path, exc)
            return {}

    def _save(self) -> None:
        if not self.stale_after and not self.path.exists():
            return  # a run folder without recorded backends gets no file
        from roll_core.tracking import replace_file

        text = json.dumps({"stale_after": self.stale_after}, sort_keys=True) + "\n"
        if not self.path.exists() or self.path.read_text() != text:
            replace_file(self.path, text)

    def truncate(self, last_step: int) -> dict[str, int]:
        """Note a truncation to `last_step` (backends away now lose what follows it) and return, for each active
        backend that missed an earlier one, the last step it holds valid records of (`caught_up` once it is
        truncated there: its records after that step are stale)."""
        floors: dict[str, int] = {}
        for name, after in self.stale_after.items():
            if name not in self.active:
                self.stale_after[name] = last_step if after is None else min(after, last_step)
            elif after is not None:
                floors[name] = min(after, last_step)
        self._save()
        return floors

    def caught_up(self, names: Sequence[str]) -> None:
        """The backends `names` now hold the run folder's steps (their stale steps dropped and resent)."""
        for name in names:
            self.stale_after[name] = None
        self._save()
