"""The asynchronous prompts collector's `async/version` is the run's weight version, also after a resume.

The scheduler counts versions from 0 in every process; its admission budget and staleness bound are in that count
(a batch's staleness is the scheduler's version minus its rows' `behaviour_version`, both of this process), so a
resume does not move them. `async/version` read the scheduler's count: 3 before a resume at version 3, 0 after it,
and `finish_sync` ignored the trainer's version it was given."""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

from roll_core.cluster.reward_guard import RewardFailureBudget
from roll_core.interfaces import SamplingParams
from roll_core.pipelines.collectors.prompts_async import AsyncPromptCollector
from roll_core.pipelines.metrics import StepLog
from roll_core.protocol import Batch
from roll_core.scheduling.scheduler import GroupState, SampleState, Segment


def _group(gid: int, version: int) -> GroupState:
    """A complete group of two samples generated at scheduler version `version`."""
    problem = types.SimpleNamespace(answer="", id=f"p{gid}", prompt="q")
    group = GroupState(gid, problem, [3, 4], version)
    group.samples = [SampleState(group, i, [Segment([5, 6], [-0.1, -0.1], version)], finish="stop") for i in (0, 1)]
    group.finished = 2
    return group


class _Driver:
    """Hands out one complete group per take, generated at the scheduler's current version; `stats` as the real
    driver's (its `async/version`: the scheduler's count); `finish_update` bumps the scheduler's version."""

    def __init__(self, sched: Any) -> None:
        self.sched, self.gid = sched, 0

    def take(self, n: int) -> list[GroupState]:
        self.gid += 1
        return [_group(self.gid, self.sched.version)]

    def discard(self, group: GroupState) -> None:
        raise AssertionError("nothing is discarded here")

    def held(self) -> Any:
        return contextlib.nullcontext()

    def stats(self) -> dict[str, float]:
        return {"async/version": float(self.sched.version)}

    def finish_update(self) -> None:
        self.sched.version += 1


class _Reward:
    def score(self, batch: Batch) -> Batch:
        s = torch.tensor([0.0, 1.0])
        out = Batch({"scores": s, "correct": s, "formatted": torch.ones_like(s)}, {"response_text": [""] * 2})
        out.meta["reward_counters"] = {"rows": 2}
        return out


def _collector() -> AsyncPromptCollector:
    """A new process's collector (scheduler at version 0), with what `next`, `state_dict` and `load_state_dict` read."""
    c = AsyncPromptCollector.__new__(AsyncPromptCollector)
    algo = types.SimpleNamespace(group_size=2, drop_uniform_groups=False, overlong_buffer=0, reward_clip=None)
    pipeline = types.SimpleNamespace(rollout_batch_size=1)
    c.cfg = types.SimpleNamespace(algo=algo, model=types.SimpleNamespace(max_response_length=8), pipeline=pipeline)
    c.ctx = types.SimpleNamespace(samples=lambda step, rows: None)
    c.tokenizer = types.SimpleNamespace(pad_token_id=0, unk_token_id=None, convert_tokens_to_ids=lambda name: None)
    c.task = types.SimpleNamespace(messages=lambda problem: [], skipped_rows={})
    c.sched = types.SimpleNamespace(version=0, groups={})
    c.driver, c.k, c._handed, c._last_batch_at = _Driver(c.sched), 1, [], None
    c.skipped_long = c.skipped_context = c.skipped_bad_images = 0
    c.processor, c.sampling = None, SamplingParams()
    c.sampler = types.SimpleNamespace(progress=lambda: 0.0, state_dict=dict, load_state_dict=lambda state: None)
    c.reward, c.reward_budget, c._step_counters, c._step_failure = _Reward(), RewardFailureBudget(3), {}, None
    c.reward_model, c.domains, c.advantage_scale, c._replay, c._index = None, [], None, [], {}
    c._data_fingerprint = "data"
    return c


def _step(c: AsyncPromptCollector, step: int) -> dict[str, float]:
    """One step: the batch, then the weight sync to the trainer's version `step` (one update per step)."""
    out = StepLog()
    assert c.next(step, out) is not None
    c.finish_sync(step)
    return {k: out[k] for k in ("async/version", "async/staleness_max")}


def test_async_version_goes_on_after_a_resume_and_the_staleness_bound_stays_in_the_rollouts_count() -> None:
    first = _collector()
    before = [_step(first, s) for s in (1, 2, 3)]
    assert [m["async/version"] for m in before] == [0.0, 1.0, 2.0]  # the weights each batch was taken under
    state = first.state_dict()
    assert state["version"] == 3

    resumed = _collector()  # a new process: its scheduler counts from 0
    resumed.load_state_dict(state)
    after = [_step(resumed, s) for s in (4, 5)]
    assert [m["async/version"] for m in after] == [3.0, 4.0]  # read 0.0, 1.0
    assert resumed.sched.version == 2  # the scheduler's own count (its budget and bound) is not moved
    assert all(m["async/staleness_max"] == 0.0 for m in before + after)
    assert resumed.state_dict()["version"] == 5


def test_finish_sync_takes_the_trainers_version() -> None:
    """A collector whose first sync is to version 7 (a checkpoint of before `version` was recorded) says 7 from
    then on, not the syncs it saw itself."""
    c = _collector()
    c.load_state_dict({"sampler": {}, "data": "data"})  # no `version`: 0 until a sync tells it
    assert _step(c, 7)["async/version"] == 0.0
    assert _step(c, 8)["async/version"] == 7.0
