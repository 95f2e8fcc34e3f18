"""Losses, aggregation, KL: hand-computed values (arithmetic in comments) and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from roll_algos.kl import AdaptiveKLController, FixedKLController, kl_estimate
from roll_algos.losses import (
    AGG_MODES,
    POLICY_LOSS_VARIANTS,
    aggregate,
    entropy_from_logits,
    off_policy_weights,
    overlong_penalty,
    policy_loss,
    token_logprobs,
    value_loss,
)

T = torch.tensor
NAN = float("nan")


def close(a: torch.Tensor, b: float | list, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=tol, rtol=tol)


# ---------------------------------------------------------------- aggregation by hand
LOSS = T([[1.0, 2.0, NAN], [4.0, NAN, NAN], [NAN, NAN, NAN]])
MASK = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])


def test_token_mean() -> None:
    # (1 + 2 + 4) / 3 valid tokens
    close(aggregate(LOSS, MASK, "token-mean"), 7 / 3)


def test_seq_mean_token_mean() -> None:
    # rows with tokens: mean(1, 2) = 1.5 and 4; the empty third row is excluded -> (1.5 + 4) / 2
    close(aggregate(LOSS, MASK, "seq-mean-token-mean"), 2.75)


def test_seq_mean_token_sum() -> None:
    # row sums 3, 4, 0 over B = 3 rows
    close(aggregate(LOSS, MASK, "seq-mean-token-sum"), 7 / 3)


def test_seq_mean_token_sum_norm() -> None:
    # Dr.GRPO: 7 / (B=3 * norm_length=4)
    close(aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=4), 7 / 12)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm")


def test_all_masked_is_zero_for_every_mode() -> None:
    for mode in AGG_MODES:
        close(aggregate(torch.full((2, 3), NAN), torch.zeros(2, 3), mode, norm_length=3), 0.0)


def test_unknown_mode() -> None:
    with pytest.raises(ValueError, match=r"unknown aggregation 'mean'.*token-mean"):
        aggregate(LOSS, MASK, "mean")


# ---------------------------------------------------------------- policy loss by hand
def test_ppo_clip_by_hand() -> None:
    # token 0: A=+1, ratio e^0.5=1.6487 > 1.2 -> clipped: loss = -1*1.2 = -1.2  (clip-high active)
    # token 1: A=-1, ratio e^-0.5=0.6065 < 0.8 -> max(0.6065, 0.8) = 0.8     (clip-low active)
    # token 2: A=+2, ratio 1 -> -2
    logp = T([[0.5, -0.5, 0.0]])
    old = torch.zeros(1, 3)
    adv = T([[1.0, -1.0, 2.0]])
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 3), variant="ppo")
    close(loss, (-1.2 + 0.8 - 2.0) / 3)
    close(m["clipfrac_high"], 1 / 3)
    close(m["clipfrac_low"], 1 / 3)
    close(m["ratio_max"], math.exp(0.5))


def test_clip_higher_by_hand() -> None:
    # ratio 1.25, A=+1: clip_high 0.28 leaves it unclipped (-1.25); clip_high 0.2 clips to -1.2
    logp = T([[math.log(1.25)]])
    args = (logp, torch.zeros(1, 1), T([[1.0]]), torch.ones(1, 1))
    close(policy_loss(*args, clip_high=0.28)[0], -1.25)
    close(policy_loss(*args, clip_high=0.2)[0], -1.2)


def test_dual_clip_by_hand() -> None:
    # A=-1, ratio e^2 = 7.389: PPO loss = max(7.389, 0.8) = 7.389; dual clip c=3 bounds it at 3
    args = (T([[2.0]]), torch.zeros(1, 1), T([[-1.0]]), torch.ones(1, 1))
    close(policy_loss(*args)[0], math.exp(2.0))
    loss, m = policy_loss(*args, dual_clip=3.0)
    close(loss, 3.0)
    close(m["clipfrac_dual"], 1.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(*args, dual_clip=0.5)


def test_gspo_sequence_ratio_by_hand() -> None:
    # row log-ratios [0.1, 0.3] -> seq ratio exp(0.2) = 1.2214 > 1.2, A=+1 -> clipped to 1.2 on both tokens
    loss, _ = policy_loss(T([[0.1, 0.3]]), torch.zeros(1, 2), T([1.0]), torch.ones(1, 2), variant="gspo")
    close(loss, -1.2)
    # with a tiny clip range (GSPO's paper uses ~3e-4), an on-policy batch is still -A
    loss, _ = policy_loss(
        torch.zeros(1, 2), torch.zeros(1, 2), T([0.5]), torch.ones(1, 2), variant="gspo", clip_low=3e-4, clip_high=4e-4
    )
    close(loss, -0.5)


def test_cispo_tis_topr_vanilla_values() -> None:
    # ratio e^1 = 2.718 for token 0; logp values are the log-probs themselves: [1, 0]
    logp = T([[1.0, 0.0]])
    old = T([[0.0, 0.0]])
    adv = T([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    # vanilla: -(1*1 + 1*0)/2 = -0.5
    close(policy_loss(logp, old, adv, mask, variant="vanilla")[0], -0.5)
    # cispo: weight clip(2.718, 0.8, 1.2) = 1.2 on token 0 -> -(1.2*1 + 1*0)/2 = -0.6
    close(policy_loss(logp, old, adv, mask, variant="cispo")[0], -0.6)
    # tis cap 2: -(2*1 + 0)/2 = -1
    close(policy_loss(logp, old, adv, mask, variant="tis", ratio_cap=2.0)[0], -1.0)
    # topr, positive row: -A logp = -0.5; negative row (A=-1): weight clip(2.718, 0, 1)=1 -> +0.5
    close(policy_loss(logp, old, adv, mask, variant="topr")[0], -0.5)
    close(policy_loss(logp, old, -adv, mask, variant="topr")[0], 0.5)
    with pytest.raises(ValueError, match="unknown policy loss 'foo'"):
        policy_loss(logp, old, adv, mask, variant="foo")


def test_value_loss_by_hand() -> None:
    # V=2, old=0, R=0: unclipped 0.5*4 = 2; clipped V' = 0 + clip(2, -0.5, 0.5) = 0.5 -> 0.5*0.25 = 0.125
    # max(2, 0.125) = 2. Second token: V=0, old=0, R=1 -> 0.5 both ways. Mean = 1.25
    v, old, ret = T([[2.0, 0.0]]), torch.zeros(1, 2), T([[0.0, 1.0]])
    loss, m = value_loss(v, old, ret, torch.ones(1, 2), clip=0.5)
    close(loss, 1.25)
    close(m["vf_clipfrac"], 0.0)
    # V=-1, old=0, R=-2: unclipped 0.5*1=0.5, clipped V'=-0.5 -> 0.5*2.25=1.125 -> clipped branch wins
    loss, m = value_loss(T([[-1.0]]), torch.zeros(1, 1), T([[-2.0]]), torch.ones(1, 1), clip=0.5)
    close(loss, 1.125)
    close(m["vf_clipfrac"], 1.0)
    close(value_loss(T([[-1.0]]), torch.zeros(1, 1), T([[-2.0]]), torch.ones(1, 1))[0], 0.5)


def test_entropy_by_hand() -> None:
    # uniform over 4 -> ln 4; a one-hot-ish large logit -> ~0; huge logits stay finite (fp32, logsumexp)
    logits = T([[[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0]]], dtype=torch.bfloat16)
    ent = entropy_from_logits(logits, T([[1, 1]]))
    assert ent.dtype == torch.float32
    close(ent, [[math.log(4), 0.0]], tol=1e-3)
    close(entropy_from_logits(logits, T([[0, 1]])), [[0.0, 0.0]], tol=1e-3)


def test_token_logprobs_matches_log_softmax() -> None:
    logits = torch.randn(2, 3, 7)
    labels = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, labels), expected)


def test_off_policy_weights_by_hand() -> None:
    old = T([[0.0, 1.0, 0.5]])
    beh = T([[0.0, 0.0, 0.0]])
    mask = T([[1, 1, 0]])
    # token: [e^0, min(e^1, 2)] = [1, 2], masked -> 0
    close(off_policy_weights(old, beh, mask, level="token", cap=2.0), [[1.0, 2.0, 0.0]])
    # sequence: exp(0 + 1) = 2.718 -> cap 3 leaves it; masked 0
    close(off_policy_weights(old, beh, mask, level="sequence", cap=3.0), [[math.e, math.e, 0.0]])
    w = off_policy_weights(old.requires_grad_(), beh, mask)
    assert not w.requires_grad


def test_overlong_penalty_by_hand() -> None:
    # max 100, buffer 20: <=80 -> 0; 90 -> -0.5; 100 -> -1; 130 -> -1
    close(overlong_penalty(T([50, 80, 90, 100, 130]), max_length=100, buffer=20), [0, 0, -0.5, -1, -1])


# ---------------------------------------------------------------- KL
def test_kl_by_hand() -> None:
    logp, ref = T([0.0, 1.0]), T([0.0, 0.0])
    close(kl_estimate(logp, ref, "k1"), [0.0, 1.0])
    close(kl_estimate(logp, ref, "k2"), [0.0, 0.5])
    close(kl_estimate(logp, ref, "abs"), [0.0, 1.0])
    # k3: exp(-1) + 1 - 1 = 0.367879
    close(kl_estimate(logp, ref, "k3"), [0.0, math.exp(-1)])
    close(kl_estimate(logp, ref, "low_var_kl"), [0.0, math.exp(-1)])
    # clamp: log_ratio = -50 -> exp(50) would be huge; result clamped to 10
    close(kl_estimate(T([-50.0]), T([0.0]), "k3"), [10.0])
    with pytest.raises(ValueError, match="unknown KL kind"):
        kl_estimate(logp, ref, "k9")


def test_kl_controllers_by_hand() -> None:
    assert FixedKLController(0.1).update(5.0, 100) == 0.1
    c = AdaptiveKLController(0.1, target=1.0, horizon=100)
    # KL 3x target: error clipped to 0.2; 0.1 * (1 + 0.2 * 50/100) = 0.11
    assert c.update(3.0, 50) == pytest.approx(0.11)
    # KL 0.5x target: error -0.2 (clipped from -0.5); 0.11 * (1 - 0.2*100/100) = 0.088
    assert c.update(0.5, 100) == pytest.approx(0.088)
    c2 = AdaptiveKLController(1.0, 1.0, 1)
    c2.load_state_dict(c.state_dict())
    assert c2.value == pytest.approx(0.088)


def test_a_nan_kl_reading_leaves_the_adaptive_coefficient_alone() -> None:
    """One token whose log-probs are both -inf makes k3 NaN; min/max passed NaN through and the coefficient stayed
    NaN for the rest of the run (the KL term then silently dropped: `coef > 0` is False for NaN)."""
    c = AdaptiveKLController(0.05, target=6.0, horizon=10_000)
    assert c.update(float("nan"), 64) == 0.05 and c.update(float("inf"), 64) == 0.05
    assert c.update(0.3, 64) == pytest.approx(0.05 * (1 - 0.2 * 64 / 10_000))
    with pytest.raises(ValueError, match="saved coefficient is nan"):
        c.load_state_dict({"value": float("nan")})


# ---------------------------------------------------------------- properties
def _batch(seed: int, dtype: torch.dtype = torch.float64, b: int = 4, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    old = logp + 0.3 * torch.randn(b, t, generator=g, dtype=dtype)
    adv = torch.randn(b, generator=g, dtype=dtype)
    mask = (torch.rand(b, t, generator=g) > 0.3).to(dtype)
    mask[:, 0] = 1
    return logp, old, adv, mask


@given(seed=st.integers(0, 10_000), agg=st.sampled_from(AGG_MODES))
@settings(max_examples=40, deadline=None)
def test_at_ratio_one_every_variant_has_the_vanilla_gradient(seed: int, agg: str) -> None:
    logp0, _, adv, mask = _batch(seed)

    def grad(variant: str) -> torch.Tensor:
        logp = logp0.clone().requires_grad_()
        loss, _ = policy_loss(
            logp,
            logp0.detach(),
            adv,
            mask,
            variant=variant,
            agg=agg,
            norm_length=5,
            dual_clip=3.0 if variant == "ppo" else None,
        )
        (g,) = torch.autograd.grad(loss, logp)
        return g

    # Advantages are per sequence, so GSPO's gradient through the row mean (1/L per token, times L tokens)
    # lands on each token exactly as vanilla's does.
    reference = grad("vanilla")
    assert reference.abs().sum() > 0
    for variant in POLICY_LOSS_VARIANTS:
        torch.testing.assert_close(grad(variant), reference, msg=variant)


@given(seed=st.integers(0, 10_000), variant=st.sampled_from(POLICY_LOSS_VARIANTS), agg=st.sampled_from(AGG_MODES))
@settings(max_examples=60, deadline=None)
def test_masked_positions_change_nothing_and_get_no_gradient(seed: int, variant: str, agg: str) -> None:
    logp, old, adv, mask = _batch(seed)
    junk = torch.full_like(logp, NAN)
    logp_a = logp.clone().requires_grad_()
    logp_b = torch.where(mask.bool(), logp, junk).requires_grad_()
    old_b = torch.where(mask.bool(), old, -junk)
    la, ma = policy_loss(logp_a, old, adv, mask, variant=variant, agg=agg, norm_length=5)
    lb, mb = policy_loss(logp_b, old_b, adv, mask, variant=variant, agg=agg, norm_length=5)
    torch.testing.assert_close(la, lb)
    for k in ma:
        torch.testing.assert_close(ma[k], mb[k])
    (ga,) = torch.autograd.grad(la, logp_a)
    (gb,) = torch.autograd.grad(lb, logp_b)
    assert torch.isfinite(gb).all()
    torch.testing.assert_close(ga, gb)
    assert (gb[~mask.bool()] == 0).all()


@given(variant=st.sampled_from(POLICY_LOSS_VARIANTS), agg=st.sampled_from(AGG_MODES))
@settings(max_examples=30, deadline=None)
def test_loss_is_finite_for_all_masked_rows(variant: str, agg: str) -> None:
    logp = torch.full((2, 3), NAN, requires_grad=True)
    mask = torch.zeros(2, 3)
    loss, metrics = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), mask, variant=variant, agg=agg, norm_length=3)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    vl, _ = value_loss(
        torch.full((2, 3), NAN), torch.zeros(2, 3), torch.zeros(2, 3), mask, clip=0.2, agg=agg, norm_length=3
    )
    assert torch.isfinite(vl)


@given(a=st.floats(-30, 30, allow_nan=False), b=st.floats(-30, 30, allow_nan=False))
@settings(max_examples=100, deadline=None)
def test_k3_and_k2_follow_their_formulas_and_vanish_only_at_equal_logprobs(a: float, b: float) -> None:
    """k3 = exp(-x) + x - 1 with x = log pi - log ref (clamped to [0, 10]), k2 = x^2 / 2, against fp64. A bare
    `k3 >= 0` could not fail: the implementation clamps at 0, so a wrong sign or formula would pass it."""
    x = torch.tensor(a, dtype=torch.float32).double() - torch.tensor(b, dtype=torch.float32).double()
    k3, k2 = kl_estimate(T([a]), T([b]), "k3").item(), kl_estimate(T([a]), T([b]), "k2").item()
    exact = min(math.expm1(-x.clamp(-20, 20).item()) + x.clamp(-20, 20).item(), 10.0)
    assert k3 == pytest.approx(exact, rel=1e-4, abs=1e-6)
    assert k2 == pytest.approx(0.5 * x.item() ** 2, rel=1e-5, abs=1e-6)
    if abs(x.item()) > 1e-2:  # k3 ~ x^2 / 2 near 0: positive in fp32 here
        assert k3 > 0 and k2 > 0
    if a == b:
        assert k3 == 0 and k2 == 0


@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 50))
@settings(max_examples=30, deadline=None)
def test_k1_and_k3_are_unbiased_estimates_of_the_kl(seed: int, vocab: int) -> None:
    """Averaged over tokens sampled from pi (here: weighted by pi exactly), k1 and k3 give KL(pi || ref), which is
    positive when the distributions differ; k3's clamps do not act for these logits."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(0.4 * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    ref = torch.log_softmax(0.4 * torch.randn(vocab, generator=gen, dtype=torch.float64), -1)
    assume(float((ref - logp).max()) < 2.5)  # k3 per token stays below its clamp at 10
    kl = float((logp.exp() * (logp - ref)).sum())
    assert kl > 0
    for kind in ("k1", "k3"):
        per_token = kl_estimate(logp[None], ref[None], kind)[0]
        assert float((logp.exp() * per_token).sum()) == pytest.approx(kl, rel=1e-9, abs=1e-12), kind


