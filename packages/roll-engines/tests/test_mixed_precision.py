"""Mixed precision: fp32 master weights and optimizer state with bf16/fp16 compute track the fp32 run; a pure bf16
run does not (its small updates round away). Also: no dropout in trained models (the critic's head had 0.1)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from roll_core.cluster.ports import free_port
from roll_core.models import resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch
from roll_engines.train.fsdp2 import FSDP2TrainEngine
from roll_engines.train.hf import HFTrainEngine

STEPS, LR = 8, 1e-5  # Adam steps of ~1e-5 per weight: below bf16's resolution for weights of ~0.02


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return resolve_model_path("builtin:tiny")


def _train(engine: Any, batch: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    w0 = {k: v.float().clone() for k, v in engine.iter_weights()}
    for _ in range(STEPS):
        engine.train_step(batch, PolicyObjective())
    return w0, {k: v.float().clone() for k, v in engine.iter_weights()}


def _dist(a: dict, b: dict) -> float:
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a).sqrt())


@pytest.fixture(scope="module")
def fp32_run(path: str) -> tuple[dict, dict]:
    return _train(HFTrainEngine(path, lr=LR, micro_batch_size=6), toy_batch(path))


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_low_precision_compute_with_fp32_master_tracks_fp32(path: str, fp32_run, compute: str) -> None:
    w0, ref = fp32_run
    eng = HFTrainEngine(path, dtype=compute, param_dtype="float32", lr=LR, micro_batch_size=6)
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())  # master weights
    assert (eng.scaler is not None) == (compute == "float16")  # fp16 only with a grad scaler
    _, got = _train(eng, toy_batch(path))
    # Stated tolerance: within 15% of the fp32 run's whole update (measured: ~4% for bf16).
    assert _dist(got, ref) < 0.15 * _dist(ref, w0)
    state = next(iter(eng.optimizer.state.values()))
    assert state["exp_avg"].dtype == torch.float32


def test_fp16_compute_gradients_are_the_true_gradients(path: str) -> None:
    """`compute_gradients` under fp16's loss scaler: the backward runs on the scaled loss, and the gradients it
    returned were the scaled ones (2^16 times the fp32 engine's). They are unscaled, and the scaler is untouched."""
    batch = toy_batch(path)
    ref = HFTrainEngine(path).compute_gradients(batch, PolicyObjective())
    eng = HFTrainEngine(path, dtype="float16", param_dtype="float32")
    got = eng.compute_gradients(batch, PolicyObjective())
    assert got.keys() == ref.keys() and eng.scaler.get_scale() == 2.0**16
    for name, g in ref.items():  # fp16 compute: a few percent off the fp32 gradient (measured < 1%)
        assert float((got[name] - g).norm()) <= 0.05 * float(g.norm()) + 1e-6, name


def test_pure_bf16_updates_round_away(path: str, fp32_run) -> None:
    w0, ref = fp32_run
    _, pure = _train(
        HFTrainEngine(path, dtype="bfloat16", param_dtype="bfloat16", lr=LR, micro_batch_size=6), toy_batch(path)
    )
    assert _dist(pure, ref) > 0.5 * _dist(ref, w0)  # measured ~100%: the pure-bf16 run went elsewhere


def test_fp16_parameters_are_refused(path: str) -> None:
    with pytest.raises(ValueError, match="param_dtype=float16 cannot train"):
        HFTrainEngine(path, param_dtype="float16")


def test_master_weights_narrower_than_the_compute_dtype_are_refused(path: str) -> None:
    """bf16 parameters with fp32 compute: autocast cannot widen (it ran everything in bf16, silently)."""
    from roll_core.config import ConfigError, load_config

    with pytest.raises(ValueError, match="narrower than the compute dtype"):
        HFTrainEngine(path, dtype="float32", param_dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"param_dtype=bfloat16 with model\.dtype=float32"):
        load_config(["train_engine.param_dtype=bfloat16", "model.dtype=float32"])
    load_config(["train_engine.param_dtype=bfloat16", "model.dtype=bfloat16"])  # pure bf16 stays allowed


def test_fsdp2_mixed_precision_policy_tracks_fp32(path: str, fp32_run, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    try:
        eng = FSDP2TrainEngine(path, dtype="bfloat16", lr=LR, micro_batch_size=6, dist_backend="gloo")
        assert all(p.dtype == torch.float32 for p in eng.model.parameters())  # sharded fp32 masters
        w0, ref = fp32_run
        _, got = _train(eng, toy_batch(path))
        assert _dist(got, ref) < 0.15 * _dist(ref, w0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_reference_holds_only_the_compute_dtype(path: str) -> None:
    # (pure bf16; with fp32 masters the reference mirrors autocast: tests/test_reference_precision.py)
    ref = HFTrainEngine(path, role="reference", dtype="bfloat16", param_dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in ref.model.parameters()) and ref.optimizer is None


def test_critic_values_do_not_depend_on_train_mode(path: str) -> None:
    """Values trained on must equal the values scored in eval mode: no dropout in the value head."""
    critic = HFTrainEngine(path, role="critic", lr=1e-3)
    batch = toy_batch(path)
    critic.model.train()
    a = critic._forward(batch, 1.0, False)["values"]
    b = critic._forward(batch, 1.0, False)["values"]
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, critic.compute_values(batch)["values"])


def test_pure_bf16_on_a_cpu_without_fast_bf16_trains_in_fp32(
    path: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """model.dtype=bfloat16 (or auto) with train_engine.param_dtype=bfloat16 passes the config check; on an AVX2-only
    CPU the platform computes in fp32, and the engine refused its bf16 masters (narrower than compute) on every
    trainer worker. The masters now follow the compute dtype, and the log says so."""
    import logging
    from types import SimpleNamespace

    from roll_core.cluster.roles import build_engine
    from roll_engines.config import HFTrainEngineConfig
    from roll_hw import cpu

    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx", "avx2", "fma"})  # an AVX2-only CPU
    cfg = {**vars(HFTrainEngineConfig()), "param_dtype": "bfloat16"}
    runtime = {"model_path": path, "dtype": "bfloat16", "platform": "cpu", "device": "auto", "role": "actor"}
    with caplog.at_level(logging.WARNING):
        engine = build_engine(SimpleNamespace(), cfg, runtime)
    assert engine.compute_dtype == torch.float32 and engine.dtype == torch.float32
    assert "param_dtype bfloat16 -> float32" in caplog.text
