"""The `sglang` engine maps roll's engine-neutral knobs to SGLang's own names (runs on CPU: SGLang is faked).

`infer_engine.max_num_seqs` is SGLang's `max_running_requests`, `max_model_len` its `context_length`; a null
`mem_fraction_static` (a config built outside a run, which would resolve it by placement) is SGLang's usual 0.8.
The adapter's request bookkeeping (a running id refused to a second request) runs against the fake too.
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import sys
import types
from typing import Any, ClassVar

import pytest


class _FakeEngine:
    """Records the keyword arguments SGLang's `Engine` would get; enough of it for the adapter to start/stop."""

    last: ClassVar[dict[str, Any]] = {}

    def __init__(self, **kwargs: Any) -> None:
        type(self).last = kwargs
        self.loop = asyncio.new_event_loop()
        self.aborted: set[str] = set()
        # As SGLang's TokenizerManager: a request is in `rid_to_state` once its task has run, and an abort for a rid
        # not there is dropped without a word.
        self.tokenizer_manager = types.SimpleNamespace(rid_to_state={}, abort_request=self._abort_request)

    def _abort_request(self, rid: str) -> None:
        if rid in self.tokenizer_manager.rid_to_state:
            self.aborted.add(rid)

    async def async_generate(self, input_ids: Any, sampling_params: Any, return_logprob: bool, rid: str) -> Any:
        """Runs until aborted, then answers as SGLang does for an aborted request with nothing generated; the
        prompt [666] fails at once (SGLang raising for a request, a row of a batch failing)."""
        if list(input_ids) == [666]:
            raise RuntimeError("row failed in SGLang")
        self.tokenizer_manager.rid_to_state[rid] = "state"
        while rid not in self.aborted:
            await asyncio.sleep(0.005)
        return {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}

    def shutdown(self) -> None:
        self.loop.close()

    def update_weights_from_tensor(self, named_tensors: Any, flush_cache: bool) -> tuple[bool, str]:
        return (False, "shape mismatch for model.norm.weight") if named_tensors[0][0] == "bad" else (True, "")

    def flush_cache(self) -> None:
        pass


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch) -> type[_FakeEngine]:
    module = types.ModuleType("sglang")
    module.__spec__ = importlib.machinery.ModuleSpec("sglang", None)  # found by the installed-extra check
    module.__version__ = "0.5.10"
    module.Engine = _FakeEngine
    monkeypatch.setitem(sys.modules, "sglang", module)
    return _FakeEngine


def _build(**kwargs: Any) -> dict[str, Any]:
    from roll_core.models import resolve_model_path
    from roll_engines.infer.sglang import SGLangInferEngine

    engine = SGLangInferEngine(resolve_model_path("builtin:tiny"), device="cuda", **kwargs)
    try:
        return dict(_FakeEngine.last)
    finally:
        engine.shutdown()


def test_max_num_seqs_is_max_running_requests(fake_sglang) -> None:
    sent = _build(max_num_seqs=48, max_model_len=200, mem_fraction_static=0.5)
    assert sent["max_running_requests"] == 48
    assert sent["context_length"] == 200
    assert sent["mem_fraction_static"] == 0.5
    assert "max_num_seqs" not in sent and "max_model_len" not in sent


def test_null_knobs_leave_sglang_its_defaults(fake_sglang) -> None:
    sent = _build(max_num_seqs=None, mem_fraction_static=None)
    assert "max_running_requests" not in sent  # SGLang sizes its running batch from memory
    assert sent["mem_fraction_static"] == 0.8


def test_config_keys_reach_the_constructor(fake_sglang) -> None:
    """Every key of the sglang schema that is not a worker key is a constructor argument (no silent **unused)."""
    import dataclasses
    import inspect

    from roll_core.cluster.roles import WORKER_KEYS
    from roll_engines.config import SGLangInferEngineConfig
    from roll_engines.infer.sglang import SGLangInferEngine

    params = set(inspect.signature(SGLangInferEngine).parameters)
    keys = {f.name for f in dataclasses.fields(SGLangInferEngineConfig) if not f.name.startswith("_")}
    keys -= set(WORKER_KEYS)
    assert keys <= params, f"sglang schema keys the constructor only swallows: {sorted(keys - params)}"


