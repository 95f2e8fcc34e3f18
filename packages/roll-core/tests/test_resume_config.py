"""Resuming with changed settings: changeable keys are reported (and take effect), fixed ones are refused with both
values (roll_core.config.resume), against the config each checkpoint records (roll_core.checkpoint)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from roll_core.checkpoint import CheckpointManager
from roll_core.config import ConfigError, load_config
from roll_core.config.resume import check_checkpoint, check_resume, config_dict, is_fixed

SAVED = {
    "experiment": "quickstart",
    "model": {"path": "builtin:tiny", "tokenizer": None, "dtype": "float32"},
    "algo": {"lr": 1e-4, "group_size": 8, "weight_decay": 0.0, "betas": [0.9, 0.999]},
    "env": {"_target_": "roll_envs.tasks.arithmetic.ArithmeticTask", "digits": 1, "eval_size": 100,
            "reward": {"_target_": "roll_envs.rewards.math.MathReward", "format_weight": 0.0}},
    "train_engine": {"name": "hf", "world_size": 1, "lora_rank": 0},
    "pipeline": {"max_steps": 10, "seed": 42, "resume": False, "resume_from": None, "save_every": 5},
}  # fmt: skip


def _changed(**paths: object) -> dict:
    cfg = copy.deepcopy(SAVED)
    for dotted, value in paths.items():
        *parents, leaf = dotted.split("__")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def test_changeable_settings_are_listed_with_old_and_new_values() -> None:
    now = _changed(
        algo__lr=1e-6,
        pipeline__max_steps=20,
        pipeline__resume=True,  # how this launch finds the run: never a change
        train_engine__world_size=2,  # engines reshard their checkpoints
        env__reward__format_weight=0.1,
        env__eval_size=50,
    )
    assert check_resume(SAVED, now) == [
        "algo.lr: 0.0001 -> 1e-06",
        "env.eval_size: 100 -> 50",
        "env.reward.format_weight: 0.0 -> 0.1",
        "pipeline.max_steps: 10 -> 20",
        "train_engine.world_size: 1 -> 2",
    ]
    assert check_resume(SAVED, copy.deepcopy(SAVED)) == []
    # A YAML round trip may write 1e-4 as 0.0001 or an int as a float: the same value is no change.
    assert check_resume(SAVED, _changed(algo__lr=0.0001, pipeline__max_steps=10.0)) == []


def test_fixed_settings_are_refused_each_with_both_values_and_the_way_out() -> None:
    now = _changed(model__path="other/model", algo__group_size=4, pipeline__seed=1, algo__lr=1e-6)
    with pytest.raises(ConfigError) as err:
        check_resume(SAVED, now, where="run/checkpoints/step_000005")
    msg = str(err.value)
    assert "run/checkpoints/step_000005" in msg
    for line in ('model.path: "builtin:tiny" -> "other/model"', "algo.group_size: 8 -> 4", "pipeline.seed: 42 -> 1"):
        assert line in msg
    assert "algo.lr" not in msg  # changeable keys are not part of the refusal
    assert "Set them back" in msg and "pipeline.resume=false" in msg
    with pytest.raises(ConfigError, match=r"env\.reward\._target_: .*-> \"my\.Reward\""):
        check_resume(SAVED, _changed(env__reward___target_="my.Reward"))
    with pytest.raises(ConfigError, match=r"env\.digits: 1 -> 2"):
        check_resume(SAVED, _changed(env__digits=2))
    # the number of critics: which critic folders the checkpoint holds (1 -> 2 failed loading critic_1's weights)
    with pytest.raises(ConfigError, match=r"algo\.num_critics: 1 -> 2"):
        check_resume(_changed(algo__num_critics=1), _changed(algo__num_critics=2))


def test_keys_only_one_side_has_are_reported_not_refused() -> None:
    now = _changed()
    now["pipeline"]["max_reward_failure_steps"] = 3  # a field added by an upgrade
    del now["env"]["reward"]["format_weight"]
    assert check_resume(SAVED, now) == [
        "env.reward.format_weight: 0.0 -> (absent)",
        "pipeline.max_reward_failure_steps: (absent) -> 3",
    ]
    assert is_fixed("env.path") and is_fixed("model.path") and not is_fixed("env.reward.timeout_s")
    assert not is_fixed("algo.lr") and not is_fixed("infer_engine.max_num_seqs")
    assert not is_fixed("env.on_failure") and not is_fixed("env.failure_reward") and is_fixed("env.max_turns")


def test_a_checkpoint_records_its_config_and_a_resumed_config_is_checked_against_it(tmp_path: Path) -> None:
    cfg = load_config(["model=tiny", "algo.lr=1e-4"])
    mgr = CheckpointManager(tmp_path, keep_last=1, config=config_dict(cfg))
    folder = mgr.commit(mgr.staging(3), 3, {"sampler": {}})
    assert CheckpointManager.read_config(folder) == config_dict(cfg)

    assert check_checkpoint(folder, load_config(["model=tiny", "algo.lr=1e-6"])) == ["algo.lr: 0.0001 -> 1e-06"]
    with pytest.raises(ConfigError, match=r"algo\.group_size: 8 -> 4"):
        check_checkpoint(folder, load_config(["model=tiny", "algo.lr=1e-4", "algo.group_size=4"]))

    # Without an explicit config the run folder's config.yaml (the Tracker's, the config in effect) is recorded.
    (tmp_path / "config.yaml").write_text("algo:\n  lr: 0.001\n")
    folder = CheckpointManager(tmp_path, keep_last=1).commit(mgr.staging(4), 4, {})
    assert CheckpointManager.read_config(folder) == {"algo": {"lr": 0.001}}
    (folder / "config.yaml").unlink()
    assert "records no config" in check_checkpoint(folder, cfg)[0]


@pytest.mark.parametrize(
    ("saved", "now"),
    [
        ({"math": "/models/a"}, {"math": "/models/b"}),  # a teacher replaced
        ({}, {"math": "/models/a"}),  # a teacher added
        ({"math": "/models/a", "code": "/models/c"}, {"math": "/models/a"}),  # a teacher removed
    ],
)
def test_routed_teachers_cannot_change_on_resume(saved: dict, now: dict) -> None:
    """distill.teachers is compared whole: an entry on one side only is a change (elsewhere a key one side lacks is
    taken as a setting a newer version added, and only reported)."""
    old, new = {"distill": {"teachers": saved}}, {"distill": {"teachers": now}}
    with pytest.raises(ConfigError, match=r"distill\.teachers: "):
        check_resume(old, new)
    assert check_resume(old, copy.deepcopy(old)) == []


def test_a_changed_kl_coef_restarts_the_adaptive_controller_an_unchanged_one_continues() -> None:
    """The resume check lists algo.kl_coef as a change that takes effect: with the adaptive controller
    (algo.kl_target) it then starts from the new value; unchanged, the checkpoint's adapted value continues."""
    from types import SimpleNamespace

    from roll_core.pipelines.objectives.rl import RLObjective

    roles = SimpleNamespace(sampling=SimpleNamespace(temperature=1.0), critics=None, critic=None)

    def objective(coef: float) -> RLObjective:
        cfg = load_config(["model=tiny", f"algo.kl_coef={coef}", "algo.kl_target=0.001"])
        return RLObjective(cfg, roles, trajectories=False)

    saved = objective(0.01)
    saved.kl_ctl.value = 0.0102  # adapted during the run
    state = saved.state_dict()
    same, changed = objective(0.01), objective(0.1)
    same.load_state_dict(state)
    changed.load_state_dict(state)
    assert same.kl_ctl.value == 0.0102 and changed.kl_ctl.value == 0.1
    old = objective(0.1)  # a checkpoint written before the field: its value continues
    old.load_state_dict({"kl": {"value": 0.0102}})
    assert old.kl_ctl.value == 0.0102
    # A NaN saved coefficient (a checkpoint of a run before NaN KLs were skipped) is refused, not a run whose KL term
    # silently vanished (`coef > 0` is False for NaN).
    with pytest.raises(ValueError, match="saved coefficient is nan"):
        objective(0.01).load_state_dict({"kl": {"value": float("nan"), "init": 0.01}})


