"""Distillation: top-k KL with its tail bucket against hand values (python math), the exact full-vocabulary KL when
K = V, masking of NaN slots, and the on-policy distillation advantages' sign and masking."""

from __future__ import annotations

import math

import pytest
import torch

from roll_algos.distill import (
    TAIL_EPS,
    on_policy_distill_advantages,
    reverse_kl_per_token,
    topk_distill_loss,
)

NAN = float("nan")
# Position 0 (V = 4, K = 2): teacher p = [.5, .3, .15, .05] keeps ids 0, 1 (tail .2); student q at those ids .4, .2
# (tail .4). Position 1: the teacher's top-2 hold all its mass (.6, .4: tail 0); student .5, .25 (tail .25).
# Position 2 is masked and holds NaN.
TEACHER = [[[0.5, 0.3], [0.6, 0.4], [NAN, NAN]]]
STUDENT = [[[0.4, 0.2], [0.5, 0.25], [NAN, NAN]]]
MASK = torch.tensor([[1, 1, 0]])

FWD = [
    0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.4),
    0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.25),  # + 0 log 0 for the empty teacher tail
]
REV = [
    0.4 * math.log(0.4 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.4 * math.log(0.4 / 0.2),
    # the teacher's empty tail is clamped at TAIL_EPS inside the log: a large, finite penalty
    0.5 * math.log(0.5 / 0.6) + 0.25 * math.log(0.25 / 0.4) + 0.25 * math.log(0.25 / TAIL_EPS),
]


def logs(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64).log()


@pytest.mark.parametrize(("kind", "expected"), [("forward", FWD), ("reverse", REV)])
def test_topk_kl_with_tail_by_hand(kind: str, expected: list[float]) -> None:
    student = logs(STUDENT).requires_grad_(True)
    teacher = logs(TEACHER).requires_grad_(True)
    loss, kl, m = topk_distill_loss(student, teacher, MASK, kind=kind)
    torch.testing.assert_close(kl, torch.tensor([[*expected, 0.0]], dtype=torch.float64), rtol=0, atol=1e-9)
    assert abs(loss.item() - sum(expected) / 2) < 1e-9
    assert abs(float(m["kl"]) - sum(expected) / 2) < 1e-9
    assert abs(float(m["teacher_topk_mass"]) - (0.8 + 1.0) / 2) < 1e-12
    assert abs(float(m["student_topk_mass"]) - (0.6 + 0.75) / 2) < 1e-12
    loss.backward()
    assert torch.isfinite(student.grad).all() and torch.equal(student.grad[0, 2], torch.zeros(2, dtype=torch.float64))
    assert student.grad[0, :2].abs().sum() > 0
    assert teacher.grad is None  # the teacher is a constant


def test_forward_gradient_by_hand() -> None:
    # Forward KL at position 0 as a function of the student's log-probs s_k:
    # d/ds_k = -p_k + p_tail * q_k / q_tail (the tail's log q_tail = log(1 - sum_k exp s_k)); loss = mean of 2 tokens.
    student = logs(STUDENT).requires_grad_(True)
    loss, _, _ = topk_distill_loss(student, logs(TEACHER), MASK, kind="forward")
    loss.backward()
    expected = [(-0.5 + 0.2 * 0.4 / 0.4) / 2, (-0.3 + 0.2 * 0.2 / 0.4) / 2]
    torch.testing.assert_close(student.grad[0, 0], torch.tensor(expected, dtype=torch.float64))


def test_no_tail_renormalises_over_the_k_ids() -> None:
    # Position 0 renormalised: teacher [5/8, 3/8], student [2/3, 1/3]; position 1: teacher [.6, .4], student [2/3, 1/3].
    fwd = [
        5 / 8 * math.log((5 / 8) / (2 / 3)) + 3 / 8 * math.log((3 / 8) / (1 / 3)),
        0.6 * math.log(0.6 / (2 / 3)) + 0.4 * math.log(0.4 / (1 / 3)),
    ]
    _, kl, _ = topk_distill_loss(logs(STUDENT), logs(TEACHER), MASK, kind="forward", tail=False)
    torch.testing.assert_close(kl, torch.tensor([[*fwd, 0.0]], dtype=torch.float64), rtol=0, atol=1e-9)


def _random_pair(vocab: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    s = torch.log_softmax(torch.randn(2, 3, vocab, generator=g, dtype=torch.float64), -1)
    t = torch.log_softmax(2 * torch.randn(2, 3, vocab, generator=g, dtype=torch.float64), -1)
    return s, t


@pytest.mark.parametrize("kind", ["forward", "reverse"])
@pytest.mark.parametrize("tail", [True, False])
def test_k_equals_v_is_the_full_vocabulary_kl(kind: str, tail: bool) -> None:
    s, t = _random_pair()
    p, q = (t, s) if kind == "forward" else (s, t)
    full = (p.exp() * (p - q)).sum(-1)
    top_t, ids = t.topk(t.shape[-1], dim=-1)  # K = V: every id, in the teacher's order
    _, kl, m = topk_distill_loss(s.gather(-1, ids), top_t, torch.ones(2, 3), kind=kind, tail=tail)
    torch.testing.assert_close(kl, full, rtol=0, atol=1e-9)
    assert abs(float(m["teacher_topk_mass"]) - 1.0) < 1e-12


@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_k_below_v_is_a_lower_bound_and_forward_differs_from_reverse(kind: str) -> None:
    s, t = _random_pair()
    p, q = (t, s) if kind == "forward" else (s, t)
    full = (p.exp() * (p - q)).sum(-1)
    top_t, ids = t.topk(3, dim=-1)
    _, kl, _ = topk_distill_loss(s.gather(-1, ids), top_t, torch.ones(2, 3), kind=kind)
    assert (kl >= -1e-12).all() and (kl <= full + 1e-12).all()  # merging outcomes never increases a KL
    _, other, _ = topk_distill_loss(
        s.gather(-1, ids), top_t, torch.ones(2, 3), kind="reverse" if kind == "forward" else "forward"
    )
    assert (kl - other).abs().max() > 1e-3


def test_identical_distributions_give_zero_and_half_precision_is_upcast() -> None:
    s, _ = _random_pair()
    top, _ = s.topk(2, dim=-1)
    for kind in ("forward", "reverse"):
        loss, kl, _ = topk_distill_loss(top.clone(), top, torch.ones(2, 3), kind=kind)
        assert float(kl.abs().max()) < 1e-12 and loss.item() == pytest.approx(0.0, abs=1e-12)
    _, kl16, _ = topk_distill_loss(top.to(torch.bfloat16), top.to(torch.bfloat16), torch.ones(2, 3))
    assert kl16.dtype == torch.float32


def test_topk_mass_rounded_above_one_counts_as_one() -> None:
    # A half-precision student can report top-k mass 0.7 + 0.31 = 1.01: its tail is taken as 0 (not -0.01, which
    # would add -0.01 * (log TAIL_EPS - log 0.1) of spurious KL), and the reported mass is 1.
    student = logs([[[0.7, 0.31]]])
    teacher = logs([[[0.6, 0.3]]])
    _, kl, m = topk_distill_loss(student, teacher, torch.ones(1, 1), kind="reverse")
    expected = 0.7 * math.log(0.7 / 0.6) + 0.31 * math.log(0.31 / 0.3)
    assert abs(kl.item() - expected) < 1e-9
    assert m["student_topk_mass"].item() == pytest.approx(1.0)


def test_topk_errors() -> None:
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="unknown distillation KL kind"):
        topk_distill_loss(x, x, torch.ones(2, 3), kind="jsd")
    with pytest.raises(ValueError, match=r"must both be \(B, T, K\)"):
        topk_distill_loss(x, torch.zeros(2, 3, 5), torch.ones(2, 3))
    with pytest.raises(ValueError, match="does not match"):
        topk_distill_loss(x, x, torch.ones(2, 4))


def test_top_1_lists_need_the_tail_bucket() -> None:
    """Rows storing the teacher's top-1 with tail=False trained nothing: renormalised over one id both sides are
    log 1, a loss and gradient of 0 whatever the student. With the tail it is the KL of two Bernoullis."""
    student = torch.tensor([[[math.log(0.4)]]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[[math.log(0.7)]]], dtype=torch.float64)
    mask = torch.ones(1, 1)
    loss, _, _ = topk_distill_loss(student, teacher, mask, kind="forward", tail=True)
    assert loss.item() == pytest.approx(0.7 * math.log(0.7 / 0.4) + 0.3 * math.log(0.3 / 0.6))
    loss, _, _ = topk_distill_loss(student, teacher, mask, kind="reverse", tail=True)
    assert loss.item() == pytest.approx(0.4 * math.log(0.4 / 0.7) + 0.6 * math.log(0.6 / 0.3))
    loss.backward()
    assert student.grad is not None and student.grad.abs().item() > 0.1
    for kind in ("forward", "reverse"):
        with pytest.raises(ValueError, match=r"K=1 top-k lists with tail=False give a KL of 0"):
            topk_distill_loss(student, teacher, mask, kind=kind, tail=False)


# ---------------------------------------------------------------- on-policy distillation
def test_on_policy_advantages_sign_scale_and_mask() -> None:
    student = torch.tensor([[-1.0, -2.0, NAN], [-0.3, NAN, NAN]], requires_grad=True)
    teacher = torch.tensor([[-1.5, -1.0, 0.0], [-0.3, 1.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # s - t = 0.5 (student overrates: pushed down), -1 (teacher prefers: pushed up), 0 (agreement)
    torch.testing.assert_close(reverse_kl_per_token(student, teacher, mask), torch.tensor([[0.5, -1.0, 0], [0, 0, 0]]))
    adv = on_policy_distill_advantages(student, teacher, mask, coef=2.0)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))
    assert not adv.requires_grad
    with pytest.raises(ValueError, match="coef must be > 0"):
        on_policy_distill_advantages(student, teacher, mask, coef=0.0)
    with pytest.raises(ValueError, match="teacher_logp"):
        on_policy_distill_advantages(student, teacher[:, :2], mask)
