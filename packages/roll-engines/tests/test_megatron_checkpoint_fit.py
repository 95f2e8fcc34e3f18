"""A `megatron` engine given a checkpoint of its own engine that it cannot resume says why, naming both sides and the
ways on, before anything is loaded (roll_engines.train.megatron._weights.refuse_unfit_megatron, with the hf family's
messages: roll_engines.train._checkpoint_fit). What a checkpoint without a recorded config (an older roll's) met
after a changed setting: a GRPO checkpoint resumed by a PPO run's critic (no `critic/`: "model has no *.safetensors
weights"), a full one by a LoRA engine (a bare FileNotFoundError on adapter/adapter_config.json), a LoRA one by an
engine training every weight (Megatron's "Cannot merge two lists with different lengths" from its optimizer's
param_groups); an adapter of another rank names the settings to resume with. TP=PP=1 in this process over gloo;
the checkpoints are fresh engines' (saving needs no step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")

LORA = {"lora_rank": 4, "lora_alpha": 8.0}


def _megatron(path: str, **kw: Any) -> Any:
    from roll_engines.train.megatron import MegatronTrainEngine

    return MegatronTrainEngine(path, dist_backend="gloo", use_distributed_optimizer=False, micro_batch_size=3, **kw)


@pytest.fixture(scope="module")
def saved(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A full and a LoRA (rank 4) Megatron checkpoint of the tiny model, each as a GRPO run's actor folder."""
    folders = {}
    for kind, kw in (("full", {}), ("lora", LORA)):
        folders[kind] = tmp_path_factory.mktemp(kind) / "step_000001" / "actor"
        _megatron(tiny, **kw).save(folders[kind], tiny)
    return folders


def _fresh(engine: Any) -> bool:
    from roll_engines.train.megatron._checkpoint import stepped

    return engine._step == 0 and (engine.optimizer is None or not stepped(engine.optimizer))


def test_a_checkpoint_without_the_role_says_so(tiny: str, saved: dict[str, Path]) -> None:
    """A GRPO checkpoint (actor/ only) resumed by a PPO run's critic."""
    critic = saved["full"].parent / "critic"
    engine = _megatron(tiny, role="critic")
    with pytest.raises(FileNotFoundError) as refused:
        engine.load(critic)
    message = str(refused.value)
    assert f"{critic}: no such folder; the checkpoint {critic.parent} holds actor/" in message
    assert "without this critic" in message and "safetensors" not in message
    assert f"model.path={saved['full'] / 'model'}" in message
    assert _fresh(engine)


def test_a_full_checkpoint_is_refused_by_a_lora_engine(tiny: str, saved: dict[str, Path]) -> None:
    engine = _megatron(tiny, **LORA)
    with pytest.raises(ValueError) as refused:
        engine.load(saved["full"])
    message = str(refused.value)
    assert f"{saved['full']} holds no LoRA adapter (adapter/)" in message
    assert "train_engine.lora_rank=4" in message and "Resume with train_engine.lora_rank=0" in message
    assert _fresh(engine)


def test_a_lora_checkpoint_is_refused_by_a_full_engine_and_read_by_a_reference(tiny: str, saved: dict) -> None:
    engine = _megatron(tiny)
    with pytest.raises(ValueError) as refused:
        engine.load(saved["lora"])
    message = str(refused.value)
    assert f"{saved['lora']} is a LoRA checkpoint (adapter/, rank 4)" in message
    assert "train_engine.lora_rank=4" in message and f"model.path={saved['lora'] / 'model'}" in message
    assert _fresh(engine)
    _megatron(tiny, role="reference", trainable=False).load(saved["lora"])  # trains nothing: its merged model/


def test_an_adapter_of_another_rank_names_the_settings_to_resume_with(tiny: str, saved: dict[str, Path]) -> None:
    engine = _megatron(tiny, lora_rank=8, lora_alpha=8.0)
    with pytest.raises(ValueError) as refused:
        engine.load(saved["lora"])
    message = str(refused.value)
    assert "adapter r=4, lora_alpha=8.0; this run has lora_rank=8, lora_alpha=8.0" in message
    assert "Resume with train_engine.lora_rank=4 and train_engine.lora_alpha=8.0" in message
    assert f"model.path={saved['lora'] / 'model'}" in message
    assert _fresh(engine)
