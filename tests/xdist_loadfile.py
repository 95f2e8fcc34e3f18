"""`--dist loadfile` that survives a crashed worker (pytest-xdist 3.8's LoadFileScheduling deadlocks after one).

Loaded by the root conftest (`pytest_xdist_make_scheduler`). The README's test command runs `-n 2 --dist loadfile`:
a test module keeps one worker, so its module-scoped fixtures (a Ray instance: 10-15 s) start once. When a worker
dies (the conftest's watchdog ends a hung test's process, the OOM killer, a segfault), xdist 3.8.0 replaces it, and:
- `remove_node` puts the dead worker's whole workload back on the queue, its finished modules included. A finished
  module is later sent to a worker as an empty batch (`send_runtest_some([])`) that never completes, so that worker
  is never given more; at the end every worker waits for a next test and the controller for a result, for ever
  (pytest-xdist issues #1313, #1378). The CI runs of 2026-12-07 hung so, 25 minutes into the 90-minute limit.
- the test the worker died on goes back with its module and is run again (and may kill the next worker too),
  though xdist already reported it failed (pull request #1371);
- a worker is given one more module only when it holds at most two pending tests; given a one-test module and
  nothing else (a replacement worker late in the run), it waits for a second test before running the first (the
  worker needs the next item) and never ends (issue #1327).
`CrashSafeLoadFile` requeues only the modules with tests left (the crashed test counted done), skips modules with
nothing left when assigning, and tops a worker up to two pending tests or, with the queue empty, tells it to shut
down (it then runs what it holds). Nothing changes while no worker dies.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling


class CrashSafeLoadFile(LoadFileScheduling):
    """LoadFileScheduling whose recovery from a dead worker cannot deadlock (see the module docstring)."""

    def remove_node(self, node: Any) -> str | None:
        workload = self.assigned_work.pop(node)
        if not self._pending_of(workload):
            return None
        crashitem = next(nid for unit in workload.values() for nid, done in unit.items() if not done)
        for unit in workload.values():  # reported failed by xdist: not run again
            if crashitem in unit:
                unit[crashitem] = True
        self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashitem

    def _assign_work_unit(self, node: Any) -> None:
        while self.workqueue:
            scope, unit = self.workqueue.popitem(last=False)
            if all(unit.values()):  # nothing left to run in it: sent, it would never complete
                continue
            self.assigned_work.setdefault(node, {})[scope] = unit
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(nid) for nid, done in unit.items() if not done])
            return

    def _reschedule(self, node: Any) -> None:
        if node.shutting_down:
            return
        # A worker runs a test only once it knows the next one (or that none follows): keep two pending, or say
        # that no more will come.
        while self.workqueue and self._pending_of(self.assigned_work.get(node, {})) < 2:
            self._assign_work_unit(node)
        if not self.workqueue:
            node.shutdown()


def make_scheduler(config: Any, log: Any) -> Any:
    """The scheduler for `--dist loadfile` (None: xdist's own for every other mode)."""
    if config.getvalue("dist") != "loadfile":
        return None
    return CrashSafeLoadFile(config, log)
