"""Partial-GPU mode on real engines: the async driver with an EnginePool over two in-process HF engines of the tiny
model. Engine 1 (a training device's engine) joins while requests run on engine 0 and takes some over, then is
taken out while they run: they resume on engine 0 with their prefixes kept, and every sample has exactly
max_new_tokens tokens whose behaviour log-probs equal a teacher-forced forward (a lost or doubled token would break
the context of what follows)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from roll_core.interfaces import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_holds import EngineHold

N_TOKENS = 200


class _Engines:
    """The InferGroup request API over in-process engines, with the `rank=` placement partial-GPU mode uses."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines
        self.holds: dict[int, EngineHold] = {}
        self.placed: dict[str, int] = {}
        self.offloaded: set[int] = set()  # engines whose device the trainer holds: a request there is a bug

    def submit_request(self, request: Any, route_key: str | None = None, rank: int | None = None) -> Any:
        if rank is None or rank in self.offloaded:
            raise AssertionError(f"request {request.request_id} placed on engine {rank}")
        self.placed[request.request_id] = rank
        return self.engines[rank].submit(request)

    def abort(self, request_id: str) -> bool:
        for rank, engine in enumerate(self.engines):
            if engine.abort(request_id):
                if rank in self.holds:  # the abort is recorded: the held engine may step (and retire it)
                    self.holds[rank].release()
                return True
        return False


def _wait(cond: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_an_engine_leaves_and_rejoins_while_requests_run(tiny_model: str) -> None:
    from roll_core.pipelines.sampling import generation_from_samples
    from roll_core.protocol import build_sequences, pad_left
    from roll_core.scheduling.driver import AsyncRollout
    from roll_core.scheduling.pool import EnginePool
    from roll_core.scheduling.scheduler import RolloutScheduler
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.train.hf import HFTrainEngine

    engines = [HFInferEngine(tiny_model, max_new_tokens=N_TOKENS) for _ in range(2)]
    infer = _Engines(engines)
    # Each engine pauses once it runs a request with enough tokens, until one of its requests is aborted: the
    # expand and the shrink then always find requests running there (engine_holds.py says why polling raced).
    infer.holds = {0: EngineHold(engines[0], tokens=3), 1: EngineHold(engines[1], tokens=5)}

    class Problem:  # a roll_core.interfaces.ProblemLike
        id, prompt, answer = "p", "say 7", "7"

    sched = RolloutScheduler(batch_groups=2, group_size=2, max_new_tokens=N_TOKENS, async_ratio=1)
    prompts = iter([[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16, 17, 18]] * 4)
    pool = EnginePool([0, 1], active=[0])  # engine 1 is a training device's: not lent yet
    infer.offloaded.add(1)
    params = SamplingParams(max_new_tokens=N_TOKENS, ignore_eos=True, seed=3)
    driver = AsyncRollout(infer, sched, lambda: (Problem(), next(prompts)), params, pool=pool, timeout_s=60)

    def on(rank: int) -> list[Any]:
        return list(engines[rank].batcher.running)

    driver.start()
    try:
        infer.holds[0].wait("engine 0 to generate")
        infer.offloaded.clear()
        moved_in = driver.expand([1], rebalance=True)  # the trainer waits: engine 1 joins and takes requests over
        assert moved_in > 0
        infer.holds[1].wait("engine 1 to generate")
        assert any(len(s.tokens) >= 5 for s in on(1))
        resumed_before = sched.counters["resumed_requests"]
        moved_out = driver.shrink([1])  # the trainer takes its device back: its requests resume on engine 0
        infer.offloaded.add(1)
        assert moved_out > 0 and pool.active == [0]
        _wait(lambda: not on(1), "engine 1 to retire its aborted requests")
        groups = driver.take(2) + driver.take(2)
        assert sched.counters["resumed_requests"] > resumed_before  # aborted mid-way, not waited out
    finally:
        driver.close()
        for e in engines:
            e.shutdown()
    assert pool.counters["moved_requests"] == moved_in and pool.counters["shrunk_requests"] == moved_out
    assert sched.counters["resumed_requests"] > 0
    samples = [s for g in groups for s in g.samples]
    assert all(len(s.tokens) == N_TOKENS and len(s.logprobs) == N_TOKENS for s in samples)
    assert any(len(s.segments) > 1 for s in samples)  # some were generated on both engines
    gen = generation_from_samples(groups, engines[0].pad_id)
    p_ids, p_mask = pad_left(gen["prompt_ids"], engines[0].pad_id)
    batch = build_sequences(p_ids, p_mask, gen["responses"], gen["response_mask"])
    batch.update(responses=gen["responses"], response_mask=gen["response_mask"])
    logp = HFTrainEngine(tiny_model, trainable=False, role="reference").compute_logprobs(batch)["logprobs"]
    torch.testing.assert_close(logp, gen["behaviour_logprobs"], atol=2e-4, rtol=1e-4)
