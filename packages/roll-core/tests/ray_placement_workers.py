"""Workers for test_cluster_ray_placement.py, in a module of their own: Ray workers import it (the test module,
imported by pytest's importlib mode, is not importable by name).

- `LaunchEnv`: reports the torch.distributed launch variables its process sees after the group's set-up.
"""

from __future__ import annotations

import os

from roll_core.cluster.worker import INHERITED_LAUNCH_ENV, Dispatch, Worker, dispatch


class LaunchEnv(Worker):
    @dispatch(Dispatch.BROADCAST)
    def launch_env(self) -> dict[str, str | None]:
        return {var: os.environ.get(var) for var in INHERITED_LAUNCH_ENV}