@given(seed=st.integers(0, 10_000), variant=st.sampled_from(POLICY_LOSS_VARIANTS), agg=st.sampled_from(AGG_MODES))
@settings(max_examples=40, deadline=None)
def test_fp32_matches_fp64(seed: int, variant: str, agg: str) -> None:
    logp, old, adv, mask = _batch(seed)
    l64, _ = policy_loss(
        logp, old, adv, mask, variant=variant, agg=agg, norm_length=5, dual_clip=3.0 if variant == "ppo" else None
    )
    l32, _ = policy_loss(
        logp.float(),
        old.float(),
        adv.float(),
        mask.float(),
        variant=variant,
        agg=agg,
        norm_length=5,
        dual_clip=3.0 if variant == "ppo" else None,
    )
    torch.testing.assert_close(l32.double(), l64, atol=1e-5, rtol=1e-4)
    for kind in ("k1", "k2", "k3", "abs"):
        torch.testing.assert_close(
            kl_estimate(logp.float(), old.float(), kind).double(), kl_estimate(logp, old, kind), atol=1e-5, rtol=1e-4
        )


# ---------------------------------------------------------------- review fixes
def test_approx_kl_is_k3_of_kl_old_to_new() -> None:
    """The tokens were sampled from the old policy, so k3 of KL(old || new) is r - 1 - log r with r = new / old
    (Schulman's k3 with q = old as the sampler). The metric had the direction swapped: 1/r - 1 + log r, which
    estimates neither KL from old-policy samples."""
    # one token, log r = log 2: 2 - 1 - ln 2 = 0.306853 (the swapped form gave 0.5 - 1 + ln 2 = 0.193147)
    _, m = policy_loss(T([[math.log(2.0)]]), T([[0.0]]), T([[1.0]]), torch.ones(1, 1))
    close(m["approx_kl"], 2.0 - 1.0 - math.log(2.0))
    # unbiased: weighting every vocabulary token by its old-policy probability gives KL(old || new) exactly
    g = torch.Generator().manual_seed(0)
    old = torch.log_softmax(torch.randn(1, 20, generator=g, dtype=torch.float64), -1)
    new = torch.log_softmax(old + 0.5 * torch.randn(1, 20, generator=g, dtype=torch.float64), -1)
    exact = float((old.exp() * (old - new)).sum())
    weights = old.exp()[0]
    per_token = []
    for i in range(20):  # the metric of a one-token batch is that token's estimate
        _, m = policy_loss(new[:, i : i + 1], old[:, i : i + 1], T([[1.0]], dtype=torch.float64), torch.ones(1, 1))
        per_token.append(m["approx_kl"])
    assert float((weights * torch.stack(per_token)).sum()) == pytest.approx(exact, rel=1e-9)


