"""Learning tests: a tiny model's reward rises under GRPO and PPO, in-process and on Ray, both layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.testing import reward_curve as rewards
from roll_core.testing import run_pipeline as run
from roll_core.testing import tiny_overrides


def assert_learns(history: list[dict], margin: float = 0.25) -> None:
    r = rewards(history)
    first, last = sum(r[:4]) / 4, sum(r[-4:]) / 4
    assert last > first + margin, f"reward did not rise enough: first {first:.3f}, last {last:.3f}, curve {r}"


def test_grpo_learns_local(seven_task: Path, tmp_path: Path) -> None:
    _, history = run(tiny_overrides(seven_task, tmp_path, "algo=grpo"))
    assert_learns(history)
    assert (tmp_path / "curves.png").exists() and list((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "checkpoints" / "step_000020" / "actor" / "model" / "config.json").exists()


def test_ppo_learns_local(seven_task: Path, tmp_path: Path) -> None:
    _, history = run(tiny_overrides(seven_task, tmp_path, "algo=ppo", "algo.group_size=8", "algo.critic_lr=3e-3"))
    assert_learns(history)
    assert any(h.get("critic/vf_loss") is not None for h in history)


@pytest.mark.ray
def test_grpo_learns_on_ray_colocated(ray_cluster, seven_task: Path, tmp_path: Path) -> None:
    _, history = run(tiny_overrides(seven_task, tmp_path, "algo=grpo", "cluster=ray", "cluster.placement=colocated"))
    assert_learns(history)


@pytest.mark.ray
def test_ppo_learns_on_ray_disaggregated(ray_cluster, seven_task: Path, tmp_path: Path) -> None:
    _, history = run(
        tiny_overrides(
            seven_task,
            tmp_path,
            "algo=ppo",
            "algo.critic_lr=3e-3",
            "cluster=ray",
            "cluster.placement=disaggregated",
            "pipeline.reward_workers=2",
        )
    )
    assert_learns(history)


@pytest.mark.ray
def test_async_grpo_learns_on_ray_with_partial_rollout(ray_cluster, seven_task: Path, tmp_path: Path) -> None:
    """The engine in its own actor generates the next batch while the trainer trains (real overlap); partial
    rollout aborts and resumes what runs at each sync."""
    _, history = run(
        tiny_overrides(
            seven_task,
            tmp_path,
            "algo=grpo",
            "cluster=ray",
            "cluster.placement=disaggregated",
            "pipeline.async_ratio=1",
            "pipeline.partial_rollout=true",
            "algo.off_policy_correction=token",
        )
    )
    assert_learns(history)
    assert all(h["async/staleness_max"] <= 1 for h in history)


def test_resume_reproduces_the_uninterrupted_run(seven_task: Path, tmp_path: Path) -> None:
    common = ["algo=grpo", "pipeline.max_steps=6", "algo.kl_coef=0.01", "algo.ppo_epochs=2"]
    _, full = run(tiny_overrides(seven_task, tmp_path / "full", *common, "pipeline.save_every=3"))
    # "Crash" after step 3: run only 3 steps, then resume in the same folder up to step 6.
    run(tiny_overrides(seven_task, tmp_path / "resumed", *common, "pipeline.save_every=3", "pipeline.max_steps=3"))
    _, resumed = run(
        tiny_overrides(seven_task, tmp_path / "resumed", *common, "pipeline.save_every=3", "pipeline.resume=true")
    )
    keys = ["reward/mean", "actor/pg_loss", "actor/kl_to_ref", "actor/entropy", "response/length_mean"]
    by_step = {h["step"]: h for h in full}
    assert [h["step"] for h in resumed] == [1, 2, 3, 4, 5, 6]
    for h in resumed:
        for k in keys:
            assert h[k] == pytest.approx(by_step[h["step"]][k], rel=1e-5, abs=1e-6), (h["step"], k)


def test_sleeping_engine_gets_full_syncs_and_samples_the_trained_policy(seven_task: Path, tmp_path: Path) -> None:
    """sleep_level=2 discards the engine's weights after every rollout: each sync must then send all of them."""
    _, history = run(tiny_overrides(seven_task, tmp_path, "infer_engine.sleep_level=2", "pipeline.max_steps=4"))
    steps = [h for h in history if h["step"] > 0]
    assert all(h["sync/full"] == 1.0 for h in steps)
    assert max(h["actor/train_infer_logprob_diff"] for h in steps) < 1e-4  # NaN weights would show here


def test_lora_grpo_learns_with_less_optimizer_memory(seven_task: Path, tmp_path: Path) -> None:
    """LoRA adapters (lm_head included: the tiny model's answer token lives there) learn the task; AdamW holds
    state for the adapters only, and the KL reference is the base with adapters disabled."""
    pytest.importorskip("peft")
    _, full = run(tiny_overrides(seven_task, tmp_path / "full", "algo=grpo", "pipeline.max_steps=2"))
    _, lora = run(
        tiny_overrides(
            seven_task,
            tmp_path / "lora",
            "algo=grpo",
            "algo.lr=1e-2",
            "algo.kl_coef=0.001",
            "train_engine.lora_rank=8",
            "train_engine.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head]",
        )
    )
    assert_learns(lora)
    steps = [h for h in lora if h["step"] > 0]
    assert all("actor/kl_to_ref" in h for h in steps) and steps[-1]["actor/kl_to_ref"] > 0
    assert steps[-1]["actor/optimizer_state_mb"] < 0.5 * full[-1]["actor/optimizer_state_mb"]
    assert (tmp_path / "lora" / "checkpoints" / "step_000020" / "actor" / "adapter" / "adapter_config.json").exists()
