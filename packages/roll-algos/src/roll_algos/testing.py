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
- on-policy (old_logp = logp), the gradient is the policy gradient: each valid token's entry is -A_t times its
  aggregation weight (token-mean 1/N, seq-mean-token-mean 1/(n_b R), seq-mean-token-sum 1/B,
  seq-mean-token-sum-norm 1/(B L)), for per-token advantages of both signs; a variant whose on-policy gradient is
  not REINFORCE's by design is listed in `on_policy_exempt`.
- off-policy, against an independent per-token reference (`reference_losses`, built-ins in `REFERENCE_LOSSES`,
  written case by case from the papers in plain Python floats): the loss value, the gradient (so stop-gradients sit
  where the formula puts them), and the metrics `clipfrac_low`/`clipfrac_high`/`clipfrac_dual`, `approx_kl`,
  `ratio_mean`, `ratio_max`, over asymmetric clip ranges with and without a dual clip, ratios on both sides of
  the clip range and beyond the dual clip. Variants without a reference are not checked here.
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
        reference_losses = {"my_variant": my_reference}  # optional: (ReferenceToken, settings) -> TokenReference

`installed_loss_plugin` installs a loss plugin into a folder for the length of a test (a real distribution that
`importlib.metadata` finds on `sys.path`, as pip would leave it), for tests of the plugin path itself.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import pytest
import torch
from torch import Tensor

from roll_algos.kl import KL_KINDS
from roll_algos.kl import kl_estimate as _kl_estimate
from roll_algos.losses import AGG_MODES, POLICY_LOSS_VARIANTS, PolicyLossSettings, clear_policy_loss_cache
from roll_algos.losses import policy_loss as _policy_loss

__all__ = [
    "REFERENCE_LOSSES",
    "PolicyLossTestSuite",
    "ReferenceLoss",
    "ReferenceToken",
    "TokenReference",
    "installed_loss_plugin",
    "loss_batch",
    "reference_batch",
]

#: `norm_length` passed to every call (seq-mean-token-sum-norm needs one; the others ignore it).
NORM_LENGTH = 6
_CLIPFRACS = ("clipfrac_low", "clipfrac_high", "clipfrac_dual")


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


def reference_batch(seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, old_logp, advantages, mask), each (5, 7) float64, for the reference checks: log-ratios of std 0.8 (both
    sides of any usual clip range) plus one token per sign beyond a dual clip of 3 (log r = +-1.5), sequence ratios
    below and above the clip range, advantages per token of both signs, rows of both signs of mean advantage; row 1
    has a hole, row 4 is empty; NaN at padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(5, 7, dtype=torch.float64)
    mask[0, 5:] = 0
    mask[1, 2] = 0
    mask[4] = 0
    logp = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3 - 0.05
    log_ratio = torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.8
    log_ratio[2] += 0.3  # row 2's sequence ratio e^0.42 = 1.52: above the clip range (GSPO's clip-high)
    log_ratio[2, 0], log_ratio[3, 1] = 1.5, -1.5
    adv = torch.randn(5, 7, generator=g, dtype=torch.float64)
    adv[2, 0], adv[3, 1] = -1.0, 1.0  # r = e^1.5 = 4.5 > 3 with A < 0: the dual clip acts
    adv[0] = adv[0].abs() + 0.1  # row 0 positive, row 3 negative (topr's default split by mean advantage)
    adv[3] = -(adv[3].abs() + 0.1)
    pad = ~mask.bool()
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    old = logp - log_ratio
    return torch.where(pad, nan, logp), torch.where(pad, nan, old), torch.where(pad, nan, adv), mask


class ReferenceToken(NamedTuple):
    """One valid token as a reference loss sees it (plain floats)."""

    #: log pi(y_t) under the current policy.
    logp: float
    #: log r_t = logp - old_logp.
    log_ratio: float
    #: A_t.
    adv: float
    #: The row's sequence log-ratio: the mean of log r over its valid tokens.
    seq_log_ratio: float
    #: The row's mean advantage over its valid tokens.
    row_adv_mean: float


