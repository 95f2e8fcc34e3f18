"""The TrainEngine conformance suite over every installed `roll.train_engines` entry point, in-tree (`hf`, `fsdp2`
as one rank in-process, `megatron` at TP=PP=1 over gloo) or out-of-tree. Each is built by its class's
`conformance_engine` hook or constructor (roll_core.testing.train_engine); one that cannot run here skips with the
reason."""

from __future__ import annotations

import pytest

from roll_core import registry
from roll_core.testing.train_engine import TrainEngineTestSuite

IN_TREE = {"hf", "fsdp2", "megatron"}


# torch's FSDP2 warns when a wrapped root returns a view: the critic's score head (a Linear on (N, T, H)) does, under
# `fsdp2 role=critic`. A false alarm here (roll does no in-place op on the values), but it should be silenced in the
# engine, not here: reported (issue 23, conformance suites).
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning")
class TestEveryInstalledTrainEngine(TrainEngineTestSuite):
    @pytest.fixture(scope="class", autouse=True, params=registry.available("roll.train_engines"))
    @classmethod
    def _engine(cls, request: pytest.FixtureRequest) -> None:
        cls.engine_class = registry.load("roll.train_engines", request.param)


def test_in_tree_engines_are_discovered() -> None:
    """The loop above runs over the in-tree engines at least (a broken discovery would run zero cases)."""
    assert IN_TREE <= set(registry.available("roll.train_engines"))
