"""Rollout/training corrections (roll_algos.corrections), checked against numbers worked by hand.

The batch: three rows, the ratio r = pi_old / pi_behaviour of each valid token chosen (behaviour log-probs log 0.5):
    row 0: r = 1, 3, 0.25 (+ 1 pad)    product 0.75,   geometric mean 0.75^(1/3)   = 0.9086
    row 1: r = 1.5, 1.2 (+ 2 pads)     product 1.8,    geometric mean sqrt(1.8)     = 1.3416
    row 2: r = 1.002, 0.999, 1, 1      product 1.000998, geometric mean 1.000998^(1/4) = 1.00025
9 valid tokens. Padded positions hold NaN and inf: they must not reach any weight or statistic.
"""

from __future__ import annotations

import math

import pytest
import torch

from roll_algos.corrections import (
    DEFAULT_BOUNDS,
    correction_weights,
    geo_mask,
    icepop,
    ratio_stats,
    resolve_bounds,
    sequence_mask,
    token_mask,
)
from roll_algos.losses import policy_loss

NAN, INF = float("nan"), float("inf")
RATIOS = [[1.0, 3.0, 0.25, NAN], [1.5, 1.2, NAN, NAN], [1.002, 0.999, 1.0, 1.0]]
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    behaviour = torch.full((3, 4), math.log(0.5), dtype=torch.float64)
    old = behaviour + torch.tensor(RATIOS, dtype=torch.float64).log()
    behaviour[1, 3] = INF  # garbage under padding on both sides
    old[0, 3] = -INF
    return old.float(), behaviour.float(), MASK


def test_token_mask_drops_tokens_outside_the_band() -> None:
    # Defaults [0.5, 2]: row 0 loses r=3 (above) and r=0.25 (below); rows 1 and 2 keep every token.
    c = token_mask(*batch(), low=0.5, high=2.0)
    assert c.weights.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    s = {k: round(float(v), 6) for k, v in c.stats.items()}
    # 2 of 9 tokens masked, in 1 of 3 rows; one above, one below.
    assert s == {"masked_fraction": round(2 / 9, 6), "masked_seq_fraction": round(1 / 3, 6),
                 "above_fraction": round(1 / 9, 6), "below_fraction": round(1 / 9, 6)}  # fmt: skip


def test_sequence_mask_tests_the_product_of_a_rows_ratios() -> None:
    # [0.5, 2]: the products 0.75, 1.8, 1.000998 all pass, so row 0 keeps its r=3 token (unlike token_mask).
    assert sequence_mask(*batch(), low=0.5, high=2.0).weights.tolist() == MASK.tolist()
    # [0.8, 1.5]: row 0 (0.75 < 0.8) and row 1 (1.8 > 1.5) are dropped whole: 5 of 9 tokens, 2 of 3 rows.
    c = sequence_mask(*batch(), low=0.8, high=1.5)
    assert c.weights.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert float(c.stats["masked_fraction"]) == pytest.approx(5 / 9)
    assert float(c.stats["masked_seq_fraction"]) == pytest.approx(2 / 3)
    assert float(c.stats["above_fraction"]) == pytest.approx(2 / 9)  # row 1's two tokens
    assert float(c.stats["below_fraction"]) == pytest.approx(3 / 9)  # row 0's three tokens


