"""The vllm engine releases vLLM when it is dropped without `shutdown()`, without vLLM: a stand-in `vllm` module
(an `LLM` whose engine client is named `InprocClient`, an in-process core with a `UniProcExecutor`) behind the real
VLLMInferEngine.__init__, driver thread and shutdown. Its driver thread held the engine (a bound method as the
thread's target): a dropped engine was never collected, its vLLM (in-process: the process-wide parallel groups)
stayed up, and the next engine of the process shared them. The real vLLM-CPU run is test_vllm_dropped.py."""

from __future__ import annotations

import functools
import gc
import importlib.machinery
import logging
import subprocess
import sys
import textwrap
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core.interfaces import Request, SamplingParams

#: Every stand-in client's shutdown, in order (the client objects).
SHUTDOWNS: list[Any] = []
SHARED = "VLLM_ENABLE_V1_MULTIPROCESSING=1"  # in the warning about two live in-process engines


class UniProcExecutor:
    pass


class InprocClient:
    """Named as vLLM's in-process engine client: roll reads the layout from the class names."""

    def __init__(self) -> None:
        self.engine_core = types.SimpleNamespace(model_executor=UniProcExecutor())

    def shutdown(self, timeout: float | None = None) -> None:
        SHUTDOWNS.append(self)


class _LLMEngine:
    def __init__(self) -> None:
        self.engine_core = InprocClient()
        self.model_config = types.SimpleNamespace(
            max_model_len=64, get_vocab_size=lambda: 100, dtype=torch.float32, is_multimodal_model=False
        )
        self.vllm_config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=1))

    def step(self) -> list:
        return []


class LLM:
    def __init__(self, **kwargs: Any) -> None:
        self.llm_engine = _LLMEngine()

    def get_tokenizer(self) -> Any:
        return types.SimpleNamespace(pad_token_id=0, eos_token_id=1)

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list:
        return [{}]  # roll_weight_dtypes: nothing kept wider than the dtype


def install_fake_vllm() -> None:
    """Put the stand-in `vllm` (and `vllm.sampling_params`) in sys.modules."""
    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)  # found by roll_engines.config.VLLM.require
    vllm.LLM = LLM
    vllm.SamplingParams = object
    params = types.ModuleType("vllm.sampling_params")
    params.RequestOutputKind = types.SimpleNamespace(DELTA="delta")
    vllm.sampling_params = params
    sys.modules["vllm"], sys.modules["vllm.sampling_params"] = vllm, params


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "OMP_NUM_THREADS",
        "VLLM_CPU_OMP_THREADS_BIND",
        "TOKENIZERS_PARALLELISM",
    ):
        monkeypatch.delenv(name, raising=False)  # cpu_env sets them: restored after the test
    monkeypatch.setitem(sys.modules, "vllm", None)  # the real one, where imported, comes back after the test
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", None)
    install_fake_vllm()
    SHUTDOWNS.clear()


def build(path: str, name: str) -> Any:
    from roll_engines.infer.vllm import VLLMInferEngine

    return VLLMInferEngine(path, name=name, kv_cache_gb=1, num_threads=1)


def works(engine: Any) -> bool:
    """A control call through the driver thread (abort of no request) answers."""
    return engine.abort("nothing-runs") is False


