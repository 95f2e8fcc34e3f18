"""The asynchronous episodes collector (`pipeline=agentic pipeline.async_ratio=k`): episodes run ahead of the
trainer, in the background, at most k weight versions old, and nothing generated is thrown away.

Contract:
- Admission controls staleness: at most (version + skipped + k + 1) x rollout_batch_size groups are ever started
  (a group: `group_size` episodes of one environment seed; `skipped`: batches handed out with nothing to train on,
  after which the trainer does not sync), so generation runs at most k batches ahead. Without `skipped` each such
  batch would shrink the lead for good, and k + 1 of them would leave `next` waiting for groups never started.
- Batches are taken in start order: batch n is groups [nB, (n+1)B), and `next` waits for the oldest groups
  instead of skipping to newer complete ones. With the admission rule, a group started at version u is trained at
  a version <= u + k: no sample is ever too old, none is dropped for staleness, and long episodes are not
  selected against (dropping stale work trains on the short ones). Every row carries `behaviour_version`, the
  oldest weight version of its tokens; `next` checks the bound.
- Around a weight sync the `TurnGate` stops admitting turns; with `pipeline.partial_rollout` the turns in flight
  are aborted and resumed under the new weights (an episode keeps its earlier turns' tokens and behaviour
  log-probs, and the partial turn's), otherwise the sync waits for them (`pipeline.agentic_sync_wait_s` at most,
  then a TimeoutError naming them and the key). An aborted turn whose result has not come
  `pipeline.async_abort_timeout_s` after the abort, or whose result raises, is lost (roll_core.agentic.turn_gate):
  the sync goes on, the turn resumes with its earlier attempts' tokens (`async/unanswered_aborts`,
  `async/failed_aborts`, one warning per version).
- Failures: an episode whose turn request fails in the engine (not aborted) stops the run: the trainer's next call
  (`next`, `begin_sync`) raises a RuntimeError naming the group, episode, request and turn, chained to the engine's
  error. `next` waits `pipeline.async_batch_timeout_s` for a batch at most, then raises a TimeoutError naming the
  turn requests still running, oldest first with how long each has run (a hung engine).
- Group i belongs to step `first_step + i // B` and uses that step's environment seeds, as the synchronous
  collector would. Checkpoints hold the run's weight version (`version`: `async/version` goes on after a resume,
  as the prompts collector's does; it read 0 after resuming at version 2, while admission and the staleness bound
  stay in this process's own count of syncs) and nothing more (episodes in flight at a save are not stored: a
  resumed run starts fresh ones), so an async run resumes correctly but not bit for bit.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from roll_core.agentic.trajectory import Trajectory
from roll_core.agentic.turn_gate import TurnGate
from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import Collected, CollectorContext
from roll_core.pipelines.collectors.episodes import EpisodeCollector
from roll_core.pipelines.collectors.prompts_async import check_async
from roll_core.pipelines.metrics import StepLog
from roll_core.scheduling._driver_timeouts import running_aged
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)


class AsyncEpisodeCollector(EpisodeCollector):
    """Episodes generated ahead of the trainer (see the module docstring)."""

    # The trainer's weight version minus this process's syncs (`_version`, which admission, the gate's versions and
    # the staleness bound count in): `async/version` is the run's count, also after a resume.
    _version_base = 0

    def __init__(self, ctx: CollectorContext) -> None:
        p = ctx.cfg.pipeline
        if p.tail_groups:
            raise ConfigError("pipeline.tail_groups is not supported by pipeline=agentic: set it to 0")
        check_async(ctx)
        gate = TurnGate(
            ctx.infer,
            partial_rollout=p.partial_rollout,
            abort_timeout_s=p.async_abort_timeout_s,
            sync_wait_s=p.agentic_sync_wait_s,  # a sync without partial rollout waits this long for running turns
        )
        super().__init__(ctx, gate=gate)
        self.gate: TurnGate = self.rollout.gate  # type: ignore[assignment]
        self.k, self.groups_per_batch, self.group_size = p.async_ratio, p.rollout_batch_size, ctx.cfg.algo.group_size
        self.timeout_s = p.async_batch_timeout_s  # how long `next` waits for a batch
        slots = (self.k + 1) * self.groups_per_batch * self.group_size  # episodes in flight at most
        self.eval_slot = slots
        self.envs.grow(slots + len(self.eval_seeds))
        self._free_slots = list(range(slots))
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="roll-async-episode")
        self._cv = threading.Condition()
        self._version = 0  # weight syncs since this collector started
        self._started = 0  # groups started
        self._taken = 0  # groups handed to the trainer
        self._skipped = 0  # batches handed out with nothing to train on (no weight sync followed them)
        self._results: dict[int, list[Trajectory | None]] = {}
        self._first_step: int | None = None
        self._seeds: dict[int, list[int]] = {}  # step -> its environment seeds
        self._error: BaseException | None = None
        self._error_at = ""  # which episode failed (`_raise`)
        self._closed = False
        self._last_batch_at: float | None = None
        self._resumed_seen = 0

    # ---- the collector contract ---------------------------------------------------------------------------
    def next(self, step: int, out: StepLog) -> Collected | None:
        """The oldest rollout_batch_size groups, waiting for them to finish (see the module docstring)."""
        with out.timer("generate"), self._cv:  # time the trainer waited for rollout
            if self._first_step is None:
                self._first_step = step
            self._fill()
            wanted = range(self._taken, self._taken + self.groups_per_batch)
            deadline = time.monotonic() + self.timeout_s
            while not all(self._complete(i) for i in wanted):
                self._raise()
                if time.monotonic() > deadline:
                    raise self._timeout(wanted)
                self._cv.wait(0.5)
            trajs = [t for i in wanted for t in self._results.pop(i)]  # type: ignore[misc]
            self._taken += self.groups_per_batch
            in_flight = self._started - self._taken
            self._fill()
        collected = self.collected(step, trajs, out)
        out["async/in_flight_groups"] = float(in_flight)
        out["async/version"] = float(self._version + self._version_base)  # the run's count, not this process's
        resumed = sum(t.resumed_turns for t in trajs)
        out["async/resumed_turns"] = float(resumed)
        out.update(self.gate.stats())  # aborted turn requests lost since the previous batch
        now = time.monotonic()
        span = out.timers["generate"] if self._last_batch_at is None else now - self._last_batch_at
        self._last_batch_at = now
        out["perf/generate_wait_seconds"] = out.timers["generate"]
        if collected is None:
            with self._cv:  # no sync follows: the batch's place in the admission budget is given back here
                self._skipped += 1
                self._fill()
            return None
        batch = collected.batch
        out["perf/rollout_tokens_per_s"] = float(batch["response_mask"].sum()) / max(span, 1e-9)
        staleness = (self._version - batch["behaviour_version"]).float()
        if float(staleness.max()) > self.k:  # the admission rule's guarantee, checked where it matters
            raise AssertionError(f"an episode {int(staleness.max())} versions old reached the trainer (bound {self.k})")
        out["async/staleness_mean"] = float(staleness.mean())
        out["async/staleness_max"] = float(staleness.max())
        return collected

    def begin_sync(self) -> None:
        self._raise()
        self.gate.begin_update()

    def finish_sync(self, version: int) -> None:
        """After the weight sync to the trainer's `version`: admission and the gate go on in this process's count."""
        with self._cv:
            self._version += 1
            self._version_base = version - self._version
            self.gate.finish_update(self._version)
            self._fill()

    def state_dict(self) -> dict[str, Any]:
        """The run's weight version (`version`); episodes in flight are not stored (see the module docstring)."""
        with self._cv:
            return {**super().state_dict(), "version": self._version + self._version_base}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """`async/version` goes on from the checkpoint's `version` (absent in checkpoints of before, or of a
        synchronous run: 0 until the first weight sync tells it)."""
        super().load_state_dict(state)
        with self._cv:
            self._version_base = int(state.get("version", 0)) - self._version

    def close(self) -> None:
        with self._cv:
            self._closed = True
        self.gate.close()
        self._pool.shutdown(wait=True, cancel_futures=True)
        super().close()

    # ---- background episodes ------------------------------------------------------------------------------
    def behaviour_versions(self, kept: list[Trajectory]) -> torch.Tensor:
        return torch.tensor([t.min_version for t in kept], dtype=torch.long)

    def _complete(self, group: int) -> bool:
        got = self._results.get(group)
        return got is not None and all(t is not None for t in got)

    def _raise(self) -> None:
        """Raise an episode's failure in the trainer's thread, naming the episode (and the request: its note)."""
        if self._error is not None:
            exc = self._error
            notes = "; ".join(getattr(exc, "__notes__", ()))
            raise RuntimeError(
                f"async episodes failed ({self._error_at}){': ' + notes if notes else ''}: {type(exc).__name__}: {exc}"
            ) from exc

    def _timeout(self, wanted: range) -> TimeoutError:
        """The error of a batch not complete after `timeout_s` (lock held): what it waits for, what runs."""
        missing = sum(t is None for i in wanted for t in self._results.get(i, [None] * self.group_size))
        running = self.gate.running_since()
        return TimeoutError(
            f"async episodes: batch not complete after {self.timeout_s}s (pipeline.async_batch_timeout_s): "
            f"{missing} episode(s) of groups {wanted.start}..{wanted.stop - 1} unfinished; "
            f"{running_aged(running, 'turn request(s)')}"
            f"{'; requests running without finishing (a hung or slow inference engine?)' if running else ''}"
        )

    def _fill(self) -> None:
        """Start groups while the admission budget and free environment slots allow (lock held)."""
        budget = (self._version + self._skipped + self.k + 1) * self.groups_per_batch
        while (
            not self._closed
            and self._first_step is not None
            and self._started < budget
            and len(self._free_slots) >= self.group_size
        ):
            group = self._started
            self._started += 1
            step = self._first_step + group // self.groups_per_batch
            if step not in self._seeds:
                self._seeds = {s: v for s, v in self._seeds.items() if s >= step - 1}
                self._seeds[step] = self.train_seeds(step)
            env_seed = self._seeds[step][group % self.groups_per_batch]
            params = self.sampling.replace(seed=derive_seed(self.cfg.pipeline.seed, Purpose.ROLLOUT, step))
            self._results[group] = [None] * self.group_size
            for j in range(self.group_size):
                slot = self._free_slots.pop()
                index = (group % self.groups_per_batch) * self.group_size + j  # as the synchronous collector's
                self._pool.submit(self._episode, group, j, slot, env_seed, params, index)

    def _episode(self, group: int, j: int, slot: int, env_seed: int, params: Any, index: int) -> None:
        try:
            traj = self.rollout.episode(slot, env_seed, group % self.groups_per_batch, params, index)
        except BaseException as exc:  # surfaced in the trainer's thread by _raise
            log.exception("async episode %d of group %d failed", j, group)
            with self._cv:
                if self._error is None:  # the first failure is the cause; later ones are often its consequences
                    self._error, self._error_at = exc, f"group {group}, episode {j}, env seed {env_seed}"
                self._cv.notify_all()
            return
        with self._cv:
            self._free_slots.append(slot)
            self._results[group][j] = traj
            self._fill()
            self._cv.notify_all()
