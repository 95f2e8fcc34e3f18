"""Every entry point an installed roll package declares loads, and agrees with the config node that names it.

Built-ins are declared exactly as out-of-tree plugins are (ARCHITECTURE.md, "Plugins"), so this covers both: the
in-tree packages and the dummy plugins of tests/plugins when nox has installed them. Nothing here builds a model
or an engine: each entry point is imported, and each config option is composed, not run.

| group | agrees with |
|---|---|
| roll.platforms | its class's `name`; `roll_hw.detect` returns the same class; `hw=<name>` sets `platform: <name>` |
| roll.train_engines / roll.infer_engines | `<group>=<name>` composes to a node whose `_target_` is the class |
| roll.envs | `env=<name>` composes to a node whose `_target_` is the task class |
| roll.agentic_envs | `make_env(<name>)` builds that class; `env=<x>` options with `env: <name>` name installed ones |
| roll.rewards | some env option's `reward._target_` names each of roll-envs' rewards; a typo'd target lists them |
| roll.algorithms | `algo.adv_estimator` accepts each; every `algo=<x>` option names an installed one |
| roll.losses | roll-algos' dispatcher loads the same object; `algo.policy_loss` accepts exactly the installed names |
| roll.collectors | `pipeline=<name>` composes with `pipeline.name: <name>` |
| roll.trackers | a `TrackerBackend` class; `pipeline.trackers` accepts every name, and its default is installed |
| roll.configs | a callable (the CLI and `compose` call them all) |
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import distributions
from typing import Any

import pytest
from hydra.utils import get_object
from omegaconf import DictConfig

from roll_core import registry
from roll_core.config import compose
from roll_core.config.search_path import group_options

#: (group, name) of every entry point of an installed roll-* distribution, and the distribution.
DECLARED: dict[tuple[str, str], str] = {
    (ep.group, ep.name): dist.metadata["Name"]
    for dist in distributions()
    if dist.metadata["Name"].startswith("roll-")
    for ep in dist.entry_points
    if ep.group.startswith("roll.")
}
#: Config group of each engine-like entry-point group (the option name is the entry-point name).
OPTION_GROUPS = {
    "roll.train_engines": "train_engine",
    "roll.infer_engines": "infer_engine",
    "roll.envs": "env",
    "roll.collectors": "pipeline",
}


def _path(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _is_option(group: str, name: str) -> bool:
    """A YAML option in a config folder, or a node a `roll.configs` entry stored (the dummy engine's)."""
    from hydra.core.config_store import ConfigStore

    if name in group_options(group):
        return True
    registry.register_all_configs()
    return f"{name}.yaml" in ConfigStore.instance().repo.get(group, {})


def _names(group: str) -> list[str]:
    return sorted(name for g, name in DECLARED if g == group)


@pytest.fixture(scope="module")
def options() -> dict[tuple[str, str], DictConfig]:
    """(config group, option) -> the composed node, for every option an entry point or the env group names.

    Composition does not validate combinations, so one compose covers one option of every group at once (about
    0.3 s each: 5 composes instead of 20).
    """
    wanted: dict[str, list[str]] = {cfg_group: _names(group) for group, cfg_group in OPTION_GROUPS.items()}
    wanted["env"] = sorted(set(wanted["env"]) | set(group_options("env")))
    wanted["hw"] = sorted(group_options("hw"))
    wanted["algo"] = sorted(group_options("algo"))
    out = {}
    for row in range(max(map(len, wanted.values()))):
        picks = {g: names[row] for g, names in wanted.items() if row < len(names)}
        picks = {g: n for g, n in picks.items() if _is_option(g, n)}
        cfg = compose([f"{g}={n}" for g, n in picks.items()])
        out.update({(g, n): cfg[g] for g, n in picks.items()})
    return out


def test_declared_groups_are_read() -> None:
    from roll_hw.doctor import PLUGIN_GROUPS

    assert {g for g, _ in DECLARED} <= set(registry.GROUPS), "a roll package declares a group nothing reads"
    # roll-doctor lists every plugin kind (roll.configs are schemas, not plugins a user picks).
    assert set(PLUGIN_GROUPS.values()) == set(registry.GROUPS) - {"roll.configs"}
    in_tree = {"roll-hw", "roll-algos", "roll-core", "roll-engines", "roll-envs"}
    for group in registry.GROUPS:
        assert {DECLARED[k] for k in DECLARED if k[0] == group} & in_tree, f"no built-in declares {group}"


@pytest.mark.parametrize(("group", "name"), sorted(DECLARED), ids=[f"{g}:{n}" for g, n in sorted(DECLARED)])
def test_entry_point_loads(group: str, name: str) -> None:
    obj = registry.load(group, name)
    assert callable(obj), f"{group}:{name} loads {obj!r}"


def test_platforms_agree_with_their_names_and_hw_options(options: dict[tuple[str, str], DictConfig]) -> None:
    from roll_hw import Platform
    from roll_hw.detect import get_platform_class, platform_names

    for name in _names("roll.platforms"):
        cls = registry.load("roll.platforms", name)
        assert issubclass(cls, Platform) and cls.name == name
        assert get_platform_class(name) is cls  # roll-hw's own reader sees the same
    assert set(platform_names()) == set(_names("roll.platforms"))
    for (group, option), node in options.items():
        if group == "hw" and option != "auto":
            assert node.platform == option and option in _names("roll.platforms")


@pytest.mark.parametrize("group", sorted(OPTION_GROUPS))
def test_option_named_like_the_entry_point_builds_it(group: str, options: dict[tuple[str, str], DictConfig]) -> None:
    cfg_group = OPTION_GROUPS[group]
    for name in _names(group):
        assert (cfg_group, name) in options, f"{group}:{name} is installed but `{cfg_group}={name}` is no option"
        node, obj = options[(cfg_group, name)], registry.load(group, name)
        if group == "roll.collectors":
            assert node.name == name
        else:  # the same object (a package may re-export its class under a shorter path)
            assert get_object(node._target_) is obj, f"{cfg_group}={name} builds {node._target_}, not {obj}"


def test_agentic_envs_agree_with_make_env_and_env_options(options: dict[tuple[str, str], DictConfig]) -> None:
    from roll_envs.agentic import available_envs, make_env
    from roll_envs.agentic.registry import PREFIXES

    installed = _names("roll.agentic_envs")
    assert available_envs()[: len(installed)] == installed
    for name in installed:
        assert type(make_env(name)) is registry.load("roll.agentic_envs", name)
    named_by_options = {
        node.env
        for (group, _), node in options.items()
        if group == "env" and "env" in node and isinstance(node.env, str) and node.env.split(":")[0] not in PREFIXES
    }
    assert named_by_options and named_by_options <= set(installed)
    own = {n for n in installed if DECLARED[("roll.agentic_envs", n)] == "roll-envs"}
    assert own <= {o for (g, o) in options if g == "env"}, "each roll-envs environment has its env=<name> option"


def test_rewards_agree_with_env_reward_nodes(options: dict[tuple[str, str], DictConfig]) -> None:
    nodes = [node.reward for (group, _), node in options.items() if group == "env" and "reward" in node]
    from roll_envs.config import REWARD_SCHEMAS  # the env/reward=<name> options (registered by the composes above)

    built = {get_object(node._target_) for node in nodes} | {get_object(s._target_) for s in REWARD_SCHEMAS.values()}
    installed = {registry.load("roll.rewards", name) for name in _names("roll.rewards")}
    for name in _names("roll.rewards"):
        cls = registry.load("roll.rewards", name)
        assert callable(getattr(cls, "score", None)), f"roll.rewards:{name} has no score()"
        if DECLARED[("roll.rewards", name)] == "roll-envs":
            assert cls in built, f"roll.rewards:{name} is the reward of no env option and no env/reward option"
    assert built <= installed, "an env option's reward is not declared under roll.rewards"


def test_unknown_reward_target_lists_installed_rewards() -> None:
    from hydra.errors import InstantiationException

    from roll_core.config.build import build
    from roll_envs.config import ArithmeticEnvConfig

    node = dataclasses.asdict(ArithmeticEnvConfig(train_size=4, eval_size=2))
    node["reward"]["_target_"] = "roll_envs.rewards.math.MathRewrd"
    with pytest.raises(InstantiationException) as err:
        build(node)
    for name in _names("roll.rewards"):
        target = _path(registry.load("roll.rewards", name))
        assert f"\t{name}: {target}" in str(err.value)


def test_estimators_agree_with_algo_options(options: dict[tuple[str, str], DictConfig]) -> None:
    from roll_core.config.schema import algo_choices

    assert set(algo_choices()["adv_estimator"]) == set(_names("roll.algorithms"))
    presets = {node.adv_estimator for (group, _), node in options.items() if group == "algo"}
    assert presets and presets <= set(_names("roll.algorithms"))


def test_trackers_are_backends_that_pipeline_trackers_names() -> None:
    from roll_core.config import load_config
    from roll_core.interfaces.tracking import TrackerBackend

    names = _names("roll.trackers")
    for name in names:
        cls = registry.load("roll.trackers", name)
        assert isinstance(cls, type) and issubclass(cls, TrackerBackend), f"roll.trackers:{name} is {cls!r}"
    assert load_config([f"pipeline.trackers=[{','.join(names)}]"]).pipeline.trackers == names
    assert set(load_config([]).pipeline.trackers) <= set(names), "the default pipeline.trackers is not installed"


def test_losses_agree_with_the_dispatcher_and_algo_policy_loss(options: dict[tuple[str, str], DictConfig]) -> None:
    from roll_algos.losses import POLICY_LOSS_VARIANTS, get_policy_loss
    from roll_core.config.schema import AlgoConfig, algo_choices

    names = _names("roll.losses")
    assert set(POLICY_LOSS_VARIANTS) <= set(names), "a built-in loss is not a roll.losses entry point"
    assert set(algo_choices()["policy_loss"]) == set(names)
    for name in names:
        assert get_policy_loss(name) is registry.load("roll.losses", name), f"two readers disagree on {name}"
        assert AlgoConfig(policy_loss=name).policy_loss == name
    presets = {node.policy_loss for (group, _), node in options.items() if group == "algo"}
    assert presets and presets <= set(names), "an algo=<x> option names a loss that is not installed"