def test_deterministic_makes_seeds_count(fake_sglang) -> None:
    assert _build(deterministic=True)["enable_deterministic_inference"] is True
    assert "enable_deterministic_inference" not in _build()


def test_a_refused_weight_update_raises(fake_sglang) -> None:
    """SGLang answers (False, message) instead of raising: the adapter must not take that as success."""
    import torch

    from roll_core.models import resolve_model_path
    from roll_engines.infer.sglang import SGLangInferEngine

    engine = SGLangInferEngine(resolve_model_path("builtin:tiny"), device="cuda")
    try:
        assert engine.update_weights([("good", torch.ones(2))]) == 8
        with pytest.raises(RuntimeError, match="shape mismatch"):
            engine.update_weights([("bad", torch.ones(2))])
    finally:
        engine.shutdown()


def test_a_worker_on_another_gpu_starts_sglang_there(fake_sglang) -> None:
    """SGLang counts from base_gpu_id (0) whatever device is current: a worker on cuda:3 (every GPU visible under
    Ray's NOSET switch) loaded onto GPU 0. The device now decides; a base_gpu_id naming another GPU is refused."""
    from roll_core.models import resolve_model_path
    from roll_engines.infer.sglang import SGLangInferEngine

    path = resolve_model_path("builtin:tiny")
    for device, base, expected in (("cuda", 0, 0), ("cuda:0", 0, 0), ("cuda:3", 0, 3), ("cuda:3", 3, 3)):
        engine = SGLangInferEngine(path, device=device, base_gpu_id=base)
        engine.shutdown()
        assert _FakeEngine.last["base_gpu_id"] == expected, (device, base)
    with pytest.raises(ValueError, match=r"base_gpu_id=1 but this worker's device is cuda:3"):
        SGLangInferEngine(path, device="cuda:3", base_gpu_id=1)


def test_a_running_request_id_is_refused_and_the_first_stays_abortable(fake_sglang) -> None:
    """A second request under a running request's id replaced its SGLang rid: abort reached only the second, and
    the first to finish dropped the entry, leaving the other unabortable. The second is refused (as hf and vllm
    refuse it); the first aborts; the id is free again once its request resolved."""
    from roll_core.interfaces import Request, SamplingParams
    from roll_core.models import resolve_model_path
    from roll_engines.infer.sglang import SGLangInferEngine

    engine = SGLangInferEngine(resolve_model_path("builtin:tiny"), device="cuda")
    try:
        params = SamplingParams(max_new_tokens=8)
        first = engine.submit(Request("dup", [5, 6, 7], params))
        second = engine.submit(Request("dup", [5, 6], params))
        with pytest.raises(ValueError, match=r"sglang: request id 'dup' is already running"):
            second.result(timeout=60)
        assert engine.abort("dup") is True
        out = first.result(timeout=60)
        assert out.finish_reason == "abort" and out.prompt_ids == [5, 6, 7]
        again = engine.submit(Request("dup", [5, 6], params))
        assert engine.abort("dup") is True
        assert again.result(timeout=60).prompt_ids == [5, 6]
    finally:
        engine.shutdown()


