"""A batch refused on one data-parallel rank is refused on every rank (roll_engines.train._agree): each rank checks
its own rows before any forward, and a rank that raised alone left the others waiting in their first collective
until the process group timed out (NCCL: 30 minutes), a hang instead of an error. Two gloo ranks on CPU, the tiny
model: rank 1's batch holds a response id past the vocabulary, rank 0's is fine; both ranks raise the same
ValueError naming rank 1 (scoring and training), and the engines then score a good batch (the ranks' collectives
still pair up). On the old code rank 0 went on alone: fsdp2's scoring and both engines' training waited in their
first collective (here until the test's short group timeout or deadline); Megatron's scoring returned log-probs on
rank 0 while rank 1 raised.

The same for what a batch carries beyond its token ids: a distillation loss's gather ids (`gather_ids_key`) out of
the vocabulary on rank 1 (both engines: checked per micro-batch, mid-forward, on the old code), and on fsdp2 (a
tiny MoE with routing replay) replayed expert ids out of range on rank 1, in scoring and attention credit (checked
per micro-batch, after the first collectives, on the old code)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roll_core.testing.gloo_ranks import join_gloo_group, run_two_ranks
from roll_engines.train._agree import agreed, refusal

#: The ranks' process-group timeout: a rank left waiting in a collective fails after this (not 30 minutes).
GROUP_TIMEOUT_S = 60
#: How long the test waits for both ranks.
DEADLINE_S = 240


def test_one_process_runs_the_check_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """size 1: the check's own result or exception, and no collective (single-process cost nil)."""
    import torch.distributed as dist

    def no_collective(*args: object, **kwargs: object) -> None:
        raise AssertionError("a collective in a single process")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    monkeypatch.setattr(dist, "all_gather", no_collective)
    assert agreed(lambda: {"x": 1}, 1) == {"x": 1}
    err = KeyError("responses")

    def fails() -> None:
        raise err

    with pytest.raises(KeyError) as got:
        agreed(fails, 1)
    assert got.value is err


def test_the_refusal_names_every_failing_rank() -> None:
    one = refusal({1: ("ValueError", "bad id 7")}, 2)
    assert type(one) is ValueError
    assert str(one).startswith("data-parallel rank 1 of 2 refused its batch")
    assert str(one).endswith("rank 1: ValueError: bad id 7")
    both = refusal({0: ("TypeError", "a"), 3: ("TypeError", "b")}, 4)
    assert type(both) is TypeError and "ranks 0, 3 of 4" in str(both) and "rank 0: TypeError: a; rank 3" in str(both)
    mixed = refusal({0: ("TypeError", "a"), 1: ("RuntimeError", "b")}, 2)
    assert type(mixed) is ValueError
    custom = refusal({1: ("SomeLibraryError", "c")}, 2)  # not a builtin: ValueError
    assert type(custom) is ValueError and "rank 1: SomeLibraryError: c" in str(custom)


def _attempt(results: dict, name: str, call, out: str) -> None:
    """Record `call()`'s outcome under `name` (None, or its exception's type and message), saved at once: the
    test reads what a rank got even when the other one hangs."""
    try:
        got = call()
        results[name] = {"ok": {k: tuple(v.shape) for k, v in got.items()} if isinstance(got, dict) else None}
    except Exception as e:
        results[name] = {"error": (type(e).__name__, str(e))}
    torch.save(results, out)


