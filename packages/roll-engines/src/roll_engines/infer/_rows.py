"""The rows of a `generate` call, shared by the infer engines.

Contract: `row_requests` builds row k*n + j (sample j of prompt k) with a fresh random id and, when the sampling
params carry a seed, the stream seeded by (seed, first_row + row): results do not depend on how a batch was
split over engines. `run_rows` submits rows one by one and waits for all; when one fails (refused as it is
submitted, or failing later) or the wait is interrupted, the rows already submitted are aborted before the error
is raised, so none keeps running in the engine for nobody. `caller_error` renames a row's failure that names the
internal request id (a `generate` caller never saw it) by the caller's prompt index and row; `run_rows` does so for
the engines that give it their name. `RequestFailed` / `RequestRefused` are such errors (RuntimeError / ValueError
naming a request id, with the message without it as `detail`) for the engines' own request failures. `DriverAborts`
is the abort side of the engines whose requests one driver thread owns (vllm, sglang).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from typing import Any, TypeVar

from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.seeds import Purpose, derive_seed


def row_requests(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    n: int,
    first_row: int = 0,
    mm: Sequence[Any] | None = None,
) -> list[Request]:
    """`len(prompts) * n` requests, row k*n + j being sample j of prompt k; `mm[k]` (one object for the n samples of
    prompt k: one prefill) is set as each row's `mm` when given."""
    requests = []
    for k, prompt in enumerate(prompts):
        for j in range(n):
            row = first_row + k * n + j
            seed = None if params.seed is None else derive_seed(params.seed, Purpose.ENGINE_ROW, row)
            # A random id: a counter's `batch-N` could be a caller's running request id, refused as a duplicate.
            req = Request(f"generate-{uuid.uuid4().hex}", list(prompt), params.replace(seed=seed))
            req.mm = mm[k] if mm is not None else None
            requests.append(req)
    return requests


_E = TypeVar("_E", bound="_NamesRequest")


class _NamesRequest(Exception):
    """An error of one request that names its id in the message; `detail` is the message without it (what
    `caller_error` puts after a `generate` caller's prompt and row instead)."""

    def __init__(self, request_id: str, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.detail = message if detail is None else detail

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole (a Ray actor's error reaches its caller so)
        return type(self), (self.request_id, str(self), self.detail)

    @classmethod
    def of(cls: type[_E], name: str, request_id: str, detail: str) -> _E:
        """The error of engine `name`'s request `request_id`: "<name> request '<id>': <detail>"."""
        return cls(request_id, f"{name} request {request_id!r}: {detail}", detail)


class RequestFailed(_NamesRequest, RuntimeError):
    """A request the engine failed while running it (vLLM's finish_reason "error")."""


class RequestRefused(_NamesRequest, ValueError):
    """A request whose input or output the engine could not take (pictures expanded otherwise, no log-probs)."""


def caller_error(exc: BaseException, name: str, row: int, n: int) -> BaseException:
    """`exc` of row `row` of a `generate` call (`n` samples per prompt) as its caller should read it: an error that
    names the row's internal request id (it has `request_id` and `detail`: PrefillError, ConstraintViolation) is
    remade, same type, naming prompt `row // n` and the row instead (the original chained by the raiser); any
    other error is returned as is."""
    detail = getattr(exc, "detail", None)
    if getattr(exc, "request_id", None) is None or not isinstance(detail, str):
        return exc
    return type(exc)(exc.request_id, f"{name} engine: prompt {row // n} (row {row}): {detail}", detail)


def run_rows(
    requests: Sequence[Request],
    submit: Callable[[Request], Future[RequestOutput]],
    abort_submitted: Callable[[Sequence[Request]], None],
    name: str | None = None,
    n: int = 1,
) -> list[RequestOutput]:
    """Submit `requests` one by one and return their outputs in order. On the first failure (or an interrupted
    wait) `abort_submitted` gets the rows submitted so far, then the error is raised: with `name` (the engine's)
    and `n` (samples per prompt) given, a failure that names the row's internal request id is raised as
    `caller_error` remakes it (prompt and row; the original chained as its cause)."""
    futures: list[Future[RequestOutput]] = []
    row: int | None = None  # the row that failed (None: an interrupted wait)
    try:
        for req in requests:  # one by one: rows submitted before a refusal are aborted below
            row = len(futures)
            futures.append(submit(req))
        row = None
        wait(futures, return_when=FIRST_EXCEPTION)  # not row by row: a late row's failure is seen at once
        row = next((i for i, f in enumerate(futures) if f.done() and f.exception() is not None), None)
        if row is not None:
            raise futures[row].exception()  # type: ignore[misc]
    except BaseException as exc:
        if futures:
            abort_submitted(requests[: len(futures)])
        if name is not None and row is not None and (named := caller_error(exc, name, row, n)) is not exc:
            raise named from exc  # the caller's prompt and row, not an internal request id
        raise
    return [f.result() for f in futures]


class DriverAborts:
    """`abort` and the abort of a `generate` batch's submitted rows, for an engine whose requests one driver thread owns
    (vllm, sglang). The engine provides `_control(fn)` (`fn` run on the driver thread; RuntimeError after `shutdown`),
    `_stopped` and `_abort_now(request_id)` (on the driver thread: False when it is not running)."""

    _stopped: bool

    def abort(self, request_id: str) -> bool:
        """False when `request_id` is not running; after `shutdown` (which failed every request) at once."""
        try:
            return bool(self._control(lambda: self._abort_now(request_id)))  # type: ignore[attr-defined]
        except RuntimeError:
            if self._stopped:  # shut down before the driver took it: nothing is left to abort
                return False
            raise

    def _abort_rows(self, submitted: Sequence[Request]) -> None:
        """Abort `submitted` on the driver thread (`run_rows`' `abort_submitted`). An engine shut down before the
        job ran (`_control`'s RuntimeError, `_stopped` set) has nothing left running: that is not an error, and the
        batch's own error is raised. Any other failure of the abort (the engine's abort raised, also a RuntimeError
        while the engine runs) is raised: rows may still run in the engine for nobody."""
        if self._stopped:  # after shutdown nothing runs, and no driver would take the job
            return
        try:
            self._control(lambda: [self._abort_now(r.request_id) for r in submitted])  # type: ignore[attr-defined]
        except RuntimeError:
            if self._stopped:  # shut down meanwhile (the job refused or failed by shutdown): nothing runs
                return
            raise
