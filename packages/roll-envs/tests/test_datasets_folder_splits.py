"""Which split of a saved `datasets` folder a file task reads (roll_envs.tasks._datasets_folder): env.split /
env.eval_split name one; several splits and none `train` (none beside it, for env.eval_path) is a ConfigError
naming them, not training on whichever was saved first; a lone split needs no name."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.errors import ConfigError
from roll_envs.rewards.math import MathReward
from roll_envs.tasks.dataset import FileTask

datasets = pytest.importorskip("datasets")


def _save(folder: Path, splits: dict[str, int]) -> str:
    """A DatasetDict with `n` rows `<split> <i>` in each split, saved to `folder`."""
    rows = {s: [{"prompt": f"{s} {i}", "answer": str(i)} for i in range(n)] for s, n in splits.items()}
    datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in rows.items()}).save_to_disk(str(folder))
    return str(folder)


def _prompts(problems: list) -> set[str]:
    return {p.prompt for p in problems}


def test_several_splits_none_train_is_refused_naming_them_and_the_key(tmp_path: Path) -> None:
    """It trained on `validation` (the first saved) with only a warning."""
    folder = _save(tmp_path / "ds", {"validation": 20, "test": 20})
    with pytest.raises(ConfigError, match=r"splits \['validation', 'test'\] and none is 'train'.*env\.split="):
        FileTask(MathReward(), path=folder, eval_size=2)


def test_env_split_names_the_split_to_train_on(tmp_path: Path) -> None:
    folder = _save(tmp_path / "ds", {"validation": 20, "test": 30})
    task = FileTask(MathReward(), path=folder, split="test", eval_fraction=0.0, eval_size=0)
    assert _prompts(task.train_set()) == {f"test {i}" for i in range(30)}
    assert all(p.id.startswith("data:ds/test:") for p in task.train_set())
    with pytest.raises(ConfigError, match=r"env\.split='tset'.*holds the splits \['validation', 'test'\]"):
        FileTask(MathReward(), path=folder, split="tset")


def test_a_lone_split_needs_no_name_and_train_is_still_the_default(tmp_path: Path) -> None:
    lone = _save(tmp_path / "lone", {"validation": 20})
    task = FileTask(MathReward(), path=lone, eval_fraction=0.0, eval_size=0)
    assert _prompts(task.train_set()) == {f"validation {i}" for i in range(20)}
    assert all(p.id.startswith("data:lone:") for p in task.train_set())  # (ids as before)
    both = _save(tmp_path / "both", {"test": 5, "train": 20})
    task = FileTask(MathReward(), path=both, eval_fraction=0.0, eval_size=0)
    assert _prompts(task.train_set()) == {f"train {i}" for i in range(20)}


def test_eval_path_holds_out_the_split_beside_train(tmp_path: Path) -> None:
    """env.eval_path naming a {train, test} folder read its `train` split: held-out accuracy measured on training
    rows. Now its `test` split, with ids apart from the training rows' (both were `data:ds:1`)."""
    folder = _save(tmp_path / "ds", {"train": 20, "test": 6})
    task = FileTask(MathReward(), path=folder, eval_path=folder, eval_size=10)
    assert _prompts(task.train_set()) == {f"train {i}" for i in range(20)}
    assert _prompts(task.eval_set()) == {f"test {i}" for i in range(6)}
    assert not {p.id for p in task.train_set()} & {p.id for p in task.eval_set()}
    named = FileTask(MathReward(), path=folder, eval_path=folder, eval_split="train", eval_size=10)
    assert _prompts(named.eval_set()) <= {f"train {i}" for i in range(20)}  # named: what the user asked for
    three = _save(tmp_path / "three", {"train": 5, "validation": 3, "test": 3})
    with pytest.raises(ConfigError, match=r"env\.eval_path\) holds the splits .*not one held-out split.*eval_split="):
        FileTask(MathReward(), path=str(three), eval_path=str(three))
    picked = FileTask(MathReward(), path=three, eval_path=three, eval_split="validation", eval_size=10)
    assert _prompts(picked.eval_set()) == {f"validation {i}" for i in range(3)}


def test_a_split_named_where_there_are_none_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    datasets.Dataset.from_list([{"prompt": f"q {i}", "answer": "1"} for i in range(5)]).save_to_disk(str(plain))
    with pytest.raises(ConfigError, match=r"env\.split='train'.*saved as one dataset, without splits"):
        FileTask(MathReward(), path=str(plain), split="train")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "q", "answer": "1"}\n')
    with pytest.raises(ConfigError, match=r"env\.split='train' names a split of a datasets folder.*is a file"):
        FileTask(MathReward(), path=str(rows), split="train")
    with pytest.raises(ConfigError, match=r"env\.eval_split='test'.*env\.eval_path, which is not set"):
        FileTask(MathReward(), path=str(rows), eval_split="test")


def test_a_task_without_the_key_is_told_to_save_the_split_on_its_own(tmp_path: Path) -> None:
    """env=code reads folders with the same reader: no silent `validation` there either."""
    from roll_envs.tasks.code import load_code_problems

    folder = _save(tmp_path / "ds", {"validation": 3, "test": 3})
    with pytest.raises(ConfigError, match=r"none is 'train': save the one to read to its own folder"):
        load_code_problems(folder)


def test_env_split_is_a_config_key_and_checked(tmp_path: Path) -> None:
    from hydra.utils import instantiate

    from roll_core.config import load_config

    folder = _save(tmp_path / "ds", {"validation": 20, "test": 30})
    cfg = load_config(["env=file", f"env.path={folder}", "env.split=test", "env.eval_size=0"])
    task = instantiate(cfg.env)
    assert _prompts(task.train_set()) <= {f"test {i}" for i in range(30)}
    with pytest.raises(ConfigError, match=r"env\.eval_split='test' names a split of env\.eval_path"):
        load_config(["env=file", f"env.path={folder}", "env.eval_split=test"])
    with pytest.raises(ConfigError, match=r"env\.split='' must name a split"):
        load_config(["env=file", f"env.path={folder}", "env.split=''"])
