"""The asynchronous collectors' bounds as pipeline config keys: `pipeline.async_batch_timeout_s` (how long the trainer
waits for a batch) and `pipeline.async_abort_timeout_s` (how long an aborted request may take to bring its result)
reach RLVR's `AsyncRollout` and agentic's `TurnGate` / batch wait; a value that is not a positive finite number is a
config error naming the key, and a misspelled key is still one. The collectors are built around these settings
only: their base classes' data, tasks and engines are stand-ins."""

from __future__ import annotations

import types
from typing import Any

import pytest

from roll_core.config.compose import load_config
from roll_core.errors import ConfigError
from roll_core.interfaces import SamplingParams
from roll_core.pipelines.collectors import episodes, episodes_async, prompts, prompts_async

KEYS = ["pipeline.async_ratio=1", "pipeline.async_batch_timeout_s=120", "pipeline.async_abort_timeout_s=7.5"]


def test_defaults() -> None:
    p = load_config([]).pipeline
    assert (p.async_batch_timeout_s, p.async_abort_timeout_s) == (3600.0, 60.0)


def test_the_keys_reach_the_rlvr_async_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(KEYS)
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
    assert built == {"timeout_s": 120.0, "abort_timeout_s": 7.5}


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
    finally:
        c._pool.shutdown(wait=True)


@pytest.mark.parametrize("key", ["pipeline.async_batch_timeout_s", "pipeline.async_abort_timeout_s"])
@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_bound_must_be_a_positive_number(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}=\S+ must be (a finite number )?> 0"):
        load_config([f"{key}={value}"])


def test_a_misspelled_key_is_still_an_error() -> None:
    with pytest.raises(ConfigError, match=r"(?s)async_abort_timeout.*Did you mean 'pipeline.async_abort_timeout_s'"):
        load_config(["pipeline.async_abort_timeout=5"])
