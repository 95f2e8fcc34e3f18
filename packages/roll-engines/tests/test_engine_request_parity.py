"""The vllm and sglang engines refuse the stops the hf engine refuses, with its message, before anything is queued
(roll_engines.infer._stop_checks), and their `generate` names a failed row by the caller's prompt and row, not by the
row's internal `generate-<hex>` id (roll_engines.infer._rows.run_rows / caller_error), while the request API keeps
the caller's id. Run without vLLM or SGLang: the vllm engine's own driver thread, tables and `generate` over a
stand-in for vLLM's `LLMEngine` (add_request / step / abort_request)."""

from __future__ import annotations

import itertools
import pickle
import queue
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.interfaces import Request, SamplingParams
from roll_engines.infer import _vllm_inproc as inproc
from roll_engines.infer._vllm_requests import RequestTable
from roll_engines.infer.hf import HFInferEngine
from roll_engines.infer.sglang import SGLangInferEngine, to_request_output
from roll_engines.infer.vllm import VLLMInferEngine

VOCAB = 100

BAD = [
    ({"stop": ("</s>", "")}, r"stop=\['</s>', ''\] holds an empty string"),
    ({"stop_token_ids": (3, -1)}, r"stop_token_ids \[-1\] are not token ids of the model's vocabulary \[0, 100\)"),
    ({"stop_token_ids": (VOCAB,)}, r"stop_token_ids \[100\] are not token ids"),
    ({"stop_token_ids": (2.0,)}, r"stop_token_ids \[2.0\] are not token ids"),
    ({"stop_token_ids": (True,)}, r"stop_token_ids \[True\] are not token ids"),
]
IDS = ["empty-stop-string", "negative-id", "id-past-vocab", "float-id", "bool-id"]


class _Core:
    """vLLM's `LLMEngine` as the vllm engine drives it: every request added finishes at the next step with one token,
    "length", except the `fail_at`-th added (0-based), which vLLM ends with finish_reason "error"."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.added: list[str] = []
        self.live: list[str] = []
        self.engine_core = SimpleNamespace(shutdown=lambda: None)

    def add_request(self, rid: str, prompt: dict[str, Any], params: Any, lora_request: Any = None) -> str:
        self.added.append(rid)
        self.live.append(rid)
        return f"{rid}-internal"

    def step(self) -> list[Any]:
        outs = []
        for rid in self.live:
            reason = "error" if self.added.index(rid) == self.fail_at else "length"
            done = SimpleNamespace(token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}], finish_reason=reason)
            done.routed_experts = None
            outs.append(SimpleNamespace(request_id=rid, prompt_token_ids=None, finished=True, outputs=[done]))
        self.live = []
        return outs

    def abort_request(self, ids: list[str]) -> None:
        self.live = [r for r in self.live if r not in ids]


@pytest.fixture
def vllm_engine(request: pytest.FixtureRequest) -> Iterator[VLLMInferEngine]:
    """A VLLMInferEngine over `_Core(fail_at=request.param)` (no vLLM): its own driver thread and tables."""
    engine = VLLMInferEngine.__new__(VLLMInferEngine)
    engine.name, engine.path, engine.engine = "vllm", "stand-in", _Core(getattr(request, "param", None))
    engine._vocab, engine._context, engine._pad_id, engine._version = VOCAB, 64, 0, 0
    engine.defaults = SamplingParams(max_new_tokens=4)
    engine._vllm_sampling, engine._delta = (lambda **kw: kw), None
    engine._ids, engine._jobs, engine._queueing = itertools.count(), queue.Queue(), threading.Lock()
    engine._pending, engine._deferred = RequestTable("vllm"), []
    engine._adapters = engine._routing = engine._sender = engine._image_token_id = None
    engine._paused = engine._stopped = False
    inproc.join(engine)  # its Release (vLLM's client shut down at shutdown), as __init__ records it
    engine._driver = inproc.start_driver(engine, "stand-in-driver")
    yield engine
    engine.shutdown()
    assert not engine._driver.is_alive()


def _sglang() -> SGLangInferEngine:
    engine = SGLangInferEngine.__new__(SGLangInferEngine)
    engine.name, engine._vocab = "sglang", VOCAB
    return engine


@pytest.mark.parametrize(("changes", "match"), BAD, ids=IDS)
def test_vllm_and_sglang_refuse_the_stops_hf_refuses_with_its_message(changes: dict[str, Any], match: str) -> None:
    """vLLM refused these only as a row reached it (an empty stop string building its SamplingParams, an id past
    the vocabulary at add_request), SGLang not at all (an empty string ended every response at its first token,
    an id past the vocabulary never stopped one). Every engine's check_sampling now refuses them with one message."""
    params = SamplingParams(max_new_tokens=4).replace(**changes)
    messages = []
    for check in (
        lambda p: HFInferEngine.check_sampling(SimpleNamespace(name="e", _vocab=VOCAB), p),  # type: ignore[arg-type]
        lambda p: VLLMInferEngine.check_sampling(SimpleNamespace(name="e", _vocab=VOCAB), p),  # type: ignore[arg-type]
        lambda p: SGLangInferEngine.check_sampling(SimpleNamespace(name="e", _vocab=VOCAB), p),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError, match=match) as info:
            check(params)
        messages.append(str(info.value))
    assert messages[0].startswith("e engine: ") and messages == [messages[0]] * 3
    with pytest.raises(ValueError, match=match):  # SGLang's submit and generate check before anything is queued
        _sglang().submit(Request("mine", [1, 2], params))
    ok = SamplingParams(stop=("</s>",), stop_token_ids=(0, VOCAB - 1))
    for engine in (SimpleNamespace(name="e", _vocab=VOCAB), None):  # None: no vocabulary known yet
        VLLMInferEngine.check_sampling(engine, ok)  # type: ignore[arg-type]
        SGLangInferEngine.check_sampling(engine, ok)  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "match"), BAD, ids=IDS)
