"""An `hf` or `fsdp2` engine given a checkpoint it cannot resume says why, naming both sides and the ways on
(roll_engines.train._checkpoint_fit), before anything is loaded: the engine stays as it was.

A checkpoint the `megatron` engine wrote (`model/` an HF folder, `optimizer/` a
Megatron distributed checkpoint: `metadata.json`, `common.pt`, shards; no `engine.pt`) says so plainly, naming both
engines and the ways on, as the Megatron engine refuses an hf-family checkpoint (test_megatron_foreign_checkpoint.py).
It failed on the missing `engine.pt` with a bare FileNotFoundError. The refusal comes before anything is written: the
engine stays fresh. An hf-family checkpoint that lost its `engine.pt` says that instead. The Megatron folder is built
by hand in Megatron's layout (file names as Megatron-Core 0.16's dist_checkpointing writes them): a real Megatron
save takes seconds of imports and a process group.

The others are what a checkpoint without a recorded config (an older roll's) met after a changed setting: a GRPO
checkpoint resumed by PPO (no `critic/`: "has no optimizer checkpoint: it is a weights-only folder"), a full one by a
LoRA engine (a bare FileNotFoundError on `adapter/adapter_config.json`), a LoRA one by a full engine
(torch.distributed.checkpoint's "Missing key in checkpoint state_dict: optimizer.state...")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch


@pytest.fixture(scope="module")
def hf_checkpoint(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step hf engine checkpoint of the tiny model, as a run's actor folder."""
    from roll_engines.train.hf import HFTrainEngine

    engine = HFTrainEngine(tiny, lr=1e-2, micro_batch_size=3)
    engine.train_step(toy_batch(tiny), PolicyObjective(agg="token-mean"))
    folder = tmp_path_factory.mktemp("hf-run") / "step_000001" / "actor"
    engine.save(folder, tiny)
    return folder


def _megatron_shaped(hf_checkpoint: Path, root: Path, config: str | None, marker: bool) -> Path:
    """A Megatron engine's actor folder: the HF `model/` (Megatron exports one too) and an `optimizer/` of Megatron's
    files (`metadata.json` only where `marker`), with the step's config.yaml recording `config` as the engine."""
    folder = root / "step_000001" / "actor"
    shutil.copytree(hf_checkpoint / "model", folder / "model")
    optimizer = folder / "optimizer"
    optimizer.mkdir()
    if marker:
        backend = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
        (optimizer / "metadata.json").write_text(json.dumps({**backend, "common_backend": "torch"}))
    torch.save({"step": 1, "optimizer_steps_per_step": 1, "kind": "distributed"}, optimizer / "common.pt")
    (optimizer / "__0_0.distcp").write_bytes(b"\0" * 64)
    if config is not None:
        (folder.parent / "config.yaml").write_text(f"train_engine:\n  name: {config}\n")
    return folder


@pytest.fixture
def make_engine(tiny: str):
    """`make_engine(kind)`: a fresh hf or fsdp2 engine of the tiny model named as its config names it; fsdp2's
    group of one ends after the test."""
    made = []

    def make(kind: str, **kw: Any) -> Any:
        from roll_engines.train.fsdp2 import FSDP2TrainEngine
        from roll_engines.train.hf import HFTrainEngine

        settings = {"lr": 1e-2, "micro_batch_size": 3, "name": kind, **kw}
        engine = (
            FSDP2TrainEngine(tiny, dist_backend="gloo", **settings)
            if kind == "fsdp2"
            else HFTrainEngine(tiny, **settings)
        )
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in engine.model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = p.detach().cpu().clone()
    return out


