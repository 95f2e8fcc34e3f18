"""The asynchronous collectors' bounds as pipeline config keys: `pipeline.async_batch_timeout_s` (how long the trainer
waits for a batch), `pipeline.async_abort_timeout_s` (how long an aborted request may take to bring its result),
`pipeline.max_idle_aborts` (the engine's own aborts of a sample in a row, none with a token, before RLVR's driver
fails it as refused; its other callers' tests: test_rlvr_aborts.py, test_eval_rows.py, test_agentic_rollout.py,
test_agent_abort_timeout.py) and `pipeline.agentic_sync_wait_s` (how long an agentic sync without partial rollout
waits for the running turns) reach RLVR's `AsyncRollout` and agentic's `TurnGate` / batch wait; a value out of range
is a config error naming the key, and a misspelled key is still one. The collectors are built around these settings
only: their base classes' data, tasks and engines are stand-ins; the driver and the gate built from the keys are
the real ones, over a scripted request engine (roll_core.testing.held_requests)."""

from __future__ import annotations

import collections
import time
import types
from collections.abc import Callable
from typing import Any

import pytest

from roll_core.agentic.turn_gate import SYNC_WAIT_S
from roll_core.config.compose import load_config
from roll_core.errors import ConfigError
from roll_core.idle_aborts import MAX_IDLE_ABORTS
from roll_core.interfaces import Request, SamplingParams
from roll_core.pipelines.collectors import episodes, episodes_async, prompts, prompts_async
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.scheduler import RolloutScheduler
from roll_core.testing.held_requests import HeldRequestEngine

KEYS = [
    "pipeline.async_ratio=1",
    "pipeline.async_batch_timeout_s=120",
    "pipeline.async_abort_timeout_s=7.5",
    "pipeline.max_idle_aborts=3",
    "pipeline.agentic_sync_wait_s=45",
]


def test_defaults() -> None:
    p = load_config([]).pipeline
    assert (p.async_batch_timeout_s, p.async_abort_timeout_s) == (3600.0, 60.0)
    # the schema's defaults are the modules' own (one rule for every caller of idle_aborts)
    assert (p.max_idle_aborts, p.agentic_sync_wait_s) == (MAX_IDLE_ABORTS, SYNC_WAIT_S) == (8, 600.0)


def _driver_kwargs(monkeypatch: pytest.MonkeyPatch, overrides: list[str]) -> dict[str, Any]:
    """The keyword arguments the RLVR async collector built from `overrides` gives its `AsyncRollout`."""
    cfg = load_config(overrides)
    built: dict[str, Any] = {}

    def base_init(self: Any, ctx: Any) -> None:  # PromptCollector's: data, reward roles
        self.cfg, self.ctx, self.infer, self.tokenizer = ctx.cfg, ctx, ctx.infer, None
        self.sampling, self.sampler, self.train_set, self.processor = SamplingParams(), object(), [], None

    class Driver:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.update(kwargs)

    monkeypatch.setattr(prompts.PromptCollector, "__init__", base_init)
    monkeypatch.setattr(prompts_async, "check_async", lambda ctx: None)
    monkeypatch.setattr(prompts_async, "AsyncRollout", Driver)
    prompts_async.AsyncPromptCollector(types.SimpleNamespace(cfg=cfg, infer=object()))
    return built


def test_the_keys_reach_the_rlvr_async_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    built = _driver_kwargs(monkeypatch, KEYS)
    assert built == {"timeout_s": 120.0, "abort_timeout_s": 7.5, "max_idle_aborts": 3}


def _pauses(n: int) -> Callable[[Request], bool]:
    """A `preempt`: the engine aborts the first `n` requests of each prompt itself at once, without a token (an
    engine that pauses its requests that often), then holds the next one until served."""
    seen: collections.Counter[int] = collections.Counter()

    def preempt(request: Request) -> bool:
        seen[request.prompt_ids[0]] += 1
        return seen[request.prompt_ids[0]] <= n

    return preempt


