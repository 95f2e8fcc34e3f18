"""Preference losses: each variant's loss and metrics against the formula in plain python math, the configuration
errors, and the surrogate identity of `preference_row_weights` (grad of sum w*logp == grad of the mean loss) on a
tiny linear softmax policy."""

from __future__ import annotations

import math

import pytest
import torch

from roll_algos.preference import PREFERENCE_VARIANTS, preference_loss, preference_row_weights

# Three pairs. Policy minus reference: chosen [0.5, 0.5, -0.5], rejected [-0.5, 0.5, 0.5].
C = [-5.0, -3.0, -8.0]
R = [-6.0, -2.0, -8.5]
REF_C = [-5.5, -3.5, -7.5]
REF_R = [-5.5, -2.5, -9.0]
LEN_C = [2, 4, 1]
LEN_R = [5, 1, 2]
BETA = 0.5


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def by_hand(variant: str, ls: float = 0.0, gamma: float = 0.0) -> tuple[list[float], list[float], list[float]]:
    """Per-pair losses and the implicit rewards (chosen, rejected) straight from the formulas, in python floats."""
    losses, rc, rr = [], [], []
    for i in range(3):
        if variant == "simpo":
            xc, xr = C[i] / LEN_C[i], R[i] / LEN_R[i]
        elif variant == "ipo":
            xc, xr = (C[i] - REF_C[i]) / LEN_C[i], (R[i] - REF_R[i]) / LEN_R[i]
        else:
            xc, xr = C[i] - REF_C[i], R[i] - REF_R[i]
        h = xc - xr
        if variant in ("sigmoid", "simpo"):
            z = BETA * h - gamma
            losses.append(-(1 - ls) * logsig(z) - ls * logsig(-z))
        elif variant == "ipo":
            losses.append((h - 1 / (2 * BETA)) ** 2)
        else:
            losses.append(max(0.0, 1 - BETA * h))
        rc.append(BETA * xc)
        rr.append(BETA * xr)
    return losses, rc, rr


