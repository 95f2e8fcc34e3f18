"""The asynchronous episodes collector's admission budget (roll_core.pipelines.collectors.episodes_async) when some
batches have nothing to train on (every environment of the batch failed at reset): the trainer does not sync after
those, so the budget must give their place back, or k + 1 of them leave `next` waiting for groups never started.

The collector is built around its bookkeeping only: episodes are stand-ins that finish at once (what they hold
does not matter to admission), the batch a step yields is decided by the test."""

from __future__ import annotations

import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from roll_core.pipelines.collectors.episodes_async import AsyncEpisodeCollector
from roll_core.pipelines.metrics import StepLog

B, G = 2, 2  # groups per batch, episodes per group


def collector(k: int, empty_steps: set[int]) -> AsyncEpisodeCollector:
    c = object.__new__(AsyncEpisodeCollector)
    c.k, c.groups_per_batch, c.group_size, c.timeout_s = k, B, G, 5.0
    slots = (k + 1) * B * G
    c._free_slots, c._pool = list(range(slots)), ThreadPoolExecutor(slots)
    c._cv, c._version, c._started, c._taken, c._skipped = threading.Condition(), 0, 0, 0, 0
    c._results, c._first_step, c._seeds, c._error, c._closed, c._last_batch_at = {}, None, {}, None, False, None
    c.cfg = types.SimpleNamespace(pipeline=types.SimpleNamespace(seed=0))
    c.sampling = types.SimpleNamespace(replace=lambda **kw: None)
    c.train_seeds = lambda step: list(range(B))
    c.rollout = types.SimpleNamespace(episode=lambda *a: types.SimpleNamespace(resumed_turns=0))
    c.gate = types.SimpleNamespace(finish_update=lambda v: None, stats=dict)

    def collected(step, trajs, out):
        if step in empty_steps:
            return None
        rows = len(trajs)
        return types.SimpleNamespace(
            batch={"response_mask": torch.ones(rows, 3), "behaviour_version": torch.full((rows,), c._version)}
        )

    c.collected = collected
    return c


@pytest.mark.parametrize("k", [0, 1, 2])
def test_batches_with_nothing_to_train_on_do_not_shrink_the_lead(k: int) -> None:
    empty = {1, 3, 4, 6}  # more than k + 1 of them
    c = collector(k, empty)
    try:
        for step in range(1, 9):
            got = c.next(step, StepLog())
            assert (got is None) == (step in empty)
            if got is not None:  # the trainer trains and syncs
                c.finish_sync(c._version + 1)
            # between steps: k + 1 batches started ahead of the trainer, after a trained step as after an empty one
            assert c._started - c._taken == (k + 1) * B
        assert c._taken == 8 * B and c._version == 8 - len(empty)
    finally:
        c._pool.shutdown(wait=True)