@pytest.mark.parametrize(("overrides", "served"), [([], False), (["pipeline.max_idle_aborts=11"], True)])
def test_max_idle_aborts_decides_when_an_engine_that_keeps_pausing_refuses(
    monkeypatch: pytest.MonkeyPatch, overrides: list[str], served: bool
) -> None:
    """An engine aborts each sample 10 times in a row without a token before it generates. With the default (8)
    the rollout fails at the 8th, naming the key that allows more; with `pipeline.max_idle_aborts=11` (it was no
    key: the driver's 8 was fixed) the sample resumes each time and its group is trained."""
    kwargs = _driver_kwargs(monkeypatch, ["pipeline.async_ratio=1", *overrides])
    engine = HeldRequestEngine(abort_tokens=[], serve_tokens=[8], preempt=_pauses(10))
    sched = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=0)
    prompts_ = iter(range(10**6))
    kwargs["timeout_s"] = 10.0
    driver = AsyncRollout(engine, sched, lambda: ("p", [next(prompts_)]), SamplingParams(max_new_tokens=4), **kwargs)
    try:
        if served:
            driver.start()
            engine.wait_running(1)  # the 11th request of prompt [0]: held
            engine.serve()
            [group] = driver.take(1)
            assert group.samples[0].tokens == [8] and sum(r.prompt_ids[0] == 0 for r in engine.requests) == 11
        else:
            with pytest.raises(RuntimeError, match=r"8 times in a row .*raise pipeline[.]max_idle_aborts, now 8"):
                driver.take(1)
            assert len(engine.requests) == 8
    finally:
        driver.close()
        engine.release()


def test_the_keys_reach_the_agentic_gate_and_batch_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config([*KEYS, "pipeline=agentic", "pipeline.partial_rollout=true"])

    def base_init(self: Any, ctx: Any, gate: Any = None) -> None:  # EpisodeCollector's: task, environments
        self.cfg, self.eval_seeds = ctx.cfg, []
        self.rollout, self.envs = types.SimpleNamespace(gate=gate), types.SimpleNamespace(grow=lambda n: None)

    monkeypatch.setattr(episodes.EpisodeCollector, "__init__", base_init)
    monkeypatch.setattr(episodes_async, "check_async", lambda ctx: None)
    c = episodes_async.AsyncEpisodeCollector(types.SimpleNamespace(cfg=cfg, infer=object()))
    try:
        assert (c.timeout_s, c.gate.abort_timeout_s, c.gate.partial_rollout) == (120.0, 7.5, True)
        assert c.gate.sync_wait_s == 45.0
    finally:
        c._pool.shutdown(wait=True)


