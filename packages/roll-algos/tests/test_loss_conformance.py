"""The loss conformance suite (roll_algos.testing) over roll-algos' own policy-loss variants, aggregation modes and
KL estimators (every name in POLICY_LOSS_VARIANTS x AGG_MODES, and KL_KINDS)."""

from __future__ import annotations

from roll_algos.testing import PolicyLossTestSuite


class TestPolicyLosses(PolicyLossTestSuite):
    pass
