"""The episode-recording harness of the agentic turn tests (test_agentic_turn_assembly.py,
test_agentic_turn_followups.py, test_agent_turn_followups.py), in one place (a test module puts this folder on
sys.path to import it: pytest's importlib mode does not).

- `hf_infer_group(context)`: the hf engine on the builtin tiny model as an in-process inference group, and its
  tokenizer (a module fixture yields from it);
- `RecordingEngine(inner, keep, cut)`: an inference group's request API over `inner` that records every request
  and its output, and optionally cuts the first attempt of chosen requests short, reported aborted (an abort
  mid-turn);
- `ScriptedEngine(script)`: an inference group that answers turn k with `script[k]`;
- `seeded_words(seed)`, `split_point(tok, ids)`: a few words a seed picks (the tiny model's greedy reply depends on
  them), and a stop string within a response that a resumed attempt can split.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from roll_core.agentic.trajectory import Trajectory
from roll_core.interfaces import Request, RequestOutput

WORDS = "the a cat dog runs jumps over under red blue green sky sea 12 7 ok no yes go stop left right".split()


def seeded_words(seed: int | None) -> str:
    """2 to 12 of `WORDS`, as `random.Random(seed)` picks them."""
    pick = random.Random(seed)
    return " ".join(pick.choice(WORDS) for _ in range(pick.randint(2, 12)))


def turn_of(request_id: str) -> int:
    """The turn number of an agentic rollout's first attempt of a turn (its id ends with `-turn-<k>`)."""
    return int(request_id.rsplit("-", 1)[1])


def hf_infer_group(context: int) -> Iterator[tuple[Any, Any]]:
    """Yields (inference group, tokenizer): one local hf worker on the builtin tiny model whose context is `context`
    tokens (infer_engine.max_model_len), 64 new tokens at most; shut down after."""
    from transformers import AutoTokenizer

    from roll_core.cluster.roles import InferGroup, InferWorker
    from roll_core.models import resolve_model_path
    from roll_engines.config import HFInferEngineConfig

    path = resolve_model_path("builtin:tiny")
    runtime = {"model_path": path, "max_new_tokens": 64, "num_threads": 1}
    engine = {**vars(HFInferEngineConfig()), "max_model_len": context}
    infer = InferGroup(InferWorker, 1, "local", engine=engine, runtime=runtime)
    try:
        yield infer, AutoTokenizer.from_pretrained(path)
    finally:
        infer.shutdown()


def _first_request(request: Request, earlier: int) -> bool:
    return earlier == 0


class RecordingEngine:
    """The request API of `inner` (an InferGroup, or roll_core.testing.infer_engine.RequestsOf over an engine) that
    records every request as submitted: `requests` in order, `prompts` and `route_keys` by request id (the prompt
    ids copied then), and `outputs` by request id once its result is read.

    With `keep`, a request that `cut(request, earlier)` picks (`earlier`: how many requests came before it; by
    default the first request) is cut after `keep` tokens and reported aborted: an abort mid-turn (a weight sync's,
    or the engine's own preemption), which the caller resumes with a request of its own."""

    def __init__(
        self, inner: Any, keep: int | None = None, cut: Callable[[Request, int], bool] = _first_request
    ) -> None:
        self.inner, self.keep, self.cut, self.lock = inner, keep, cut, threading.Lock()
        self.requests: list[Request] = []
        self.prompts: dict[str, list[int]] = {}
        self.route_keys: dict[str, str | None] = {}
        self.outputs: dict[str, RequestOutput] = {}

    def submit_request(self, request: Request, route_key: str | None = None) -> Any:
        with self.lock:
            earlier = len(self.requests)
            self.requests.append(request)
            self.prompts[request.request_id] = list(request.prompt_ids)
            self.route_keys[request.request_id] = route_key
        if self.keep is not None and self.cut(request, earlier):
            short = Request(request.request_id, request.prompt_ids, request.params.replace(max_new_tokens=self.keep))
            out = self.inner.submit_request(short, route_key=route_key).result()
            handle: Any = Future()
            handle.set_result(RequestOutput(out.request_id, out.prompt_ids, out.token_ids, out.logprobs, "abort"))
        else:
            handle = self.inner.submit_request(request, route_key=route_key)
        read = handle.result

        def result(*args: Any, **kwargs: Any) -> RequestOutput:
            out = read(*args, **kwargs)
            with self.lock:
                self.outputs[request.request_id] = out
            return out

        handle.result = result
        return handle

    def abort(self, request_id: str) -> bool:
        return self.inner.abort(request_id)

    def check_sampling(self, params: Any) -> None:
        self.inner.check_sampling(params)

    def max_context_length(self) -> int:
        return self.inner.max_context_length()

    def turns_of(self, traj: Trajectory) -> list[tuple[list[int], RequestOutput]]:
        """(prompt ids, output) of an agentic rollout's episode, turn by turn: the requests of the route key whose
        first turn's prompt is the trajectory's prompt (each episode's first observation names its seed)."""
        firsts = [self.route_keys[r] for r, p in self.prompts.items() if r.endswith("-turn-0") and p == traj.prompt_ids]
        assert len(firsts) == 1, firsts
        rids = sorted((r for r, key in self.route_keys.items() if key == firsts[0]), key=turn_of)
        return [(self.prompts[r], self.outputs[r]) for r in rids]


class ScriptedEngine:
    """An inference group that answers turn k (`turn_of` its request id) with `script[k]` (ids, finish reason), each
    token's log-prob -0.5."""

    def __init__(self, script: list[tuple[list[int], str]]) -> None:
        self.script = script

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        ids, finish = self.script[turn_of(request.request_id)]
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, ids, [-0.5] * len(ids), finish))
        return fut

    def abort(self, request_id: str) -> bool:
        return False


def split_point(tok: Any, ids: list[int]) -> tuple[str, int] | None:
    """A 3-token stop string of the response `ids` (no special token) and the index of the token that completes it
    first (not before the 7th token)."""
    for k in range(6, len(ids) - 4):
        stop = tok.decode(ids[k - 2 : k + 1])
        plain = not any(i in tok.all_special_ids for i in ids[k - 2 : k + 1])
        if plain and len(stop) >= 3 and stop.strip() == stop and stop not in tok.decode(ids[:k]):
            return stop, k
    return None
