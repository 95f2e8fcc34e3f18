"""Aborting a running request of the hf engine: a second abort of it stops nothing, and an engine whose only rows were
aborted may sleep at once, before any next decode step retires them."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_engines.infer.hf import HFInferEngine

LONG = SamplingParams(temperature=1.0, max_new_tokens=300, ignore_eos=True, seed=3)


@pytest.fixture
def engine(tiny: str):
    engine = HFInferEngine(tiny)
    yield engine
    engine.shutdown()


def _running(engine: HFInferEngine, request_id: str, steps: int) -> Future[RequestOutput]:
    """Queue a request and step it `steps` times in this thread (no background loop: nothing steps unless told)."""
    seq = engine._prepare(Request(request_id, [5, 6, 7], LONG))
    engine.batcher.add(seq)
    for _ in range(steps):
        engine.batcher.step()
    assert not seq.future.done()
    return seq.future


def test_a_second_abort_of_a_running_request_stops_nothing(engine: HFInferEngine) -> None:
    """Both aborts said True (the protocol: False once the request is finished; the vllm engine says so)."""
    fut = _running(engine, "r", 4)
    assert engine.abort("r") is True
    assert engine.abort("r") is False
    engine.batcher.step()
    out = fut.result(timeout=0)
    assert out.finish_reason == "abort" and len(out.token_ids) == len(out.logprobs) == 5


def test_an_engine_whose_requests_were_aborted_sleeps_at_once(engine: HFInferEngine) -> None:
    """The aborted rows stayed in the running batch until a next decode step; a `sleep` called before the engine's loop
    took that step was refused ("cannot sleep while requests run; finish or abort them"), though they were aborted."""
    futures = [_running(engine, f"r{i}", 2) for i in range(2)]
    assert all(engine.abort(f"r{i}") for i in range(2))
    engine.sleep(level=1)
    outs = [f.result(timeout=0) for f in futures]
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert [len(o.token_ids) for o in outs] == [5, 3]  # r0 ran 4 steps (1 + 4 tokens), r1 2 (1 + 2)
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)
    assert engine.memory_bytes()["kv_cache"] == 0
    engine.wake_up()
    again = engine.generate([[5, 6]], SamplingParams(max_new_tokens=3, seed=0, ignore_eos=True))
    assert again.response_mask.sum() == 3
