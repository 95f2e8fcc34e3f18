"""A resume that changes the optimizer steps per training step says, in one INFO line, that the train engines
re-base the LR schedule and where (roll_core.pipelines._resume_schedule; the engines' own rule and its test:
roll_engines.train._settings.rebased, packages/roll-engines/tests/test_resume_lr_rebase.py; a whole resumed run:
tests/e2e/test_resume_lr_rebase.py). The schedule counts optimizer steps, so 2 mini-batches -> 1 at step 2 of 4
under a cosine schedule put it at its end, and the rest of the run trained at LR 0. The engines re-base only a count
their checkpoint records with its steps per training step: a checkpoint written before they recorded it (or by an
engine whose record roll cannot read) is said in a WARNING with where the schedule goes on (there: LR 0) and what to
do, not in the INFO line that it is re-based."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from roll_core.checkpoint import CheckpointManager
from roll_core.config import load_config
from roll_core.config.resume import config_dict
from roll_core.pipelines._resume_schedule import log_schedule_rebase, recorded, schedule_rebase

BASE = ["model=tiny", "pipeline.max_steps=4", "pipeline.rollout_batch_size=4", "algo.group_size=8"]
LOGGER = "roll_core.pipelines._resume_schedule"


def _cfg(*extra: str):
    return load_config([*BASE, *extra])


@pytest.fixture(scope="module")
def hf_engine_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An hf train engine's checkpoint folder (model/, optimizer/, engine.pt) of a plan of 2 optimizer steps per
    training step, as the trainer writes it under a checkpoint's actor/."""
    import os

    from roll_core.models import resolve_model_path
    from roll_engines.train.hf import HFTrainEngine

    old = os.environ.get("ROLL_CACHE_DIR")
    os.environ["ROLL_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    try:
        tiny = resolve_model_path("builtin:tiny")
        engine = HFTrainEngine(tiny, lr=1e-2, lr_schedule="cosine", total_steps=8, optimizer_steps_per_step=2)
        folder = tmp_path_factory.mktemp("engine") / "actor"
        engine.save(folder, tiny)
        yield folder
    finally:
        if old is None:
            os.environ.pop("ROLL_CACHE_DIR", None)
        else:
            os.environ["ROLL_CACHE_DIR"] = old


def _checkpoint(root: Path, engine: Path, *saved: str, engines: tuple[str, ...] = ("actor",)) -> Path:
    """A checkpoint at step 2 of a run with the `saved` settings, holding a copy of `engine` as each of `engines`."""
    mgr = CheckpointManager(root, keep_last=1, config=config_dict(_cfg(*saved)))
    tmp = mgr.staging(2)
    for name in engines:
        shutil.copytree(engine, tmp / name)
    return mgr.commit(tmp, 2, {})


def _drop_record(path: Path) -> None:
    """`path` (engine.pt, or Megatron's optimizer/common.pt) as a roll before the record wrote it."""
    state = torch.load(path, weights_only=True)
    assert state.pop("optimizer_steps_per_step") == 2
    torch.save(state, path)


def test_fewer_mini_batches_under_a_decaying_schedule_is_said_with_the_lr_the_run_goes_on_at(
    tmp_path: Path, hf_engine_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _checkpoint(tmp_path, hf_engine_folder, "algo.lr_schedule=cosine", "algo.num_mini_batches=2")
    assert recorded(folder) == {"actor": True}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        message = log_schedule_rebase(folder, _cfg("algo.lr_schedule=cosine", "algo.num_mini_batches=1"))
    assert message is not None and message in caplog.text
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # no warning: nothing is left to do
    # the checkpoint counted 2 x 2 optimizer steps, a run planned with one mini-batch would be at 2 of 4 (cosine:
    # half the LR); the count stayed 4 of 4 before, the schedule's end (LR 0)
    assert "from the checkpoint's optimizer step 4 to 2 of 4" in message and "(LR 0.5 x algo.lr)" in message


@pytest.mark.parametrize("engines", [("actor",), ("actor", "critic")])
def test_a_checkpoint_without_the_record_is_a_warning_with_where_the_schedule_goes_on(
    tmp_path: Path, hf_engine_folder: Path, engines: tuple[str, ...], caplog: pytest.LogCaptureFixture
) -> None:
    """Written before the engines recorded their optimizer steps per training step: they keep the count, which the
    new plan reads as its end. Said at INFO as re-based before; a WARNING with LR 0 and the remedy now (one engine
    without the record is enough: the critic's schedule then ends)."""
    folder = _checkpoint(
        tmp_path, hf_engine_folder, "algo.lr_schedule=cosine", "algo.num_mini_batches=2", engines=engines
    )
    _drop_record(folder / engines[-1] / "engine.pt")
    assert recorded(folder) == {name: name != engines[-1] for name in engines}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        message = log_schedule_rebase(folder, _cfg("algo.lr_schedule=cosine", "algo.num_mini_batches=1"))
    assert message is not None and message in caplog.text
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert f"the checkpoint's {engines[-1]} state records no optimizer steps per training step" in message
    assert "up to 4 of 4" in message and "the remaining steps train at LR 0" in message
    assert (
        "resume with the checkpoint's algo.num_mini_batches" in message and "the train engines re-base" not in message
    )


def test_megatrons_record_is_read_from_its_optimizer_checkpoints_common_state(
    tmp_path: Path, hf_engine_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Megatron records it in its optimizer checkpoint's common state (optimizer/common.pt; no engine.pt)."""
    folder = _checkpoint(tmp_path, hf_engine_folder, "algo.lr_schedule=cosine", "algo.num_mini_batches=2")
    actor = folder / "actor"
    (actor / "engine.pt").unlink()
    shutil.rmtree(actor / "optimizer")
    (actor / "optimizer").mkdir()
    common = {"optimizer": {"param_groups": []}, "step": 4, "optimizer_steps_per_step": 2, "kind": "plain"}
    torch.save(common, actor / "optimizer" / "common.pt")  # (the keys megatron._checkpoint.optimizer_state saves)
    now = _cfg("algo.lr_schedule=cosine", "algo.num_mini_batches=1")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert recorded(folder) == {"actor": True} and log_schedule_rebase(folder, now) is not None
    _drop_record(actor / "optimizer" / "common.pt")
    assert recorded(folder) == {"actor": False}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert "records no optimizer steps per training step" in (log_schedule_rebase(folder, now) or "")
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING]


def test_an_engine_layout_roll_cannot_read_is_a_warning(
    tmp_path: Path, hf_engine_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A plugin engine's own checkpoint layout: roll cannot tell whether it re-bases (one that does not take the
    runtime key cannot)."""
    folder = _checkpoint(tmp_path, hf_engine_folder, "algo.lr_schedule=cosine", "algo.num_mini_batches=2")
    (folder / "critic").mkdir()
    (folder / "critic" / "state.bin").write_bytes(b"a plugin's own format")
    assert recorded(folder) == {"actor": True, "critic": None}
    with caplog.at_level(logging.INFO, logger=LOGGER):
        message = log_schedule_rebase(folder, _cfg("algo.lr_schedule=cosine", "algo.num_mini_batches=1"))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert message is not None and "roll cannot tell whether critic recorded them" in message


def test_a_constant_schedule_past_its_warm_up_without_the_record_says_nothing(
    tmp_path: Path, hf_engine_folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _checkpoint(tmp_path, hf_engine_folder, "algo.num_mini_batches=2")
    _drop_record(folder / "actor" / "engine.pt")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert log_schedule_rebase(folder, _cfg("algo.num_mini_batches=1")) is None  # the LR is algo.lr either way
    assert not caplog.records


@pytest.mark.parametrize(
    ("saved", "now", "step", "positions"),
    [
        # more optimizer steps per step: 2 x 1 -> 2 x 2 of 8
        (["algo.lr_schedule=linear"], ["algo.lr_schedule=linear", "algo.ppo_epochs=2"], 2, "2 to 4 of 8"),
        # a constant schedule: the count moves all the same (the LR is algo.lr at both positions)
        (["algo.num_mini_batches=2"], ["algo.num_mini_batches=1"], 2, "4 to 2 of 4"),
        # pipeline.max_steps alone: the count stays, a run planned with the new length's
        (["algo.lr_schedule=cosine"], ["algo.lr_schedule=cosine", "pipeline.max_steps=8"], 2, None),
        # mini-batches from algo.mini_batch_size: a changed rollout_batch_size changes their number (32 rows / 16
        # -> 16 / 16)
        (
            ["algo.lr_schedule=cosine", "algo.mini_batch_size=16"],
            ["algo.lr_schedule=cosine", "algo.mini_batch_size=16", "pipeline.rollout_batch_size=2"],
            1,
            "2 to 1 of 4",
        ),
    ],
)
def test_a_change_of_the_steps_per_training_step_is_said_with_both_positions(
    saved: list[str], now: list[str], step: int, positions: str | None
) -> None:
    message = schedule_rebase(config_dict(_cfg(*saved)), _cfg(*now), step)
    if positions is None:
        assert message is None
    else:
        assert message is not None and f"from the checkpoint's optimizer step {positions}," in message


def test_a_config_of_another_shape_is_not_compared() -> None:
    assert schedule_rebase({"algo": {"lr": 1e-4}}, _cfg("algo.num_mini_batches=2"), 2) is None
