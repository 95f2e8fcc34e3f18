"""A `megatron` engine given a checkpoint the `hf` or `fsdp2` engine wrote (`model/`, `optimizer/` a
torch.distributed.checkpoint, `engine.pt`) says so plainly: which engine wrote it (the run's config.yaml beside it,
where there is one) and that train_engine must match or the run start afresh from its weights. It said the folder was
"a weights-only folder, or one saved by an older roll", neither of which it is. The refusal comes before anything is
written: the engine stays fresh. A weights-only folder keeps its own message. TP=PP=1 in this process over gloo."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")


@pytest.fixture(scope="module")
def hf_checkpoint(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step hf engine checkpoint of the tiny model, as a run's actor folder (no config.yaml beside it yet)."""
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.hf import HFTrainEngine

    engine = HFTrainEngine(tiny, lr=1e-2, micro_batch_size=3)
    engine.train_step(toy_batch(tiny), PolicyObjective(agg="token-mean"))
    folder = tmp_path_factory.mktemp("run") / "step_000001" / "actor"
    engine.save(folder, tiny)
    assert (folder / "engine.pt").is_file() and (folder / "optimizer" / ".metadata").is_file()
    return folder


@pytest.mark.parametrize(("config", "named"), [(None, "hf or fsdp2"), ("fsdp2", "fsdp2"), ("hf", "hf")])
def test_megatron_names_the_engine_that_wrote_an_hf_family_checkpoint(
    tiny: str, hf_checkpoint: Path, config: str | None, named: str
) -> None:
    from roll_engines.train.megatron import MegatronTrainEngine
    from roll_engines.train.megatron._checkpoint import stepped

    recorded = hf_checkpoint.parent / "config.yaml"  # the run config a checkpoint records (roll_core.checkpoint)
    if config is None:
        recorded.unlink(missing_ok=True)
    else:
        recorded.write_text(f"model:\n  path: {tiny}\ntrain_engine:\n  name: {config}\n  world_size: 2\n")
    engine = MegatronTrainEngine(tiny, dist_backend="gloo", micro_batch_size=3, lr=1e-2)
    with pytest.raises(ValueError) as refused:
        engine.load(hf_checkpoint)
    message = str(refused.value)
    assert f"{hf_checkpoint} is a checkpoint of train_engine={named}, not of train_engine=megatron" in message
    assert "Resume it with the engine that wrote it" in message
    assert f"model.path={hf_checkpoint / 'model'}" in message
    assert "weights-only" not in message and "older roll" not in message
    assert engine._step == 0 and not stepped(engine.optimizer)  # nothing of the checkpoint was loaded


def test_a_weights_only_folder_keeps_its_message(tiny: str, hf_checkpoint: Path, tmp_path: Path) -> None:
    from roll_engines.train.megatron import MegatronTrainEngine

    folder = tmp_path / "weights"
    shutil.copytree(hf_checkpoint / "model", folder / "model")
    (folder / "optimizer").mkdir()  # an optimizer folder with no Megatron metadata, and no engine.pt
    engine = MegatronTrainEngine(tiny, dist_backend="gloo", micro_batch_size=3, lr=1e-2)
    with pytest.raises(FileNotFoundError, match=r"holds no Megatron distributed checkpoint .* weights-only"):
        engine.load(folder)
