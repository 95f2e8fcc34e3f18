"""Qwen3-MoE and Qwen2-MoE on the `megatron` engine (TP=PP=EP=1 in-process over gloo; EP=2 on Ray in
tests/e2e/test_megatron_ray.py): their experts, router and (Qwen2-MoE) gated shared expert map exactly to
transformers' model, log-probs equal transformers', gradients and a step equal the hf engine's, and a checkpoint is
an HF folder transformers loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")


@pytest.fixture(
    scope="module",
    params=[("qwen3_moe", True), ("qwen3_moe", False), ("qwen2_moe", False)],
    ids=["qwen3-norm-topk", "qwen3-no-norm-topk", "qwen2-shared-expert"],
)
def moe_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    from roll_core.testing.models import tiny_model

    kind, norm_topk_prob = request.param
    return tiny_model(kind, tmp_path_factory.mktemp("moe"), norm_topk_prob=norm_topk_prob)


def moe_path_kind(path: str) -> str:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).model_type


def _megatron(path: str, **kw):
    from roll_engines.train.megatron import MegatronTrainEngine

    common = {"dist_backend": "gloo", "micro_batch_size": 3, "lr": 1e-2, "use_distributed_optimizer": False}
    return MegatronTrainEngine(path, **{**common, **kw})


def test_moe_maps_exactly_and_gives_transformers_logprobs(moe_path: str) -> None:
    from transformers import AutoModelForCausalLM

    from roll_core.testing.models import assert_matches_transformers

    hf = AutoModelForCausalLM.from_pretrained(moe_path).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf  # transformers' fused experts
    assert_matches_transformers(_megatron(moe_path), moe_path, hf)


def test_moe_gradients_step_and_checkpoint_equal_hf(moe_path: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_engines.train.hf import HFTrainEngine

    batch, objective = toy_batch(moe_path), PolicyObjective(agg="token-mean")
    hf, mega = HFTrainEngine(moe_path, lr=1e-2, micro_batch_size=3), _megatron(moe_path)
    expected = hf.compute_gradients(batch, objective)
    grads = mega.compute_gradients(batch, objective)
    assert set(grads) == set(expected)
    routed = [n for n in grads if "experts" in n or n.endswith("mlp.gate.weight")]
    assert len(routed) == 2 * 3 and all(grads[n].abs().max() > 0 for n in routed)  # experts and router learn
    shared = [n for n in grads if ".shared_expert" in n]
    assert len(shared) == (2 * 4 if "qwen2" in moe_path_kind(moe_path) else 0)  # gate, up, down, gate weight
    assert all(grads[n].abs().max() > 0 for n in shared)
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)
    hf.train_step(batch, objective)
    mega.train_step(batch, objective)
    weights = mega.get_weights()
    for name, w in hf.get_weights().items():  # 2% of Adam's first step (lr 1e-2), as in the dense tests
        torch.testing.assert_close(weights[name], w, atol=2e-4, rtol=0, msg=name)
    mega.save(tmp_path / "ckpt", moe_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model").state_dict()
    for name, w in weights.items():
        torch.testing.assert_close(saved[name], w, atol=0, rtol=0, msg=name)
    again = _megatron(str(tmp_path / "ckpt" / "model"))  # the saved folder loads back (per-expert or fused)
    for name, w in again.get_weights().items():
        torch.testing.assert_close(w, weights[name], atol=0, rtol=0, msg=name)


def test_moe_config_errors(moe_path: str) -> None:
    from roll_core.models import resolve_model_path

    with pytest.raises(ValueError, match="this llama model is dense"):
        _megatron(resolve_model_path("builtin:tiny"), expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="only with sequence parallelism"):
        _megatron(moe_path, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="must divide the model's 4 experts"):
        _megatron(moe_path, expert_model_parallel_size=3)
    with pytest.raises(ValueError, match="adapts no MoE experts"):
        _megatron(moe_path, lora_rank=4)  # all-linear names the MLP


def test_layouts_the_mapping_cannot_express_are_refused() -> None:
    """Qwen2-MoE checkpoints with dense layers between sparse ones, and sliding-window attention, have no Megatron
    local-spec equivalent: refused with the setting that caused it (not mapped into a silently different model)."""
    from transformers import Qwen2Config, Qwen2MoeConfig

    from roll_engines.train.megatron._convert import check_supported

    small = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "hidden_size": 64}
    check_supported(Qwen2MoeConfig(num_experts=4, **small), 1, 1, ep=2)  # every layer sparse: fine
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        check_supported(Qwen2MoeConfig(num_experts=4, decoder_sparse_step=2, **small), 1, 1)
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\]"):
        check_supported(Qwen2MoeConfig(num_experts=4, mlp_only_layers=[1], **small), 1, 1)
    with pytest.raises(ValueError, match="sliding-window attention"):  # (layers from max_window_layers on slide)
        check_supported(Qwen2Config(use_sliding_window=True, max_window_layers=0, **small), 1, 1)
