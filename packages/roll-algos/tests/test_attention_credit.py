"""Attention-based credit (roll_algos.attention_credit), checked against numbers worked by hand.

The map: one head over 5 positions, position 0 the prompt, 1..4 the response (mask 0 1 1 1 1):
    row 0: 1                                 WAAD(W=2) 0     distance 0
    row 1: .5  .5                            WAAD .5          distance .5
    row 2: .2  .3  .5                        WAAD .4+.3 = .7  distance .4+.3 = .7
    row 3: .1  .1  .2  .6                    WAAD .2+.2+.2 = .6 (3 -> 2)        distance .3+.2+.2 = .7
    row 4: .4  .1  .1  .1  .3                WAAD .8+.2+.2+.1 = 1.3 (4, 3 -> 2) distance 1.6+.3+.2+.1 = 2.2
FAI (mean over the later response rows): key 1 from rows 2..4 (.3+.1+.1)/3 = 1/6; key 2 from rows 3, 4 (.2+.1)/2
= .15; key 3 from row 4: .1; key 4 has no later row: 0; key 0 is the prompt: 0.
Token t's WAAD is its generating row's (t - 1): tokens 1..4 get 0, .5, .7, .6.
"""

from __future__ import annotations

import math

import pytest
import torch

from roll_algos.attention_credit import (
    DEFAULTS,
    STRATEGIES,
    anchor_tokens,
    attention_distance,
    coupled_tokens,
    credit_weights,
    fai,
    fai_sums,
    future_counts,
    generated_by,
    head_distance,
    head_mean,
    preplan_tokens,
    select_heads,
    top_fraction,
    waad,
)

MAP = torch.tensor(
    [
        [1.0, 0, 0, 0, 0],
        [0.5, 0.5, 0, 0, 0],
        [0.2, 0.3, 0.5, 0, 0],
        [0.1, 0.1, 0.2, 0.6, 0],
        [0.4, 0.1, 0.1, 0.1, 0.3],
    ],
    dtype=torch.float64,
)
MASK = torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.float64)


def close(x: torch.Tensor, expected: list) -> None:
    assert torch.allclose(x.to(torch.float64), torch.tensor(expected, dtype=torch.float64), atol=1e-9), x


def test_waad_clips_each_distance_to_the_window() -> None:
    close(waad(MAP[None], 2), [[0, 0.5, 0.7, 0.6, 1.3]])
    close(waad(MAP[None], 100), [[0, 0.5, 0.7, 0.7, 2.2]])  # a window past every distance: the plain distance
    close(attention_distance(MAP[None]), [[0, 0.5, 0.7, 0.7, 2.2]])
    with pytest.raises(ValueError, match="window=0 must be >= 1"):
        waad(MAP, 0)


def test_fai_averages_the_attention_from_later_response_rows_only() -> None:
    close(fai(MAP[None], MASK), [[0, 1 / 6, 0.15, 0.1, 0]])
    close(future_counts(MASK), [[4, 3, 2, 1, 0]])
    # The prompt row 0 and a token's own row never count: key 1 gets nothing from rows 0 and 1.
    assert float(fai(MAP[None], MASK)[0, 1]) == pytest.approx(0.5 / 3)


def test_row_blocks_add_up_to_the_whole_map() -> None:
    """Streaming the rows in blocks (what an engine does to bound memory) gives the same WAAD and FAI sums."""
    rows = torch.arange(5)
    parts = [(slice(0, 2), rows[:2]), (slice(2, 5), rows[2:])]
    close(torch.cat([waad(MAP[None, s], 2, r) for s, r in parts], -1), [[0, 0.5, 0.7, 0.6, 1.3]])
    sums = sum(fai_sums(MAP[None, s], MASK[:, s], r) for s, r in parts)
    close(sums, [[1.2, 0.5, 0.3, 0.1, 0]])  # raw sums: the prompt key's (.5+.2+.1+.4) is dropped by `fai`
    with pytest.raises(ValueError, match="needs its row positions"):
        waad(MAP[None, :2], 2)


def test_garbage_in_padded_rows_never_reaches_fai() -> None:
    padded = torch.cat([MAP, torch.full((1, 5), math.nan, dtype=torch.float64)])  # a 6th row, NaN
    padded = torch.cat([padded, torch.zeros(6, 1, dtype=torch.float64)], 1)  # and a 6th key
    padded[5, 5] = math.nan
    mask = torch.cat([MASK, torch.zeros(1, 1, dtype=torch.float64)], 1)
    close(fai(padded[None], mask), [[0, 1 / 6, 0.15, 0.1, 0, 0]])


def test_each_token_gets_the_waad_of_the_row_that_generated_it() -> None:
    close(generated_by(waad(MAP[None], 2)), [[0, 0, 0.5, 0.7, 0.6]])


