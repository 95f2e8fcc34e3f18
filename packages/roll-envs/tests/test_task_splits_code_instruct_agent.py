"""env=code, env=instruct and env=openai_agent read a `datasets` folder through env=file's loader
(roll_envs.tasks.dataset `_read_rows`), but had no env.split / env.eval_split and read env.eval_path as training
data: a {train, test} folder given as env.eval_path held out its `train` split (held-out accuracy measured on training
rows, with only a warning), and a folder of several splits none `train` could not be read at all. They now take the
same keys with the same refusals as env=file (roll_envs.tasks._datasets_folder)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from roll_core.errors import ConfigError
from roll_envs.agentic.openai_agent import OpenAIAgentEnvConfig, OpenAIAgentTask
from roll_envs.config import CodeEnvConfig
from roll_envs.rewards.ifeval import InstructionReward
from roll_envs.rewards.math import MathReward
from roll_envs.tasks.code import CodeTask
from roll_envs.tasks.instruct import InstructEnvConfig, InstructTask

datasets = pytest.importorskip("datasets")


def _row(kind: str, text: str) -> dict[str, Any]:
    if kind == "code":
        return {"prompt": text, "tests": json.dumps([{"input": "1\n", "output": "1\n"}])}
    if kind == "instruct":
        return {"prompt": text, "constraints": json.dumps([{"type": "case", "mode": "lower"}])}
    return {"prompt": text}


def _save(folder: Path, kind: str, splits: dict[str, int]) -> str:
    dd = {s: datasets.Dataset.from_list([_row(kind, f"{s} {i}") for i in range(n)]) for s, n in splits.items()}
    datasets.DatasetDict(dd).save_to_disk(str(folder))
    return str(folder)


def _build(kind: str) -> Callable[..., Any]:
    if kind == "code":
        return lambda **kw: CodeTask(MathReward(), **kw)
    if kind == "instruct":
        return lambda **kw: InstructTask(InstructionReward(), **kw)
    return lambda **kw: OpenAIAgentTask(command=["true"], **kw)


def _texts(kind: str, items: list) -> set[str]:
    return {item["prompt"] if kind == "agent" else item.prompt for item in items}


KINDS = ["code", "instruct", "agent"]


@pytest.mark.parametrize("kind", KINDS)
def test_eval_path_holds_out_the_split_beside_train(kind: str, tmp_path: Path) -> None:
    folder = _save(tmp_path / "ds", kind, {"train": 20, "test": 6})
    task = _build(kind)(path=folder, eval_path=folder, eval_size=10)
    train = task.train_rows(20, 0) if kind == "agent" else task.train_set()
    held = task.eval_rows() if kind == "agent" else task.eval_set()
    assert _texts(kind, train) == {f"train {i}" for i in range(20)}
    assert _texts(kind, held) == {f"test {i}" for i in range(6)}  # was its `train` rows
    if kind != "agent":  # rows of two splits of one folder had one id (`code:ds:1`)
        assert not {p.id for p in train} & {p.id for p in held}


@pytest.mark.parametrize("kind", KINDS)
def test_split_keys_name_the_splits(kind: str, tmp_path: Path) -> None:
    folder = _save(tmp_path / "ds", kind, {"validation": 12, "test": 8})
    with pytest.raises(ConfigError, match=r"splits \['validation', 'test'\] and none is 'train'.*env\.split="):
        _build(kind)(path=folder, eval_size=2)
    task = _build(kind)(path=folder, split="validation", eval_path=folder, eval_split="test", eval_size=10)
    train = task.train_rows(12, 0) if kind == "agent" else task.train_set()
    held = task.eval_rows() if kind == "agent" else task.eval_set()
    assert _texts(kind, train) == {f"validation {i}" for i in range(12)}
    assert _texts(kind, held) == {f"test {i}" for i in range(8)}
    with pytest.raises(ConfigError, match=r"env\.split='tset'.*holds the splits"):
        _build(kind)(path=folder, split="tset")


@pytest.mark.parametrize("kind", KINDS)
def test_a_split_of_a_file_or_of_nothing_is_refused(kind: str, tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(_row(kind, f"q {i}")) + "\n" for i in range(10)))
    with pytest.raises(ConfigError, match=r"env\.split='train' names a split of a datasets folder.*is a file"):
        _build(kind)(path=str(rows), split="train")
    with pytest.raises(ConfigError, match=r"eval_split"):
        _build(kind)(path=str(rows), eval_split="test")


@pytest.mark.parametrize("config", [CodeEnvConfig, InstructEnvConfig, OpenAIAgentEnvConfig])
def test_configs_take_and_check_the_split_keys(config: Any) -> None:
    extra = {"command": ["true"]} if config is OpenAIAgentEnvConfig else {}
    node = config(path="ds", eval_path="ds", split="validation", eval_split="test", **extra)
    assert (node.split, node.eval_split) == ("validation", "test")
    with pytest.raises(ValueError, match=r"env\.eval_split='test' names a split of env\.eval_path, which is not set"):
        config(path="ds", eval_split="test", **extra)
    with pytest.raises(ValueError, match=r"env\.split=' ' must name a split"):
        config(path="ds", split=" ", **extra)