def test_icepop_keeps_the_ratio_inside_the_band_and_zero_outside() -> None:
    # IcePop's a=0.5, b=5: only r=0.25 leaves the band; r=3 stays, weighted 3 (calibration, not a 0/1 mask).
    c = icepop(*batch(), low=0.5, high=5.0)
    expected = [[1.0, 3.0, 0.0, 0.0], [1.5, 1.2, 0.0, 0.0], [1.002, 0.999, 1.0, 1.0]]
    assert torch.allclose(c.weights, torch.tensor(expected), atol=1e-5)
    assert float(c.stats["masked_fraction"]) == pytest.approx(1 / 9)
    assert float(c.stats["below_fraction"]) == pytest.approx(1 / 9) and float(c.stats["above_fraction"]) == 0
    # A tighter band [0.9, 2] also drops r=3.
    tight = icepop(*batch(), low=0.9, high=2.0).weights
    assert tight[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_geo_mask_tests_the_geometric_mean_ratio() -> None:
    # Defaults [0.999, 1.001]: 0.9086 and 1.3416 fail, 1.00025 passes: rows 0 and 1 dropped, 5 of 9 tokens.
    c = geo_mask(*batch(), low=0.999, high=1.001)
    assert c.weights.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert float(c.stats["masked_fraction"]) == pytest.approx(5 / 9)
    # [0.9, 1.4] keeps all three means (0.9086, 1.3416, 1.00025); [0.95, 1.4] drops row 0 only (3 tokens).
    assert geo_mask(*batch(), low=0.9, high=1.4).weights.tolist() == MASK.tolist()
    assert float(geo_mask(*batch(), low=0.95, high=1.4).stats["masked_fraction"]) == pytest.approx(3 / 9)


def test_dispatcher_uses_the_papers_defaults_and_weights_are_detached() -> None:
    old, behaviour, mask = batch()
    old.requires_grad_(True)
    for name, (low, high) in DEFAULT_BOUNDS.items():
        c = correction_weights(name, old, behaviour, mask)
        direct = {"token_mask": token_mask, "sequence_mask": sequence_mask, "icepop": icepop, "geo_mask": geo_mask}
        assert torch.equal(c.weights, direct[name](old, behaviour, mask, low=low, high=high).weights)
        assert not c.weights.requires_grad and torch.isfinite(c.weights).all()
        assert (c.weights[mask == 0] == 0).all()
    assert DEFAULT_BOUNDS["icepop"] == (0.5, 5.0) and DEFAULT_BOUNDS["geo_mask"] == (0.999, 1.001)
    # A bound given replaces that side's default only.
    assert correction_weights("token_mask", old, behaviour, mask, high=4.0).weights[0].tolist() == [1, 1, 0, 0]


@pytest.mark.parametrize(
    ("low", "high"), [(1.2, 2.0), (0.5, 0.9), (0.0, 2.0), (-1.0, 2.0), (1.0, 1.0), (NAN, 2.0), (0.5, INF)]
)
def test_bad_bounds_are_errors(low: float, high: float) -> None:
    with pytest.raises(ValueError, match="0 < low <= 1 <= high"):
        resolve_bounds("token_mask", low, high)
    with pytest.raises(ValueError, match="unknown correction 'tis'"):
        resolve_bounds("tis")


def test_ratio_stats_over_response_tokens_only() -> None:
    s = {k: float(v) for k, v in ratio_stats(*batch()).items()}
    # Sorted valid ratios: 0.25, 0.999, 1, 1, 1, 1.002, 1.2, 1.5, 3 (n = 9, positions 0..8).
    # p5: position 0.4 -> 0.25 + 0.4 * (0.999 - 0.25) = 0.5496; p50: position 4 -> 1; p95: 7.6 -> 1.5 + 0.6 * 1.5.
    assert s["ratio_p5"] == pytest.approx(0.5496, abs=1e-5)
    assert s["ratio_p50"] == pytest.approx(1.0, abs=1e-6)
    assert s["ratio_p95"] == pytest.approx(2.4, abs=1e-5)
    assert s["ratio_max"] == pytest.approx(3.0, abs=1e-5) and s["ratio_min"] == pytest.approx(0.25, abs=1e-6)
    # mean |log r| = (ln 3 + ln 4 + ln 1.5 + ln 1.2 + ln 1.002 + |ln 0.999|) / 9 = 3.075692 / 9.
    assert s["abs_log_ratio_mean"] == pytest.approx(3.075692 / 9, abs=1e-5)
    valid = torch.tensor([1, 3, 0.25, 1.5, 1.2, 1.002, 0.999, 1, 1])
    assert s["ratio_p95"] == pytest.approx(float(torch.quantile(valid, 0.95)), abs=1e-5)
    # No valid token: no gap.
    none = ratio_stats(*batch()[:2], torch.zeros(3, 4))
    assert {k: float(v) for k, v in none.items()} == {
        "ratio_p5": 1.0, "ratio_p50": 1.0, "ratio_p95": 1.0, "ratio_max": 1.0, "ratio_min": 1.0,
        "abs_log_ratio_mean": 0.0,
    }  # fmt: skip


def test_a_masked_token_gets_no_gradient_and_a_kept_one_its_weight() -> None:
    """The weights scale each token's advantage (how roll's RL objective applies them): with vanilla -A logp and
    token-mean over the 9 valid tokens, d loss / d logp_t = -w_t A_t / 9 (masked tokens stay in the normaliser)."""
    old, behaviour, mask = batch()
    w = icepop(old, behaviour, mask, low=0.5, high=5.0).weights
    logp = torch.zeros(3, 4, requires_grad=True)
    adv = torch.ones(3, 4)
    loss, _ = policy_loss(logp, torch.zeros(3, 4), adv * w, mask, variant="vanilla")
    loss.backward()
    expected = -w / 9
    assert torch.allclose(logp.grad, expected * mask, atol=1e-6)
    assert logp.grad[0, 2] == 0 and logp.grad[0, 1] == pytest.approx(-3 / 9)  # r=0.25 dropped, r=3 weighted 3


def test_bounds_are_inclusive() -> None:
    # Ratios exactly 0.5 and 2 (log-probs log 0.5 and log 2 against 0) sit on token_mask's default band: kept.
    old = torch.tensor([[math.log(0.5), math.log(2.0), math.log(2.5)]])
    c = token_mask(old, torch.zeros(1, 3), torch.ones(1, 3), low=0.5, high=2.0)
    assert c.weights.tolist() == [[1, 1, 0]]


def test_a_token_both_policies_give_probability_zero_is_dropped_not_nan() -> None:
    """old = behaviour = -inf on a valid token (no ratio: -inf - -inf is NaN): every masking correction drops it, TIS
    gives it weight 0 (its row, at sequence level), and the ratio statistics stay finite. NaN passed every band
    test and its weight exp(NaN) reached the loss."""
    from roll_algos.losses import off_policy_weights

    old, behaviour, mask = batch()
    old[2, 1] = behaviour[2, 1] = -INF
    for name in DEFAULT_BOUNDS:
        c = correction_weights(name, old, behaviour, mask)
        assert torch.isfinite(c.weights).all() and c.weights[2, 1] == 0, name
        assert all(torch.isfinite(v) for v in c.stats.values()), name
    kept = correction_weights("token_mask", old, behaviour, mask, low=0.2, high=4.0).weights
    assert kept[2].tolist() == [1, 0, 1, 1]  # only the undefined token is dropped
    token = off_policy_weights(old, behaviour, mask, level="token", cap=2.0)
    assert token[2].tolist() == pytest.approx([1.002, 0.0, 1.0, 1.0])
    seq = off_policy_weights(old, behaviour, mask, level="sequence", cap=2.0)
    assert seq[2].tolist() == [0.0] * 4 and seq[1].tolist() == pytest.approx([1.8, 1.8, 0, 0])
    assert all(torch.isfinite(v) for v in ratio_stats(old, behaviour, mask).values())
