"""Two train-engine leftovers, each checked where it used to go wrong.

- A mini-batch without a trainable token on any rank ran every micro-batch's forward and backward for nothing (a
  zero loss), and its micro-batches' metrics (all zeros) went into the step's means: `actor/pg_loss` weighed by
  rows dragged a real mini-batch's mean towards 0, and `micro_batches`/`forward_tokens` counted the wasted passes.
  Now no pass runs (hf/fsdp2 and megatron). A rank without a trainable token beside one with some still runs its
  passes (FSDP's collectives must pair up); that its gradient is the other rank's is test_empty_mini_batch.py's
  `test_two_fsdp2_ranks_agree_on_an_empty_mini_batch`.
- A loss that gathers log-probs at a batch key (`gather_ids_key`) missing from one rank's batch: that rank's loss
  raised after the forward's collectives, on that rank alone, and the other ranks waited in the backward's until
  the process group timed out. Now every rank raises the same ValueError naming the rank and the key, before any
  forward (roll_engines.train._agree), and the group stays usable.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch
from roll_core.testing.gloo_ranks import join_gloo_group, run_two_ranks

#: A rank left waiting in a collective fails after this (not 30 minutes); the test waits DEADLINE_S for both.
GROUP_TIMEOUT_S = 30
DEADLINE_S = 180


def _masked(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    out = dict(batch)
    out["response_mask"] = batch["response_mask"].clone()
    out["response_mask"][rows] = 0
    return out


def test_hf_runs_no_pass_for_a_mini_batch_without_trainable_tokens(tiny: str) -> None:
    """Two mini-batches, the second fully masked: one forward/backward per micro-batch of the first only, and the
    metrics are the first mini-batch's alone (as training it alone)."""
    from roll_engines.train.hf import HFTrainEngine

    objective = PolicyObjective(agg="seq-mean-token-sum")  # units are rows: the empty rows weighed in the means
    batch = toy_batch(tiny)
    both = HFTrainEngine(tiny, micro_batch_size=1)
    out = both.train_step(_masked(batch, [3, 4, 5]), objective, mini_batches=2)
    alone = HFTrainEngine(tiny, micro_batch_size=1).train_step({k: v[:3] for k, v in batch.items()}, objective)
    assert out["empty_mini_batches"] == 1 and out["optimizer_steps"] == 1
    assert out["micro_batches"] == alone["micro_batches"] == 3
    assert out["forward_tokens"] == alone["forward_tokens"]
    for key, value in alone.items():
        if key.startswith(("actor/", "_weight/")):
            assert out[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    empty = both.train_step(_masked(batch, list(range(6))), objective)
    assert empty["micro_batches"] == 0 and empty["forward_tokens"] == 0 and empty["empty_mini_batches"] == 1
    assert not [k for k in empty if k.startswith("actor/")], empty  # no loss ran: no loss metric


def test_megatron_runs_no_pass_for_a_mini_batch_without_trainable_tokens(tiny: str, megatron_process_group) -> None:
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    from roll_engines.train.megatron import MegatronTrainEngine

    engine = MegatronTrainEngine(tiny, dist_backend="gloo", use_distributed_optimizer=False, micro_batch_size=2)
    runs = []
    schedule = engine._schedule
    engine._schedule = lambda micros, *a, **kw: runs.append(len(micros)) or schedule(micros, *a, **kw)
    out = engine.train_step(_masked(toy_batch(tiny), list(range(6))), PolicyObjective(agg="seq-mean-token-sum"))
    assert runs == [] and out["empty_mini_batches"] == 1 and out["optimizer_steps"] == 0
    assert not [k for k in out if k.startswith("actor/")], out
    grads = engine.compute_gradients(_masked(toy_batch(tiny), list(range(6))), PolicyObjective())
    assert grads and all(not g.any() for g in grads.values())  # no pass, and the gradient is (still) zero


def test_hf_refuses_a_batch_without_the_losss_gather_key(tiny: str) -> None:
    from roll_core.testing.train_engine import GatherLoss
    from roll_engines.train.hf import HFTrainEngine

    engine = HFTrainEngine(tiny, micro_batch_size=2)
    before = engine.micro_batches_run
    with pytest.raises(ValueError, match=r"gathers log-probs at the batch's 'teacher_ids'.*lacks"):
        engine.train_step(toy_batch(tiny), GatherLoss())
    assert engine.micro_batches_run == before  # refused before any forward


def _rank(rank: int, engine: str, port: int, path: str, out: str) -> None:
    """One of two data-parallel gloo ranks: a distillation step whose gather key rank 1's batch lacks, then
    log-probs of a good batch (the ranks' collectives must still pair up)."""
    import torch.distributed as dist

    from roll_core.testing.train_engine import GatherLoss, gather_batch

    join_gloo_group(rank, port, GROUP_TIMEOUT_S)
    settings = {"dist_backend": "gloo", "num_threads": 1, "lr": 1e-3, "micro_batch_size": 2}
    if engine == "fsdp2":
        from roll_engines.train.fsdp2 import FSDP2TrainEngine

        eng = FSDP2TrainEngine(path, **settings)
    else:
        from roll_engines.train.megatron import MegatronTrainEngine

        eng = MegatronTrainEngine(path, use_distributed_optimizer=False, **settings)
    mine = {k: v[rank::2].clone() for k, v in toy_batch(path).items()}
    distill = gather_batch(mine)
    if rank == 1:
        del distill["teacher_ids"]
    results: dict = {}
    for name, call in (
        ("gather", lambda: eng.train_step(distill, GatherLoss())),
        ("good", lambda: eng.compute_logprobs(mine)),
    ):
        try:
            got = call()
            results[name] = {"ok": {k: tuple(v.shape) for k, v in got.items()}}
        except Exception as e:
            results[name] = {"error": (type(e).__name__, str(e))}
        torch.save(results, f"{out}.{rank}")  # at once: what a rank got is readable even if the other one hangs
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("engine", ["fsdp2", "megatron"])
def test_two_ranks_both_refuse_a_gather_key_missing_on_rank_1(tiny: str, tmp_path: Path, engine: str) -> None:
    preload = ["torch", "transformers"]
    if engine == "megatron":
        pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
        preload += ["megatron.core", "roll_engines.train.megatron", "roll_core.testing.train_engine"]
    got = run_two_ranks(_rank, engine, tiny, tmp_path / "ranks", preload, DEADLINE_S)
    for rank, results in enumerate(got):
        kind, message = results["gather"].get("error", (None, f"rank {rank} raised nothing"))
        assert kind == "ValueError", (rank, results)
        assert message.startswith("data-parallel rank 1 of 2 refused its batch"), (rank, message)
        assert "rank 1: ValueError:" in message and "'teacher_ids' (loss_fn.gather_ids_key)" in message, message
        assert "rank 0:" not in message, (rank, message)
        assert results["good"].get("ok", {}).get("logprobs") == (3, 7), (rank, results["good"])


def test_megatron_lora_grad_norm_counts_a_shared_a_once(tiny: str, megatron_process_group) -> None:
    """Megatron fuses q/k/v (gate/up) into one layer with one LoRA A; `compute_gradients` repeats that A's gradient
    under each peft projection. The step's `grad_norm` is the norm over the engine's own (unique) parameters: the
    shared A once, not once per projection (checked also at TP=2, with and without sequence parallelism, by hand)."""
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    pytest.importorskip("peft")
    from roll_engines.train.megatron import MegatronTrainEngine
    from roll_engines.train.megatron._lora import wrappers

    engine = MegatronTrainEngine(
        tiny, dist_backend="gloo", use_distributed_optimizer=False, micro_batch_size=3, lora_rank=4, max_grad_norm=1e9
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero A and B (B starts at zero: A's gradient would be 0)
        for _, m in wrappers(engine.model):
            for p in (m.lora_a, m.lora_b):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    batch, objective = toy_batch(tiny), PolicyObjective(agg="token-mean")
    grads = engine.compute_gradients(batch, objective)
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        for name in [n for n in grads if f"{group[0]}.lora_A" in n]:
            for other in group[1:]:  # the same A under each projection of the fused layer
                assert torch.equal(grads[name.replace(group[0], other)], grads[name]), name
    repeated = ("k_proj.lora_A", "v_proj.lora_A", "up_proj.lora_A")
    unique = [g.double() for n, g in grads.items() if not any(r in n for r in repeated)]
    # Per decoder layer (2): q/k/v's one A and its 3 B row blocks, o's A and B, gate/up's A and 2 B blocks, down's 2.
    assert len(unique) == 2 * (4 + 2 + 3 + 2)
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in unique])).item()
    every = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads.values()]))
    assert every.item() > want * 1.01  # (what counting the shared A per projection would give)
    got = engine.train_step(batch, objective)["grad_norm"]
    assert got == pytest.approx(want, rel=1e-5)
