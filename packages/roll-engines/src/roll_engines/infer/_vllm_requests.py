"""The running requests of the `vllm` engine (roll_engines.infer.vllm): their state and the ids each goes by.

Contract: one `RequestTable` per engine, used by its driver thread alone (no lock). A running request is known by
three ids: roll's (`Request.request_id`, what `abort` names), the external id the engine gives vLLM (`roll-N`, unique
per engine) and vLLM's internal id (the external id plus a random suffix; outputs may carry either). `find` takes
either vLLM id, `rid_of` roll's. A roll request id runs at most once at a time: `add` refuses (ValueError, before
the request reaches vLLM) an id that is still running, because `abort(request_id)` could reach only one of the two
and the first to finish dropped the shared entry, leaving the other unabortable. Callers hand out unique ids
(roll_core.scheduling.pool refuses a request id placed twice); an id is free again once its request resolves
(`forget`). `Pending.extend` accumulates vLLM's DELTA outputs, so an aborted request resolves with what it generated.
A finished output whose finish reason is not in `RESPONSE_REASONS` fails its request (`finish_error`), as does a
picture expansion that disagrees with roll's (`expansion_error`): errors that name the request's id and carry the
message without it, so that `generate` names a failed row by its caller's prompt and row instead
(roll_engines.infer._rows.caller_error).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from roll_core.interfaces import Request
from roll_engines.infer._rows import RequestFailed, RequestRefused

#: vLLM's finish reasons that end a response. Any other ("error": a grammar that rejected a sampled token, a request
#: vLLM's core could not preprocess, a KV load failure; vLLM logs the cause) leaves tokens cut short or none, never a
#: response (it was once reported as "stop").
RESPONSE_REASONS = ("stop", "length", "abort")


@dataclass
class Pending:
    request: Request
    future: Future
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # A request with pictures: vLLM's expansion of its placeholders is compared with ours at its first output.
    check_prompt: bool = False
    # Adapter sync: the LoRA adapter id the request runs on (0: the base) and the weight version it was started at.
    adapter: int = 0
    version: int = 0
    # return_routing: vLLM's routed experts of the request (its finished output's), or None.
    routing: Any = None

    def extend(self, completion: Any) -> None:
        """Add one DELTA output's tokens and their log-probs (vLLM's `CompletionOutput`)."""
        new = list(completion.token_ids)
        self.tokens += new
        self.logprobs += [float(d[t].logprob) for t, d in zip(new, completion.logprobs or [])]


class RequestTable:
    """External vLLM id -> Pending, with vLLM's internal ids and roll's request ids mapped onto it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._states: dict[str, Pending] = {}  # external vLLM id -> state
        self._internal: dict[str, str] = {}  # vLLM's internal id -> external id
        self._by_roll_id: dict[str, str] = {}  # roll request id -> external id

    def __bool__(self) -> bool:
        return bool(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def states(self) -> Iterator[Pending]:
        return iter(list(self._states.values()))

    def external_ids(self) -> list[str]:
        return list(self._states)

    def check_new(self, request: Request, queued: Iterable[Request] = ()) -> None:
        """ValueError when `request`'s id is running already (module docstring), or is that of one of `queued` (the
        requests deferred until a weight sync ends, which abort names as it names running ones); call before vLLM
        sees it."""
        if request.request_id in self._by_roll_id or any(q.request_id == request.request_id for q in queued):
            raise ValueError(
                f"{self.name}: request id {request.request_id!r} is already running; a running request's id must be "
                "unique (abort names requests by it)"
            )

    def add(self, rid: str, internal: str, state: Pending) -> None:
        """Register a request vLLM has taken (after `check_new`, which must run before vLLM sees it)."""
        self._states[rid] = state
        self._internal[internal] = rid
        self._by_roll_id[state.request.request_id] = rid

    def find(self, vllm_id: str) -> tuple[str, Pending] | None:
        """The external id and state of an output's request (either vLLM id); None once resolved."""
        rid = vllm_id if vllm_id in self._states else self._internal.get(vllm_id)
        state = self._states.get(rid) if rid is not None else None
        return None if state is None else (rid, state)  # type: ignore[return-value]

    def rid_of(self, request_id: str) -> str | None:
        """The external id of roll's running request `request_id`, or None."""
        return self._by_roll_id.get(request_id)

    def forget(self, rid: str) -> Pending:
        """Drop a request's state from every map; returns it."""
        state = self._states.pop(rid)
        for internal in [k for k, v in self._internal.items() if v == rid]:
            del self._internal[internal]
        self._by_roll_id.pop(state.request.request_id, None)
        return state

    def clear(self) -> None:
        self._states.clear()
        self._internal.clear()
        self._by_roll_id.clear()


def finish_error(name: str, state: Pending, reason: str) -> RequestFailed:
    """The error of a request vLLM finished with a reason not in RESPONSE_REASONS (a RuntimeError naming the
    request's id; a `generate` row's is renamed by its prompt and row, roll_engines.infer._rows.caller_error)."""
    detail = (
        f"vLLM ended it with finish_reason {reason!r} after {len(state.tokens)} token(s) (vLLM's log names the cause)"
    )
    return RequestFailed.of(name, state.request.request_id, detail)


def expansion_error(name: str, state: Pending, theirs: list[int], image_token_id: int | None) -> RequestRefused:
    """The error of a request whose pictures vLLM's processor expanded to other prompt ids (`theirs`) than roll's (a
    ValueError naming the request's id, renamed as `finish_error`'s is)."""
    ours = list(state.request.prompt_ids)
    detail = (
        f"vLLM's processor expanded the pictures to a prompt of {len(theirs)} tokens "
        f"({theirs.count(image_token_id)} placeholders), roll's to {len(ours)} ({ours.count(image_token_id)}): the "
        "image processor configs disagree, and the tokens would not be the ones the trainer replays"
    )
    return RequestRefused.of(name, state.request.request_id, detail)
