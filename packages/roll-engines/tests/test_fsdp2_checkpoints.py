"""fsdp2 checkpoints over two gloo ranks (one process group for the module), on a tiny tied-embedding model:

- a checkpoint saved by one process resumes on two ranks, and one saved on two ranks resumes in one process, with
  the saver's weights, AdamW state (exp_avg, exp_avg_sq, step) and LR schedule position exactly, and a next step
  equal to the saver's own next step;
- the HF export of a two-rank save holds what one process writes: every tensor once (the tied LM head is not
  written beside the embedding), equal to the gathered weights, float32 as its config says, with the generation
  config and tokenizer; transformers loads it;
- a failure of what rank 0 alone does (writing `model/` at a save, reading it at a load) raises on both ranks,
  naming rank 0's error; the other rank used to wait in its next collective until the process group timed out.
  The group stays usable: a save afterwards succeeds.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core.testing.batches import toy_batch

#: Warm-up and a cosine schedule (the resumed position must carry over), weight decay on the matrices.
SETTINGS = {
    "lr": 1e-2,
    "micro_batch_size": 2,
    "warmup_steps": 2,
    "total_steps": 10,
    "lr_schedule": "cosine",
    "weight_decay": 0.1,
}
ROWS = ([0, 1, 2, 3], [4, 5])  # uneven rows per rank


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from roll_core.models import build_tiny_model

    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    path = tmp_path_factory.mktemp("models") / "tied"
    build_tiny_model(path, tie_embeddings=True, seed=3)
    return str(path)


def _adam_state(named: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {exp_avg, exp_avg_sq, step}, detached copies (the live state changes at the next step)."""
    keys = ("exp_avg", "exp_avg_sq", "step")
    return {n: {k: torch.as_tensor(st[k]).detach().clone() for k in keys} for n, st in named.items()}