def test_agentic_sync_wait_bounds_a_sync_and_its_error_names_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without partial rollout a sync lets the running turns finish: for at most `pipeline.agentic_sync_wait_s`
    (it was a fixed 600 s), then the error names the turns and the key to raise."""
    cfg = load_config(["pipeline=agentic", "pipeline.async_ratio=1", "pipeline.agentic_sync_wait_s=0.3"])

    def base_init(self: Any, ctx: Any, gate: Any = None) -> None:  # EpisodeCollector's: task, environments
        self.cfg, self.eval_seeds = ctx.cfg, []
        self.rollout, self.envs = types.SimpleNamespace(gate=gate), types.SimpleNamespace(grow=lambda n: None)

    monkeypatch.setattr(episodes.EpisodeCollector, "__init__", base_init)
    monkeypatch.setattr(episodes_async, "check_async", lambda ctx: None)
    engine = HeldRequestEngine(abort_tokens=[], serve_tokens=[8])
    c = episodes_async.AsyncEpisodeCollector(types.SimpleNamespace(cfg=cfg, infer=engine))
    try:
        c.gate.enter("ep0-turn-1")  # a turn running, never finishing
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as err:
            c.gate.begin_update()
        assert 0.3 <= time.monotonic() - t0 < 2.0
        assert "1 turn request(s) still running 0.3s" in str(err.value) and "ep0-turn-1" in str(err.value)
        assert "raise pipeline.agentic_sync_wait_s" in str(err.value) and not engine.aborts  # waited, not aborted
    finally:
        c._pool.shutdown(wait=True)


@pytest.mark.parametrize(
    "key", ["pipeline.async_batch_timeout_s", "pipeline.async_abort_timeout_s", "pipeline.agentic_sync_wait_s"]
)
@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_bound_must_be_a_positive_number(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}=\S+ must be (a finite number )?> 0"):
        load_config([f"{key}={value}"])


@pytest.mark.parametrize(
    ("value", "error"),
    [("0", "=0 must be >= 1"), ("-2", "=-2 must be >= 1"), ("2.5", "could not be converted to Integer")],
)
def test_max_idle_aborts_must_be_an_integer_of_at_least_one(value: str, error: str) -> None:
    with pytest.raises(ConfigError, match=rf"(?s)pipeline[.]max_idle_aborts.*{error}"):
        load_config([f"pipeline.max_idle_aborts={value}"])


def test_a_misspelled_key_is_still_an_error() -> None:
    with pytest.raises(ConfigError, match=r"(?s)async_abort_timeout.*Did you mean 'pipeline.async_abort_timeout_s'"):
        load_config(["pipeline.async_abort_timeout=5"])


def test_the_driver_and_the_gate_refuse_bad_bounds_given_directly() -> None:
    """Built without a config (tests, plugins), the classes check the bounds themselves."""
    from roll_core.agentic.turn_gate import TurnGate

    sched = RolloutScheduler(batch_groups=1, group_size=1, max_new_tokens=4, async_ratio=0)
    bad: Any
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"max_idle_aborts={bad!r} must be an integer >= 1"):
            AsyncRollout(object(), sched, lambda: ("p", [0]), SamplingParams(), max_idle_aborts=bad)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"sync_wait_s=.* must be a finite number > 0"):
            TurnGate(object(), partial_rollout=False, sync_wait_s=bad)


def test_every_idle_abort_caller_refuses_a_bad_max_idle_aborts_given_directly() -> None:
    """Built without a config, the sync collector's resumes, the agentic rollout and the agent sessions check
    `max_idle_aborts` as the driver does; the longest wait before a refusal follows the value."""
    from roll_core.agentic.agent_sessions import AgentSessions
    from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
    from roll_core.idle_aborts import IDLE_BACKOFF_MAX_S, idle_backoff_total_s
    from roll_core.protocol import Batch

    gen = Batch(fields={"finish_reason": ["stop"]})
    bad: Any
    for bad in (0, 2.5, True):
        match = rf"max_idle_aborts={bad!r} must be an integer >= 1 .*pipeline[.]max_idle_aborts"
        with pytest.raises(ValueError, match=match):
            prompts.resume_aborted(object(), gen, gen, SamplingParams(), 1, 0, max_idle_aborts=bad)
        with pytest.raises(ValueError, match=match):
            AgenticRollout(object(), object(), object(), object(), EpisodeLimits(), max_idle_aborts=bad)
        with pytest.raises(ValueError, match=match):
            AgentSessions(object(), object(), str, str, max_idle_aborts=bad)
    assert idle_backoff_total_s() == idle_backoff_total_s(MAX_IDLE_ABORTS)
    assert idle_backoff_total_s(1) == 0.0 and idle_backoff_total_s(3) == pytest.approx(0.05 + 0.1)
    # pipeline.max_idle_aborts=20: the doubling waits up to IDLE_BACKOFF_MAX_S, then that wait per further try
    assert idle_backoff_total_s(20) == pytest.approx(0.05 + 0.1 + 0.2 + 0.4 + 0.8 + 14 * IDLE_BACKOFF_MAX_S)