def test_top_fraction_rounds_up_skips_masked_tokens_and_breaks_ties_to_the_earlier() -> None:
    assert top_fraction(torch.tensor([[1.0, 1, 1, 0]]), torch.ones(1, 4), 0.5).tolist() == [[True, True, False, False]]
    score, mask = torch.tensor([[math.nan, 1.0, 2, 3]]), torch.tensor([[0.0, 1, 1, 1]])
    assert top_fraction(score, mask, 1 / 3).tolist() == [[False, False, False, True]]  # ceil(3 / 3) = 1
    assert top_fraction(score, mask, 0.34).tolist() == [[False, False, True, True]]  # ceil(1.02) = 2
    assert not top_fraction(score, torch.zeros(1, 4), 0.5).any()  # no response: nothing
    with pytest.raises(ValueError, match="ratio=0 must lie in"):
        top_fraction(score, mask, 0)


def test_preplan_and_anchor_tokens_of_the_map() -> None:
    token_waad, token_fai = generated_by(waad(MAP[None], 2)), fai(MAP[None], MASK)
    # 4 response tokens, ratio .5: the 2 highest. WAAD of tokens 1..4: 0 .5 .7 .6; FAI: 1/6 .15 .1 0.
    assert preplan_tokens(token_waad, MASK, 0.5).tolist() == [[False, False, False, True, True]]
    assert anchor_tokens(token_fai, MASK, 0.5).tolist() == [[False, True, True, False, False]]


def test_coupling_pairs_an_anchor_with_a_preplan_token_just_before_or_on_it() -> None:
    pre = torch.tensor([[1, 0, 0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    anc = torch.tensor([[0, 1, 0, 0, 0, 0, 1, 0]], dtype=torch.bool)
    assert coupled_tokens(pre, anc, 1).nonzero()[:, 1].tolist() == [0, 1]  # (0, 1); 3 and 6 are 3 apart
    assert coupled_tokens(pre, anc, 3).nonzero()[:, 1].tolist() == [0, 1, 3, 6]
    assert not coupled_tokens(pre, anc, 0).any()  # none coincides
    assert coupled_tokens(pre, pre, 0).equal(pre)  # a token both preplan and anchor is its own pair
    assert not coupled_tokens(anc, pre, 1).any()  # an anchor before its preplan token is no pair


def test_credit_weights_of_the_three_strategies() -> None:
    token_waad, token_fai = generated_by(waad(MAP[None], 2)), fai(MAP[None], MASK)
    pre = credit_weights("preplan", token_waad, token_fai, MASK, ratio=0.5, gamma=2.0)
    close(pre.weights, [[1, 1, 1, 2, 2]])
    assert float(pre.stats["boosted_fraction"]) == 0.5 and float(pre.stats["weight_mean"]) == 1.5
    anc = credit_weights("anchor", token_waad, token_fai, MASK, ratio=0.5, gamma=2.0)
    close(anc.weights, [[1, 2, 2, 1, 1]])
    # ratio .75: preplan 2 3 4, anchors 1 2 3; coupled (<= 1 apart): (2, 2) (2, 3) (3, 3) -> tokens 2, 3
    cpl = credit_weights("coupled", token_waad, token_fai, MASK, ratio=0.75, gamma=1.5, coupling=1)
    assert cpl.boosted.tolist() == [[False, False, True, True, False]]
    assert float(cpl.stats["weight_mean"]) == pytest.approx((1 + 1.5 + 1.5 + 1) / 4)
    assert set(STRATEGIES) == {"preplan", "anchor", "coupled"} and DEFAULTS["gamma"] > 1
    with pytest.raises(ValueError, match="'random' is not one of"):
        credit_weights("random", token_waad, token_fai, MASK)
    with pytest.raises(ValueError, match=r"gamma=0\.0 must be"):
        credit_weights("anchor", token_waad, token_fai, MASK, gamma=0.0)


def test_heads_are_told_apart_by_their_mean_attention_distance() -> None:
    d = torch.tensor([[2.0, 0.5, 3.0, 0.5]])
    assert select_heads(d, 0.5, local=True).tolist() == [[False, True, False, True]]
    assert select_heads(d, 0.5, local=False).tolist() == [[True, False, True, False]]
    assert select_heads(d, 0.25, local=True).tolist() == [[False, True, False, False]]  # tie: the lower index
    # Two heads: the map above and one that attends to its own position (distance 0, the most local).
    attn = torch.stack([MAP, torch.eye(5, dtype=torch.float64)])[None]
    # Mean over the rows generating tokens 1..4 (rows 0..3): head 0 (0 + .5 + .7 + .7) / 4 = .475, head 1 0.
    close(head_distance(attn, MASK), [[0.475, 0]])
    local = select_heads(head_distance(attn, MASK), 0.5, local=True)
    glob = select_heads(head_distance(attn, MASK), 0.5, local=False)
    assert local.tolist() == [[False, True]] and glob.tolist() == [[True, False]]
    close(head_mean(waad(attn, 2), local), [[0, 0, 0, 0, 0]])
    close(head_mean(fai(attn, MASK), glob), [[0, 1 / 6, 0.15, 0.1, 0]])
    close(head_mean(fai(attn, MASK), local | glob), [[0, 1 / 12, 0.075, 0.05, 0]])  # the identity head gives 0