class TokenReference(NamedTuple):
    """A reference loss's answer for one token."""

    #: The per-token loss value.
    loss: float
    #: d loss_t / d logp_t with every stop-gradient of the formula applied (a sequence-ratio loss in GSPO-token
    #: form has no cross-token term).
    grad: float
    #: The ratio the loss used (r_t, or the row's s).
    ratio: float
    #: Which of clipfrac_low / clipfrac_high / clipfrac_dual this token counts in (absent: not counted).
    clipped: frozenset[str] = frozenset()


ReferenceLoss = Callable[[ReferenceToken, PolicyLossSettings], TokenReference]


def _clipped_reference(r: float, a: float, s: PolicyLossSettings) -> TokenReference:
    """PPO's surrogate by cases (Schulman et al. 2017, with DAPO's asymmetric range and the dual clip of Ye et al.
    2020): A >= 0: -A min(r, 1 + clip_high); A < 0: -A max(r, 1 - clip_low), then min(that, -c A)."""
    if a >= 0:
        if r > 1 + s.clip_high:
            return TokenReference(-a * (1 + s.clip_high), 0.0, r, frozenset({"clipfrac_high"} if a > 0 else ()))
        return TokenReference(-a * r, -a * r, r)
    if s.dual_clip is not None and r > s.dual_clip:
        return TokenReference(-a * s.dual_clip, 0.0, r, frozenset({"clipfrac_dual"}))
    if r < 1 - s.clip_low:
        return TokenReference(-a * (1 - s.clip_low), 0.0, r, frozenset({"clipfrac_low"}))
    return TokenReference(-a * r, -a * r, r)


def _ppo_reference(t: ReferenceToken, s: PolicyLossSettings) -> TokenReference:
    return _clipped_reference(math.exp(t.log_ratio), t.adv, s)


def _gspo_reference(t: ReferenceToken, s: PolicyLossSettings) -> TokenReference:
    """GSPO-token: the PPO cases on the row's s = exp(mean log r); gradient -A_t s on the token when unclipped."""
    return _clipped_reference(math.exp(t.seq_log_ratio), t.adv, s)


def _weighted_reference(t: ReferenceToken, weight: float) -> TokenReference:
    """-sg(w) A logp: value -w A logp, gradient -w A."""
    return TokenReference(-weight * t.adv * t.logp, -weight * t.adv, math.exp(t.log_ratio))


def _cispo_reference(t: ReferenceToken, s: PolicyLossSettings) -> TokenReference:
    r = math.exp(t.log_ratio)
    return _weighted_reference(t, min(max(r, 1 - s.clip_low), 1 + s.clip_high))


def _tis_reference(t: ReferenceToken, s: PolicyLossSettings) -> TokenReference:
    return _weighted_reference(t, min(math.exp(t.log_ratio), s.ratio_cap))


def _topr_reference(t: ReferenceToken, s: PolicyLossSettings) -> TokenReference:
    return _weighted_reference(t, 1.0 if t.row_adv_mean > 0 else min(math.exp(t.log_ratio), 1.0))


def _vanilla_reference(t: ReferenceToken, s: PolicyLossSettings) -> TokenReference:
    return _weighted_reference(t, 1.0)


#: The built-in variants' references: one function of (token, settings) per name.
REFERENCE_LOSSES: Mapping[str, ReferenceLoss] = {
    "ppo": _ppo_reference,
    "gspo": _gspo_reference,
    "cispo": _cispo_reference,
    "tis": _tis_reference,
    "topr": _topr_reference,
    "vanilla": _vanilla_reference,
}
#: Settings of the reference checks: symmetric without a dual clip; DAPO's clip-higher with a dual clip and a cap.
REFERENCE_SETTINGS = (
    PolicyLossSettings(clip_low=0.2, clip_high=0.2, dual_clip=None, ratio_cap=2.0),
    PolicyLossSettings(clip_low=0.2, clip_high=0.28, dual_clip=3.0, ratio_cap=1.5),
)