@pytest.mark.parametrize(
    ("key", "saved", "now"),
    [
        ("correct_key", "correct", None),  # null: a judge's continuous reward scores the rows instead of the 0/1 flag
        ("reward_key", "reward", "judge_score"),
        ("group_key", "prompt_id", "prompt"),
        ("pair_margin", 0.0, 0.5),
        ("pairs_per_prompt", 1, 4),
    ],
)
def test_how_rollout_rows_are_scored_and_paired_cannot_change_on_resume(key: str, saved: object, now: object) -> None:
    """These settings decide which SFT rows or preference pairs a rollout file yields: another value on resume
    would continue the sampler's position over other rows (the same count slips past the sampler's size check)."""
    old = {"data": {"path": "rollouts/rows.parquet", "format": "rollout", key: saved}}
    new = copy.deepcopy(old)
    new["data"][key] = now
    with pytest.raises(ConfigError, match=rf"cannot resume from ckpt.*\n  data\.{key}: ") as err:
        check_resume(old, new, where="ckpt")
    assert "Set them back" in str(err.value)
    assert is_fixed(f"data.{key}")
    assert check_resume(old, copy.deepcopy(old)) == []
    # A checkpoint saved before the key existed is not refused, only reported.
    del old["data"][key]
    assert check_resume(old, new) == [f"data.{key}: (absent) -> {json.dumps(now)}"]


