"""`entropy_from_logits` over logits with -inf entries (rows masked out: a padded vocabulary's extra rows, a
truncated or constrained distribution) equals the entropy over the remaining rows, with the same finite gradient
and 0 for the masked rows: the product p * x was 0 * -inf = NaN there."""

from __future__ import annotations

import torch

from roll_algos.losses import entropy_from_logits


def test_minus_inf_rows_add_nothing_to_the_entropy_nor_its_gradient() -> None:
    torch.manual_seed(0)
    kept = torch.randn(2, 3, 5) * 3
    masked = torch.cat([kept, torch.full((2, 3, 4), float("-inf"))], dim=-1).requires_grad_(True)
    ref = kept.clone().requires_grad_(True)
    got, want = entropy_from_logits(masked), entropy_from_logits(ref)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    got.sum().backward()
    want.sum().backward()
    assert torch.isfinite(masked.grad).all()
    torch.testing.assert_close(masked.grad[..., :5], ref.grad, atol=1e-6, rtol=1e-6)
    assert torch.equal(masked.grad[..., 5:], torch.zeros(2, 3, 4))
    # by hand: two equally likely tokens and two masked ones have entropy log 2
    two = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]])
    torch.testing.assert_close(entropy_from_logits(two), torch.tensor([[0.6931471805599453]]))


def test_finite_logits_keep_no_extra_vocabulary_sized_copy_for_the_backward() -> None:
    """The -inf handling must not cost every run memory: with finite logits, the backward keeps the fp32 logits and
    the probabilities only (2 x B*T*V*4 bytes); a masked copy and its bool mask made it 3.25 x (at R=8192, V=152k:
    ~6 GB more per micro-batch)."""
    logits = torch.randn(2, 8, 1000, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ent = entropy_from_logits(logits)
    assert sum(kept.values()) <= 2 * logits.numel() * 4 + 1024
    ent.sum().backward()  # still differentiable
    assert torch.isfinite(logits.grad).all()
