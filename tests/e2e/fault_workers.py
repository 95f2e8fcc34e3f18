"""A worker for the call-timeout tests, in a module of its own: a Ray worker imports it without torch (fast start)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from roll_core.cluster.worker import Dispatch, Worker, dispatch


class Napper(Worker):
    """A worker whose first incarnation hangs in `nap()` (it leaves a marker file); a restarted one answers."""

    def __init__(self, marker: str, **base) -> None:
        super().__init__(**base)
        self.marker = Path(marker)

    @dispatch(Dispatch.BROADCAST)
    def nap(self, seconds: float) -> int:
        if not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            time.sleep(seconds)
        return os.getpid()
