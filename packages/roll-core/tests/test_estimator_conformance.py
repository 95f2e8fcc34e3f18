"""The estimator conformance suite (roll_core.testing.estimators) over every installed `roll.algorithms` entry:
roll-core's own (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, gigpo, turn_grpo) and any
out-of-tree estimator installed alongside."""

from __future__ import annotations

from roll_core import registry
from roll_core.testing.estimators import EstimatorTestSuite

IN_TREE = {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "gigpo", "turn_grpo"}


class TestEveryInstalledEstimator(EstimatorTestSuite):
    pass


def test_in_tree_estimators_are_discovered() -> None:
    """The suite above runs over the in-tree estimators at least (a broken discovery would run zero cases)."""
    assert IN_TREE <= set(registry.available("roll.algorithms"))