def test_shutdown_fails_running_and_queued_requests_and_later_calls_return_at_once(fake_sglang) -> None:
    """shutdown stopped the driver and left every request it had not resolved (running in SGLang, or queued behind a
    control call) unresolved, and `abort` or a control call after it waited for ever on a job no driver would take.
    Now each such request fails naming the shutdown, `abort` answers False at once, and the rest raise at once."""
    import threading
    import time

    from roll_core.interfaces import Request, SamplingParams
    from roll_core.models import resolve_model_path
    from roll_engines.infer.sglang import SGLangInferEngine

    engine = SGLangInferEngine(resolve_model_path("builtin:tiny"), device="cuda")
    params = SamplingParams(max_new_tokens=8)
    running = engine.submit(Request("running", [5, 6, 7], params))
    deadline = time.monotonic() + 60
    while "running" not in engine._rids:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.005)
    held, release = threading.Event(), threading.Event()
    # A control call holds the driver (a weight update, say): the next request waits in the queue behind it.
    threading.Thread(target=engine._control, args=(lambda: held.set() or release.wait(),), daemon=True).start()
    assert held.wait(60)  # the driver runs it: it was queued before the request below
    queued = engine.submit(Request("queued", [5, 6], params))
    stopping = threading.Thread(target=engine.shutdown, daemon=True)
    stopping.start()
    while not engine._stopped:
        time.sleep(0.005)
    release.set()
    stopping.join(timeout=30)
    assert not stopping.is_alive()
    for fut in (running, queued):
        with pytest.raises(RuntimeError, match="sglang engine shut down"):
            fut.result(timeout=60)

    def at_once(fn: Any) -> Any:
        """fn() run where a hang cannot block the test: its result, or the exception it raised, within 30 s."""
        box: list[Any] = []

        def run() -> None:
            try:
                box.append(fn())
            except Exception as exc:
                box.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout=30)  # a hang is for ever: 30 s tells it from a slow return on a loaded machine
        assert box, f"{fn} waited for ever after shutdown"
        return box[0]

    assert at_once(lambda: engine.abort("running")) is False
    for call in (engine.begin_weight_update, lambda: engine.submit(Request("late", [5], params))):
        exc = at_once(call)
        assert isinstance(exc, RuntimeError) and "sglang engine shut down" in str(exc), exc


def test_a_failed_row_aborts_the_batchs_other_rows(fake_sglang) -> None:
    """generate raised the first failed row's error and left the batch's other rows running in SGLang for nobody
    (nothing aborted them). Now they are aborted before the error is raised, as the hf and vllm engines do."""
    import time

    from roll_core.interfaces import SamplingParams
    from roll_core.models import resolve_model_path
    from roll_engines.infer.sglang import SGLangInferEngine

    engine = SGLangInferEngine(resolve_model_path("builtin:tiny"), device="cuda")
    try:
        with pytest.raises(RuntimeError, match="row failed in SGLang"):
            engine.generate([[666], [5, 6], [7, 8, 9]], SamplingParams(max_new_tokens=8), n=2)
        deadline = time.monotonic() + 60
        while engine._tasks:  # the four healthy rows end once aborted (the fake runs until then)
            assert time.monotonic() < deadline, f"{len(engine._tasks)} rows still running in SGLang after the error"
            time.sleep(0.01)
        assert len(engine.engine.aborted) == 4 and not engine._rids
    finally:
        engine.shutdown()


def test_an_abort_before_sglang_registered_the_request_is_not_lost(fake_sglang) -> None:
    """SGLang drops an abort for a rid its tokenizer manager has not registered yet. A request submitted while the
    loop was idle (here: a weight sync pausing it) and aborted before it ran was not aborted: it ran to its end (the
    fake: for ever). The abort is now sent again once SGLang has registered the request."""
    from roll_core.interfaces import Request, SamplingParams
    from roll_core.models import resolve_model_path
    from roll_engines.infer.sglang import SGLangInferEngine

    engine = SGLangInferEngine(resolve_model_path("builtin:tiny"), device="cuda")
    try:
        engine.begin_weight_update()  # the driver stops running SGLang's loop
        fut = engine.submit(Request("early", [5, 6, 7], SamplingParams(max_new_tokens=8)))
        assert engine.abort("early") is True
        engine.finish_weight_update()
        out = fut.result(timeout=60)
        assert out.finish_reason == "abort" and out.token_ids == [] and not engine._unsent_aborts
    finally:
        engine.shutdown()
