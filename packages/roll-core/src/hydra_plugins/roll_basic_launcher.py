"""roll's default launcher for Hydra sweeps (`hydra/launcher=basic`, roll's conf/hydra/launcher/basic.yaml shadows
Hydra's own entry): Hydra's BasicLauncher, which runs the jobs one after another in this process, except that every
job's config of a batch is checked as a run checks it (roll_core.sweep_checks.check_basic_batch: unknown keys, the
schemas' checks) before the first job starts. Hydra's launcher composed each job only when its turn came, so a bad
value failed its job after the jobs before it had trained; the Ray launcher already checked (roll_core.sweep_launcher).

Hydra imports every module of the `hydra_plugins` namespace package whatever the application, so this one imports
only Hydra's launcher class; roll_core is imported when a sweep launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra._internal.core_plugins.basic_launcher import BasicLauncher as _HydraBasicLauncher


class BasicLauncher(_HydraBasicLauncher):
    """Hydra's basic launcher; `launch` refuses the batch before any job runs when one job's config is invalid."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        from roll_core.sweep_checks import check_basic_batch

        check_basic_batch(self, job_overrides, initial_job_idx)
        return super().launch(job_overrides, initial_job_idx)
