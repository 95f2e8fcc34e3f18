"""Compose every config option and experiment on CPU; bind every `_target_` to its constructor without building.

Nothing here builds a model, starts Ray or touches a device: it is the torchtune validation trick. A config that
fails here would fail at the start of a real run, so these tests are the cheap guard for every config folder: the
ones the installed packages ship and the repository's `conf/` (roll_core.config.search_path).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from roll_core.cluster.roles import WORKER_KEYS
from roll_core.config import ConfigError, compose, to_object
from roll_core.config.search_path import config_dirs, group_options
from roll_core.testing import fill_missing

CONF_DIRS = config_dirs()  # the repository's conf/, then roll_core/conf, roll_engines/conf, roll_envs/conf
_FOLDERS = {p.name for d in CONF_DIRS for p in d.iterdir() if p.is_dir() and p.name[0] not in "_."}
GROUPS = sorted(_FOLDERS - {"experiment"})
OPTIONS = [(g, o) for g in GROUPS for o in group_options(g)]
EXPERIMENTS = sorted(group_options("experiment"))
YAMLS = [(d, p) for d in CONF_DIRS for p in sorted(d.rglob("*.yaml"))]


def test_every_group_has_options() -> None:
    for group in ("algo", "train_engine", "infer_engine", "env", "model", "hw", "cluster", "pipeline"):
        assert group in GROUPS and group_options(group), f"no installed package ships options for {group}/"


@pytest.mark.parametrize(("folder", "path"), YAMLS, ids=[f"{d.parent.name}/{p.relative_to(d)}" for d, p in YAMLS])
def test_every_yaml_starts_with_purpose_and_launch_comment(folder: Path, path: Path) -> None:
    head = path.read_text().splitlines()[:3]
    assert head[0].startswith("#") and len(head[0]) > 10, f"{path}: first line must say what it is for"
    assert any("roll-train" in line for line in head if line.startswith("#")), f"{path}: give a launch command"


def _bind_targets(node: Any, where: str) -> int:
    """Bind every `_target_` node's keys to its callable's signature; returns how many were checked."""
    count = 0
    if isinstance(node, DictConfig):
        if "_target_" in node:
            target = get_object(node["_target_"])
            # Worker keys (world size, weight sync, sleep, venv) configure the worker, not the engine.
            kwargs = {k: v for k, v in node.items() if not str(k).startswith("_") and k not in WORKER_KEYS}
            try:
                inspect.signature(target).bind_partial(**kwargs)  # run-time args (model path, lr) come later
            except TypeError as exc:
                raise AssertionError(f"{where}: {node['_target_']} does not accept {sorted(kwargs)}: {exc}") from exc
            count += 1
        for k, v in node.items():
            count += _bind_targets(v, f"{where}.{k}")
    elif isinstance(node, ListConfig):
        for i, v in enumerate(node):
            count += _bind_targets(v, f"{where}[{i}]")
    return count


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_validates_and_binds(group: str, option: str) -> None:
    cfg = compose([f"{group}={option}"])
    OmegaConf.resolve(cfg)
    node = cfg[group]
    fill_missing(node)
    obj = OmegaConf.to_object(node)  # runs __post_init__ invariants of this group's schema
    assert obj is not None
    _bind_targets(node, group)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_to_typed_config(experiment: str) -> None:
    cfg = compose([f"experiment={experiment}"])
    fill_missing(cfg)
    typed = to_object(cfg)
    assert typed.experiment and typed.pipeline.max_steps > 0
    assert _bind_targets(cfg, "cfg") >= 3  # train engine, infer engine, env at least


def test_default_primary_config_is_complete() -> None:
    typed = to_object(compose([]))
    assert typed.algo.adv_estimator == "grpo" and typed.cluster.backend == "local"


def test_misspelled_override_names_key_and_suggests() -> None:
    with pytest.raises(ConfigError, match=r"(?s)Key 'lrr' not in 'AlgoConfig'.*Did you mean 'algo.lr'\?"):
        compose(["algo.lrr=1e-5"])
    with pytest.raises(ConfigError, match=r"(?s)max_stepz.*Did you mean 'pipeline.max_steps'\?"):
        compose(["pipeline.max_stepz=3"])


def test_wrong_type_names_key() -> None:
    with pytest.raises(ConfigError, match=r"(?s)could not be converted to Integer.*full_key: algo.group_size"):
        compose(["algo.group_size=eight"])


def test_forced_append_of_unknown_key_still_fails() -> None:
    # Hydra's "+key=value" bypasses struct mode while composing; materialising the dataclass must still refuse.
    with pytest.raises(ConfigError, match="lrr"):
        to_object(compose(["+algo.lrr=3"]))


def test_misspelled_key_in_yaml_names_file_key_and_suggestion(tmp_path: Path) -> None:
    conf = tmp_path / "conf"  # a user's folder: layered over the packaged groups
    (conf / "algo").mkdir(parents=True)
    (conf / "algo" / "typo.yaml").write_text(
        "# a preset with a typo\n# roll-train algo=typo\ndefaults:\n  - algo_schema\n  - _self_\ngroup_sise: 4\n"
    )
    with pytest.raises(ConfigError, match=r"(?s)group_sise.*Did you mean 'algo.group_size'\?"):
        compose(["algo=typo"], conf_dir=conf)


def test_invariant_violation_says_how_to_fix() -> None:
    with pytest.raises(ConfigError, match=r"set algo.group_size >= 2"):
        to_object(compose(["algo=grpo", "algo.group_size=1"]))
    with pytest.raises(ConfigError, match=r"algo.dual_clip=0.5 must be > 1"):
        to_object(compose(["algo.dual_clip=0.5"]))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algo.refill_oversample=nan", "algo.refill_oversample"),
        ("algo.refill_max_batches=inf", "algo.refill_max_batches"),
        ("algo.dual_clip=nan", "algo.dual_clip"),
        ("algo.dual_clip=inf", "algo.dual_clip"),
        ("pipeline.reward_error_score=nan", "pipeline.reward_error_score"),
        ("cluster.placement_timeout_s=-5", "cluster.placement_timeout_s"),
        ("cluster.placement_timeout_s=nan", "cluster.placement_timeout_s"),
        ("train_engine.lora_alpha=nan", "lora_alpha"),
        ("train_engine.lora_dropout=1.5", "train_engine.lora_dropout"),
        ("train_engine.lora_dropout=nan", "train_engine.lora_dropout"),
        ("train_engine.lora_dropout=0.1", "train_engine.lora_dropout"),  # (hf: dropout noise moves the PPO ratio)
        ("infer_engine.max_concurrency=0", "infer_engine.max_concurrency"),
    ],
)
def test_non_finite_and_out_of_range_numbers_are_refused_at_composition(override: str, key: str) -> None:
    """Each used to compose and fail later (a ceil of inf at step 1, a NaN loss bound, Ray refusing a negative
    timeout at placement) or to be replaced silently (max_concurrency 0 -> 64)."""
    extra = ["train_engine.lora_rank=4"] if "lora" in override else []
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        to_object(compose([*extra, override]))


def test_engine_specific_sampling_limits_name_the_engine() -> None:
    with pytest.raises(ConfigError, match=r"infer_engine=sglang reports log-probs before top-k/top-p truncation"):
        to_object(compose(["infer_engine=sglang", "infer_engine.top_p=0.9"]))
    with pytest.raises(ConfigError, match=r"infer_engine.temperature=0.0 must be > 0 for RL sampling"):
        to_object(compose(["infer_engine=vllm", "infer_engine.temperature=0"]))
    with pytest.raises(ConfigError, match=r"sync_transport='pigeon' is not one of"):
        to_object(compose(["infer_engine.sync_transport=pigeon"]))


def test_a_mini_batch_size_that_does_not_divide_the_batch_is_refused() -> None:
    """algo.mini_batch_size is samples per optimizer step: 24 of 32 rows was one step of 32, and 40 or 1000 one
    step of the whole batch (no clipping), silently."""
    for size in (24, 40):
        with pytest.raises(ConfigError, match=rf"algo\.mini_batch_size={size} does not divide the 32 samples"):
            to_object(compose(["pipeline.rollout_batch_size=4", "algo.group_size=8", f"algo.mini_batch_size={size}"]))
    to_object(compose(["pipeline.rollout_batch_size=4", "algo.group_size=8", "algo.mini_batch_size=16"]))


def test_a_warm_up_longer_than_the_run_is_said(caplog: pytest.LogCaptureFixture) -> None:
    from roll_core.config import load_config
    from roll_core.pipelines.wiring import optimizer_schedule

    with caplog.at_level("WARNING"):
        schedule = optimizer_schedule(load_config(["pipeline.max_steps=12", "algo.warmup_steps=1000"]))
    assert schedule["total_steps"] == 12 and "peaks at 1.2% of it" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        optimizer_schedule(load_config(["pipeline.max_steps=12", "algo.warmup_steps=12"]))  # peaks at the last step
    assert "warmup_steps" not in caplog.text


def test_an_inference_actor_serves_every_request_a_step_can_have_in_flight() -> None:
    """A request holds its actor call until generated: a fixed 64 calls capped the engine's batch at 64 sequences
    and queued aborts and weight syncs behind the rest ((k + 1) x B x G requests in flight with async_ratio=k).
    null now sizes it from the run (per rank, plus room for control calls); a value given is kept."""
    from roll_core.config import load_config
    from roll_core.pipelines.wiring import request_concurrency

    assert request_concurrency(load_config(["pipeline.rollout_batch_size=2", "algo.group_size=4"])) == 64
    big = ["pipeline.rollout_batch_size=32", "algo.group_size=8"]
    assert request_concurrency(load_config(big)) == 256 + 16
    assert request_concurrency(load_config([*big, "pipeline.async_ratio=1"])) == 512 + 16
    assert request_concurrency(load_config([*big, "pipeline.async_ratio=1", "infer_engine.world_size=4"])) == 128 + 16


def test_a_misspelt_role_in_call_timeouts_is_refused() -> None:
    """+cluster.call_timeouts.rewards=60 composed and left the reward role at the default 3600 s."""
    with pytest.raises(ConfigError, match=r"cluster\.call_timeouts\.rewards: .*did you mean reward\?"):
        to_object(compose(["+cluster.call_timeouts.rewards=60"]))
    cfg = to_object(compose(["+cluster.call_timeouts.reward=60", "+cluster.call_timeouts.critic_1=5"]))
    assert cfg.cluster.timeout_for("reward") == 60.0 and cfg.cluster.timeout_for("critic_1") == 5.0


def test_a_tracker_named_twice_is_refused_at_composition() -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.trackers=\['jsonl', 'jsonl'\] names jsonl twice"):
        to_object(compose(["pipeline.trackers=[jsonl,jsonl]"]))


def test_a_missing_extra_of_a_multi_domain_sub_task_is_named_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """env=multi's sub-tasks sit in a dict: their rewards' extras were not checked, and the run failed later with an
    84-line instantiation traceback instead of one line naming roll-envs[math]."""
    import sys

    from roll_core.errors import MissingExtraError, check_installed

    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if roll-envs[math] were not installed
    cfg = to_object(compose(["experiment=multi_domain", "model=tiny"]))
    with pytest.raises(MissingExtraError, match=r"math-verify: pip install 'roll-envs\[math\]'"):
        check_installed(cfg)
