"""A resume that changes the optimizer steps a training step takes re-bases the LR schedule's count
(roll_engines.train._settings.rebased): the hf, fsdp2 and megatron engines record the optimizer steps per training
step with the count, and one resumed with another number goes on where an engine with its settings from the start
would be. The count was read against the new plan: 2 optimizer steps per training step -> 1 at training step 2 of 4
under a cosine schedule put it at optimizer step 4 of 4, and the rest trained at LR 0. Adam's own step counts (bias
correction) stay the updates taken."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core.pipelines.objectives import PolicyObjective
from roll_engines.train._optim import lr_lambda
from roll_engines.train._settings import rebased

LR, MAX_STEPS, DONE = 1e-2, 4, 2  # a run of 4 training steps, stopped after 2


def _build(kind: str, path: str, per_step: int) -> Any:
    """An engine of `kind` planned for MAX_STEPS training steps of `per_step` optimizer steps (cosine)."""
    kw = dict(
        lr=LR,
        lr_schedule="cosine",
        total_steps=MAX_STEPS * per_step,
        optimizer_steps_per_step=per_step,
        micro_batch_size=3,
    )
    if kind == "megatron":
        from roll_engines.train.megatron import MegatronTrainEngine

        return MegatronTrainEngine(path, dist_backend="gloo", use_distributed_optimizer=False, **kw)
    if kind == "fsdp2":
        from roll_engines.train.fsdp2 import FSDP2TrainEngine

        return FSDP2TrainEngine.conformance_engine(path, **kw)
    from roll_engines.train.hf import HFTrainEngine

    return HFTrainEngine(path, **kw)


def _adam_steps(engine: Any) -> set[float]:
    """Adam's per-parameter step counts (the torch optimizer inside a Megatron one)."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return {float(st["step"]) for st in opt.state.values() if "step" in st}


@pytest.fixture(params=["hf", "fsdp2", "megatron"])
def kind(request: pytest.FixtureRequest) -> Any:
    if request.param == "megatron":
        pytest.importorskip("megatron.core")
    yield request.param
    import torch.distributed as dist

    if request.param == "megatron":
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(("saved_per_step", "per_step"), [(2, 1), (1, 2)])
def test_a_resume_with_other_optimizer_steps_per_step_goes_on_at_the_new_plans_lr(
    tiny: str, tmp_path: Path, kind: str, saved_per_step: int, per_step: int, caplog: pytest.LogCaptureFixture
) -> None:
    from roll_core.testing.batches import toy_batch

    batch = toy_batch(tiny)
    saved = _build(kind, tiny, saved_per_step)
    for _ in range(DONE):
        assert saved.train_step(batch, PolicyObjective(), mini_batches=saved_per_step)["optimizer_steps"] == (
            saved_per_step
        )
    saved.save(tmp_path / "ckpt", tiny)
    del saved
    resumed = _build(kind, tiny, per_step)
    with caplog.at_level(logging.INFO, logger="roll_engines.train._settings"):
        resumed.load(tmp_path / "ckpt")
    adam = _adam_steps(resumed)
    out = resumed.train_step(batch, PolicyObjective(), mini_batches=per_step)
    # a run with these settings from the start takes training step 3 at optimizer steps DONE x per_step, ... of
    # MAX_STEPS x per_step (2 -> 1 read the saved count 4 as the end of the new plan: LR 0)
    fn = lr_lambda("cosine", 0, MAX_STEPS * per_step)
    want = sum(LR * fn(DONE * per_step + i) for i in range(per_step)) / per_step
    assert out["lr"] == pytest.approx(want) and want > 0.1 * LR
    assert f"re-based from optimizer step {DONE * saved_per_step} " in caplog.text
    # Adam's bias correction counts the updates the moments took: not re-based
    assert adam == {float(DONE * saved_per_step)}


def test_a_checkpoint_without_the_record_keeps_its_count(tiny: str, tmp_path: Path) -> None:
    """engine.pt of a roll that did not record the optimizer steps per training step: the count as it is (what the
    engines did before), since what it was counted at is unknown."""
    from roll_core.testing.batches import toy_batch

    batch = toy_batch(tiny)
    saved = _build("hf", tiny, 2)
    saved.train_step(batch, PolicyObjective(), mini_batches=2)
    saved.save(tmp_path / "ckpt", tiny)
    state = torch.load(tmp_path / "ckpt" / "engine.pt", weights_only=True)
    assert state.pop("optimizer_steps_per_step") == 2
    torch.save(state, tmp_path / "ckpt" / "engine.pt")
    resumed = _build("hf", tiny, 1)
    resumed.load(tmp_path / "ckpt")
    assert resumed.scheduler.last_epoch == 2


def test_a_corrupt_record_is_refused_before_anything_loads(tiny: str, tmp_path: Path) -> None:
    from roll_core.testing.batches import toy_batch

    saved = _build("hf", tiny, 2)
    saved.train_step(toy_batch(tiny), PolicyObjective(), mini_batches=2)
    saved.save(tmp_path / "ckpt", tiny)
    state = torch.load(tmp_path / "ckpt" / "engine.pt", weights_only=True)
    torch.save({**state, "optimizer_steps_per_step": 0}, tmp_path / "ckpt" / "engine.pt")
    resumed = _build("hf", tiny, 1)
    before = {k: v.clone() for k, v in resumed.model.state_dict().items()}
    with pytest.raises(ValueError, match="the checkpoint's optimizer steps per training step is 0"):
        resumed.load(tmp_path / "ckpt")
    assert not resumed.optimizer.state and resumed.scheduler.last_epoch == 0
    for name, w in resumed.model.state_dict().items():
        torch.testing.assert_close(w, before[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("count", "saved", "now", "want"),
    [
        (8, 2, 1, 4),  # training step 4 of 2 optimizer steps each -> 4 of 1
        (4, 1, 3, 12),
        (7, 2, 1, 3),  # a skipped (non-finite) optimizer step: scaled too, rounded down
        (5, 2, 2, 5),  # the same plan: the count as it is
        (5, None, 3, 5),  # no record (an older checkpoint): the count as it is
    ],
)
def test_the_rebase_rule(count: int, saved: int | None, now: int, want: int) -> None:
    assert rebased(count, saved, now) == want


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_a_record_that_is_no_positive_integer_is_an_error(bad: Any) -> None:
    with pytest.raises(ValueError, match="not a positive integer"):
        rebased(4, bad, 1)
    with pytest.raises(ValueError, match="this run's"):
        rebased(4, 2, bad)
