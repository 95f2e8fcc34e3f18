"""The `none` objective (`roll.objectives`): nothing trains (rollout-only runs: generate, score, write rows).

Its roles have no actor (RoleNeeds(train=False)): no training model is loaded and no weights sync. A collector
that pairs with it returns None from `next` (its rows are written by the collector itself); a batch handed to
`update` anyway is an error, never silently dropped work.
"""

from __future__ import annotations

from typing import Any

from roll_core.config.schema import RLVRConfig
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives import RoleNeeds
from roll_core.pipelines.wiring import Roles


class NoObjective:
    """Trains nothing (see the module docstring)."""

    def update(self, step: int, collected: Collected, out: StepLog) -> None:
        raise RuntimeError(
            f"step {step}: the `none` objective trains nothing, but the collector returned a batch of "
            f"{len(collected.batch)} rows: a rollout-only collector writes its rows and returns None"
        )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _None:
    def needs(self, cfg: RLVRConfig) -> RoleNeeds:
        return RoleNeeds(train=False)

    def __call__(self, cfg: RLVRConfig, roles: Roles, *, trajectories: bool) -> NoObjective:
        return NoObjective()


no_objective = _None()
