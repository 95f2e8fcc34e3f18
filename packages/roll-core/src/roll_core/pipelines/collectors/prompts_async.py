"""The asynchronous prompts collector (`pipeline=rlvr pipeline.async_ratio=k`): generation runs ahead of the
trainer, in the background, by at most k weight versions.

The background driver (roll_core.scheduling.driver) keeps generating groups within the scheduler's budget;
`next` takes complete groups (oldest first, within the staleness bound), scores them, drops groups without
reward variance when dynamic sampling is on (their budget starts new groups at once), drops (and replaces) groups
whose prompt fills the engine's context (`data/skipped_context_prompts`), and returns an assembled batch with
`behaviour_version` (B,) per row. `data/refill_rounds` means what the synchronous collector's does: the takes made
to replace groups dynamic sampling dropped; a take that only replaces groups whose prompt filled the context is none
(the synchronous collector does not replace those), so it is 0 with dynamic sampling off. The step's counts cover
every take as the synchronous collector's cover every round: `reward/rows` and the reward's other counters,
`perf/rollout_tokens` (the taken groups' response tokens, dropped ones included; `perf/rollout_tokens_per_s` over the
time between batches) and what `assemble` counts (`data/picture_token_cuts`). The trainer then
recomputes the proximal log-probs (`old_logprobs`) at its current version, and `algo.off_policy_correction` weighs
each token by the truncated ratio pi_old / pi_behaviour (decoupled PPO); `begin_sync` / `finish_sync` bracket the
weight sync so that partial rollout can abort and resume requests around it. A batch that no sync follows was not
trained (a wrapper dropped it: pipeline=distill without teacher prompts): the next `next` gives its groups back to the
budget as discards (`async/discarded_groups`). `pipeline.async_batch_timeout_s` bounds the trainer's wait for a batch,
`pipeline.async_abort_timeout_s` the wait for an aborted request's result and `pipeline.max_idle_aborts` the engine's
own aborts of a sample in a row without a token before it counts as refused (roll_core.scheduling.driver).

Checkpoints store the data sampler and the training-set indices of the groups started but not yet trained
(`pending`, in start order: the sampler's position is past them); a resumed run starts those prompts first, so
no prompt is skipped or repeated. Their responses are not stored (they are generated again), so an async run
resumes with the uninterrupted run's prompts but not bit for bit. A checkpoint waits for a draw under way on the
driver's data thread (the data position and the groups are one state), at most `pipeline.async_batch_timeout_s`:
past it, a TimeoutError names the data source whose `next_group` blocks. `next` never waits for a draw (the skip
counts the data thread keeps have a lock of their own).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import torch

from roll_core.config.engines import refuse_sleeping_engines
from roll_core.data import LockedSampler
from roll_core.errors import ConfigError
from roll_core.interfaces import SamplingParams
from roll_core.pipelines.collectors import Collected, CollectorContext
from roll_core.pipelines.collectors.prompts import PromptCollector, reward_counts
from roll_core.pipelines.metrics import StepLog, domain_metrics, reward_metrics
from roll_core.pipelines.rollout import PROBLEM_FIELDS, BadPictures, assemble, encode_prompt, picture_token_ids
from roll_core.pipelines.sampling import RM_ROW_TENSORS, generation_from_samples, informative_groups
from roll_core.protocol import Batch
from roll_core.scheduling.driver import AsyncRollout
from roll_core.scheduling.scheduler import GroupState, RolloutScheduler
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)


def check_async(ctx: CollectorContext) -> None:
    """Refuse settings an asynchronous collector cannot honour; warn when off-policy samples go uncorrected."""
    cfg = ctx.cfg
    ie, k = cfg.infer_engine, cfg.pipeline.async_ratio
    if not ctx.infer.continuous_batching():
        raise ConfigError(
            f"pipeline.async_ratio={k} needs an inference engine with continuous batching; "
            f"infer_engine={ie.name} is synchronous-only: use pipeline.async_ratio=0"
        )
    refuse_sleeping_engines(k, ie.sleep_level)  # (refused at composition too: RLVRConfig)
    if cfg.algo.off_policy_correction is None:
        log.warning(
            "pipeline.async_ratio=%d without algo.off_policy_correction: samples up to %d versions old are trained "
            "with the proximal policy only (set algo.off_policy_correction=token for decoupled PPO)",
            k,
            k,
        )


def stop_at_pictures(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """A vision-language policy's sampling stops on a picture placeholder it samples itself: the response is cut
    before it anyway (rollout.cut_picture_tokens), and a response aborted at a sync with one in its prefix could not
    be resumed (the engine refuses a placeholder with no picture behind it, and the rollout thread died)."""
    stops = tuple(dict.fromkeys((*params.stop_token_ids, *sorted(picture_token_ids(tokenizer)))))
    return params.replace(stop_token_ids=stops)


class AsyncPromptCollector(PromptCollector):
    """Prompts generated ahead of the trainer (see the module docstring); data, reward and evaluation as in the
    synchronous collector."""

    # The trainer's weight version minus the scheduler's: the scheduler counts from 0 in every process (its budget
    # and staleness bound are in its own count, which a resume must not move), the run's count goes on after a
    # resume; `async/version` is the run's (it read 0 after resuming at version 3).
    _version_base = 0
    # Guards the skip counts `_next_group` keeps on the driver's data thread against `next`'s reset, held for one
    # increment or one swap (the driver's `held` waits for a draw under way: a blocked data source stalled `next`).
    _skips_lock = threading.Lock()

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        check_async(ctx)
        self.sampler = LockedSampler(self.sampler)  # drawn on the driver's thread, saved on the trainer's
        self._index = {id(p): i for i, p in enumerate(self.train_set)}  # a group's problem -> its index (pending)
        if self.processor is not None:
            self.sampling = stop_at_pictures(self.sampling, self.tokenizer)
        p = self.cfg.pipeline
        self.k = p.async_ratio
        self.sched = RolloutScheduler(
            batch_groups=p.rollout_batch_size,
            group_size=self.cfg.algo.group_size,
            max_new_tokens=self.cfg.model.max_response_length,
            async_ratio=p.async_ratio,
            tail_groups=p.tail_groups,
            partial_rollout=p.partial_rollout,
        )
        self.skipped_long = 0
        self.skipped_context = 0  # groups whose prompt filled the engine's context (data/skipped_context_prompts)
        self.skipped_bad_images = 0
        self._last_batch_at: float | None = None  # when the previous batch was taken (rollout throughput)
        # The groups of the batch handed out last, until the weight sync after its update: still held at the next
        # `next`, nothing trained them (a wrapper dropped the batch: pipeline=distill without teacher prompts).
        self._handed: list[GroupState] = []
        seed = derive_seed(p.seed, Purpose.ASYNC_ROLLOUT)
        self.driver = AsyncRollout(
            self.infer,
            self.sched,
            self._next_group,
            self.sampling.replace(seed=seed),
            timeout_s=p.async_batch_timeout_s,  # how long `take` waits for a batch
            abort_timeout_s=p.async_abort_timeout_s,  # how long an aborted request may take before it is lost
            max_idle_aborts=p.max_idle_aborts,  # the engine's own aborts in a row without a token: a refusal
        )

    def _next_group(self) -> tuple[Any, list[int], Any]:
        """The next training problem whose prompt fits, its ids and pictures (runs on the driver's data thread; long
        ones and ones with unreadable pictures are counted, under `_skips_lock`)."""
        limit = self.cfg.model.max_prompt_length
        for _ in range(10_000):
            problem = self.train_set[self._draw(1)[0]]
            try:  # a huge row is not even tokenised
                ids, _, mm = encode_prompt(
                    self.tokenizer, self.task, problem, limit, self.cfg.model.chat_template_kwargs, self.processor
                )
            except BadPictures as exc:
                log.warning("problem %s skipped: its pictures: %s", problem.id, exc)
                with self._skips_lock:
                    self.skipped_bad_images += 1
                continue
            if ids is not None:
                return problem, ids, mm
            with self._skips_lock:
                self.skipped_long += 1
        raise ValueError(f"10000 prompts in a row exceed model.max_prompt_length={limit}: raise it")

    def next(self, step: int, out: StepLog) -> Collected | None:
        """The next batch: rollout_batch_size groups (fewer if dynamic sampling hits its cap), scored."""
        algo, want = self.cfg.algo, self.cfg.pipeline.rollout_batch_size
        g = algo.group_size
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        cap = math.ceil(algo.refill_max_batches * want) if algo.drop_uniform_groups else want
        kept: list[GroupState] = []
        first: tuple[Batch, Batch] | None = None
        cols: dict[int, dict[str, torch.Tensor]] = {}  # gid -> its rows' scores, correct, formatted
        sampled = refills = too_long = tokens = 0
        counts: dict[str, int] = {}  # what `assemble` counts in each take (picture cuts, MoE routing not replayed)
        # Whether the previous take had a group dynamic sampling dropped: the next take refills it (a refill round).
        uniform_dropped = False
        if self._handed:
            # No sync followed the previous batch, so nothing trained it: its groups go back to the budget as
            # discards. Left booked as trained, each such batch took one batch of the rollout's lead for good, and
            # after async_ratio + 1 of them `take` waited out async_batch_timeout_s for groups never started.
            for grp in self._handed:
                self.driver.discard(grp)
            self._handed = []
        with out.timer("generate"):  # time the trainer waited for rollout
            while len(kept) < want and sampled < cap:
                refills += int(uniform_dropped)
                uniform_dropped = False
                groups = self.driver.take(min(want - len(kept), cap - sampled))
                # A group whose prompt fills the engine's context generated nothing: dropped, counted and replaced
                # by the next one (one such prompt ended the run); a step of nothing else is an error.
                fits = [grp for grp in groups if not self._fills_context(grp)]
                for grp in groups:
                    if grp not in fits:
                        self.skipped_context += 1
                        self.driver.discard(grp)
                        too_long += 1
                if too_long > 10 * want and first is None:  # (a ConfigError: one line from roll-train)
                    raise ConfigError(
                        f"{too_long} prompts in a row fill the inference engine's context: raise "
                        "infer_engine.max_model_len (prompt + response tokens) above model.max_prompt_length + "
                        "model.max_response_length, or lower model.max_prompt_length below the engine's context"
                    )
                groups = fits
                sampled += len(groups)
                # the engine's work for every take, groups dynamic sampling drops next included (throughput)
                tokens += sum(len(s.tokens) for grp in groups for s in grp.samples)
                if not groups:
                    continue
                gen = generation_from_samples(groups, pad, self.task, self.tokenizer, self.sampling.stop)
                batch = self._assemble(gen, counts)
                scored = self.score(batch, out)
                keys = ("scores", "correct", "formatted", *(k for k in RM_ROW_TENSORS if k in scored))
                batch = batch.union(scored.select(*keys))
                first = first or (batch, scored)
                for i, grp in enumerate(groups):
                    cols[grp.gid] = {k: batch[k][i * g : (i + 1) * g] for k in keys}
                useful = (
                    informative_groups(batch["scores"], g)
                    if algo.drop_uniform_groups
                    else torch.ones(len(groups), dtype=torch.bool)
                )
                for grp, ok in zip(groups, useful.tolist()):
                    if ok:
                        kept.append(grp)
                    else:
                        self.driver.discard(grp)
                        uniform_dropped = True
        assert first is not None
        step_counters = self.end_reward_step(step)
        b0, scored0 = first
        lengths = b0["response_mask"].sum(-1)
        out.update(reward_metrics(b0, scored0, lengths, self.cfg.model.max_response_length))
        out.update(reward_counts(step_counters))  # every take's rows, as the synchronous collector's every round's
        out.update(counts)
        if len(self.domains) > 1:
            out.update(domain_metrics(b0, lengths, self.cfg.model.max_response_length, self.domains))
        self.log_samples(step, b0, scored0)
        out["data/dropped_groups"] = sampled - len(kept)
        out["data/sampled_groups"] = sampled
        out["data/refill_rounds"] = refills  # the sync collector's count (module docstring)
        out["data/refill_short_groups"] = max(0, want - len(kept))
        with self._skips_lock:  # the driver's data thread counts these in `_next_group`, under the same lock
            out["data/skipped_long_prompts"], self.skipped_long = self.skipped_long, 0
            bad_images, self.skipped_bad_images = self.skipped_bad_images, 0
        out["data/skipped_context_prompts"], self.skipped_context = self.skipped_context, 0
        if self.processor is not None:
            out["data/skipped_bad_images"] = bad_images
        if not kept:
            return None
        self._handed = kept
        batch = self._assemble(generation_from_samples(kept, pad, self.task, self.tokenizer, self.sampling.stop))
        for k in cols[kept[0].gid]:
            batch[k] = torch.cat([cols[grp.gid][k] for grp in kept])
        if self.reward_model is not None:  # normalize=batch: over the whole batch's rows, not each chunk's
            batch = self.reward_model.renormalise(batch)
        staleness = (self.sched.version - batch["behaviour_version"]).float()
        if float(staleness.max()) > self.k:  # the scheduler's contract, checked where it matters
            raise AssertionError(f"a sample {int(staleness.max())} versions old reached the trainer (bound {self.k})")
        out["async/staleness_mean"] = float(staleness.mean())
        out["async/staleness_max"] = float(staleness.max())
        out.update(self.driver.stats())
        out["async/version"] = float(self.sched.version + self._version_base)  # the run's count, not this process's
        # The trainer's wait ("generate") is not the rollout's time when generation overlaps training: rollout
        # throughput is the batch's tokens over the time between two batches (the first batch: its own wait).
        now = time.monotonic()
        span = out.timers["generate"] if self._last_batch_at is None else now - self._last_batch_at
        self._last_batch_at = now
        out["perf/rollout_tokens"] = float(tokens)  # as the synchronous collector's: every group taken
        out["perf/rollout_tokens_per_s"] = tokens / max(span, 1e-9)
        out["perf/generate_wait_seconds"] = out.timers["generate"]
        return self._collected(batch, out)

    @staticmethod
    def _fills_context(group: GroupState) -> bool:
        """Whether the engine refused `group`'s prompt as filling its context (every sample of a group shares it)."""
        return any(s.finish == "prompt_too_long" for s in group.samples)

    def _assemble(self, gen: Batch, counts: dict[str, int] | None = None) -> Batch:
        """`gen` (groups' samples) assembled; `counts` (when given) adds up what `assemble` counts, as the
        synchronous collector sums it over its rounds: `data/picture_token_cuts`, and `routing/unreplayed_*` for a
        generation that carries MoE routing."""
        own = ("prompt_ids", *PROBLEM_FIELDS, *(["mm_inputs"] if "mm_inputs" in gen else []))
        prompts = gen.select(*own)
        rest = [k for k in gen.keys() if k not in own]
        metrics: dict[str, Any] = {}
        batch = assemble(self.tokenizer, prompts, gen.select(*rest), metrics)
        if counts is not None:
            # (its prompt_too_long count is 0 here: those groups were dropped before, data/skipped_context_prompts)
            for k, v in metrics.items():
                if k != "data/skipped_context_prompts":
                    counts[k] = counts.get(k, 0) + v
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The base state, with `pending` the indices of the groups started and not yet trained (then any not yet
        restarted after a resume), read with the driver held: no group starts, no prompt is drawn meanwhile. It waits
        for a draw under way at most the driver's `timeout_s` (pipeline.async_batch_timeout_s), then raises a
        TimeoutError naming the data source (it waited without limit: a stuck data source hung the run silently)."""
        with self.driver.held():
            state = super().state_dict()
            pending = [self._index[id(g.payload)] for g in self.sched.groups.values()] + self._replay
            state["version"] = self.sched.version + self._version_base  # the run's weight version
        if pending:
            state["pending"] = pending
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The base state; the run's weight version (`version`) goes on in `async/version` (absent in checkpoints
        of before: 0, until the first weight sync tells it)."""
        super().load_state_dict(state)
        self._version_base = int(state.get("version", 0)) - self.sched.version

    def begin_sync(self) -> None:
        self.driver.begin_update()

    def finish_sync(self, version: int) -> None:
        """After the weight sync to the trainer's `version`: the handed-out batch was trained, generation resumes."""
        self._handed = []  # trained: the update this sync follows
        self.driver.finish_update()
        self._version_base = version - self.sched.version  # (the scheduler's bump is its own: driver.finish_update)

    def close(self) -> None:
        try:
            self.driver.close()
        finally:  # the base's: the reward model (skipped here before)
            super().close()
