"""Conformance suite of roll-algos' loss contract: every policy-loss variant under every aggregation mode, and every
KL estimator, by the names roll-algos exports (`losses.POLICY_LOSS_VARIANTS`, roll-algos' own `roll.losses` entry
points; `losses.AGG_MODES`; `kl.KL_KINDS`).

Policy loss, for each variant x aggregation (`policy_loss(logp, old_logp, advantages, mask, variant=, agg=)`) on a
batch with a hole in the mask, an empty row, and NaN on the masked positions of every input:
- the loss is a finite 0-dim tensor, its gradient finite and exactly 0 on masked positions, its metrics detached
  finite 0-dim tensors;
- zero advantages give a zero loss and a zero gradient;
- at ratio 1 (old_logp = logp) with positive advantages the gradient raises every valid token's log-prob, and a
  small step along it lowers the loss: with old_logp kept (the PPO family, vanilla, topr), or, for the variants
  whose loss value carries a stop-gradient ratio weight (`weighted_surrogates`: cispo, tis), with that weight held
  (old_logp moved with the step): their value at a new ratio mixes the weight's change in, which the gradient
  does not follow by design.
KL estimator, for each kind (`kl_estimate(logp, ref_logp, kind)`): (B, T), finite with a finite gradient, exactly
0 where the two log-probs are equal and >= 0 for the kinds that estimate a divergence (all but k1).
Unknown names (variant, aggregation, KL kind) are a ValueError that lists the choices.

roll-algos' tests run it (packages/roll-algos/tests/test_loss_conformance.py). It imports pytest (roll-algos' `test`
extra), so only tests import this module. A package that adds a loss declares its `PolicyLoss` under
`[project.entry-points."roll.losses"]` and runs the suite over its names through the same dispatcher::

    from roll_algos.testing import PolicyLossTestSuite

    class TestMyLoss(PolicyLossTestSuite):
        variants = ("my_variant",)
        kl_kinds = ("k3",)  # the KL cases run over `kl_estimate` (default roll_algos.kl.kl_estimate) and these kinds

`installed_loss_plugin` installs a loss plugin into a folder for the length of a test (a real distribution that
`importlib.metadata` finds on `sys.path`, as pip would leave it), for tests of the plugin path itself.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor

from roll_algos.kl import KL_KINDS
from roll_algos.kl import kl_estimate as _kl_estimate
from roll_algos.losses import AGG_MODES, POLICY_LOSS_VARIANTS, clear_policy_loss_cache
from roll_algos.losses import policy_loss as _policy_loss

__all__ = ["PolicyLossTestSuite", "installed_loss_plugin", "loss_batch"]

#: `norm_length` passed to every call (seq-mean-token-sum-norm needs one; the others ignore it).
NORM_LENGTH = 6


def loss_batch(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, old_logp, advantages, mask), each (4, 6): row 1 has a hole, row 3 is empty; NaN on masked positions
    of all three inputs (they must not reach the loss or its gradient). Advantages are per token, of both signs."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(
        [[1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.float32
    )
    logp = -torch.rand(4, 6, generator=g) * 3 - 0.05
    old = logp + torch.randn(4, 6, generator=g) * 0.3
    adv = torch.randn(4, 6, generator=g)
    nan = torch.tensor(float("nan"))
    pad = ~mask.bool()
    return torch.where(pad, nan, logp), torch.where(pad, nan, old), torch.where(pad, nan, adv), mask


class PolicyLossTestSuite:
    """Shared tests; one case per (variant, aggregation) and per KL kind."""

    #: Policy-loss variants under test.
    variants: ClassVar[Sequence[str]] = POLICY_LOSS_VARIANTS
    #: Aggregation modes under test.
    agg_modes: ClassVar[Sequence[str]] = AGG_MODES
    #: KL estimator kinds under test.
    kl_kinds: ClassVar[Sequence[str]] = KL_KINDS
    #: The function under test (`roll_algos.losses.policy_loss`'s signature).
    policy_loss: ClassVar[Callable[..., tuple[Tensor, dict[str, Tensor]]]] = staticmethod(_policy_loss)
    #: The KL estimator under test (`roll_algos.kl.kl_estimate`'s signature).
    kl_estimate: ClassVar[Callable[[Tensor, Tensor, str], Tensor]] = staticmethod(_kl_estimate)
    #: Step along the gradient in the descent check.
    step: ClassVar[float] = 1e-3
    #: Variants of the form -sg(w(ratio)) * A * logp: their descent is checked with w held (see the docstring).
    weighted_surrogates: ClassVar[frozenset[str]] = frozenset({"cispo", "tis"})

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if {"variant", "agg"} <= set(metafunc.fixturenames):
            metafunc.parametrize(("variant", "agg"), [(v, a) for v in self.variants for a in self.agg_modes])
        elif "kl_kind" in metafunc.fixturenames:
            metafunc.parametrize("kl_kind", list(self.kl_kinds))

    def _loss(self, logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, variant: str, agg: str) -> Any:
        return self.policy_loss(logp, old, adv, mask, variant=variant, agg=agg, norm_length=NORM_LENGTH)

    def _grad(self, logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, variant: str, agg: str) -> tuple:
        logp = logp.clone().requires_grad_()
        loss, metrics = self._loss(logp, old, adv, mask, variant, agg)
        (grad,) = torch.autograd.grad(loss, logp)
        return loss.detach(), grad, metrics

    def test_finite_scalar_loss_and_gradient(self, variant: str, agg: str) -> None:
        logp, old, adv, mask = loss_batch()
        loss, grad, metrics = self._grad(logp, old, adv, mask, variant, agg)
        assert loss.dim() == 0 and torch.isfinite(loss), f"loss {loss}"
        assert torch.isfinite(grad).all(), f"gradient {grad}"
        assert (grad[~mask.bool()] == 0).all(), "a masked position got a gradient"
        assert grad[mask.bool()].abs().sum() > 0, "no gradient on the valid tokens"
        assert isinstance(metrics, dict)
        for name, value in metrics.items():
            assert isinstance(value, Tensor) and value.dim() == 0, f"metric {name}: {value!r}"
            assert torch.isfinite(value) and not value.requires_grad, f"metric {name}: {value!r}"

    def test_zero_advantages_give_zero_gradient(self, variant: str, agg: str) -> None:
        logp, old, adv, mask = loss_batch(1)
        zeros = torch.where(mask.bool(), 0.0, adv)  # NaN stays on the padding
        loss, grad, _ = self._grad(logp, old, zeros, mask, variant, agg)
        assert loss == 0, f"loss {loss} with zero advantages"
        assert (grad == 0).all(), f"gradient {grad[grad != 0][:5].tolist()} with zero advantages"

    def test_positive_advantages_at_ratio_one_descend(self, variant: str, agg: str) -> None:
        logp, _, adv, mask = loss_batch(2)
        positive = torch.where(mask.bool(), adv.abs() + 0.1, adv)
        loss, grad, _ = self._grad(logp, logp, positive, mask, variant, agg)
        valid = mask.bool()
        assert (grad[valid] < 0).all(), f"a valid token's log-prob is not pushed up: {grad[valid].tolist()}"
        stepped = torch.where(valid, logp - self.step * grad, logp)
        behaviour = stepped if variant in self.weighted_surrogates else logp
        after, _ = self._loss(stepped, behaviour, positive, mask, variant, agg)
        assert after < loss, f"a step along the gradient took the loss from {loss} to {after}"

    def test_unknown_names_are_value_errors(self) -> None:
        logp, old, adv, mask = loss_batch()
        with pytest.raises(ValueError, match=self.variants[0]):
            self._loss(logp, old, adv, mask, "no-such-variant", self.agg_modes[0])
        with pytest.raises(ValueError, match=self.agg_modes[0]):
            self._loss(logp, old, adv, mask, self.variants[0], "no-such-aggregation")
        with pytest.raises(ValueError, match=self.kl_kinds[0]):
            self.kl_estimate(logp, old, "no-such-kl")

    def test_kl_estimate(self, kl_kind: str) -> None:
        g = torch.Generator().manual_seed(3)
        logp = (-torch.rand(3, 5, generator=g) * 3).requires_grad_()
        ref = logp.detach() + torch.randn(3, 5, generator=g)
        ref[0] = logp[0].detach()  # row 0: the two policies agree
        kl = self.kl_estimate(logp, ref, kl_kind)
        assert kl.shape == logp.shape and torch.isfinite(kl).all(), f"{kl_kind}: {kl}"
        assert (kl[0] == 0).all(), f"{kl_kind} is not 0 where the log-probs are equal: {kl[0].tolist()}"
        if kl_kind != "k1":  # k1 (the log ratio) is unbiased but takes either sign
            assert (kl >= 0).all(), f"{kl_kind} is negative: {kl.min()}"
        (grad,) = torch.autograd.grad(kl.sum(), logp)
        assert torch.isfinite(grad).all()


@contextmanager
def installed_loss_plugin(
    folder: Path, *, dist: str, module: str, source: str, entries: Mapping[str, str]
) -> Iterator[None]:
    """Install a `roll.losses` plugin into `folder` while the block runs, and remove it after.

    Writes `<module>.py` with `source` and a `<dist>-0.1.dist-info` declaring `entries` (name -> "module:attr")
    under `roll.losses`, puts `folder` first on `sys.path` and clears roll-algos' loss cache, so
    `policy_loss(variant=<name>)` finds it exactly as it finds a pip-installed package. Callers that also read the
    group through another cache (`roll_core.registry`) clear that one themselves.
    """
    (folder / f"{module}.py").write_text(source)
    info = folder / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[roll.losses]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()  # the module file is new: a cached directory listing would miss it
    clear_policy_loss_cache()
    try:
        yield
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(module, None)
        clear_policy_loss_cache()