def _rank(rank: int, engine: str, port: int, path: str, out: str) -> None:
    """One of two data-parallel gloo ranks (process-group timeout GROUP_TIMEOUT_S): log-probs of a batch whose
    response id is bad on rank 1 only, a training step on it, one whose ids are bad on both ranks, a distillation
    step whose gather ids are bad on rank 1 only (fsdp2: log-probs and attention credit of a batch whose replayed
    routing is bad on rank 1 only), then log-probs of a good batch."""
    import torch.distributed as dist

    from roll_core.pipelines.objectives import PolicyObjective
    from roll_core.routing import ROUTED_EXPERTS, UNROUTED
    from roll_core.testing.batches import toy_batch
    from roll_core.testing.train_engine import GatherLoss, gather_batch

    join_gloo_group(rank, port, GROUP_TIMEOUT_S)  # the engines join it
    settings = {"dist_backend": "gloo", "num_threads": 1, "lr": 1e-3, "micro_batch_size": 2}
    if engine == "fsdp2":
        from roll_engines.train.fsdp2 import FSDP2TrainEngine

        eng = FSDP2TrainEngine(path, routing_replay=True, **settings)  # a tiny MoE
    else:
        from roll_engines.train.megatron import MegatronTrainEngine

        eng = MegatronTrainEngine(path, use_distributed_optimizer=False, **settings)
    vocab = int(eng.hf_config.vocab_size) if engine == "megatron" else int(eng.model.config.vocab_size)
    mine = {k: v[rank::2].clone() for k, v in toy_batch(path).items()}
    if eng.routing is not None:  # every position UNROUTED: valid, the routers choose
        shape = (*mine["input_ids"].shape, len(eng.routing.routers), eng.routing.top_k)
        mine[ROUTED_EXPERTS] = torch.full(shape, UNROUTED, dtype=torch.int16)
    bad_response = {**mine, "responses": mine["responses"].clone()}
    bad_response["responses"][0, 0] = vocab + 5  # `responses` only: its input ids stay valid
    bad_prompt = {**mine, "input_ids": mine["input_ids"].clone()}
    bad_prompt["input_ids"][0, 0] = -1
    results: dict = {}
    where = f"{out}.{rank}"
    one_bad = bad_response if rank == 1 else mine
    _attempt(results, "logprobs", lambda: eng.compute_logprobs(one_bad), where)
    _attempt(results, "train", lambda: eng.train_step(one_bad, PolicyObjective()), where)
    both_bad = bad_prompt if rank == 0 else bad_response
    _attempt(results, "both", lambda: eng.train_step(both_bad, PolicyObjective()), where)
    distill = gather_batch(mine)
    if rank == 1:
        distill["teacher_ids"][0, 0, 1] = vocab + 5
    _attempt(results, "gather", lambda: eng.train_step(distill, GatherLoss()), where)
    if eng.routing is not None:
        routed = {**mine, ROUTED_EXPERTS: mine[ROUTED_EXPERTS].clone()}
        if rank == 1:
            routed[ROUTED_EXPERTS][0, -1, 0, 0] = eng.routing.num_experts
        _attempt(results, "routing", lambda: eng.compute_logprobs(routed), where)
        _attempt(results, "attention", lambda: eng.compute_attention_credit(routed), where)
    _attempt(results, "good", lambda: eng.compute_logprobs(mine), where)
    dist.barrier()
    dist.destroy_process_group()


def _check(got: list[dict], vocab_hint: str, routing: bool = False) -> None:
    for rank, results in enumerate(got):
        for call in ("logprobs", "train"):
            kind, message = results[call].get("error", (None, f"rank {rank} raised nothing"))
            # Both ranks: the same ValueError, naming rank 1 (and only it) with its own message.
            assert kind == "ValueError", (rank, call, results)
            assert message.startswith("data-parallel rank 1 of 2 refused its batch"), (rank, call, message)
            assert "rank 1: ValueError:" in message and f"response token id {vocab_hint}" in message, (rank, message)
            assert "rank 0:" not in message, (rank, call, message)
        kind, message = results["both"].get("error", (None, f"rank {rank} raised nothing"))
        assert kind == "ValueError" and "data-parallel ranks 0, 1 of 2" in message, (rank, message)
        assert "rank 0: ValueError:" in message and "input_ids token id -1" in message, (rank, message)
        assert "rank 1: ValueError:" in message and f"response token id {vocab_hint}" in message, (rank, message)
        # A loss's gather ids past the vocabulary on rank 1: refused on both ranks before any forward.
        kind, message = results["gather"].get("error", (None, f"rank {rank} raised nothing"))
        assert kind == "ValueError" and message.startswith("data-parallel rank 1 of 2 refused"), (rank, message)
        assert f"loss_fn.gather_ids_key='teacher_ids' token id {vocab_hint} (index (0, 0, 1))" in message, message
        assert "rank 0:" not in message, (rank, message)
        for call in ("routing", "attention") if routing else ():  # replayed expert ids past the experts on rank 1
            kind, message = results[call].get("error", (None, f"rank {rank} raised nothing"))
            assert kind == "ValueError" and message.startswith("data-parallel rank 1 of 2"), (rank, call, message)
            assert "rank 1: ValueError: routed_experts holds expert ids outside [-1, 4)" in message, (rank, message)
            assert "rank 0:" not in message, (rank, call, message)
        # The group is still paired up: a good batch scores on both ranks.
        assert results["good"].get("ok", {}).get("logprobs") == (3, 7), (rank, results["good"])


def test_two_fsdp2_ranks_both_raise_a_refusal_of_rank_1(tiny: str, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from roll_core.testing.models import tiny_model

    moe = tiny_model("qwen3_moe", tmp_path / "moe")  # 4 experts, top-2: routing replay on
    got = run_two_ranks(_rank, "fsdp2", moe, tmp_path / "ranks", ["torch", "transformers"], DEADLINE_S)
    _check(got, str(AutoConfig.from_pretrained(moe).vocab_size + 5), routing=True)


def test_two_megatron_ranks_both_raise_a_refusal_of_rank_1(tiny: str, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    from transformers import AutoConfig

    preload = [
        "torch",
        "transformers",
        "megatron.core",
        "roll_engines.train.megatron",
        "roll_core.testing.train_engine",
    ]
    got = run_two_ranks(_rank, "megatron", tiny, tmp_path / "ranks", preload, DEADLINE_S)
    _check(got, str(AutoConfig.from_pretrained(tiny).vocab_size + 5))