def _agg_weights(mask: Tensor, agg: str) -> list[list[float]]:
    """Each valid token's weight in the aggregated loss (the module docstring of roll_algos.losses), in Python."""
    rows = mask.bool().tolist()
    n_tok = sum(map(sum, rows))
    n_rows = sum(1 for r in rows if any(r))
    out = []
    for r in rows:
        n = sum(r)
        w = {
            "token-mean": 1 / max(n_tok, 1),
            "seq-mean-token-mean": 1 / (max(n, 1) * max(n_rows, 1)),
            "seq-mean-token-sum": 1 / len(rows),
            "seq-mean-token-sum-norm": 1 / (len(rows) * NORM_LENGTH),
        }[agg]
        out.append([w if v else 0.0 for v in r])
    return out


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
    #: Variants whose on-policy gradient is not REINFORCE's by design (e.g. a scaled or regularised loss).
    on_policy_exempt: ClassVar[frozenset[str]] = frozenset()
    #: Per-token references by variant name (`ReferenceLoss`); a plugin adds its own to check its formula.
    reference_losses: ClassVar[Mapping[str, ReferenceLoss]] = REFERENCE_LOSSES

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if {"variant", "agg", "settings"} <= set(metafunc.fixturenames):
            cases = [
                pytest.param(v, a, s, id=f"{v}-{a}-{i}")
                for v in self.variants
                if v in self.reference_losses
                for a in self.agg_modes
                for i, s in enumerate(REFERENCE_SETTINGS)
            ]
            metafunc.parametrize(("variant", "agg", "settings"), cases)
        elif {"variant", "agg"} <= set(metafunc.fixturenames):
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

    def test_on_policy_gradient_is_the_policy_gradient(self, variant: str, agg: str) -> None:
        if variant in self.on_policy_exempt:
            pytest.skip(f"{variant} is in on_policy_exempt")
        logp, _, adv, mask = loss_batch(4)
        _, grad, _ = self._grad(logp, logp, adv, mask, variant, agg)
        weights = torch.tensor(_agg_weights(mask, agg), dtype=grad.dtype)
        expected = torch.where(mask.bool(), -adv * weights, 0.0)
        torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5, msg=f"{variant} on-policy gradient")

    def test_matches_the_reference_off_policy(self, variant: str, agg: str, settings: PolicyLossSettings) -> None:
        logp, old, adv, mask = reference_batch()
        ref = self.reference_losses[variant]
        weights = _agg_weights(mask, agg)
        valid = mask.bool().tolist()
        total, grads, ratios, counts, kls = 0.0, [], [], dict.fromkeys(_CLIPFRACS, 0), []
        for b in range(mask.shape[0]):
            idx = [t for t in range(mask.shape[1]) if valid[b][t]]
            lr = [float(logp[b, t] - old[b, t]) for t in idx]
            seq = sum(lr) / max(len(idx), 1)
            row_adv = sum(float(adv[b, t]) for t in idx) / max(len(idx), 1)
            row = [0.0] * mask.shape[1]
            for t, x in zip(idx, lr):
                out = ref(ReferenceToken(float(logp[b, t]), x, float(adv[b, t]), seq, row_adv), settings)
                total += weights[b][t] * out.loss
                row[t] = weights[b][t] * out.grad
                ratios.append(out.ratio)
                kls.append(math.expm1(x) - x)
                for k in out.clipped:
                    counts[k] += 1
            grads.append(row)
        n = len(ratios)
        leaf = logp.clone().requires_grad_()
        loss, metrics = self.policy_loss(
            leaf,
            old,
            adv,
            mask,
            variant=variant,
            agg=agg,
            norm_length=NORM_LENGTH,
            clip_low=settings.clip_low,
            clip_high=settings.clip_high,
            dual_clip=settings.dual_clip,
            ratio_cap=settings.ratio_cap,
        )
        (grad,) = torch.autograd.grad(loss, leaf)
        assert loss.item() == pytest.approx(total, rel=1e-6, abs=1e-9), f"{variant} loss"
        torch.testing.assert_close(grad, torch.tensor(grads, dtype=grad.dtype), atol=1e-9, rtol=1e-6)
        expected = {k: counts[k] / n for k in _CLIPFRACS}
        expected.update(approx_kl=sum(kls) / n, ratio_mean=sum(ratios) / n, ratio_max=max(ratios))
        for k, v in expected.items():
            assert metrics[k].item() == pytest.approx(v, rel=1e-6, abs=1e-9), f"{variant} metric {k}"

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