def run(variant: str, ls: float = 0.0, gamma: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ref = (None, None) if variant == "simpo" else (t(REF_C), t(REF_R))
    return preference_loss(
        t(C),
        t(R),
        *ref,
        variant=variant,
        beta=BETA,
        label_smoothing=ls,
        simpo_gamma=gamma,
        chosen_len=torch.tensor(LEN_C),
        rejected_len=torch.tensor(LEN_R),
    )


CASES = [("sigmoid", 0.0, 0.0), ("sigmoid", 0.2, 0.0), ("ipo", 0.0, 0.0), ("hinge", 0.0, 0.0), ("simpo", 0.1, 0.3)]


@pytest.mark.parametrize(("variant", "ls", "gamma"), CASES)
def test_loss_and_metrics_by_hand(variant: str, ls: float, gamma: float) -> None:
    loss, m = run(variant, ls, gamma)
    losses, rc, rr = by_hand(variant, ls, gamma)
    torch.testing.assert_close(loss, t(losses), rtol=0, atol=1e-12)
    margins = [a - b for a, b in zip(rc, rr)]
    expected = {
        "rewards_chosen": sum(rc) / 3,
        "rewards_rejected": sum(rr) / 3,
        "reward_margin": sum(margins) / 3,
        "reward_accuracy": sum(x > 0 for x in margins) / 3,
        "loss": sum(losses) / 3,
    }
    assert set(m) == set(expected)
    for k, v in expected.items():
        assert m[k].dim() == 0 and not m[k].requires_grad
        assert abs(float(m[k]) - v) < 1e-12, (k, float(m[k]), v)


def test_sigmoid_values_are_the_textbook_ones() -> None:
    # Pair margins h = 0.5 - (-0.5) = 1, 0.5 - 0.5 = 0, -0.5 - 0.5 = -1; beta h = 0.5, 0, -0.5.
    loss, m = run("sigmoid")
    torch.testing.assert_close(loss, t([math.log1p(math.exp(-0.5)), math.log(2.0), math.log1p(math.exp(0.5))]))
    assert float(m["reward_accuracy"]) == pytest.approx(1 / 3)  # only pair 0 has margin > 0 (pair 1 is a tie)
    # cDPO: label smoothing changes the loss of every pair (pair 1 stays log 2: sigma(0) is 1/2 either way).
    smooth, _ = run("sigmoid", ls=0.2)
    assert float(smooth[0]) > float(loss[0]) and float(smooth[2]) < float(loss[2])
    # ipo with beta = 0.5 aims the length-averaged margin at 1 / (2 beta) = 1.
    ipo, _ = run("ipo")
    assert float(ipo[0]) == pytest.approx((0.5 / 2 - (-0.5) / 5 - 1.0) ** 2)


def test_sigmoid_row_weights_closed_form() -> None:
    # d/dz [-(1-eps) log s(z) - eps log s(-z)] = s(z) - (1 - eps); dz/dc = beta = -dz/dr; the mean divides by N = 3.
    ls = 0.2
    w_c, w_r, loss, _ = preference_row_weights(
        t(C), t(R), t(REF_C), t(REF_R), variant="sigmoid", beta=BETA, label_smoothing=ls
    )
    sig = [1 / (1 + math.exp(-BETA * h)) for h in (1.0, 0.0, -1.0)]
    expected = t([BETA * (s - (1 - ls)) / 3 for s in sig])
    torch.testing.assert_close(w_c, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(w_r, -expected, rtol=0, atol=1e-12)
    assert not loss.requires_grad


# ---------------------------------------------------------------- the surrogate identity on a real (tiny) policy
def _policy_logps(w: torch.Tensor, feats: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token log-probs (rows, T) of a linear softmax policy logits = feats @ w; masked slots poisoned with NaN."""
    logp = torch.log_softmax(feats @ w, dim=-1).gather(-1, ids[..., None]).squeeze(-1)
    return torch.where(mask.bool(), logp, float("nan"))


def _summed(tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask.bool(), tok, 0.0).sum(-1)


@pytest.mark.parametrize(("variant", "ls", "gamma"), CASES)
def test_surrogate_gradient_equals_true_gradient(variant: str, ls: float, gamma: float) -> None:
    g = torch.Generator().manual_seed(0)
    n, length, d, vocab = 3, 4, 3, 5
    w = torch.randn(d, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    w_ref = torch.randn(d, vocab, generator=g, dtype=torch.float64)
    feats = torch.randn(2, n, length, d, generator=g, dtype=torch.float64)  # [chosen, rejected]
    ids = torch.randint(0, vocab, (2, n, length), generator=g)
    mask = torch.tensor([[[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], [[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]]])
    lens = mask.sum(-1)
    kw = dict(
        variant=variant, beta=BETA, label_smoothing=ls, simpo_gamma=gamma, chosen_len=lens[0], rejected_len=lens[1]
    )
    ref: tuple = (None, None)
    if variant != "simpo":
        ref = tuple(_summed(_policy_logps(w_ref, feats[k], ids[k], mask[k]), mask[k]) for k in range(2))

    tok = [_policy_logps(w, feats[k], ids[k], mask[k]) for k in range(2)]
    true_loss, _ = preference_loss(_summed(tok[0], mask[0]), _summed(tok[1], mask[1]), *ref, **kw)
    (g_true,) = torch.autograd.grad(true_loss.mean(), w, retain_graph=True)  # tok is reused below

    with torch.no_grad():  # a trainer computes the weights from log-probs it already holds, without a graph
        w_c, w_r, loss, _ = preference_row_weights(_summed(tok[0], mask[0]), _summed(tok[1], mask[1]), *ref, **kw)
    # The surrogate as an engine sees it: each row's weight times each of its (valid) token log-probs, summed.
    surrogate = sum(torch.where(mask[k].bool(), wk[:, None] * tok[k], 0.0).sum() for k, wk in enumerate((w_c, w_r)))
    (g_sur,) = torch.autograd.grad(surrogate, w)

    assert g_true.norm() > 1e-3, "the true gradient must not vanish, or the comparison proves nothing"
    torch.testing.assert_close(g_sur, g_true, rtol=0, atol=1e-9)
    torch.testing.assert_close(loss, true_loss.detach())


# ---------------------------------------------------------------- configuration errors
@pytest.mark.parametrize(
    ("variant", "kwargs", "match"),
    [
        ("simpo", dict(ref=True), "reference-free"),
        ("sigmoid", dict(ref=False), "needs the reference"),
        ("hinge", dict(ref=False), "needs the reference"),
        ("ipo", dict(ref=True, lens=False), "pass chosen_len"),
        ("simpo", dict(ref=False, lens=False), "pass chosen_len"),
        ("hinge", dict(ref=True, label_smoothing=0.1), "label_smoothing applies"),
        ("ipo", dict(ref=True, label_smoothing=0.1), "label_smoothing applies"),
        ("sigmoid", dict(ref=True, simpo_gamma=0.5), "simpo_gamma applies"),
        ("sigmoid", dict(ref=True, beta=0.0), "beta must be > 0"),
        ("sigmoid", dict(ref=True, label_smoothing=0.5), r"label_smoothing must be in \[0, 0.5\)"),
        ("dpo", dict(ref=True), "unknown preference loss"),
        ("ipo", dict(ref=True, zero_len=True), "length <= 0"),
    ],
)
def test_configuration_errors(variant: str, kwargs: dict, match: str) -> None:
    ref = (t(REF_C), t(REF_R)) if kwargs.pop("ref") else (None, None)
    lens = kwargs.pop("lens", True)
    len_c = torch.tensor([0, 1, 1]) if kwargs.pop("zero_len", False) else torch.tensor(LEN_C)
    kw = dict(beta=BETA) | kwargs
    if lens:
        kw |= dict(chosen_len=len_c, rejected_len=torch.tensor(LEN_R))
    with pytest.raises(ValueError, match=match):
        preference_loss(t(C), t(R), *ref, variant=variant, **kw)


def test_shape_errors_and_variants() -> None:
    assert PREFERENCE_VARIANTS == ("sigmoid", "ipo", "hinge", "simpo")
    with pytest.raises(ValueError, match=r"must both be \(N,\)"):
        preference_loss(t(C), t(R[:2]), t(REF_C), t(REF_R), variant="sigmoid", beta=0.1)
    with pytest.raises(ValueError, match="ref_rejected"):
        preference_loss(t(C), t(R), t(REF_C), t(REF_R[:2]), variant="sigmoid", beta=0.1)
    with pytest.raises(ValueError, match="N >= 1"):
        preference_loss(t([]), t([]), t([]), t([]), variant="sigmoid", beta=0.1)
