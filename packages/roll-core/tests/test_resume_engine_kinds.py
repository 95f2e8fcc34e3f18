"""Resuming under another train engine or Megatron optimizer structure (roll_core.config.resume), on configs composed
as a run composes them:

- `hf` <-> `fsdp2` (one checkpoint format, each loading the other's at any world size: roll-engines'
  test_fsdp2_checkpoints.py) is a reported change in both directions, through a recorded checkpoint too; it was
  refused as a change of the engine's kind, so an hf run could not go on over a second GPU;
- a switch to or from `megatron`, an engine claiming a name of the pair under another class, and a changed LoRA shape
  across the switch stay refused;
- `train_engine.expert_model_parallel_size` across 1 (Megatron's separate expert optimizer appears or disappears) is
  refused with both values and the way out; it passed the check, and the engine refused the checkpoint only at its
  load, after Ray and the inference engines had started. 2 -> 4 (the same structure) stays a reported change.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from roll_core.checkpoint import CheckpointManager
from roll_core.config import ConfigError, load_config
from roll_core.config.resume import check_checkpoint, check_resume, config_dict

HF = ["model=tiny"]
FSDP2 = ["model=tiny", "train_engine=fsdp2", "cluster=ray"]
MEGATRON = ["model=tiny", "train_engine=megatron"]


def _config(overrides: list[str]) -> dict:
    return config_dict(load_config(overrides))


@pytest.mark.parametrize(("saved", "now"), [(HF, FSDP2), (FSDP2, HF)], ids=["hf->fsdp2", "fsdp2->hf"])
def test_hf_and_fsdp2_resume_each_others_checkpoints(saved: list[str], now: list[str], tmp_path: Path) -> None:
    before, after = _config(saved), _config(now)
    names = (before["train_engine"]["name"], after["train_engine"]["name"])
    targets = (before["train_engine"]["_target_"], after["train_engine"]["_target_"])
    worlds = (before["train_engine"]["world_size"], after["train_engine"]["world_size"])
    expected = [
        f'cluster.backend: "{before["cluster"]["backend"]}" -> "{after["cluster"]["backend"]}"',
        f'train_engine._target_: "{targets[0]}" -> "{targets[1]}"',
        f'train_engine.name: "{names[0]}" -> "{names[1]}"',
    ]
    assert check_resume(before, after)[:3] == expected
    assert f"train_engine.world_size: {worlds[0]} -> {worlds[1]}" in check_resume(before, after)

    # Through the config a checkpoint records, as the loop checks it (typed config in).
    mgr = CheckpointManager(tmp_path, keep_last=1, config=before)
    folder = mgr.commit(mgr.staging(2), 2, {"sampler": {}})
    changed = check_checkpoint(folder, load_config([*now, "algo.lr=3e-3"]))
    assert expected[1] in changed and expected[2] in changed and f"algo.lr: {before['algo']['lr']} -> 0.003" in changed


def test_a_switch_keeps_refusing_what_cannot_change() -> None:
    hf = _config(HF)
    # The LoRA shape is part of the checkpoint (its adapter/): refused across the switch as within an engine.
    with pytest.raises(ConfigError) as err:
        check_resume(hf, _config([*FSDP2, "train_engine.lora_rank=8"]))
    assert "train_engine.lora_rank: 0 -> 8" in str(err.value)
    assert "train_engine.name" not in str(err.value)  # the switch itself is not what is refused


@pytest.mark.parametrize(("saved", "now"), [(HF, MEGATRON), (MEGATRON, HF), (FSDP2, MEGATRON), (MEGATRON, FSDP2)])
def test_a_switch_to_or_from_megatron_is_refused(saved: list[str], now: list[str]) -> None:
    before, after = _config(saved), _config(now)
    with pytest.raises(ConfigError) as err:
        check_resume(before, after)
    msg = str(err.value)
    assert f'train_engine.name: "{before["train_engine"]["name"]}" -> "{after["train_engine"]["name"]}"' in msg
    assert "train_engine._target_" in msg and "Set them back" in msg


def test_an_engine_of_another_class_under_a_pairs_name_is_refused() -> None:
    hf = _config(HF)
    plugin = copy.deepcopy(_config(FSDP2))
    plugin["train_engine"]["_target_"] = "my_plugin.ShardedEngine"  # named fsdp2, writes who knows what
    with pytest.raises(ConfigError, match=r'train_engine\._target_: .* -> "my_plugin\.ShardedEngine"'):
        check_resume(hf, plugin)
    # Configs that record only the name (as older tests' dicts): the pair is recognised by it.
    assert check_resume({"train_engine": {"name": "hf"}}, {"train_engine": {"name": "fsdp2"}}) == [
        'train_engine.name: "hf" -> "fsdp2"'
    ]
    with pytest.raises(ConfigError, match=r'train_engine\.name: "hf" -> "other"'):
        check_resume({"train_engine": {"name": "hf"}}, {"train_engine": {"name": "other"}})


def _megatron(world: int, ep: int) -> dict:
    return _config([*MEGATRON, f"train_engine.world_size={world}", f"train_engine.expert_model_parallel_size={ep}"])


@pytest.mark.parametrize(
    ("saved", "now", "way_out"),
    [
        ((2, 1), (2, 2), "resume with train_engine.expert_model_parallel_size=1,"),
        ((2, 2), (2, 1), "resume with train_engine.expert_model_parallel_size > 1"),
    ],
    ids=["1->2", "2->1"],
)
def test_expert_parallelism_across_1_is_refused_before_anything_starts(
    saved: tuple[int, int], now: tuple[int, int], way_out: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check_resume(_megatron(*saved), _megatron(*now), where="run/checkpoints/step_000004")
    msg = str(err.value)
    assert f"train_engine.expert_model_parallel_size: {saved[1]} -> {now[1]} (" in msg, msg
    assert "experts' optimizer state apart" in msg and way_out in msg, msg
    assert "run/checkpoints/step_000004" in msg


def test_expert_parallelism_may_change_on_its_side_of_1() -> None:
    assert check_resume(_megatron(2, 2), _megatron(4, 4)) == [
        "train_engine.expert_model_parallel_size: 2 -> 4",
        "train_engine.world_size: 2 -> 4",
    ]
    assert check_resume(_megatron(1, 1), _megatron(2, 1)) == ["train_engine.world_size: 1 -> 2"]
    # A checkpoint written before the key existed: not compared (the engine's load still refuses a mismatch).
    older = _megatron(2, 1)
    del older["train_engine"]["expert_model_parallel_size"]
    assert check_resume(older, _megatron(2, 2)) == ["train_engine.expert_model_parallel_size: (absent) -> 2"]
