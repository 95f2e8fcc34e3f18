"""The policy objective applies a correction's weights: a masked token gets no gradient, a kept one its weight."""

from __future__ import annotations

import math

import pytest
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


def test_heavy_masking_is_named_once_with_the_band_to_widen() -> None:
    from roll_core.pipelines.metrics import HEAVY_MASKING, heavy_masking_warning

    step = {
        "actor/correction/masked_fraction": 0.9468,
        "actor/correction/ratio_p5": 0.9195,
        "actor/correction/ratio_p95": 1.0467,
    }
    line = heavy_masking_warning(step, "geo_mask")
    assert line is not None and "geo_mask masked 95%" in line and "0.9195..1.0467" in line
    assert "algo.correction_low" in line and "icepop" in line
    assert heavy_masking_warning({**step, "actor/correction/masked_fraction": HEAVY_MASKING}, "geo_mask") is None
    assert heavy_masking_warning({"actor/correction/masked_fraction": 0.6}, "token_mask").endswith("or use icepop")
    assert heavy_masking_warning({"actor/train_infer_logprob_diff": 0.1}, None) is None  # no masking correction
    assert heavy_masking_warning({"actor/correction/masked_fraction": float("nan")}, "icepop") is None


def test_a_non_finite_kl_loss_coefficient_is_refused() -> None:
    """`kl_loss_coef > 0` is False for NaN: a NaN coefficient (the adaptive controller's, before it skipped NaN
    readings) silently trained without the KL term."""
    with pytest.raises(ValueError, match="kl_loss_coef=nan is not finite"):
        PolicyObjective(kl_loss_coef=float("nan"))
