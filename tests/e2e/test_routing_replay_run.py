"""Routed-expert replay through the whole synchronous pipeline (cluster=local), per training engine: a bf16 hf rollout
engine records its routing, the fp32 trainer (hf or megatron) replays it, and the logged train/infer log-prob gap
(`actor/train_infer_logprob_diff`) is several times smaller than without replay, on a tiny Qwen3-MoE whose routers
are near ties (bf16 flips some top-2 choices: `actor/routing_replay_changed_fraction` > 0).

Two runs per engine (~40 s each on 2 cores): beyond CI's budget; its parts run in CI in
packages/roll-engines/tests/test_routing_replay.py and test_megatron_routing_replay.py (the same gap, engine-level).
`nox -s full_matrix` runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roll_core.testing import run_pipeline, tiny_overrides

pytestmark = pytest.mark.full_matrix


@pytest.fixture(scope="module")
def near_ties(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen3-MoE with near-tie routers (one shared router row plus 0.02 x noise per expert) and 3x expert
    outputs, as packages/roll-engines/tests/test_routing_replay.py builds it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from roll_core.testing.models import tiny_model

    tiny = tiny_model("qwen3_moe", tmp_path_factory.mktemp("moe"))
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(1, p.shape[1], generator=gen) + 0.02 * torch.randn(p.shape, generator=gen))
            elif name.endswith("experts.down_proj"):
                p.mul_(3.0)
    out = tmp_path_factory.mktemp("moe_ties")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("engine", ["hf", "megatron"])
def test_replay_shrinks_the_logged_gap(
    engine: str, near_ties: str, seven_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from roll_hw.cpu import CpuPlatform

    if engine == "megatron":
        pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    # Without native bf16 the CPU platform turns bf16 into fp32: claim it (as test_correction_learning.py does).
    monkeypatch.setattr(CpuPlatform, "runs_bf16", classmethod(lambda cls: True))
    gaps = {}
    for replay in (False, True):
        _, history = run_pipeline(
            tiny_overrides(
                seven_task,
                tmp_path / f"replay-{replay}",
                f"model.path={near_ties}",
                f"train_engine={engine}",
                "infer_engine.dtype=bfloat16",
                "infer_engine.return_routing=true",
                f"train_engine.routing_replay={str(replay).lower()}",
                "algo.off_policy_correction=icepop",
                "pipeline.max_steps=2",
            )
        )
        steps = [h for h in history if h["step"] > 0]
        assert len(steps) == 2
        gaps[replay] = [h["actor/train_infer_logprob_diff"] for h in steps]
        if replay:
            assert all(h["actor/routing_replay_changed_fraction"] > 0 for h in steps)  # bf16 flips near ties
        else:
            assert all("actor/routing_replay_changed_fraction" not in h for h in steps)
    with capsys.disabled():
        print(f"\n{engine}: train/infer log-prob gap per step without replay {gaps[False]}, with {gaps[True]}")
    assert sum(gaps[True]) < 0.5 * sum(gaps[False])
