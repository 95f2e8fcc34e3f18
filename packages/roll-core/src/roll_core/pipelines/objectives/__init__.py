"""Objectives: how the Trainer turns a collected batch into optimizer steps (RL, SFT, DPO, distillation, none).

A pipeline kind is a collector (where batches come from) plus an objective (what the update does with them). The
collector factory names its objective (`factory.objective`, a `roll.objectives` entry point); the objective
factory says which training-side roles it needs (`needs(cfg) -> RoleNeeds`, read by `build_roles` before any
model loads) and builds the objective from the config and the built roles.

Contract of an `Objective`:
- `update(step, collected, out)` trains on `collected` (roll_core.pipelines.collectors.Collected) and writes its
  metrics to `out`; the actor's train metrics go under `actor/` (`actor/nonfinite_steps` counts optimizer steps
  skipped for a non-finite loss: the Trainer stops a run after a streak of them).
- `state_dict()` / `load_state_dict(state)`: what a resumed run needs (the RL objective's adaptive KL coefficient;
  the DPO objective's cached reference log-probs are recomputed, never trusted across runs).
- `check(cfg)` (on the factory) raises ConfigError before anything is built.

Loss objects (what engines call per micro-batch) live in roll_core.pipelines.losses and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from roll_core.pipelines.losses import PolicyObjective, ValueObjective, agg_units

if TYPE_CHECKING:
    from roll_core.config.schema import RLVRConfig
    from roll_core.pipelines.collectors import Collected
    from roll_core.pipelines.metrics import StepLog
    from roll_core.pipelines.wiring import Roles

__all__ = [
    "Objective",
    "ObjectiveFactory",
    "PolicyObjective",
    "RoleNeeds",
    "ValueObjective",
    "agg_units",
    "load_objective",
]


@dataclass
class RoleNeeds:
    """The training-side roles an objective needs (build_roles builds exactly these)."""

    #: A trainable actor (false only for rollout-only runs: nothing trains, no weights sync).
    train: bool = True
    #: A frozen reference policy (the base model, or the actor's base with LoRA adapters off).
    reference: bool = False
    #: A value model (PPO's GAE).
    critic: bool = False
    #: Frozen teachers by name -> model path (on-policy or offline distillation scored by a teacher role).
    teachers: dict[str, str] = field(default_factory=dict)


class Objective(Protocol):
    """What the Trainer runs on each collected batch (see the module docstring)."""

    def update(self, step: int, collected: Collected, out: StepLog) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ObjectiveFactory(Protocol):
    """What a `roll.objectives` entry point loads to."""

    def needs(self, cfg: RLVRConfig) -> RoleNeeds:
        """The roles `build_roles` must build for this objective (and raise ConfigError for unusable settings)."""
        ...

    def __call__(self, cfg: RLVRConfig, roles: Roles, *, trajectories: bool) -> Objective: ...


def load_objective(name: str) -> ObjectiveFactory:
    """The installed `roll.objectives` factory called `name` (a clear error lists the installed ones)."""
    from roll_core import registry

    return registry.load("roll.objectives", name)