def test_vllm_refuses_them_before_any_row_is_queued(
    vllm_engine: VLLMInferEngine, changes: dict[str, Any], match: str
) -> None:
    """vLLM's generate queued rows 0.. and the refusal came as a row failure from the driver thread (an empty stop
    string) or from vLLM's add_request (an id past the vocabulary); through the stand-in nothing refused at all.
    Now `generate` and `submit` raise before anything reaches the engine."""
    params = SamplingParams(max_new_tokens=4).replace(**changes)
    with pytest.raises(ValueError, match=match):
        vllm_engine.generate([[1, 2], [3, 4]], params, n=2)
    with pytest.raises(ValueError, match=match):
        vllm_engine.submit(Request("mine", [1, 2], params))
    assert vllm_engine.engine.added == [] and vllm_engine._jobs.empty()
    out = vllm_engine.generate([[1, 2]], SamplingParams(max_new_tokens=4, stop=("</s>",), stop_token_ids=(99,)))
    assert out.finish_reasons == ["length"] and len(vllm_engine.engine.added) == 1


@pytest.mark.parametrize("vllm_engine", [3], indirect=True)
def test_vllm_generate_names_the_prompt_and_row_vllm_failed(vllm_engine: VLLMInferEngine) -> None:
    """A row vLLM ends with finish_reason "error" failed `generate` with "vllm request 'generate-<hex>': ...", an id
    its caller never saw. Row 3 (the second sample of prompt 1) now fails naming prompt 1 and row 3, the same type
    (a RuntimeError), the internal error chained as its cause; the request API still names the caller's id."""
    with pytest.raises(RuntimeError) as info:
        vllm_engine.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=4), n=2)
    assert str(info.value) == (
        "vllm engine: prompt 1 (row 3): vLLM ended it with finish_reason 'error' after 1 token(s) (vLLM's log names "
        "the cause)"
    )
    from roll_engines.infer._rows import RequestFailed

    assert "generate-" not in str(info.value) and isinstance(info.value, RequestFailed)
    assert "generate-" in str(info.value.__cause__)
    vllm_engine.engine.fail_at = len(vllm_engine.engine.added)  # the next request added
    fut = vllm_engine.submit(Request("mine", [1, 2], SamplingParams(max_new_tokens=4)))
    with pytest.raises(RuntimeError, match=r"^vllm request 'mine': vLLM ended it with finish_reason 'error'") as err:
        fut.result(timeout=60)
    again = pickle.loads(pickle.dumps(err.value))  # a Ray actor's error crosses to its caller pickled
    assert (type(again), str(again), again.request_id) == (RequestFailed, str(err.value), "mine")


def test_vllm_generate_names_the_prompt_whose_pictures_a_text_model_refuses(vllm_engine: VLLMInferEngine) -> None:
    """Pictures sent to a text model were refused naming the row's internal id ("request 'generate-<hex>'")."""
    mm = SimpleNamespace(num_images=1)
    with pytest.raises(ValueError, match=r"^vllm engine: prompt 1 carries 1 picture\(s\) but stand-in is not"):
        vllm_engine.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=4), mm=[None, mm])
    assert vllm_engine.engine.added == []


def test_sglang_generate_names_the_prompt_and_row_of_a_result_without_logprobs() -> None:
    """SGLang's result without log-probs failed `generate` naming "request generate-<hex>"; it names the prompt and
    row now (a ValueError, as before), and `to_request_output` still names the caller's id."""
    engine = _sglang()
    engine.defaults, engine._stopped = SamplingParams(max_new_tokens=4), False
    bare = {"output_ids": [7], "meta_info": {"finish_reason": {"type": "stop"}}}

    def submit(request: Request) -> Any:
        from concurrent.futures import Future

        fut: Future = Future()
        try:
            fut.set_result(to_request_output(request, bare, 0))
        except ValueError as exc:
            fut.set_exception(exc)
        return fut

    engine.submit = submit  # type: ignore[method-assign]
    engine._control = lambda fn: fn()  # type: ignore[method-assign]
    engine._abort_now = lambda request_id: False  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"^sglang engine: prompt 0 \(row 0\): SGLang returned 1 generated tokens"):
        engine.generate([[1, 2]], n=2)
    with pytest.raises(ValueError, match=r"^sglang request 'mine': SGLang returned 1 generated tokens"):
        to_request_output(Request("mine", [1, 2], SamplingParams()), bare, 0)


def test_sglang_fails_a_result_without_logprobs_whatever_its_request_id_says() -> None:
    """`_complete` read any ValueError whose message said "context" or "too long" as SGLang's prompt refusal: a
    request named "context-7" whose result lacked log-probs resolved as an empty "prompt_too_long" output."""
    import asyncio
    from concurrent.futures import Future

    async def bare() -> dict[str, Any]:
        return {"output_ids": [7], "meta_info": {"finish_reason": {"type": "stop"}}}

    engine = _sglang()
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(bare())
        loop.run_until_complete(task)
    finally:
        loop.close()
    fut: Future = Future()
    engine._tasks, engine._rids = {task: (Request("context-7", [1, 2], SamplingParams()), fut, "rid", 0)}, {}
    engine._complete(task)
    with pytest.raises(ValueError, match=r"^sglang request 'context-7': SGLang returned 1 generated tokens without"):
        fut.result(timeout=0)
