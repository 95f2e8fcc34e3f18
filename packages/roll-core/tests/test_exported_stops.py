"""`add_stop_tokens` (roll_core.pipelines.exported_stops) on the layouts an exported folder's generation config comes
in: one eos id (an int), none at all (no generation_config.json), and the cases that leave the file as it was. (The
engines' real exports, through the trainer's save: roll-engines' test_export_stop_tokens.py.)"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from roll_core.errors import ConfigError
from roll_core.pipelines.exported_stops import add_stop_tokens, merged_eos


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The built-in tiny model's folder (eos `</s>` = 2, `<pad>` = 0; generation config eos_token_id: 2)."""
    from roll_core.models import resolve_model_path

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "model"
    shutil.copytree(resolve_model_path("builtin:tiny"), out)
    return out


def _gen(folder: Path) -> dict:
    return json.loads((folder / "generation_config.json").read_text())


def test_merged_eos_keeps_the_bases_ids_first_and_adds_each_id_once() -> None:
    assert merged_eos(2, [0, 2, 0]) == [2, 0]
    assert merged_eos([7, 3], [3, 9]) == [7, 3, 9]
    assert merged_eos(None, [4]) == [4]


def test_one_eos_id_becomes_a_list_with_the_stop_tokens_after_it(folder: Path) -> None:
    from transformers import GenerationConfig

    before = _gen(folder)
    assert before["eos_token_id"] == 2
    assert add_stop_tokens(folder, ["<pad>", "</s>"]) == [2, 0]
    after = _gen(folder)
    assert before["_from_model_config"] is True
    assert after == {k: v for k, v in before.items() if k != "_from_model_config"} | {"eos_token_id": [2, 0]}
    assert GenerationConfig.from_pretrained(folder).eos_token_id == [2, 0]


def test_a_folder_without_a_generation_config_gets_the_one_from_pretrained_builds_with_the_stop_tokens(
    folder: Path,
) -> None:
    from transformers import GenerationConfig

    (folder / "generation_config.json").unlink()
    assert add_stop_tokens(folder, ["<pad>"]) == [2, 0]
    config = GenerationConfig.from_pretrained(folder)
    assert config.eos_token_id == [2, 0] and config.bos_token_id == 1  # config.json's ids kept
    assert not _gen(folder).get("_from_model_config")


def test_nothing_to_add_leaves_the_folder_as_it_was(folder: Path, tmp_path: Path) -> None:
    text = (folder / "generation_config.json").read_bytes()
    assert add_stop_tokens(folder, []) is None
    assert add_stop_tokens(folder, ["</s>"]) is None  # already the eos
    assert (folder / "generation_config.json").read_bytes() == text
    assert add_stop_tokens(tmp_path / "no-model", ["</s>"]) is None  # an engine that wrote no model folder
    assert not (tmp_path / "no-model").exists()


def test_a_stop_token_the_folders_tokenizer_lacks_is_a_config_error(folder: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.stop_tokens: '<\|im_end\|>' is not a token"):
        add_stop_tokens(folder, ["<|im_end|>"])


def test_a_failure_while_saving_is_a_warning_not_the_end_of_the_run(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer's save writes the stop ids after the weights: a tokenizer the driver cannot load (a missing
    trust_remote_code module, an unreadable file) raised out of the save as a checkpoint error and ended the run."""
    from roll_core.pipelines.exported_stops import export_stop_tokens

    before = _gen(folder)
    (folder / "tokenizer.json").write_text("{not json")
    for name in ("tokenizer.model", "vocab.json", "merges.txt"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(Exception):  # noqa: B017
        add_stop_tokens(folder, ["<pad>"])
    with caplog.at_level("WARNING", logger="roll_core.pipelines.exported_stops"):
        assert export_stop_tokens(folder, ["<pad>"]) is None
    assert "could not add model.stop_tokens ['<pad>']" in caplog.text and "the checkpoint is saved" in caplog.text
    assert _gen(folder) == before
