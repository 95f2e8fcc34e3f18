"""Estimators and corrections against their papers, with numbers computed by hand (arithmetic in the comments).

Rows whose token log ratios are extreme or undefined (a log-prob of -inf) at sequence level, the rollout/train
corrections' edge; and gradient checks of GAE, the KL estimators and the clipped losses that the value-only tests
elsewhere leave open.
"""

from __future__ import annotations

import math

import pytest
import torch

from roll_algos.advantages import gae
from roll_algos.corrections import geo_mask, sequence_mask
from roll_algos.kl import kl_estimate
from roll_algos.losses import off_policy_weights, policy_loss

T = torch.tensor
INF, NAN = math.inf, math.nan


def close(a: torch.Tensor, b: list[float] | float, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


# Four rows of log-probs, trainer (old) and engine (behaviour); the last token of rows 1-3 is padding (NaN there).
#   row 0: log r = [NaN (-inf - -inf: no ratio), -inf (trainer prob 0), 0]
#   row 1: log r = [-1 - -26 = 25, -30 - -9 = -21]: product ratio e^4 = 54.6, geometric mean e^2 = 7.39
#   row 2: log r = [0.3, -0.2]: product e^0.1 = 1.105, geometric mean e^0.05 = 1.051
#   row 3: log r = [+inf (engine prob 0), -inf (trainer prob 0)]: the product inf * 0 is undefined
OLD = T([[-INF, -INF, -1.0], [-1.0, -30.0, NAN], [-1.0, -1.2, NAN], [-1.0, -INF, NAN]])
BEH = T([[-INF, -2.0, -1.0], [-26.0, -9.0, NAN], [-1.3, -1.0, NAN], [-INF, -2.0, NAN]])
MASK = T([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 0]])


def test_sequence_mask_tests_the_true_product_and_drops_rows_without_one() -> None:
    # Only row 2 (1.105 in [0.5, 2]) is kept. Clamping each token to +-20 before summing kept rows 0, 1 and 3:
    # row 0 as +20 - 20 + 0 = 0, row 1 as 20 - 20 = 0 (a ratio of 54.6 read as 1), row 3 as 20 - 20 = 0.
    corr = sequence_mask(OLD, BEH, MASK, low=0.5, high=2.0)
    close(corr.weights, [[0, 0, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]])
    # 9 valid tokens, 7 of them in dropped rows, all above the band (+inf, e^4, undefined counted as +inf)
    close(corr.stats["masked_fraction"], 7 / 9)
    close(corr.stats["masked_seq_fraction"], 3 / 4)
    close(corr.stats["above_fraction"], 7 / 9)
    close(corr.stats["below_fraction"], 0.0)


def test_geo_mask_tests_the_true_geometric_mean_and_drops_rows_without_one() -> None:
    # band [0.9, 1.1]: row 2 (1.051) kept; row 1 (7.39) dropped, where the clamped mean (20 - 20) / 2 = 0 kept it;
    # rows 0 and 3 have no ratio.
    corr = geo_mask(OLD, BEH, MASK, low=0.9, high=1.1)
    close(corr.weights, [[0, 0, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]])
    # row 2's geometric mean e^0.05 = 1.0513 lies above a [0.999, 1.001] band
    close(geo_mask(OLD[2:3], BEH[2:3], MASK[2:3], low=0.999, high=1.001).weights, [[0, 0, 0]])


def test_sequence_truncated_is_of_a_row_with_ratios_zero_and_inf_is_zero() -> None:
    # row 3 (ratios inf and 0) has no product: weight 0. Its tokens were +-3.4e38 after nan_to_num and summed to
    # 0: weight e^0 = 1. Row 2: min(e^0.1, 2) = 1.10517. Row 0 (a token without a ratio): 0.
    w = off_policy_weights(OLD, BEH, MASK, level="sequence", cap=2.0)
    close(w, [[0, 0, 0], [2, 2, 0], [1.105171, 1.105171, 0], [0, 0, 0]])
    # token level: row 0 [no ratio -> 0, ratio 0, e^0 = 1]; row 1 [min(e^25, 2), e^-21]; row 2 [e^0.3, e^-0.2];
    # row 3 [min(inf, 2), 0]
    w = off_policy_weights(OLD, BEH, MASK, level="token", cap=2.0)
    close(w, [[0, 0, 1], [2, math.exp(-21), 0], [1.349859, 0.818731, 0], [2, 0, 0]])


def test_truncated_is_of_half_precision_log_probs_is_fp32() -> None:
    # bf16 log-probs (exact in bf16): log r = [0.5, 0.25], product e^0.75 = 2.117000 (under the cap 3). In bf16
    # the weight was rounded to 2.109375 (steps of 2^-7 between 2 and 4).
    old = T([[-1.0, -1.0]], dtype=torch.bfloat16)
    beh = T([[-1.5, -1.25]], dtype=torch.bfloat16)
    w = off_policy_weights(old, beh, torch.ones(1, 2), level="sequence", cap=3.0)
    assert w.dtype == torch.float32
    close(w, [[2.117000, 2.117000]])


