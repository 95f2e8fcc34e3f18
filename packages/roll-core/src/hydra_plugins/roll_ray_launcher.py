"""roll's Ray launcher for Hydra sweeps (`hydra/launcher=ray`): hydra-ray-launcher's RayLauncher, except that a
job whose process dies is recorded as killed and the sweep goes on (the work: roll_core.sweep_launcher).

Hydra imports every module of the `hydra_plugins` namespace package whatever the application, so this one imports
only Hydra and hydra-ray-launcher's light class module; without roll-core[sweep] it defines nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from hydra_plugins.hydra_ray_launcher.ray_launcher import RayLauncher as _HydraRayLauncher
except ImportError:  # roll-core[sweep] not installed: hydra/launcher=ray then fails to find the class
    _HydraRayLauncher = None  # type: ignore[assignment,misc]

if _HydraRayLauncher is not None:

    class RayLauncher(_HydraRayLauncher):
        """hydra-ray-launcher's launcher; `launch` waits for every job and records the killed ones."""

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
            from roll_core.sweep_launcher import launch_jobs

            return launch_jobs(self, job_overrides, initial_job_idx)
