"""A run resumed under the other engine of the hf family (`hf` <-> `fsdp2`: one checkpoint format) goes on exactly:
an SFT run trained by `hf` to step 2, resumed by `fsdp2` for step 3, then by `hf` again for step 4, logs the losses
and gradient norms of the uninterrupted `hf` run at steps 3 and 4 (the same rows, weights, Adam moments and schedule
position). The config check on resume (roll_core.config.resume) refused both switches as a change of the engine's
kind, so a one-GPU hf run could not go on over more GPUs. fsdp2 runs one rank here (cluster=local, a gloo group of
one); its checkpoints at other world sizes are roll-engines' test_fsdp2_checkpoints.py."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from roll_core.testing import run_pipeline

sys.path.insert(0, str(Path(__file__).parent))
from sft_runs import sft_data, sft_overrides

FSDP2 = ("train_engine=fsdp2", "train_engine.world_size=1")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return sft_data(tmp_path_factory.mktemp("switch-data"))


def _overrides(data: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """test_sft.py's SFT run but for the cosine schedule, whose position must carry across the switches, and a
    checkpoint every step (each part of the switched run resumes the one before) with no evaluation."""
    return sft_overrides(data, out, *extra, lr_schedule="cosine", eval_every=0, save_every=1)


def _steps(history: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {h["step"]: h for h in history}


def _fsdp2_run(overrides: list[str]) -> list[dict[str, Any]]:
    """Run with fsdp2 on one rank in this process: the engine joins the process's group, a gloo group of one made
    here (and destroyed after)."""
    import torch.distributed as dist

    from roll_core.cluster.ports import free_port

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        return run_pipeline(overrides)[1]
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def test_a_run_resumes_across_hf_and_fsdp2_exactly(
    data: dict[str, Path], tmp_path: Path, sigterm_in_step: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    full = _steps(run_pipeline(_overrides(data, tmp_path / "full"))[1])
    out = tmp_path / "switched"
    # Stopped (a SIGTERM) after steps 2 and 3: every part plans the same 4-step cosine schedule as the full run.
    sigterm_in_step(2)
    run_pipeline(_overrides(data, out))
    monkeypatch.undo()
    sigterm_in_step(3)
    third = _steps(_fsdp2_run(_overrides(data, out, "pipeline.resume=true", *FSDP2)))
    monkeypatch.undo()
    fourth = _steps(run_pipeline(_overrides(data, out, "pipeline.resume=true"))[1])
    assert max(third) == 3 and max(fourth) == 4
    config = (out / "checkpoints" / "step_000003" / "config.yaml").read_text()
    assert "name: fsdp2" in config  # step 3's checkpoint was fsdp2's, step 4 resumed it under hf
    for s, got in ((3, third[3]), (4, fourth[4])):
        assert got["actor/optimizer_steps"] == 2.0
        for k in ("sft/loss", "actor/grad_norm", "actor/lr", "data/epoch"):
            assert got[k] == pytest.approx(full[s][k], rel=1e-5, abs=1e-6), (s, k)
    assert full[4]["actor/lr"] < full[3]["actor/lr"] < full[2]["actor/lr"]  # the cosine schedule's position counts
