"""Policy losses as `roll.losses` plugins: the split into one `PolicyLoss` per variant changed no number, the
built-ins are roll-algos' declared entry points, and an out-of-tree loss goes through the same dispatcher (found,
called, checked by the conformance suite; a clash with a built-in name, a broken import or a wrong shape is a clear
error)."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from roll_algos import _plugins, losses
from roll_algos.losses import (
    POLICY_LOSS_VARIANTS,
    PolicyLossPluginError,
    get_policy_loss,
    policy_loss,
    policy_loss_names,
)
from roll_algos.testing import PolicyLossTestSuite, installed_loss_plugin, loss_batch

# Recorded with the if/elif `policy_loss` before the split (commit df8fc1b), on `_batch()` in float64:
# (variant, kwargs, loss, sum of gradient * position index, metrics in `_METRICS` order).
# Two corrections since, each checked against an independent per-token loop over `_batch()`: `approx_kl` is k3 of
# KL(old || new), r - 1 - log r (was 1/r - 1 + log r: 0.09399022183971892), and gspo's gradient is GSPO-token's,
# -A_t s per token (through the row mean it was -10.133882890273021).
_METRICS = ("clipfrac_low", "clipfrac_high", "clipfrac_dual", "approx_kl", "ratio_mean", "ratio_max")
BEFORE_SPLIT = [
    ("ppo", {}, -0.4305947949597091, -10.794828194476079, (0.3076923076923077, 0.15384615384615385, 0.0, 0.08744051277774387, 1.0130397870697208, 1.9519413077878809)),  # noqa: E501
    ("ppo", {"dual_clip": 1.5, "clip_high": 0.28}, -0.44135050857400315, -10.831016825888552, (0.3076923076923077, 0.15384615384615385, 0.07692307692307693, 0.08744051277774387, 1.0130397870697208, 1.9519413077878809)),  # noqa: E501
    ("gspo", {"agg": "seq-mean-token-mean"}, -0.3488127522052243, -10.578462365302501, (0.3076923076923077, 0.0, 0.0, 0.08744051277774387, 0.937569863230759, 1.079279359907784)),  # noqa: E501
    ("cispo", {}, 0.8061833293783602, -11.808477712800986, (0.0, 0.0, 0.0, 0.08744051277774387, 1.0130397870697208, 1.9519413077878809)),  # noqa: E501
    ("tis", {"ratio_cap": 1.2}, 0.8658261791300494, -11.81319460969653, (0.0, 0.0, 0.0, 0.08744051277774387, 1.0130397870697208, 1.9519413077878809)),  # noqa: E501
    ("topr", {}, 0.7498578703626516, -10.85049566013363, (0.0, 0.0, 0.0, 0.08744051277774387, 1.0130397870697208, 1.9519413077878809)),  # noqa: E501
    ("vanilla", {"agg": "seq-mean-token-sum"}, 2.0117108175928724, -34.71108044476496, (0.0, 0.0, 0.0, 0.08744051277774387, 1.0130397870697208, 1.9519413077878809)),  # noqa: E501
]  # fmt: skip


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(4, 5) float64: row 1 has a hole, row 2 is empty; ratios on both sides of the clip range."""
    g = torch.Generator().manual_seed(7)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    logp = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 2 - 0.1
    old = logp + torch.randn(4, 5, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(4, 5, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


@pytest.mark.parametrize(("variant", "kwargs", "loss", "grad", "metrics"), BEFORE_SPLIT)
def test_numbers_unchanged_by_the_split(variant: str, kwargs: dict, loss: float, grad: float, metrics: tuple) -> None:
    logp, old, adv, mask = _batch()
    logp.requires_grad_()
    out, got = policy_loss(logp, old, adv, mask, variant=variant, **kwargs)
    (g,) = torch.autograd.grad(out, logp)
    weighted = (g * torch.arange(20, dtype=torch.float64).view(4, 5)).sum()
    assert out.item() == pytest.approx(loss, rel=1e-12, abs=1e-15)
    assert weighted.item() == pytest.approx(grad, rel=1e-12)
    assert tuple(got) == _METRICS
    assert [got[k].item() for k in _METRICS] == pytest.approx(list(metrics), rel=1e-12, abs=1e-15)


def test_builtins_are_roll_algos_entry_points() -> None:
    assert POLICY_LOSS_VARIANTS == ("cispo", "gspo", "ppo", "tis", "topr", "vanilla")
    assert set(POLICY_LOSS_VARIANTS) <= set(policy_loss_names())
    for name in POLICY_LOSS_VARIANTS:
        assert get_policy_loss(name) is getattr(losses, f"{name}_loss")
    # The source-checkout fallback reads the same declarations as the installed metadata.
    source = {ep.name: ep.value for ep in _plugins._source_entry_points()}
    installed = {ep.name: ep.value for ep in entry_points(group=_plugins.GROUP) if ep.dist.name == "roll-algos"}
    assert source == installed and set(source) == set(POLICY_LOSS_VARIANTS)


def test_unknown_name_lists_the_installed_ones() -> None:
    logp, old, adv, mask = loss_batch()
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'; choose one of cispo, gspo, ppo, tis"):
        policy_loss(logp, old, adv, mask, variant="ppo2")


# ---------------------------------------------------------------- an out-of-tree loss
PLUGIN_SOURCE = '''
import torch
from roll_algos.losses import PolicyLossTerms, bounded_log_ratio


def doubled(logp, old_logp, advantages, mask, settings):
    """-2 A logp: twice vanilla, so its numbers are checkable."""
    ratio = torch.exp(bounded_log_ratio(logp, old_logp))
    return PolicyLossTerms(-2.0 * advantages * logp, ratio, {"scale": torch.tensor(2.0)})


def flat(logp, old_logp, advantages, mask, settings):
    return PolicyLossTerms((-advantages * logp).sum(-1), logp.exp(), {})


NOT_CALLABLE = 3
'''
ENTRIES = {
    "doubled": "roll_loss_plugin_test:doubled",
    "flat": "roll_loss_plugin_test:flat",
    "broken": "roll_loss_plugin_missing:nothing",
    "constant": "roll_loss_plugin_test:NOT_CALLABLE",
}


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[None]:
    with installed_loss_plugin(
        tmp_path, dist="roll-loss-plugin-test", module="roll_loss_plugin_test", source=PLUGIN_SOURCE, entries=ENTRIES
    ):
        yield


class TestOutOfTreeLossConforms(PolicyLossTestSuite):
    """The conformance suite over the plugin's loss, through `policy_loss(variant="doubled")`."""

    variants = ("doubled",)
    kl_kinds = ("k3",)
    on_policy_exempt = frozenset({"doubled"})  # twice REINFORCE's gradient, by design (its numbers are checkable)

    @pytest.fixture(autouse=True)
    def _installed(self, plugin: None) -> None:
        pass


@pytest.mark.usefixtures("plugin")
def test_out_of_tree_loss_goes_through_the_dispatcher() -> None:
    assert policy_loss_names() == (*POLICY_LOSS_VARIANTS, "broken", "constant", "doubled", "flat")
    assert losses.POLICY_LOSS_VARIANTS == POLICY_LOSS_VARIANTS  # roll-algos' own names only
    logp, old, adv, mask = loss_batch()
    vanilla, vm = policy_loss(logp, old, adv, mask, variant="vanilla", agg="seq-mean-token-mean")
    doubled, dm = policy_loss(logp, old, adv, mask, variant="doubled", agg="seq-mean-token-mean")
    torch.testing.assert_close(doubled, 2 * vanilla)
    # Shared metrics come from the dispatcher, the plugin's own are added, the clip fractions default to 0.
    assert dm["scale"] == 2.0 and dm["clipfrac_low"] == 0 and dm["ratio_mean"] == vm["ratio_mean"]


@pytest.mark.usefixtures("plugin")
def test_bad_plugins_are_clear_errors() -> None:
    logp, old, adv, mask = loss_batch()
    with pytest.raises(PolicyLossPluginError, match=r"roll.losses:broken .*ModuleNotFoundError"):
        policy_loss(logp, old, adv, mask, variant="broken")
    with pytest.raises(PolicyLossPluginError, match=r"roll.losses:constant .* is 3, not a callable PolicyLoss"):
        policy_loss(logp, old, adv, mask, variant="constant")
    with pytest.raises(ValueError, match=r"policy loss 'flat' returned loss \(4,\) .* must be \(B, T\) = \(4, 6\)"):
        policy_loss(logp, old, adv, mask, variant="flat")


def test_a_plugin_never_replaces_a_builtin(tmp_path: Path) -> None:
    entries = {"ppo": "roll_loss_clash_test:ppo", "mine": "roll_loss_clash_test:ppo"}
    source = "from roll_algos.losses import vanilla_loss as ppo\n"
    with installed_loss_plugin(
        tmp_path, dist="roll-loss-clash", module="roll_loss_clash_test", source=source, entries=entries
    ):
        logp, old, adv, mask = loss_batch()
        with pytest.raises(
            PolicyLossPluginError, match=r"roll.losses:ppo .* declared by roll-algos and roll-loss-clash"
        ):
            policy_loss(logp, old, adv, mask, variant="ppo")
        assert torch.isfinite(policy_loss(logp, old, adv, mask, variant="mine")[0])  # its other names still work
    assert get_policy_loss("ppo") is losses.ppo_loss  # uninstalled: the built-in is back
