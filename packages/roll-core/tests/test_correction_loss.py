"""The policy objective applies a correction's weights: a masked token gets no gradient, a kept one its weight."""

from __future__ import annotations

import math

import torch

from roll_algos.corrections import icepop
from roll_core.pipelines.objectives import PolicyObjective


def test_policy_objective_multiplies_the_correction_into_each_tokens_loss() -> None:
    # Two rows of 3 tokens (row 1's last is padding); behaviour log-probs log 0.5, ratios r = 1, 3, 0.25 | 1.5, 1.2.
    # IcePop 0.5..5 gives weights 1, 3, 0 | 1.5, 1.2: mean over the 5 valid tokens (1 + 3 + 1.5 + 1.2) / 5 = 1.34.
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    behaviour = torch.full((2, 3), math.log(0.5))
    old = behaviour + torch.tensor([[1.0, 3.0, 0.25], [1.5, 1.2, 1.0]]).log()
    weights = icepop(old, behaviour, mask, low=0.5, high=5.0).weights
    logp = torch.full((2, 3), math.log(0.5), requires_grad=True)
    micro = {"response_mask": mask, "advantages": torch.ones(2, 3) * mask, "is_weights": weights}
    loss, metrics = PolicyObjective(variant="vanilla")({"logprobs": logp}, micro)
    (grad,) = torch.autograd.grad(loss, logp)
    # vanilla, token-mean over 5 tokens: d loss / d logp_t = -w_t * A_t / 5.
    torch.testing.assert_close(grad, -weights / 5)
    assert grad[0, 2] == 0
    assert math.isclose(float(metrics["actor/correction/weight_mean"]), 1.34, rel_tol=1e-6)
    # Without a correction, no weight metric and every valid token's gradient is -1/5.
    plain_micro = {k: v for k, v in micro.items() if k != "is_weights"}
    loss, metrics = PolicyObjective(variant="vanilla")({"logprobs": logp}, plain_micro)
    (plain,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(plain, -mask / 5)
    assert "actor/correction/weight_mean" not in metrics
