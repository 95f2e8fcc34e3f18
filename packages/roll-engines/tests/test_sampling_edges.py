"""Sampling edges of roll's engines: temperatures below GREEDY_TEMPERATURE decode greedily everywhere (hf's sampler,
and what roll sends vLLM and SGLang), and a caller's cancelled future is an abort in the hf batcher (never an
InvalidStateError that fails the engine's other requests)."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.testing import reference_greedy
from roll_engines.infer._sampling import processed_logprobs
from roll_engines.infer._vllm_args import sampling_params as vllm_sampling_params
from roll_engines.infer.hf import HFInferEngine
from roll_engines.infer.sglang import to_sglang_sampling
from roll_engines.infer.vllm import VLLMInferEngine

LONG = SamplingParams(temperature=1.0, max_new_tokens=300, ignore_eos=True, seed=3)
TINY_TEMPERATURES = [1e-45, 1e-38, 1e-30, 1e-6]


@pytest.mark.parametrize("t", TINY_TEMPERATURES)
def test_processed_logprobs_of_a_near_zero_temperature_are_the_greedy_rows(t: float) -> None:
    """Any positive temperature divided the logits: 1e-38 (1e-30 with large logits) made them inf, the log-probs NaN."""
    logits = torch.tensor([[2000.0, 1999.0, -5.0, 0.0], [3.0, 1.0, 2.0, 0.5]])
    temp = torch.tensor([t, t])
    got = processed_logprobs(logits, temp, [0, 0], [1.0, 1.0])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.log_softmax(logits, -1))


@pytest.fixture(scope="module")
def engine(tiny: str):
    engine = HFInferEngine(tiny)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("t", TINY_TEMPERATURES)
def test_the_hf_engine_decodes_a_near_zero_temperature_greedily(engine: HFInferEngine, tiny: str, t: float) -> None:
    """1e-38 gave NaN log-probs and a token drawn from them; 1e-6 the right tokens but log-probs of logits / 1e-6
    (about 0), not the log_softmax(logits) every greedy row reports."""
    greedy = engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
    tiny_t = engine.generate([[5, 6, 7]], SamplingParams(temperature=t, max_new_tokens=6, ignore_eos=True, seed=1))
    assert tiny_t.responses.tolist() == greedy.responses.tolist()
    assert tiny_t.responses[0].tolist() == reference_greedy(tiny, [5, 6, 7], 6)[0]
    assert torch.isfinite(tiny_t.logprobs).all()
    torch.testing.assert_close(tiny_t.logprobs, greedy.logprobs)


@pytest.mark.parametrize("t", [1e-38, 1e-6, 9e-6])
def test_vllm_and_sglang_are_sent_a_near_zero_temperature_as_greedy(t: float) -> None:
    """vLLM raises any temperature in (0, 0.01) to 0.01 (roll refused them all, 1e-6 included) and SGLang is greedy
    only below 1e-6: both now get 0 where roll's rule says greedy, so every engine decodes the same request alike."""
    p = SamplingParams(temperature=t, top_p=0.5, top_k=3)
    VLLMInferEngine.check_sampling(SimpleNamespace(name="vllm"), p)  # refused before
    assert vllm_sampling_params(lambda **kw: kw, p, 8, None)["temperature"] == 0.0
    assert to_sglang_sampling(p, 8)["temperature"] == 0.0


def test_vllm_still_refuses_a_sampling_temperature_below_its_bound() -> None:
    from roll_core.interfaces import UnsupportedSamplingError

    with pytest.raises(UnsupportedSamplingError, match=r"temperature=0\.001"):
        VLLMInferEngine.check_sampling(SimpleNamespace(name="vllm"), SamplingParams(temperature=1e-3))
    assert vllm_sampling_params(lambda **kw: kw, SamplingParams(temperature=0.7), 8, None)["temperature"] == 0.7
    assert to_sglang_sampling(SamplingParams(temperature=0.7), 8)["temperature"] == 0.7


def _queued(engine: HFInferEngine, request_id: str, prompt: list[int], params: SamplingParams = LONG) -> Future:
    seq = engine._prepare(Request(request_id, [5, 6, 7], params))
    seq.request.prompt_ids = prompt  # past the engine's checks: what the batcher itself must survive
    engine.batcher.add(seq)
    return seq.future


