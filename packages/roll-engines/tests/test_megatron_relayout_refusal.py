"""A Megatron checkpoint that another parallel layout cannot resume (its optimizer kind differs: distributed or
plain, experts apart or not) is refused naming both kinds AND both layouts: the one that saved it (recorded in the
checkpoint's common state) and this run's. Saved at TP=2 on two gloo ranks (distributed optimizer), read in one
process with the plain optimizer. The read refuses before writing anything: the engine stays fresh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
pytestmark = pytest.mark.usefixtures("megatron_process_group")

SETTINGS = {"dist_backend": "gloo", "num_threads": 1, "lr": 1e-2, "micro_batch_size": 3}


def _rank(rank: int, engine: str, port: int, path: str, out: str) -> None:
    """One of two TP ranks: one step, then a save into `out`'s folder."""
    import torch.distributed as dist

    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.testing.batches import toy_batch
    from roll_core.testing.gloo_ranks import join_gloo_group
    from roll_engines.train.megatron import MegatronTrainEngine

    join_gloo_group(rank, port, 120)
    eng = MegatronTrainEngine(path, world_size=2, tensor_parallel_size=2, **SETTINGS)
    eng.train_step(toy_batch(path), PolicyObjective(agg="token-mean"))
    eng.save(Path(out).parent / "tp2", path)
    torch.save({"saved": True}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_a_refused_resume_names_both_layouts(tiny: str, tmp_path: Path) -> None:
    from roll_core.testing.gloo_ranks import run_two_ranks
    from roll_engines.train.megatron import MegatronTrainEngine
    from roll_engines.train.megatron._checkpoint import stepped

    preload = ["torch", "transformers", "megatron.core", "roll_engines.train.megatron"]
    got = run_two_ranks(_rank, "megatron", tiny, tmp_path / "ranks", preload, 240)
    assert [g.get("saved") for g in got] == [True, True]

    plain = MegatronTrainEngine(tiny, use_distributed_optimizer=False, **SETTINGS)
    with pytest.raises(ValueError) as refused:
        plain.load(tmp_path / "tp2")
    message = str(refused.value)
    assert "holds a distributed optimizer's state; this run uses a plain one" in message
    saved_at = "saved at tensor_parallel_size=2, pipeline_parallel_size=1, context_parallel_size=1, "
    assert saved_at + "expert_model_parallel_size=1, data-parallel size 1" in message, message
    now_at = "this run at tensor_parallel_size=1, pipeline_parallel_size=1, context_parallel_size=1, "
    assert now_at + "expert_model_parallel_size=1, data-parallel size 1" in message, message
    assert plain._step == 0 and not stepped(plain.optimizer)  # nothing of the checkpoint was loaded