def test_a_dropped_engine_shuts_vllm_down_before_the_next_one_builds(
    fake_vllm: None, tiny: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A dropped engine (no shutdown, no gc call) is released by the time the next engine has built: its client
    shut down once, the engine collected, its driver thread ended; the next engine does not warn about sharing
    the groups with it, runs, and its own shutdown shuts its own client down once."""
    with caplog.at_level(logging.WARNING, logger="roll_engines.infer.vllm"):
        first = build(tiny, "vllm-a")
        assert works(first)
        client, driver, ref = first.engine.engine_core, first._driver, weakref.ref(first)
        del first
        second = build(tiny, "vllm-b")
    try:
        assert SHUTDOWNS == [client], "the dropped engine's vLLM was not shut down (once) before the next built"
        assert ref() is None, "the dropped engine was never collected"
        driver.join(timeout=60)
        assert not driver.is_alive(), "the dropped engine's driver thread kept running"
        assert not [r for r in caplog.records if SHARED in r.getMessage()], "warned about a dropped engine"
        assert works(second)
        assert second._groups_lost is None
    finally:
        own = second.engine.engine_core
        second.shutdown()
    assert SHUTDOWNS == [client, own]


def test_a_dropped_engine_in_a_reference_cycle_is_collected_by_the_next_engine(fake_vllm: None, tiny: str) -> None:
    """Dropped in a reference cycle (refcounting never frees it), the engine is collected as the next one builds,
    not later under it (then its shutdown tore the groups down under the new engine)."""
    first = build(tiny, "vllm-a")
    first.me = first
    client, ref = first.engine.engine_core, weakref.ref(first)
    del first
    assert ref() is not None and SHUTDOWNS == []  # only a collection frees it
    second = build(tiny, "vllm-b")
    try:
        assert ref() is None and SHUTDOWNS == [client]
        assert works(second)
    finally:
        second.shutdown()


def test_shutdown_then_collection_shuts_down_once(fake_vllm: None, tiny: str) -> None:
    engine = build(tiny, "vllm-a")
    client, finalizer = engine.engine.engine_core, engine._vllm_finalizer
    engine.shutdown()
    engine.shutdown()
    assert SHUTDOWNS == [client] and not finalizer.alive
    del engine
    gc.collect()
    assert SHUTDOWNS == [client]


def test_a_dropped_engine_marks_the_live_one_that_shared_its_groups(
    fake_vllm: None, tiny: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two live in-process engines warn; when one is dropped and collected its release tears the groups down, and
    the survivor refuses requests naming the cause, as after an explicit shutdown."""
    with caplog.at_level(logging.WARNING, logger="roll_engines.infer.vllm"):
        first = build(tiny, "vllm-a")
        second = build(tiny, "vllm-b")
    try:
        assert len([r for r in caplog.records if SHARED in r.getMessage()]) == 1
        ref = weakref.ref(first)
        del first
        assert ref() is None and len(SHUTDOWNS) == 1
        with pytest.raises(RuntimeError, match=r"torn down.*\(vllm-a\) shut down"):
            second.submit(Request("r", [5, 6], SamplingParams(temperature=0, max_new_tokens=2)))
    finally:
        second.shutdown()


def test_requests_held_by_a_dropped_engine_fail(fake_vllm: None, tiny: str) -> None:
    """Requests a dropped engine still held (submitted during a sync that never finished: deferred) fail with an
    error saying so, never leave their callers waiting."""
    engine = build(tiny, "vllm-a")
    engine._control(functools.partial(setattr, engine, "_paused", True))  # as begin_weight_update does
    held = engine.submit(Request("r", [5, 6], SamplingParams(temperature=0, max_new_tokens=2)))
    engine._control(int)  # after the request's job: it is deferred now
    assert not held.done()
    driver = engine._driver
    del engine
    error = held.exception(timeout=60)
    assert isinstance(error, RuntimeError) and "vllm-a engine was dropped without shutdown()" in str(error)
    driver.join(timeout=60)
    assert not driver.is_alive() and len(SHUTDOWNS) == 1


def test_an_engine_alive_at_interpreter_exit_exits_cleanly(tiny: str) -> None:
    """An engine still referenced at exit: the interpreter exits 0 with nothing printed about it (roll's finalizer
    does not run at exit; vLLM's own shut its client down then)."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_vllm_release as t
        t.install_fake_vllm()
        engine = t.build({tiny!r}, "vllm-exit")
        assert t.works(engine)
        print("built", flush=True)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("built")
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert "dropped without shutdown" not in done.stderr, done.stderr


def test_a_finalizer_run_on_a_thread_holding_the_registry_lock_does_not_hang() -> None:
    """A dropped engine's finalizer runs inside the cyclic garbage collector, on whichever thread an allocation
    triggered it: one inside `with _LOCK:` (join, collect_dropped, another engine's release) hung for good on the
    plain lock it takes again. Here the finalizer runs on a thread that holds the lock."""
    import threading

    from roll_engines.infer import _vllm_inproc as inproc

    client = InprocClient()
    client.shutdown = lambda: SHUTDOWNS.append(client)  # type: ignore[attr-defined]
    release = inproc.Release.__new__(inproc.Release)
    release.__dict__.update(
        name="vllm-gc", client=client, inproc=True, uses_groups=True, owner=lambda: None, turn=threading.Lock(),
        jobs=None, pending=None, deferred=None, adapters=None, shutdowns=0,
    )  # fmt: skip
    inproc._LIVE.add(release)
    done = threading.Event()

    def collect_while_holding_the_lock() -> None:
        with inproc._LOCK:
            inproc._collected(release)
        done.set()

    threading.Thread(target=collect_while_holding_the_lock, daemon=True).start()
    assert done.wait(60), "the finalizer hung on the registry lock its own thread held"
    assert release.shutdowns == 1 and release not in inproc._LIVE and release.client is None
