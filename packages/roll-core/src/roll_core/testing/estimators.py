"""Conformance suite of the advantage-estimator contract (`roll_core.algorithms`, entry-point group
`roll.algorithms`): every installed estimator passes it.

An estimator is loaded as a run loads it (`roll_core.algorithms.load_estimator`) and called on `AdvantageInputs`
with a real `AlgoConfig` (group_size 4, gamma = lam = 1).

Outcome batch (single-turn RLVR: consecutive groups of `group_size` rows, prefix masks of different lengths, junk
and NaN on the padding of `token_rewards` and `values`): advantages (and returns, when given) are (B, R), finite
and exactly 0 where the mask is 0; within a group the best row's mean advantage exceeds the worst row's; for the
group-relative estimators (`group_relative`: grpo, dr_grpo, rloo) a group whose rewards are all equal gets exactly
zero advantage. An estimator that needs critic values raises ValueError naming them when called without (gae).
An estimator that `needs_turns` is refused for outcome batches with a ConfigError.

Trajectory batch (agentic, only when the estimator's `trajectories` is true; else loading it for trajectories is a
ConfigError): `group_ids` with groups of unequal sizes and non-contiguous ids, masks with holes (observation
tokens), an all-zero padding row, and `turns` (turn_rewards, turn_mask, turn_ids, state_keys) when the estimator
`needs_turns`: (B, R), finite, 0 where the mask is 0 (holes and padding row included); group-relative estimators
give a group with equal episode rewards zero advantage.

roll-core's tests run it over every installed entry (packages/roll-core/tests/test_estimator_conformance.py), so
an installed out-of-tree estimator is checked too. An estimator package can run it on its own entries::

    from roll_core.testing.estimators import EstimatorTestSuite

    class TestMyEstimators(EstimatorTestSuite):
        names = ("my_estimator",)          # default: every installed roll.algorithms entry
        group_relative = frozenset({"my_estimator"})  # if it is a group baseline
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

from roll_core.algorithms import AdvantageInputs, Estimator, load_estimator, token_rewards_from_scores
from roll_core.errors import ConfigError

__all__ = ["EstimatorTestSuite", "outcome_inputs", "trajectory_inputs"]

GROUP_SIZE = 4


def _algo() -> Any:
    from roll_core.config.schema import AlgoConfig

    return AlgoConfig(group_size=GROUP_SIZE, gamma=1.0, lam=1.0)


def outcome_inputs(with_values: bool = True) -> AdvantageInputs:
    """Three groups of `GROUP_SIZE` rows, R = 6: group 0 mixed rewards, group 1 all equal (1.0), group 2 mixed;
    response lengths 1..6; NaN and 1e6 on the padding of token_rewards and values (they must not leak)."""
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.2, 1.0, 0.0])
    lengths = torch.tensor([3, 6, 1, 4, 2, 5, 6, 3, 4, 1, 6, 2])
    r = 6
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    token_rewards = token_rewards_from_scores(scores, mask)
    pad = ~mask.bool()
    junk = torch.where(torch.arange(r)[None, :] % 2 == 0, torch.tensor(float("nan")), torch.tensor(1e6))
    token_rewards = torch.where(pad, junk, token_rewards)
    values = torch.where(pad, junk, torch.full_like(mask, 0.25)) if with_values else None
    return AdvantageInputs(scores=scores, token_rewards=token_rewards, mask=mask, values=values)


#: Rows of the outcome batch whose group's rewards are all equal.
EQUAL_GROUP = slice(GROUP_SIZE, 2 * GROUP_SIZE)


def trajectory_inputs(with_turns: bool) -> tuple[AdvantageInputs, Tensor]:
    """Seven trajectories of up to 3 turns over R = 10 tokens: group 7 (rows 0, 3, 5) mixed episode rewards, group 2
    (rows 1, 4) equal rewards and equal turns, group 11 (row 2) alone, row 6 an all-masked padding row (group 7).
    Each turn is 2 assistant tokens followed by 1 observation token (a hole). Returns (inputs, the equal-group
    rows as a bool (B,) tensor)."""
    num_turns = torch.tensor([3, 2, 1, 2, 2, 3, 0])
    # 9.0: rewards of padding turns and NaN: the padding row's score; neither may count.
    turn_rewards = torch.tensor(
        [
            [0.0, 0.0, 1.0],
            [0.0, 0.5, 9.0],
            [1.0, 9.0, 9.0],
            [0.0, 0.0, 9.0],
            [0.0, 0.5, 9.0],
            [0.5, 0.0, 0.0],
            [9.0] * 3,
        ]
    )
    scores = torch.tensor([1.0, 0.5, 1.0, 0.0, 0.5, 0.5, float("nan")])
    group_ids = torch.tensor([7, 2, 11, 7, 2, 7, 7])
    b, r, k = len(num_turns), 10, 3
    mask, turn_ids = torch.zeros(b, r), torch.full((b, r), -1, dtype=torch.long)
    for row, n in enumerate(num_turns.tolist()):
        for turn in range(n):
            mask[row, 3 * turn : 3 * turn + 2] = 1  # position 3 * turn + 2 is the observation (a hole)
            turn_ids[row, 3 * turn : 3 * turn + 2] = turn
    turn_mask = (torch.arange(k)[None, :] < num_turns[:, None]).float()
    state_keys = [[f"s{row % 3}-{t}" for t in range(int(n))] for row, n in enumerate(num_turns.tolist())]
    turns = {"turn_rewards": turn_rewards, "turn_mask": turn_mask, "turn_ids": turn_ids, "state_keys": state_keys}
    token_rewards = token_rewards_from_scores(torch.nan_to_num(scores), mask)
    x = AdvantageInputs(scores, token_rewards, mask, None, group_ids, turns if with_turns else None)
    return x, group_ids == 2


def _check_tokens(name: str, t: Tensor, mask: Tensor) -> None:
    assert isinstance(t, Tensor) and t.shape == mask.shape, f"{name}: {getattr(t, 'shape', t)} for a {mask.shape} mask"
    assert torch.isfinite(t).all(), f"{name} is not finite: {t}"
    outside = t[~mask.bool()]
    assert (outside == 0).all(), f"{name} is not 0 where the mask is 0: {outside[outside != 0][:5].tolist()}"


class EstimatorTestSuite:
    """Shared tests, one case per estimator name (`names`, default every installed `roll.algorithms` entry)."""

    #: Estimators under test (None: every installed `roll.algorithms` entry).
    names: ClassVar[Sequence[str] | None] = None
    #: Group-baseline estimators: a group whose rewards are all equal gets exactly zero advantage.
    group_relative: ClassVar[frozenset[str]] = frozenset({"grpo", "dr_grpo", "rloo"})

    @classmethod
    def estimator_names(cls) -> list[str]:
        from roll_core import registry

        return sorted(cls.names if cls.names is not None else registry.available("roll.algorithms"))

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "estimator_name" in metafunc.fixturenames:
            metafunc.parametrize("estimator_name", self.estimator_names())

    @staticmethod
    def _call(est: Estimator, x: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
        out = est(x, _algo())
        assert isinstance(out, tuple) and len(out) == 2, "an estimator returns (advantages, returns or None)"
        return out

    def test_outcome_batch(self, estimator_name: str) -> None:
        est = load_estimator(estimator_name, trajectories=False) if not self._needs_turns(estimator_name) else None
        if est is None:
            with pytest.raises(ConfigError, match="pipeline=agentic"):
                load_estimator(estimator_name, trajectories=False)
            return
        x = outcome_inputs(with_values=False)
        try:
            adv, returns = self._call(est, x)
        except ValueError as exc:  # a critic-based estimator: it must say so, and work with values
            assert "values" in str(exc), f"{estimator_name} without values: {exc}"
            x = outcome_inputs(with_values=True)
            adv, returns = self._call(est, x)
        _check_tokens("advantages", adv, x.mask)
        if returns is not None:
            _check_tokens("returns", returns, x.mask)
        mean_adv = (adv * x.mask).sum(-1) / x.mask.sum(-1)
        for g in range(len(x.scores) // GROUP_SIZE):
            rows = slice(g * GROUP_SIZE, (g + 1) * GROUP_SIZE)
            scores, means = x.scores[rows], mean_adv[rows]
            if scores.max() > scores.min():
                best, worst = means[scores.argmax()], means[scores.argmin()]
                assert best > worst, f"group {g}: the best row's advantage {best} <= the worst's {worst}"
        if estimator_name in self.group_relative:
            equal = adv[EQUAL_GROUP]
            assert (equal == 0).all(), f"a group of equal rewards got advantages {equal[equal != 0].tolist()}"

    def test_trajectory_batch(self, estimator_name: str) -> None:
        from roll_core import registry

        if not getattr(registry.load("roll.algorithms", estimator_name), "trajectories", True):
            with pytest.raises(ConfigError, match="no trajectory form"):
                load_estimator(estimator_name, trajectories=True)
            return
        est = load_estimator(estimator_name, trajectories=True)
        x, equal_rows = trajectory_inputs(with_turns=self._needs_turns(estimator_name))
        adv, returns = self._call(est, x)
        _check_tokens("advantages", adv, x.mask)
        if returns is not None:
            _check_tokens("returns", returns, x.mask)
        assert (adv[x.mask.bool()] != 0).any(), "every trajectory got zero advantage"
        if estimator_name in self.group_relative:
            equal = adv[equal_rows]
            assert (equal == 0).all(), f"a group of equal rewards got advantages {equal[equal != 0].tolist()}"

    @staticmethod
    def _needs_turns(name: str) -> bool:
        from roll_core import registry

        return bool(getattr(registry.load("roll.algorithms", name), "needs_turns", False))