@pytest.mark.parametrize(("config", "marker"), [("megatron", True), (None, True), ("megatron", False)])
@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_an_hf_family_engine_names_megatron_as_the_checkpoints_writer(
    make_engine, hf_checkpoint: Path, tmp_path: Path, kind: str, config: str | None, marker: bool
) -> None:
    folder = _megatron_shaped(hf_checkpoint, tmp_path, config, marker)
    engine = make_engine(kind)
    before = _weights(engine)
    with pytest.raises(ValueError) as refused:
        engine.load(folder)
    message = str(refused.value)
    assert f"{folder} is a checkpoint of train_engine=megatron, not of train_engine={kind}" in message
    assert "Resume it with the engine that wrote it (train_engine=megatron" in message
    assert f"model.path={folder / 'model'}" in message
    # nothing of the checkpoint was loaded: the weights are the engine's own, its optimizer and schedule fresh
    assert not engine.optimizer.state and engine.scheduler.last_epoch == 0
    after = _weights(engine)
    assert all(torch.equal(after[n], w) for n, w in before.items())


def test_an_hf_checkpoint_without_engine_state_says_what_is_missing(
    make_engine, hf_checkpoint: Path, tmp_path: Path
) -> None:
    """Not Megatron's (no metadata.json; its config.yaml says hf): the message is about the lost file."""
    folder = tmp_path / "step_000001" / "actor"
    shutil.copytree(hf_checkpoint, folder)
    (folder / "engine.pt").unlink()
    (folder.parent / "config.yaml").write_text("train_engine:\n  name: hf\n")
    with pytest.raises(FileNotFoundError, match=r"has optimizer/ but no engine\.pt .* incomplete") as refused:
        make_engine("hf").load(folder)
    assert "megatron" not in str(refused.value)


