"""Top-k log-probs (`compute_logprobs(..., topk=K)`) and log-probs at a loss's ids (`gathered_logprobs`) beyond the
conformance suite (which checks every engine's default path against transformers, roll_core.testing.train_engine):
the hf engine's padded path, LoRA adapters, bad input, and Megatron at TP=2 (vocabulary split over two gloo ranks)
against the hf engine. Temperature 0.7 throughout."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from roll_core.models import resolve_model_path
from roll_core.testing.batches import toy_batch
from roll_core.testing.train_engine import TEMPERATURE, GatherLoss, gather_batch, reference_log_softmax
from roll_engines.train.hf import HFTrainEngine


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    return resolve_model_path("builtin:tiny")


def _assert_gathered(loss: GatherLoss, batch: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """What `loss` saw equals log_softmax(logits / T) of `model` (plain transformers) gathered at the teacher ids."""
    with torch.no_grad():
        full = reference_log_softmax(model, batch, TEMPERATURE)
    seen = {int(row): got[j] for rows, got in loss.seen for j, row in enumerate(rows)}
    assert sorted(seen) == list(range(len(full)))
    for i, logp in enumerate(full):
        n = logp.shape[0]
        torch.testing.assert_close(seen[i][:n], logp.gather(-1, batch["teacher_ids"][i, :n]), atol=1e-5, rtol=0)


def test_padded_path_topk_and_gathered_logprobs(path: str) -> None:
    """pack_sequences=False: the (b, R, V) logits path gives transformers' top-k and gathered log-probs."""
    from transformers import AutoModelForCausalLM

    batch = gather_batch(toy_batch(path))
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = HFTrainEngine(path, lr=1e-3, micro_batch_size=4, pack_sequences=False)
    out = eng.compute_logprobs(batch, temperature=TEMPERATURE, topk=3)
    with torch.no_grad():
        full = reference_log_softmax(plain, batch, TEMPERATURE)
    for i, logp in enumerate(full):
        n = logp.shape[0]
        want = torch.topk(logp, 3, dim=-1)
        torch.testing.assert_close(out["topk_logprobs"][i, :n], want.values, atol=1e-5, rtol=0)
        assert torch.equal(out["topk_ids"][i, :n], want.indices)
    loss = GatherLoss()
    grads = eng.compute_gradients(batch, loss, temperature=TEMPERATURE)
    _assert_gathered(loss, batch, plain)
    assert len(loss.seen) == 2 and any(g.abs().sum() > 0 for g in grads.values())  # 6 rows in micro-batches of 4


def test_lora_gathered_logprobs_are_the_adapted_model(path: str) -> None:
    """With trained LoRA adapters the gathered log-probs are those of the merged model (W + scaling * B @ A), and
    their gradient reaches the adapters only (packed: the default path; the padded one shares response_outputs)."""
    from transformers import AutoModelForCausalLM

    batch = gather_batch(toy_batch(path))
    eng = HFTrainEngine(path, lr=5e-2, micro_batch_size=3, lora_rank=4, lora_alpha=16.0)
    eng.train_step(batch, GatherLoss(), temperature=TEMPERATURE)  # adapters away from the identity
    merged = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    merged.load_state_dict(eng.get_weights())
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    moved = max((merged.state_dict()[k] - v).abs().max() for k, v in base.state_dict().items())
    assert moved > 1e-3, "the step did not move the merged weights"
    loss = GatherLoss()
    grads = eng.compute_gradients(batch, loss, temperature=TEMPERATURE)
    _assert_gathered(loss, batch, merged)
    assert grads and all("lora_" in name for name in grads)
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_bad_topk_and_gather_ids_are_refused(path: str) -> None:
    batch = gather_batch(toy_batch(path))
    eng = HFTrainEngine(path, lr=1e-3)
    with pytest.raises(ValueError, match="topk=-1"):
        eng.compute_logprobs(batch, topk=-1)
    with pytest.raises(ValueError, match="vocabulary size"):
        eng.compute_logprobs(batch, topk=10**6)
    flat = {**batch, "teacher_ids": batch["teacher_ids"][..., 0]}  # (B, R): not (B, R, K)
    with pytest.raises(ValueError, match=r"gather_ids_key='teacher_ids'.*\(B, R, K\)"):
        eng.compute_gradients(flat, GatherLoss())
    floats = {**batch, "teacher_ids": batch["teacher_ids"].float()}
    with pytest.raises(ValueError, match="integer tensor"):
        eng.compute_gradients(floats, GatherLoss())


def _megatron_tp2_rank(rank: int, port: int, path: str, out: str) -> None:
    """One of two gloo ranks of a Megatron engine at TP=2: top-k and gathered log-probs and their gradients."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    from roll_engines.train.megatron import MegatronTrainEngine

    eng = MegatronTrainEngine(
        path, tensor_parallel_size=2, dist_backend="gloo", use_distributed_optimizer=False, num_threads=1
    )
    batch = gather_batch(toy_batch(path))
    scored = eng.compute_logprobs(batch, temperature=TEMPERATURE, topk=5)
    loss = GatherLoss()
    grads = eng.compute_gradients(batch, loss, temperature=TEMPERATURE)
    if rank == 0:
        torch.save({"scored": scored, "grads": grads, "seen": loss.seen}, out)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def test_megatron_tp2_topk_and_gathered_logprobs_equal_hf(path: str, tmp_path: Path) -> None:
    """Each TP rank holds half the vocabulary: its local top-k under the global log-sum-exp, merged over TP, and the
    gathered log-probs summed over TP give the hf engine's values and gradients."""
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    import torch.multiprocessing as mp

    from roll_core.cluster.ports import free_port

    out = tmp_path / "tp2.pt"
    # From a fork server that imported torch, transformers and Megatron once (two spawned ranks import them each:
    # ~50 s on two loaded cores, ~10 s this way). Not plain fork: this process may hold state of earlier Megatron
    # engines (process groups since destroyed) that a forked rank crashes on.
    import multiprocessing

    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "transformers", "megatron.core", "roll_engines.train.megatron", "roll_core.testing.train_engine"]
    )
    ranks = mp.start_processes(
        _megatron_tp2_rank, args=(free_port(), path, str(out)), nprocs=2, join=False, start_method="forkserver"
    )
    deadline = time.monotonic() + 180
    while not ranks.join(timeout=2):  # raises what a rank raised
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the two Megatron ranks did not finish in 180 s")
    got = torch.load(out, weights_only=False)
    batch = gather_batch(toy_batch(path))
    hf = HFTrainEngine(path, lr=1e-3)
    want = hf.compute_logprobs(batch, temperature=TEMPERATURE, topk=5)
    mask = batch["response_mask"].bool()
    for key in ("logprobs", "topk_logprobs"):
        torch.testing.assert_close(got["scored"][key][mask], want[key][mask], atol=1e-5, rtol=1e-5, msg=key)
    assert torch.equal(got["scored"]["topk_ids"][mask], want["topk_ids"][mask])
    loss = GatherLoss()
    expected = hf.compute_gradients(batch, loss, temperature=TEMPERATURE)
    seen = {int(r): g for rows, gs in got["seen"] for r, g in zip(rows, gs)}
    ref = {int(r): g for rows, gs in loss.seen for r, g in zip(rows, gs)}
    for i in ref:
        torch.testing.assert_close(seen[i][mask[i]], ref[i][mask[i]], atol=1e-5, rtol=1e-5, msg=f"row {i}")
    assert set(got["grads"]) == set(expected)
    for name, g in expected.items():
        torch.testing.assert_close(got["grads"][name], g, atol=1e-6, rtol=1e-4, msg=name)