def test_gspo_gives_each_token_its_own_advantage() -> None:
    """GSPO-token (the paper's form for per-token advantages, as verl's gspo): s_i,t = sg(s_i) * pi_t / sg(pi_t),
    so the gradient at token t is -A_t * s_i (unclipped rows). Through the row mean every token got the row's mean
    advantage instead: a token whose advantage a correction mask (token_mask, icepop), AsyPPO or attention credit
    set to 0 still got a gradient."""
    # row log-ratios [0.1, -0.1] -> s = exp(0) = 1 (inside the clip range); A = [2, 0]; token-mean over 2 tokens
    logp = T([[0.1, -0.1]], dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(
        logp, torch.zeros(1, 2, dtype=torch.float64), T([[2.0, 0.0]]), torch.ones(1, 2), variant="gspo"
    )
    (grad,) = torch.autograd.grad(loss, logp)
    close(loss, (-2.0 * 1.0 + 0.0) / 2)  # the value is unchanged: -A_t s on each token
    close(grad, [[-2.0 * 1.0 / 2, 0.0]])  # the old form gave [-0.5, -0.5]
    close(m["ratio_mean"], 1.0)
    # a clipped row (s = e^0.3 = 1.35 > 1.2 with A > 0) gives no gradient to any of its tokens
    logp = T([[0.2, 0.4]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(
        logp, torch.zeros(1, 2, dtype=torch.float64), T([[1.0, 3.0]]), torch.ones(1, 2), variant="gspo"
    )
    (grad,) = torch.autograd.grad(loss, logp)
    close(loss, -(1.0 + 3.0) * 1.2 / 2)
    close(grad, [[0.0, 0.0]])


def test_half_precision_inputs_are_computed_in_fp32() -> None:
    """bf16 log-probs (a caller's engine) gave a bf16 ratio (steps of 2^-7 near 1, so clip decisions at 1.2 were
    off by up to 0.008) and bf16 sums of the loss and the clip fractions. The losses now compute in fp32 from the
    (already rounded) bf16 inputs; the gradient still reaches the bf16 leaf."""
    g = torch.Generator().manual_seed(5)
    logp = (-torch.rand(8, 300, generator=g) * 3).bfloat16()
    old = (logp.float() + 0.1 * torch.randn(8, 300, generator=g)).bfloat16()
    adv = torch.randn(8, 300, generator=g).bfloat16()
    mask = (torch.rand(8, 300, generator=g) > 0.2).float()
    leaf = logp.clone().requires_grad_()
    for variant in POLICY_LOSS_VARIANTS:
        loss, metrics = policy_loss(leaf, old, adv, mask, variant=variant, dual_clip=3.0)
        ref, ref_metrics = policy_loss(logp.float(), old.float(), adv.float(), mask, variant=variant, dual_clip=3.0)
        assert loss.dtype == torch.float32 and loss.item() == pytest.approx(ref.item(), rel=1e-6), variant
        for k, v in metrics.items():
            assert v.dtype == torch.float32 and v.item() == pytest.approx(ref_metrics[k].item(), rel=1e-6), k
        (grad,) = torch.autograd.grad(loss, leaf)
        assert grad.dtype == torch.bfloat16 and torch.isfinite(grad).all()
    values, returns = logp.clone().requires_grad_(), adv
    vl, vm = value_loss(values, old, returns, mask, clip=0.2)
    vr, vrm = value_loss(logp.float(), old.float(), returns.float(), mask, clip=0.2)
    assert vl.dtype == torch.float32 and vl.item() == pytest.approx(vr.item(), rel=1e-6)
    assert vm["vf_clipfrac"].item() == pytest.approx(vrm["vf_clipfrac"].item(), rel=1e-6)
    for mode in AGG_MODES:
        agg = aggregate(adv, mask, mode, norm_length=300)
        assert agg.dtype == torch.float32
        assert agg.item() == pytest.approx(aggregate(adv.float(), mask, mode, norm_length=300).item(), rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_loss_gradients_are_as_documented(seed: int) -> None:
    """kl.py's note on the KL kinds as losses: over tokens sampled from pi (here every vocabulary token weighted by
    its detached probability), E[grad k1] = 0, E[grad k2] = grad KL(pi || ref), E[grad k3] = grad KL(ref || pi)."""
    g = torch.Generator().manual_seed(seed)
    theta = (0.5 * torch.randn(12, generator=g, dtype=torch.float64)).requires_grad_()
    ref = torch.log_softmax(0.5 * torch.randn(12, generator=g, dtype=torch.float64), -1)  # k3 below its clamp

    def expected_grad(kind: str) -> torch.Tensor:
        logp = torch.log_softmax(theta, -1)
        per_token = kl_estimate(logp[None], ref[None], kind)[0]
        return torch.autograd.grad((logp.detach().exp() * per_token).sum(), theta)[0]

    def grad_of(f) -> torch.Tensor:
        return torch.autograd.grad(f(torch.log_softmax(theta, -1)), theta)[0]

    forward = grad_of(lambda lp: (lp.exp() * (lp - ref)).sum())  # KL(pi || ref)
    reverse = grad_of(lambda lp: (ref.exp() * (ref - lp)).sum())  # KL(ref || pi)
    torch.testing.assert_close(expected_grad("k1"), torch.zeros(12, dtype=torch.float64))
    torch.testing.assert_close(expected_grad("k2"), forward)
    torch.testing.assert_close(expected_grad("k3"), reverse)
    assert not torch.allclose(forward, reverse, atol=1e-3)
