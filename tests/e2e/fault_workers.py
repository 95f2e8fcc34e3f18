"""Workers for the call-timeout, dead-rank and restart-rerun tests, in a module of its own: Ray workers import it
without torch."""

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


class Quitter(Worker):
    """A worker whose rank 1 dies in `quit_or_wait()` while the others wait (as in a collective with it)."""

    def __init__(self, marker: str, **base) -> None:
        super().__init__(**base)
        self.marker = Path(marker)

    @dispatch(Dispatch.BROADCAST)
    def quit_or_wait(self, seconds: float) -> int:
        if self.rank == 1:
            os._exit(1)
        time.sleep(seconds)
        self.marker.write_text("waited")  # the wait ended: the caller did not fail early
        return os.getpid()


class Finisher(Worker):
    """A worker whose `work()` appends its rank to `<marker>.started`, sleeps, then appends its rank to the marker
    file: the files count started and finished runs."""

    def __init__(self, marker: str, **base) -> None:
        super().__init__(**base)
        self.marker = Path(marker)

    @dispatch(Dispatch.BROADCAST)
    def work(self, seconds: float) -> int:
        with Path(f"{self.marker}.started").open("a") as f:
            f.write(f"{self.rank}\n")
        time.sleep(seconds)
        with self.marker.open("a") as f:
            f.write(f"{self.rank}\n")
        return os.getpid()
