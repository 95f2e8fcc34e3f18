"""The abort of a `generate` batch's submitted rows on a failure (roll_engines.infer._rows: `run_rows`,
`DriverAborts._abort_rows`, the vllm and sglang engines' path): a shutdown that races the abort is no failure (the
batch's own error is raised), while an abort that failed for another reason is raised, never hidden. Fake engines
built without vLLM or SGLang."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_engines.infer._rows import DriverAborts, row_requests, run_rows


def _refusing_submit(refuse_at: int) -> Callable[[Request], Future[RequestOutput]]:
    """A `submit` that queues the first rows (never completed) and refuses row `refuse_at` (ValueError)."""
    calls = [0]

    def submit(request: Request) -> Future[RequestOutput]:
        calls[0] += 1
        if calls[0] > refuse_at:
            raise ValueError(f"row refused: {request.request_id}")
        return Future()

    return submit


class _Engine(DriverAborts):
    """`DriverAborts` over a `_control` that runs `fail(self)` instead of the job (the job's failure, as raised)."""

    def __init__(self, fail: Callable[[_Engine], BaseException | None]) -> None:
        self._stopped = False
        self.fail = fail
        self.aborted: list[str] = []

    def _control(self, fn: Callable[[], Any]) -> Any:
        exc = self.fail(self)
        if exc is not None:
            raise exc
        return fn()

    def _abort_now(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def _shut_down_meanwhile(engine: _Engine) -> BaseException:
    """The race: `_stopped` was False when `_abort_rows` looked, then shutdown failed the queued job."""
    engine._stopped = True
    return RuntimeError("vllm engine shut down")


def test_a_shutdown_racing_the_abort_of_the_rows_raises_the_batchs_own_error() -> None:
    """vLLM passes `_abort_rows` to `run_rows` as is: a shutdown between its `_stopped` check and the job (the job
    refused or failed with 'engine shut down') raised that RuntimeError instead of the row's error. Now the row's
    error is raised (a shut-down engine runs nothing: no abort is missing)."""
    engine = _Engine(_shut_down_meanwhile)
    requests = row_requests([[1, 2]], SamplingParams(), n=3)
    with pytest.raises(ValueError, match="row refused"):
        run_rows(requests, _refusing_submit(2), engine._abort_rows)


def test_an_abort_that_fails_while_the_engine_runs_is_raised_not_hidden() -> None:
    """The engine runs (not shut down) and its abort fails (a RuntimeError from the engine): the rows submitted
    keep running for nobody, so the failure is raised, chained to the batch's error (on `__context__`)."""
    engine = _Engine(lambda e: RuntimeError("abort_request failed: the tokenizer manager is gone"))
    requests = row_requests([[1, 2]], SamplingParams(), n=3)
    with pytest.raises(RuntimeError, match="abort_request failed") as info:
        run_rows(requests, _refusing_submit(2), engine._abort_rows)
    assert isinstance(info.value.__context__, ValueError)
    ok = _Engine(lambda e: None)
    with pytest.raises(ValueError, match="row refused"):
        run_rows(requests, _refusing_submit(2), ok._abort_rows)
    assert ok.aborted == [r.request_id for r in requests[:2]]  # the rows submitted before the refusal


def _sglang(fail: Callable[[Any], BaseException | None]) -> Any:
    """An SGLangInferEngine without SGLang: its `generate` over a refusing `submit` and a failing `_control`."""
    from roll_engines.infer.sglang import SGLangInferEngine

    engine = SGLangInferEngine.__new__(SGLangInferEngine)
    engine.name, engine.defaults = "sglang", SamplingParams()  # (pad_id: only read on success)
    engine._stopped = False
    engine.submit = _refusing_submit(1)

    def control(fn: Callable[[], Any]) -> Any:
        exc = fail(engine)
        if exc is not None:
            raise exc
        return fn()

    engine._control = control
    engine._abort_now = lambda request_id: True
    return engine


def test_sglang_generate_raises_an_abort_that_failed_while_the_engine_runs() -> None:
    """SGLang's `generate` suppressed every RuntimeError of the rows' abort as 'shut down meanwhile', also one
    raised while the engine ran (the rows then kept running in SGLang for nobody, and nothing said so). Now only a
    shutdown is suppressed."""
    failing = _sglang(lambda e: RuntimeError("abort_request failed: the tokenizer manager is gone"))
    with pytest.raises(RuntimeError, match="abort_request failed") as info:
        failing.generate([[1, 2]], n=2)
    assert isinstance(info.value.__context__, ValueError)
    racing = _sglang(_shut_down_meanwhile)
    with pytest.raises(ValueError, match="row refused"):
        racing.generate([[1, 2]], n=2)
