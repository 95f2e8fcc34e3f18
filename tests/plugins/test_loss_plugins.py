"""An out-of-tree policy loss, installed as a distribution with a `roll.losses` entry point, is selected by
`algo.policy_loss=<name>` and computed by the `PolicyObjective` the trainer builds, the same path as `ppo`.

The plugin is a real distribution (a dist-info that `importlib.metadata` finds on `sys.path`, as pip leaves one),
installed for the test by `roll_algos.testing.installed_loss_plugin`; nothing is mocked. The objective pickles
with the name only and resolves it where it runs, as a Ray worker does; the `local` backend calls it in-process.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from roll_algos.testing import installed_loss_plugin, loss_batch
from roll_core import registry
from roll_core.config import load_config
from roll_core.config.schema import RLVRConfig
from roll_core.errors import ConfigError
from roll_core.pipelines.objectives import PolicyObjective

PLUGIN = '''
import torch
from roll_algos.losses import PolicyLossTerms, bounded_log_ratio


def halved_reinforce(logp, old_logp, advantages, mask, settings):
    """-A logp / 2, with its own metric."""
    ratio = torch.exp(bounded_log_ratio(logp, old_logp))
    return PolicyLossTerms(-0.5 * advantages * logp, ratio, {"halved": torch.tensor(1.0)})
'''


@pytest.fixture
def plugin(tmp_path: Path) -> Iterator[None]:
    entries = {"halved_reinforce": "roll_test_loss_plugin:halved_reinforce"}
    with installed_loss_plugin(
        tmp_path, dist="roll-test-loss-plugin", module="roll_test_loss_plugin", source=PLUGIN, entries=entries
    ):
        registry.clear_cache()
        yield
    registry.clear_cache()


def _objective(cfg: RLVRConfig) -> PolicyObjective:
    """The policy objective as `Trainer.__init__` builds it from the config."""
    algo = cfg.algo
    return PolicyObjective(
        variant=algo.policy_loss, agg=algo.loss_agg, clip_low=algo.clip_low, clip_high=algo.clip_high
    )


@pytest.mark.usefixtures("plugin")
def test_algo_policy_loss_selects_an_out_of_tree_loss() -> None:
    assert "halved_reinforce" in registry.available("roll.losses")  # roll-doctor and the entry-point test see it
    cfg = load_config(["algo.policy_loss=halved_reinforce"])
    assert cfg.algo.policy_loss == "halved_reinforce"
    objective = pickle.loads(pickle.dumps(_objective(cfg)))  # as shipped to a Ray worker: the name only
    logp, old, adv, mask = loss_batch()
    micro = {"response_mask": mask, "old_logprobs": old, "advantages": adv}
    loss, metrics = objective({"logprobs": logp}, micro)
    vanilla, _ = PolicyObjective(variant="vanilla")({"logprobs": logp}, micro)
    torch.testing.assert_close(loss, 0.5 * vanilla)
    assert metrics["actor/halved"] == 1.0 and metrics["actor/clipfrac_low"] == 0


def test_uninstalled_loss_is_refused_by_name_with_the_installed_list() -> None:
    with pytest.raises(ConfigError, match=r"algo\.policy_loss='halved_reinforce' is not one of 'cispo', 'gspo', 'ppo'"):
        load_config(["algo.policy_loss=halved_reinforce"])