def test_the_reward_model_cannot_change_on_resume_its_weight_may() -> None:
    """The reward model is the task's reward, and its running score statistics (normalize=running) are restored
    from the checkpoint whatever model now scores: another model, tokenizer or template was silently scored with
    the old model's mean and std. How it is mixed in (mode, weight) is a reward weight: it may change."""
    saved = {"reward_model": {"name": "hf", "path": "/models/rm-a", "tokenizer": None, "normalize": "running",
                              "mode": "add", "weight": 1.0, "batch_size": 16}}  # fmt: skip
    for key, value in (("path", "/models/rm-b"), ("tokenizer", "/models/tok"), ("name", "none")):
        now = copy.deepcopy(saved)
        now["reward_model"][key] = value
        with pytest.raises(ConfigError, match=rf"reward_model\.{key}: "):
            check_resume(saved, now)
    now = copy.deepcopy(saved)
    now["reward_model"].update(weight=0.5, batch_size=32)
    assert check_resume(saved, now) == ["reward_model.batch_size: 16 -> 32", "reward_model.weight: 1.0 -> 0.5"]


def _multi() -> dict:
    return config_dict(load_config(["model=tiny", "env=multi"]))


def test_a_changed_task_shape_is_refused_not_taken_for_a_field_an_upgrade_added() -> None:
    """A key one side lacks was always taken as a field a version added, and only reported: a domain dropped from a
    multi-task run, domain shares set where the run had none (`{}`), or an environment keyword added resumed
    silently, the sampler's saved position then drawing another task's problems."""
    saved = _multi()
    dropped = copy.deepcopy(saved)
    del dropped["env"]["tasks"]["code"]
    code = r'\n  env\.tasks\.code: \{"_target_": "roll_envs\.tasks\.code\.CodeTask".*\.\.\. -> \(absent\)\n'
    with pytest.raises(ConfigError, match=code) as err:
        check_resume(saved, dropped)
    assert str(err.value).count("env.tasks.code") == 1  # one line for the domain, not one per setting of it
    shares = copy.deepcopy(saved)
    shares["env"]["weights"] = {"math": 3.0, "code": 1.0, "instruct": 1.0}
    with pytest.raises(ConfigError, match=r'env\.weights: \{\} -> \{"math": 3\.0, "code": 1\.0, "instruct": 1\.0\}'):
        check_resume(saved, shares)
    with pytest.raises(ConfigError, match=r'env\.weights: \{"math": 3\.0, .*\} -> \{\}'):
        check_resume(shares, saved)

    board = config_dict(load_config(["model=tiny", "env=frozen_lake"]))
    bigger = copy.deepcopy(board)
    bigger["env"]["env_kwargs"]["map_name"] = "8x8"
    with pytest.raises(ConfigError, match=r'env\.env_kwargs\.map_name: \(absent\) -> "8x8"'):
        check_resume(board, bigger)
    # A fixed field one version has and the other lacks is still a report (an upgrade), at any depth.
    older = copy.deepcopy(board)
    del older["env"]["unseen_eval"], older["algo"]["num_critics"]
    assert check_resume(older, board) == ["algo.num_critics: (absent) -> 1", "env.unseen_eval: (absent) -> false"]


def test_a_multi_task_domains_reward_weights_may_change_like_a_single_tasks() -> None:
    """env.reward.* and env.eval_size may change on resume, but the same settings of a multi-task run's domains
    (env.tasks.<domain>.reward.*) were refused: a code sandbox's memory raised after its OOMs stopped the run."""
    saved = _multi()
    now = copy.deepcopy(saved)
    now["env"]["tasks"]["code"]["reward"]["memory_mb"] = 2048
    now["env"]["tasks"]["math"]["reward"]["format_weight"] = 0.1
    now["env"]["tasks"]["math"]["eval_size"] = 50
    assert check_resume(saved, now) == [
        "env.tasks.code.reward.memory_mb: 512 -> 2048",
        "env.tasks.math.eval_size: 100 -> 50",
        "env.tasks.math.reward.format_weight: 0.0 -> 0.1",
    ]
    now["env"]["tasks"]["code"]["reward"]["_target_"] = "my.CodeReward"  # the reward's class stays fixed
    now["env"]["tasks"]["code"]["num_tests"] = 3  # and so does the task
    with pytest.raises(ConfigError) as err:
        check_resume(saved, now)
    assert "env.tasks.code.num_tests: 5 -> 3" in str(err.value)
    assert 'env.tasks.code.reward._target_: "roll_envs.rewards.code.CodeReward" -> "my.CodeReward"' in str(err.value)
    assert "memory_mb" not in str(err.value)