@pytest.fixture(scope="module")
def lora_checkpoint(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step LoRA (rank 4) hf engine checkpoint of the tiny model, as a run's actor folder."""
    pytest.importorskip("peft")
    from roll_engines.train.hf import HFTrainEngine

    engine = HFTrainEngine(tiny, lr=1e-2, micro_batch_size=3, lora_rank=4, lora_alpha=8.0)
    engine.train_step(toy_batch(tiny), PolicyObjective(agg="token-mean"))
    folder = tmp_path_factory.mktemp("lora-run") / "step_000001" / "actor"
    engine.save(folder, tiny)
    return folder


def _unchanged(engine: Any, before: dict[str, torch.Tensor]) -> None:
    assert not engine.optimizer.state and engine.scheduler.last_epoch == 0
    after = _weights(engine)
    assert after.keys() == before.keys() and all(torch.equal(after[n], w) for n, w in before.items())


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_lora_checkpoint_is_refused_by_a_full_engine(make_engine, lora_checkpoint: Path, kind: str) -> None:
    engine = make_engine(kind)
    before = _weights(engine)
    with pytest.raises(ValueError) as refused:
        engine.load(lora_checkpoint)
    message = str(refused.value)
    assert f"{lora_checkpoint} is a LoRA checkpoint (adapter/, rank 4)" in message
    assert "train_engine.lora_rank=4" in message and f"model.path={lora_checkpoint / 'model'}" in message
    _unchanged(engine, before)


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_full_checkpoint_is_refused_by_a_lora_engine(make_engine, hf_checkpoint: Path, kind: str) -> None:
    pytest.importorskip("peft")
    engine = make_engine(kind, lora_rank=4, lora_alpha=8.0)
    before = _weights(engine)
    with pytest.raises(ValueError) as refused:
        engine.load(hf_checkpoint)
    message = str(refused.value)
    assert f"{hf_checkpoint} holds no LoRA adapter (adapter/)" in message
    assert "train_engine.lora_rank=4" in message and "Resume with train_engine.lora_rank=0" in message
    _unchanged(engine, before)


def test_a_checkpoint_without_the_role_says_so(make_engine, hf_checkpoint: Path) -> None:
    """A GRPO checkpoint (actor/ only) resumed by a run with a critic."""
    critic = hf_checkpoint.parent / "critic"
    engine = make_engine("hf", role="critic")
    with pytest.raises(FileNotFoundError) as refused:
        engine.load(critic)
    message = str(refused.value)
    assert f"{critic}: no such folder; the checkpoint {hf_checkpoint.parent} holds actor/" in message
    assert "without this critic" in message and "weights-only" not in message
    assert f"model.path={hf_checkpoint / 'model'}" in message


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model's layout but for two key/value heads: its k_proj and v_proj are half the tiny model's."""
    from roll_core.models import build_tiny_model

    path = tmp_path_factory.mktemp("models") / "gqa"
    build_tiny_model(path, kv_heads=2)
    return str(path)


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_checkpoint_of_another_model_shape_names_its_folder(
    make_engine, hf_checkpoint: Path, gqa: str, kind: str
) -> None:
    """A resume whose model.path now builds another shape (an older roll's checkpoint records no config to compare):
    the mismatch said "checkpoint mismatch: shapes [...]" and nothing of which folder (or role) did not fit."""
    from roll_engines.train.fsdp2 import FSDP2TrainEngine
    from roll_engines.train.hf import HFTrainEngine

    settings = {"lr": 1e-2, "micro_batch_size": 3, "name": kind}
    engine = (
        FSDP2TrainEngine(gqa, dist_backend="gloo", **settings) if kind == "fsdp2" else HFTrainEngine(gqa, **settings)
    )
    try:
        before = _weights(engine)
        with pytest.raises(RuntimeError) as refused:
            engine.load(hf_checkpoint)
    finally:
        engine.shutdown()
    message = str(refused.value)
    assert message.startswith(
        f"{hf_checkpoint / 'model'} does not fit this engine's model ({gqa}): checkpoint mismatch"
    )
    assert "model.layers.0.self_attn.k_proj.weight (64, 64) for (32, 64)" in message
    _unchanged(engine, before)


@pytest.mark.parametrize("kind", ["hf", "fsdp2"])
def test_a_lora_checkpoint_with_other_targets_names_them(make_engine, lora_checkpoint: Path, kind: str) -> None:
    """Same rank and alpha, fewer adapted layers: peft's "adapter checkpoint mismatch: unexpected [...]" named
    neither the folder nor the setting that differs."""
    engine = make_engine(kind, lora_rank=4, lora_alpha=8.0, lora_target_modules=["q_proj"])
    before = _weights(engine)
    with pytest.raises(RuntimeError) as refused:
        engine.load(lora_checkpoint)
    message = str(refused.value)
    assert message.startswith(f"{lora_checkpoint / 'adapter'} does not fit this engine's model")
    assert "adapter checkpoint mismatch: unexpected" in message
    saved = "saved model.layers.0.mlp.down_proj, model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj, "
    assert f"it was saved with other target modules (train_engine.lora_target_modules): {saved}" in message
    assert "... (14 in all); this run q_proj. Resume with the saved lora_target_modules" in message
    _unchanged(engine, before)


def test_a_checkpoint_with_fewer_critics_names_num_critics(make_engine, hf_checkpoint: Path, tmp_path: Path) -> None:
    """AsyPPO's second critic resumed from a checkpoint of one critic: not "a run without this critic"."""
    step = tmp_path / "step_000001"
    shutil.copytree(hf_checkpoint, step / "critic")
    engine = make_engine("hf", role="critic")
    with pytest.raises(FileNotFoundError) as refused:
        engine.load(step / "critic_1")
    message = str(refused.value)
    assert f"{step / 'critic_1'}: no such folder; the checkpoint {step} holds critic/: it was saved with " in message
    assert "algo.num_critics=1, and this run has more critics" in message and "without this" not in message


def test_a_missing_checkpoint_says_so_alone(make_engine, tmp_path: Path) -> None:
    """No step folder at all (a direct load of a mistyped path): not "a run without this actor"."""
    with pytest.raises(FileNotFoundError) as refused:
        make_engine("hf").load(tmp_path / "typo" / "actor")
    assert str(refused.value) == f"{tmp_path / 'typo' / 'actor'}: no such folder (nor {tmp_path / 'typo'})"
