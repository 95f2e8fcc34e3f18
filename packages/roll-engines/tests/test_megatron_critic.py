"""The `megatron` critic (TP=PP=1 in-process over gloo; TP=2 with sequence parallelism and PP=2 on Ray in
tests/e2e/test_megatron_ray.py): a GPTModel whose output layer is a value head, read from and written as the token
classifier the `hf` critic trains. Values, value-loss gradients and a step equal the hf critic's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")


@pytest.fixture(scope="module")
def critic_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    from roll_core.testing.models import tiny_critic

    return tiny_critic(tmp_path_factory.mktemp("critic"))


def _megatron(path: str, **kw):
    from roll_engines.train.megatron import MegatronTrainEngine

    common = {"dist_backend": "gloo", "micro_batch_size": 3, "lr": 1e-2, "use_distributed_optimizer": False}
    return MegatronTrainEngine(path, role="critic", **{**common, **kw})


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_critic_values_gradients_and_step_equal_hf(critic_path: str, packed: bool, tmp_path: Path) -> None:
    from transformers import AutoModelForTokenClassification

    from roll_core.pipelines.objectives import ValueObjective
    from roll_core.testing.batches import critic_batch
    from roll_engines.train.hf import HFTrainEngine

    batch, objective = critic_batch(critic_path), ValueObjective(clip=0.2)
    hf = HFTrainEngine(critic_path, role="critic", lr=1e-2, micro_batch_size=3, pack_sequences=packed)
    mega = _megatron(critic_path, pack_sequences=packed)
    assert dict(mega.iter_weights()).keys() == hf.get_weights().keys()  # model.* and score.{weight,bias}
    mask = batch["response_mask"].bool()
    want = hf.compute_values(batch)["values"]
    got = mega.compute_values(batch)["values"]
    assert want[mask].std() > 0.1  # the head matters
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    expected, grads = hf.compute_gradients(batch, objective), mega.compute_gradients(batch, objective)
    assert set(grads) == set(expected) and grads["score.weight"].abs().max() > 0
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)
    hf.train_step(batch, objective)
    metrics = mega.train_step(batch, objective)
    assert metrics["critic/vf_loss"] > 0
    weights = mega.get_weights()
    # Adam's first step is lr * g / (|g| + eps): a gradient near eps turns float noise into a visible step (one
    # embedding element of 6336 moved 2.4e-4 apart, packed); 5% of lr still tells a wrong update (up to 2 x lr).
    for name, w in hf.get_weights().items():
        torch.testing.assert_close(weights[name], w, atol=5e-4, rtol=0, msg=name)
    mega.save(tmp_path / "ckpt", critic_path)
    saved = AutoModelForTokenClassification.from_pretrained(tmp_path / "ckpt" / "model").state_dict()
    for name, w in weights.items():
        torch.testing.assert_close(saved[name], w, atol=0, rtol=0, msg=name)


def test_critic_from_a_causal_lm_gets_a_new_seeded_head(tmp_path: Path) -> None:
    """From a causal LM folder (no score.*): a head of transformers' initial scale, the same for the same seed."""
    from roll_core.testing.batches import critic_batch
    from roll_core.testing.models import tiny_model

    lm = tiny_model("qwen3", tmp_path / "lm")
    heads = [_megatron(lm, seed=s).get_weights()["score.weight"] for s in (0, 0, 1)]
    assert heads[0].shape == (1, 64) and 0.005 < float(heads[0].std()) < 0.05  # initializer_range 0.02
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    values = _megatron(lm).compute_values(critic_batch(lm))["values"]
    assert values.shape == critic_batch(lm)["response_mask"].shape and torch.isfinite(values).all()
    with pytest.raises(ValueError, match="LoRA trains the policy only"):
        _megatron(lm, lora_rank=4)