def test_a_cancelled_request_whose_prefill_fails_does_not_fail_the_others(engine: HFInferEngine, tiny: str) -> None:
    """`_fail_prefill` set an exception on a future its caller had cancelled: the InvalidStateError failed the step,
    and with it every request of the engine."""
    greedy = SamplingParams(temperature=0, max_new_tokens=5)
    with engine._lock:
        good = _queued(engine, "good", [5, 6, 7], greedy)
        engine.batcher.step()
        bad = _queued(engine, "bad", [5, 150], greedy)  # an id past the tiny vocabulary: its prefill raises
        good2 = _queued(engine, "good2", [5, 6], greedy)  # admitted with it
        assert bad.cancel()
        while engine.batcher.has_work():
            engine._step()  # the engine's own step: a raise there fails every request
    assert good.result(timeout=0).token_ids == reference_greedy(tiny, [5, 6, 7], 5)[0]
    assert good2.result(timeout=0).token_ids == reference_greedy(tiny, [5, 6], 5)[0]
    assert bad.cancelled()


def test_a_request_cancelled_while_queued_is_never_admitted(engine: HFInferEngine) -> None:
    with engine._lock:
        fut = _queued(engine, "q", [5, 6, 7])
        assert fut.cancel()
        engine.batcher.step()
        assert not engine.batcher.has_work() and engine.batcher.cache is None


def test_a_cancelled_running_request_leaves_the_batch_and_frees_its_row(engine: HFInferEngine) -> None:
    """Its row kept generating for no one until max_new_tokens (300 here), holding its KV."""
    with engine._lock:
        gone = _queued(engine, "gone", [5, 6, 7])
        kept = _queued(engine, "kept", [5, 6], SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True))
        engine.batcher.step()
        assert gone.cancel()
        engine.batcher.step()
        assert [s.request.request_id for s in engine.batcher.running] == ["kept"]
        while engine.batcher.has_work():
            engine.batcher.step()
        assert engine.batcher.cache is None
    out: RequestOutput = kept.result(timeout=0)
    assert len(out.token_ids) == len(out.logprobs) == 6 and all(math.isfinite(x) for x in out.logprobs)


def test_an_abort_reaches_the_request_that_reused_a_cancelled_ones_id(engine: HFInferEngine) -> None:
    """A cancelled future frees its id; `abort(id)` marked the cancelled row (True) and the live request ran on."""
    with engine._lock:
        old = _queued(engine, "r", [5, 6, 7])
        engine.batcher.step()
        assert old.cancel()
        new = _queued(engine, "r", [5, 6, 7])
        engine.batcher.step()
        assert engine.batcher.abort("r") is True
        engine.batcher.step()
        assert not engine.batcher.has_work()
    assert new.result(timeout=0).finish_reason == "abort"


def test_a_submitted_request_cancelled_by_its_caller_stops_at_the_next_step(engine: HFInferEngine) -> None:
    """Through the engine's own loop thread: the cancelled row decodes no further token (the step retires it first).
    The loop's step is held after the row's first token until the caller has cancelled (polling for it under the
    engine's lock raced the loop, which may take the lock back for every step and finish all 300 tokens first)."""
    started, cancelled = threading.Event(), threading.Event()
    seen: list[tuple[Any, int]] = []
    step = engine.batcher.step

    def stepping() -> None:
        step()
        seq = next((s for s in engine.batcher.running if s.request.request_id == "bg" and s.tokens), None)
        if seq is not None and not started.is_set():
            seen.append((seq, len(seq.tokens)))
            started.set()
            cancelled.wait(60)  # the caller cancels between two steps

    engine.batcher.step = stepping  # type: ignore[method-assign]
    try:
        fut = engine.submit(Request("bg", [5, 6, 7], LONG))
        assert started.wait(120), "the request never started"
        assert fut.cancel()
        cancelled.set()
        deadline = time.monotonic() + 120
        while engine.batcher.has_work():
            assert time.monotonic() < deadline, "the cancelled row never left"
            time.sleep(0.001)
    finally:
        cancelled.set()
        del engine.batcher.step
    (seq, n) = seen[0]
    assert len(seq.tokens) == n < LONG.max_new_tokens