# ---------------------------------------------------------------- already right: the numbers, checked by hand
def test_gae_on_left_and_right_padded_rows() -> None:
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma 0.9, lam 0.5 (gamma*lam = 0.45); the value after the last token is 0
    # (the padding's V = 100 must not be bootstrapped from).
    # t=2: delta = 1 - 0.7 = 0.3; A = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03; A = 0.03 + 0.45*0.3 = 0.165
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04; A = 0.04 + 0.45*0.165 = 0.11425
    rewards = T([[0.0, 0.0, 1.0, 5.0], [5.0, 0.0, 0.0, 1.0]])
    values = T([[0.5, 0.6, 0.7, 100.0], [100.0, 0.5, 0.6, 0.7]])
    mask = T([[1, 1, 1, 0], [0, 1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    close(adv, [[0.11425, 0.165, 0.3, 0], [0, 0.11425, 0.165, 0.3]])
    close(ret, [[0.61425, 0.765, 1.0, 0], [0, 0.61425, 0.765, 1.0]])


def test_kl_estimators_values_and_gradients_by_hand() -> None:
    # pi = 0.5, ref = 0.25 on the sampled token: log_ratio = ln 2 = 0.693147, ref/pi = 0.5.
    # k1 = 0.693147 (d/dlogp 1); k2 = 0.5 ln^2 2 = 0.240227 (d/dlogp ln 2); k3 = ref/pi - 1 + ln 2 = 0.193147
    # (d/dlogp 1 - ref/pi = 0.5)
    for kind, value, grad in (("k1", 0.693147, 1.0), ("k2", 0.240227, 0.693147), ("k3", 0.193147, 0.5)):
        logp = T([math.log(0.5)], requires_grad=True)
        k = kl_estimate(logp, T([math.log(0.25)]), kind)
        k.sum().backward()
        close(k.detach(), [value])
        close(logp.grad, [grad])


def test_ppo_dual_clip_and_clip_higher_gradients_by_hand() -> None:
    # clip_low 0.2, clip_high 0.28 (DAPO), dual clip c = 3; token-mean over 3 tokens.
    # t0: r = e^0.1 = 1.105171, A = +1: inside [0.8, 1.28] -> loss -1.105171, d/dlogp -r/3 = -0.368390
    # t1: r = e^-0.3 = 0.740818, A = -1: max(0.7408, 0.8) = 0.8 (clipped, no gradient)
    # t2: r = e^1.5 = 4.481689, A = -1: max(4.4817, 1.28) = 4.4817 > c|A| = 3 -> 3 (dual clip, no gradient)
    # loss = (-1.105171 + 0.8 + 3) / 3 = 0.898276
    logp = T([[0.1, -0.3, 1.5]], requires_grad=True)
    loss, m = policy_loss(
        logp, torch.zeros(1, 3), T([[1.0, -1.0, -1.0]]), torch.ones(1, 3), clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    loss.backward()
    close(loss.detach(), 0.898276)
    close(logp.grad, [[-0.368390, 0.0, 0.0]])
    close(m["clipfrac_low"], 1 / 3)
    close(m["clipfrac_dual"], 1 / 3)


def test_gspo_geometric_mean_ratio_and_gradient_by_hand() -> None:
    # log r = [0.1, 0.3] (the padded 9.0 ignored): s = exp(mean) = e^0.2 = 1.221403, inside [0.8, 1.28], A = +1.
    # Per token the value is -s; the gradient is -s * d logp_t, token-mean over 2: -0.610701 each.
    logp = T([[0.1, 0.3, 9.0]], requires_grad=True)
    loss, m = policy_loss(
        logp, torch.zeros(1, 3), T([1.0]), T([[1, 1, 0]]), variant="gspo", clip_low=0.2, clip_high=0.28
    )
    loss.backward()
    close(loss.detach(), -1.221403)
    close(logp.grad, [[-0.610701, -0.610701, 0.0]])
    close(m["ratio_mean"], 1.221403)


def test_cispo_and_tis_weights_carry_no_gradient_by_hand() -> None:
    # logp = 1, old 0: r = e = 2.718282, A = 2. CISPO: -sg(clip(r, 0.8, 1.2)) A logp = -1.2*2*1 = -2.4, gradient
    # -2.4 (the weight is a constant). TIS cap 2: -2*2*1 = -4, gradient -4.
    for variant, value in (("cispo", -2.4), ("tis", -4.0)):
        logp = T([[1.0]], requires_grad=True)
        loss, _ = policy_loss(logp, torch.zeros(1, 1), T([2.0]), torch.ones(1, 1), variant=variant, ratio_cap=2.0)
        loss.backward()
        close(loss.detach(), value)
        close(logp.grad, [[value]])


def test_k3_of_half_precision_log_probs_is_computed_in_fp32() -> None:
    """k3 = exp(-x) - 1 + x of a log ratio x = 0.01 is 4.98e-5; in bf16 the difference of two numbers near 0.01 is
    rounding noise (bf16 resolves 0.01 to about 6e-5). Half-precision inputs are upcast first."""
    logp = torch.tensor([[-1.0]], dtype=torch.bfloat16)
    ref = logp - torch.tensor([[0.0078125]], dtype=torch.bfloat16)  # exactly representable: x = 2^-7
    x = 0.0078125
    want = math.exp(-x) - 1 + x  # 3.0314e-5
    got = kl_estimate(logp, ref, "k3")
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(want, rel=1e-3)