def _full_adam_state(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The fsdp2 engine's AdamW state gathered from every rank's shards (collective; rank 0's is the full one)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return _adam_state(get_optimizer_state_dict(engine.model, engine.optimizer, options=options).get("state", {}))


def _outcome(call: Any) -> str:
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "returned"


def _rank(rank: int, port: int, path: str, root: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    import torch.distributed as dist

    from roll_core.pipelines.objectives import PolicyObjective
    from roll_engines.train.fsdp2 import FSDP2TrainEngine

    out, objective = Path(root), PolicyObjective(agg="token-mean")
    part = {k: v[ROWS[rank]] for k, v in toy_batch(path).items()}
    got: dict[str, Any] = {}

    # Saved on two ranks: what was saved, and the unstopped run's next step.
    saver = FSDP2TrainEngine(path, dist_backend="gloo", num_threads=1, **SETTINGS)
    saver.train_step(part, objective)
    got["saved"] = (saver.get_weights(), _full_adam_state(saver), saver.scheduler.state_dict())
    saver.save(out / "two", path)
    saver.train_step(part, objective)
    got["saver_next"] = saver.get_weights()

    # Saved by one process (the test, before the ranks started), resumed on two.
    resumed = FSDP2TrainEngine(path, dist_backend="gloo", num_threads=1, **SETTINGS)
    resumed.load(out / "one")
    got["loaded"] = (resumed.get_weights(), _full_adam_state(resumed), resumed.scheduler.state_dict())
    resumed.train_step(part, objective)
    got["resumed_next"] = resumed.get_weights()

    # Rank 0's write of model/ fails (a full disk); then its read of a truncated model/ at a load.
    if rank == 0:

        def full_disk(*args: Any, **kwargs: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        resumed.model.save_pretrained = full_disk
    got["failed_save"] = _outcome(lambda: resumed.save(out / "failed", path))
    if rank == 0:
        del resumed.model.save_pretrained
        shards = sorted((out / "two" / "model").glob("*.safetensors"))
        (out / "truncated" / "model").mkdir(parents=True)
        (out / "truncated" / "model" / shards[0].name).write_bytes(shards[0].read_bytes()[:100])
    dist.barrier()
    got["failed_load"] = _outcome(lambda: resumed.load(out / "truncated"))
    got["save_after"] = _outcome(lambda: resumed.save(out / "after", path))
    torch.save(got, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both ranks' records, with the one-process checkpoint and run they are compared with."""
    import multiprocessing

    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_engines.train.hf import HFTrainEngine

    root = tmp_path_factory.mktemp("fsdp2-ckpt")
    objective, batch = PolicyObjective(agg="token-mean"), toy_batch(model)
    one = HFTrainEngine(model, **SETTINGS)
    one.train_step(batch, objective)
    named = dict(one.model.named_parameters())
    saved_one = (one.get_weights(), _adam_state({n: one.optimizer.state[p] for n, p in named.items()}))
    sched_one = one.scheduler.state_dict()
    one.save(root / "one", model)
    one.train_step(batch, objective)

    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "transformers"])
    procs = mp.start_processes(
        _rank, args=(free_port(), model, str(root)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 240
    while not procs.join(timeout=2):  # raises what a rank raised
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            pytest.fail("the two fsdp2 ranks did not finish in 240 s (a rank waiting in a collective?)")
    records = [torch.load(root / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"root": root, "rank": records, "one": saved_one, "one_sched": sched_one, "one_next": one.get_weights()}


def _assert_state_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, st in want.items():
        for k, t in st.items():
            torch.testing.assert_close(got[name][k], t, atol=0, rtol=0, msg=f"{name}.{k}")


def _assert_weights_close(got: dict, want: dict, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=atol, rtol=rtol, msg=name)


def test_one_process_checkpoint_resumes_on_two_ranks_exactly(ranks: dict[str, Any]) -> None:
    weights, adam, sched = ranks["rank"][0]["loaded"]
    _assert_weights_close(weights, ranks["one"][0], atol=0, rtol=0)
    _assert_state_equal(adam, ranks["one"][1])
    assert sched == ranks["one_sched"] and sched["last_epoch"] == 1
    _assert_weights_close(ranks["rank"][0]["resumed_next"], ranks["one_next"])


def test_two_rank_checkpoint_resumes_in_one_process_exactly(ranks: dict[str, Any]) -> None:
    from roll_core.pipelines.objectives import PolicyObjective
    from roll_engines.train.hf import HFTrainEngine

    weights, adam, sched = ranks["rank"][0]["saved"]
    path = str(ranks["root"] / "two" / "model")
    resumed = HFTrainEngine(path, **SETTINGS)
    resumed.load(ranks["root"] / "two")
    _assert_weights_close(resumed.get_weights(), weights, atol=0, rtol=0)
    named = dict(resumed.model.named_parameters())
    _assert_state_equal(_adam_state({n: resumed.optimizer.state[p] for n, p in named.items()}), adam)
    assert resumed.scheduler.state_dict() == sched
    resumed.train_step(toy_batch(path), PolicyObjective(agg="token-mean"))
    _assert_weights_close(resumed.get_weights(), ranks["rank"][0]["saver_next"])


def test_two_rank_export_is_what_one_process_writes(ranks: dict[str, Any]) -> None:
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    two, one = ranks["root"] / "two" / "model", ranks["root"] / "one" / "model"
    names = lambda folder: sorted(p.name for p in folder.iterdir())
    assert names(two) == names(one)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(names(two))
    tensors = {k: v for f in sorted(two.glob("*.safetensors")) for k, v in load_file(f).items()}
    written_by_one = {k for f in one.glob("*.safetensors") for k in load_file(f)}
    assert sorted(tensors) == sorted(written_by_one)
    assert "lm_head.weight" not in tensors  # tied: the embedding alone
    weights = ranks["rank"][0]["saved"][0]
    _assert_weights_close(tensors, weights, atol=0, rtol=0)
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    config = json.loads((two / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(two)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    _assert_weights_close({k: v for k, v in loaded.state_dict().items() if k in weights}, weights, atol=0, rtol=0)


def test_a_rank_0_failure_to_write_or_read_model_raises_on_both_ranks(ranks: dict[str, Any]) -> None:
    rank0, rank1 = ranks["rank"]
    assert rank0["failed_save"].startswith("OSError") and "No space left" in rank0["failed_save"]
    assert rank1["failed_save"].startswith("RuntimeError")
    assert "failed on data-parallel rank 0 of 2" in rank1["failed_save"] and "No space left" in rank1["failed_save"]
    assert "SafetensorError" in rank0["failed_load"]
    assert rank1["failed_load"].startswith("RuntimeError") and "rank 0 of 2: SafetensorError" in rank1["failed_load"]
    assert rank0["save_after"] == rank1["save_after"] == "returned"
    assert (ranks["root"] / "after" / "optimizer" / ".metadata").is_file()
    assert not (ranks["root"] / "failed" / "engine.pt").exists()
