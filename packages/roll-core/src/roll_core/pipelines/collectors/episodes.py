"""The episodes collector (`pipeline=agentic`, synchronous): multi-turn episodes against environments.

A step draws `pipeline.rollout_batch_size` training seeds (from the run seed and the step only: nothing to
checkpoint but the step); every seed runs `algo.group_size` episodes (a group shares its environment seed, so
group-relative estimators compare like with like), all concurrently, token-in-token-out
(roll_core.agentic.rollout), each turn one request to the inference engines. The batch is trajectories: the first
prompt is the prompt, everything after it the response, with a loss mask that is 1 on generated tokens only, plus
`group_ids` and the turn tensors the trajectory estimators read (roll_core.algorithms). An episode never runs past
the inference engine's context: a task's max_context_length longer than it is lowered to it, with a warning
(roll_core.agentic.rollout.fit_engine_context; pipeline=agent's sessions too). An episode whose environment failed at
reset, or whose first prompt the context refused, was never an attempt of the policy: nothing to train on, and no
outcome, so it is out of the reward and episode metrics, on_failure=score or not (its 0.0 pulled reward/mean down: 3
successes and 1 failed reset read 0.75), and out of eval/n, counted apart (data/reset_failed_episodes,
data/context_refused_episodes; eval/reset_failed_episodes, eval/context_refused_episodes;
roll_core.pipelines.collectors._episode_drops). Every episode left out of the batch is counted in data/dropped_episodes,
and in the count of its cause (_episode_drops: data/aborted_episodes, data/reset_failed_episodes,
data/failure_dropped_episodes, data/context_refused_episodes, data/unsampled_episodes, which add up to it). An episode
whose environment step raised or hung (end `env_error` / `env_timeout`) is, per the task's `on_failure`, trained with
its failing turn's reward set to `failure_reward` (`score`, the default; 0.0) or dropped (`drop`, counted in
data/failure_dropped_episodes, and, like an untrained episode, out of the reward and episode metrics, which describe
what was trained; a step whose every episode was left out logs no reward/* or episode rate at all, not a 0.0 over none):
either way it is counted in episode/end_<reason> and env/<counter>. Evaluation drops nothing: a held-out episode an
environment failure ended is an unsuccessful attempt whatever `on_failure` says (scored `failure_reward`, counted in
eval/n and eval/failed_episodes; those `drop` would have kept out of training in eval/dropped_episodes, with a warning),
since a timeout is often the policy's doing (a program it ran hung) and leaving them out raised the held-out success
rate silently (3 timeouts and 1 success read 1.0 on eval/n 1). An episode the rollout kept `untrained` (a turn the
engine kept aborting, `pipeline.max_idle_aborts` times in a row without a token, or the collector closing, cut it: end
`abort`, roll_core.agentic.rollout) is left out of the batch (no forward pass is spent on a row the loss would mask),
counted in data/aborted_episodes, and out of the reward and episode metrics (its partial reward is no outcome): only
episode/end_abort counts it.

Vision-language models (`model.path` a Qwen-VL family folder or builtin:tiny-qwen2.5-vl): observations may carry
pictures (env=visual_frozen_lake); the turn template renders them with the model's `VisionProcessor` and the batch
carries each trajectory's pictures in the per-row field `mm_inputs` (roll_core.agentic.trajectory).

Structured outputs (`infer_engine.structured`) are refused for training (roll-eval may use them): the trainer cannot
replay a per-turn constraint over a trajectory (see `refuse_turn_constraints`).

Metrics: success rate, mean turns, invalid-action rate, tool calls and the environment's other info counters per
episode (episode/tool_calls_mean, episode/<counter>_mean for roll_core.interfaces.agentic.INFO_COUNTERS: tool
errors, ignored tool calls, tool error outputs), environment errors and timeouts, why episodes ended; what
the task's data lost (DataCounts, roll_core.interfaces.tasks: data/skipped_rows, data/also_held_out, also in the
summary).
Evaluation: one episode per held-out seed (greedy unless pipeline.eval_temperature says otherwise); eval/success_rate
(= eval/accuracy) comes with its standard error over the eval/n episodes with an outcome (eval/success_rate_stderr,
eval/accuracy_stderr: roll_core.eval_metrics.rate_stderr, as roll-eval reports it; None for fewer than two): every
episode but those the engine refused (eval/aborted_episodes) and those never attempted (above), environment failures
included. An evaluation none of whose episodes had an outcome (every reset failed, every first prompt over the
context) logs eval/n 0 and no rate, reward or episode mean (a 0.0 read as a model that failed them all), with a
warning naming why.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import torch

from roll_core.agentic.env_manager import EnvManager
from roll_core.agentic.rollout import AgenticRollout, TurnGate, fit_engine_context, task_turns
from roll_core.agentic.trajectory import Trajectory, to_tensors
from roll_core.config.build import as_dict
from roll_core.errors import ConfigError
from roll_core.eval_metrics import rate_stderr
from roll_core.interfaces.agentic import INFO_COUNTERS
from roll_core.interfaces.tasks import AgenticTask, data_counts, data_metrics
from roll_core.pipelines.collectors import Collected, CollectorContext
from roll_core.pipelines.collectors._episode_drops import (
    ENV_FAILURES,
    drop_cause,
    drop_metrics,
    no_attempt,
    warn_nothing_evaluated,
)
from roll_core.pipelines.metrics import StepLog
from roll_core.protocol import Batch
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)


def check_task(cfg: Any, task: Any) -> None:
    """An agentic task (roll_core.interfaces.tasks.AgenticTask)."""
    if not isinstance(task, AgenticTask):
        raise ConfigError(
            "pipeline=agentic needs an agentic env (env=sokoban, frozen_lake, guess_number, tool_math, ...), "
            f"got {type(task).__name__}"
        )
    refuse_prompt_only_settings(cfg)


def refuse_turn_constraints(cfg: Any) -> None:
    """ConfigError for `infer_engine.structured`: the engines would sample every turn under the constraint (and report
    the constrained log-probs), but the trainer replays a constraint over a whole response, and a trajectory's
    response interleaves turns with observations: it would score the unconstrained policy against the constrained
    one's log-probs (every ratio off by the mass the constraint removed; it was accepted and trained so)."""
    structured = getattr(getattr(cfg, "infer_engine", None), "structured", None)
    if structured:
        raise ConfigError(
            f"infer_engine.structured={dict(structured)} with pipeline={getattr(cfg.pipeline, 'name', 'agentic')}: the "
            "trainer cannot replay a per-turn constraint over multi-turn trajectories (the PPO ratio would compare "
            "the unconstrained policy with the constrained one); unset it and let the environment reject malformed "
            "actions (info['invalid_action'])"
        )


def refuse_prompt_only_settings(cfg: Any) -> None:
    """ConfigError for the single-turn prompt collectors' reward shaping and filtering, which an episode collector
    does not apply (they were accepted and silently ignored: algo=dapo with pipeline=agentic trained every group)."""
    algo, name = cfg.algo, getattr(cfg.pipeline, "name", "agentic")
    clip, buffer = getattr(algo, "reward_clip", None), getattr(algo, "overlong_buffer", 0)
    # A reward model (reward_model=hf) scores the prompt collectors' (prompt, response) rows only: an episode
    # collector never builds it, so its scores silently never reached an agentic run's rewards.
    rm = getattr(cfg, "reward_model", None)
    ignored = [
        text
        for on, text in (
            (getattr(algo, "drop_uniform_groups", False), "algo.drop_uniform_groups=true"),
            (clip is not None, f"algo.reward_clip={clip}"),
            (buffer > 0, f"algo.overlong_buffer={buffer}"),
            (rm is not None and rm.enabled, f"reward_model={getattr(rm, 'name', None)}"),
        )
        if on
    ]
    if ignored:
        raise ConfigError(
            f"{', '.join(ignored)}: dynamic sampling and reward shaping apply to single-turn prompts "
            f"(pipeline=rlvr), not to pipeline={name}'s episodes: turn them off (algo.drop_uniform_groups=false, "
            "algo.reward_clip=null, algo.overlong_buffer=0, reward_model=none)"
        )


def vision_processor(ctx: CollectorContext) -> Any:
    """The model's `VisionProcessor` when it is a vision-language model (pictures in observations), else None; built
    with the run's picture size bounds (model.image_min_pixels / image_max_pixels: a ConfigError on a text model)."""
    from roll_core.pipelines import rollout

    if not ctx.model_path:
        return None
    return rollout.vision_processor(ctx.model_path, ctx.tokenizer, ctx.cfg.model)


class EpisodeCollector:
    """Scored trajectory batches of multi-turn episodes (see the module docstring)."""

    plot_keys: tuple[str, ...] = (
        "episode/success_rate",
        "eval/success_rate",
        "episode/turns_mean",
        "episode/invalid_action_rate",
        "reward/mean",
    )
    trajectories = True

    def __init__(self, ctx: CollectorContext, gate: TurnGate | None = None) -> None:
        cfg, task = ctx.cfg, ctx.task
        check_task(cfg, task)
        if ctx.train is not None:  # a training run (roll-eval may sample under a constraint: nothing is trained)
            refuse_turn_constraints(cfg)
        self.cfg, self.ctx, self.task, self.tokenizer = cfg, ctx, task, ctx.tokenizer
        self.sampling = ctx.sampling
        self.eval_seeds = task.eval_seeds()
        if task.num_workers > 0:  # environments on their own workers (Ray actors on cluster=ray)
            from roll_core.agentic.env_workers import EnvGroup, RemoteEnvManager

            group = ctx.cluster.group(
                EnvGroup, "env", task.num_workers, max_concurrency=max(2, task.env_threads), env=as_dict(cfg.env)
            )
            self.envs: EnvManager | RemoteEnvManager = RemoteEnvManager(group)
        else:
            self.envs = EnvManager.for_task(task)
        turns, limits = task_turns(task, self.tokenizer, cfg.model.chat_template_kwargs, vision_processor(ctx))
        limits = fit_engine_context(limits, ctx.infer)  # never past the engine's context (warned)
        self.rollout = AgenticRollout(
            ctx.infer,
            self.envs,
            turns,
            self.tokenizer,
            limits,
            gate,
            max_idle_aborts=cfg.pipeline.max_idle_aborts,  # the engine's idle aborts of a turn in a row: a refusal
        )
        self._counters = self.envs.counters()

    # ---- the collector contract ---------------------------------------------------------------------------
    def next(self, step: int, out: StepLog) -> Collected | None:
        """rollout_batch_size seeds x group_size episodes under the current weights."""
        algo, pipe = self.cfg.algo, self.cfg.pipeline
        seeds = self.train_seeds(step)
        runs = [s for s in seeds for _ in range(algo.group_size)]
        groups = [g for g in range(len(seeds)) for _ in range(algo.group_size)]
        params = self.sampling.replace(seed=derive_seed(pipe.seed, Purpose.ROLLOUT, step))
        with out.timer("generate"):
            trajs = self.rollout.run(runs, groups, params)
        collected = self.collected(step, trajs, out)
        if collected is not None:
            out["perf/rollout_tokens_per_s"] = float(collected.batch["response_mask"].sum()) / max(
                out.timers["generate"], 1e-9
            )
        return collected

    def begin_sync(self) -> None:
        return None  # no episode runs between two steps

    def finish_sync(self, version: int) -> None:
        return None

    def evaluate(self, step: int) -> dict[str, float | None]:
        """One episode per held-out seed at the eval temperature (0: greedy); the success rate (also as
        eval/accuracy) with its standard error over the `eval/n` episodes with an outcome (`<rate>_stderr`,
        roll_core.eval_metrics.rate_stderr; None for fewer than two)."""
        t0 = time.perf_counter()
        t = self.cfg.pipeline.eval_temperature
        params = self.sampling.replace(
            temperature=self.sampling.temperature if t is None else float(t),
            seed=derive_seed(self.cfg.pipeline.seed, Purpose.EVAL),
        )
        before = self.envs.counters()
        trajs = self.rollout.run(self.eval_seeds, list(range(len(self.eval_seeds))), params, first_slot=self.eval_slot)
        # every environment failure is scored failure_reward here, on_failure=drop or not: an unsuccessful attempt
        drop = score_failures(self.task, trajs, held_out=True)
        after = self.envs.counters()
        # the held-out episodes' environment failures are eval's (eval/env_*), not the next training step's
        self._counters = {k: self._counters.get(k, 0) + after[k] - before.get(k, 0) for k in after}
        m = episode_metrics(trajs, before, after)
        n = sum(has_outcome(t) for t in trajs)  # the episodes with an outcome: the rates are over them
        failed = sum(t.end in ENV_FAILURES and t.turns > 0 for t in trajs)  # a failed reset is no attempt
        dropped = failed if drop else 0
        if dropped:
            warn_dropped(dropped, len(trajs), "ended in an environment failure (env_error, env_timeout)")
        missed = Counter(no_attempt(t.turns, t.end) for t in trajs if not t.untrained)
        aborted = sum(t.untrained for t in trajs)
        out: dict[str, float | None] = {
            "eval/n": float(n),
            "eval/failed_episodes": float(failed),  # counted as unsuccessful, in eval/n
            "eval/dropped_episodes": float(dropped),  # of those, what on_failure=drop keeps out of training
            "eval/aborted_episodes": float(aborted),  # refused by the engine: not in eval/n
            # never attempted (no turn): not in eval/n (_episode_drops)
            "eval/reset_failed_episodes": float(missed["reset_failed"]),
            "eval/context_refused_episodes": float(missed["context_refused"]),
            **{f"eval/end_{k.removeprefix('episode/end_')}": v for k, v in m.items() if k.startswith("episode/end_")},
            **{f"eval/{k.removeprefix('env/')}": v for k, v in m.items() if k.startswith("env/")},
        }
        if n:
            stderr = rate_stderr(m["reward/accuracy"], n)  # as roll-eval's (roll_core.evaluate.episode_result)
            out.update(
                {
                    "eval/accuracy": m["reward/accuracy"],  # = success rate (the summary and sweeps read it)
                    "eval/accuracy_stderr": stderr,
                    "eval/success_rate": m["reward/accuracy"],
                    "eval/success_rate_stderr": stderr,
                    "eval/reward": m["reward/mean"],
                    "eval/mean_turns": m["episode/turns_mean"],
                    "eval/invalid_action_rate": m["episode/invalid_action_rate"],
                    "eval/tool_calls_mean": m["episode/tool_calls_mean"],
                    **{f"eval/{k}_mean": m[f"episode/{k}_mean"] for k in INFO_COUNTERS},
                }
            )
        else:  # no rate over nothing: a 0.0 read as a model that failed every episode
            warn_nothing_evaluated(len(trajs), {"aborted": aborted, **missed})
        out["eval/seconds"] = time.perf_counter() - t0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}  # training seeds follow from (run seed, step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def summary(self) -> dict[str, Any]:
        """The rows the task's data files lost (`data_counts`: a dataset-backed environment's training rows left
        out as held out); environment failures are per-step metrics (env/*)."""
        return data_counts(self.task)

    def close(self) -> None:
        self.envs.close()

    # ---- pieces -------------------------------------------------------------------------------------------
    #: First environment slot of evaluation episodes (background episodes of an asynchronous collector use the
    #: slots below it).
    eval_slot = 0

    def train_seeds(self, step: int) -> list[int]:
        """The environment seeds of step `step`'s groups (from the run seed and the step only)."""
        seed = derive_seed(self.cfg.pipeline.seed, Purpose.EPISODE_SEEDS, step)
        return self.task.train_seeds(self.cfg.pipeline.rollout_batch_size, seed)

    def collected(self, step: int, trajs: list[Trajectory], out: StepLog) -> Collected | None:
        """Metrics, samples and the trajectory batch of finished episodes (None: nothing to train on)."""
        now = self.envs.counters()
        drop = score_failures(self.task, trajs)
        out.update(episode_metrics(trajs, self._counters, now, drop_failures=drop))
        self._counters = now
        self._log_episodes(step, trajs)
        # an episode without a turn gives nothing to train on; one whose environment failed later, per on_failure;
        # an untrained episode (cut by an aborted turn) would be all masked: a forward pass for nothing
        causes = [drop_cause(t.untrained, t.turns, t.end, drop and t.end in ENV_FAILURES) for t in trajs]
        kept = [t for t, cause in zip(trajs, causes) if cause is None]
        out.update(drop_metrics(causes))  # data/dropped_episodes and its causes (_episode_drops)
        out.update(data_metrics(data_counts(self.task)))  # data/skipped_rows, data/also_held_out
        if not kept:
            return None
        tensors = to_tensors(kept, self.tokenizer.pad_token_id or 0)
        fields = {"state_keys": tensors.pop("state_keys"), "env_seed": [t.env_seed for t in kept]}
        if "mm_inputs" in tensors:
            fields["mm_inputs"] = tensors.pop("mm_inputs")
        batch = Batch(tensors, fields)
        versions = self.behaviour_versions(kept)
        if versions is not None:  # generated ahead of the trainer: the trainer recomputes the proximal log-probs
            batch["behaviour_version"] = versions
        out["data/trained_groups"] = len({t.group for t in kept})
        return Collected(batch, batch["episode_rewards"].clone())

    def behaviour_versions(self, kept: list[Trajectory]) -> torch.Tensor | None:
        """(B,) long weight version of each kept episode's oldest token; None: all under the current weights."""
        return None

    def _log_episodes(self, step: int, trajs: list[Trajectory], k: int = 2) -> None:
        self.ctx.samples(
            step,
            [
                {
                    "env_seed": t.env_seed,
                    "turns": t.turns,
                    "success": t.success,
                    "end": t.end,
                    "reward": t.reward,
                    "responses": t.texts,
                }
                for t in trajs[:k]
            ],
        )


def score_failures(task: Any, trajs: list[Trajectory], held_out: bool = False) -> bool:
    """Apply the task's failure policy to episodes an environment step ended: with `on_failure: score` (or a task
    without one) the failing turn's reward becomes `failure_reward` (0.0 without one), in place. Returns whether
    failed episodes are to be dropped (`on_failure: drop`): their rewards are then left as they are (no outcome,
    `episode_metrics(..., drop_failures=True)` leaves them out), except for `held_out` episodes (evaluation), which
    are scored `failure_reward` whatever the policy: evaluation counts every environment failure as an unsuccessful
    attempt."""
    policy = getattr(task, "on_failure", "score")
    if policy not in ("score", "drop"):
        raise ConfigError(f"env.on_failure={policy!r} must be score or drop")
    if policy == "drop" and not held_out:  # scored anyway, a dropped episode's failure_reward was in reward/mean
        return True
    reward = float(getattr(task, "failure_reward", 0.0))
    for t in trajs:
        if t.end in ENV_FAILURES and t.turn_rewards:
            t.turn_rewards[-1] = reward  # the rollout ended the episode on this turn's step
    return policy == "drop"


def warn_dropped(dropped: int, total: int, how: str) -> None:
    """The warning of an evaluation that counted `dropped` of its `total` held-out episodes, which `how` ended and
    `env.on_failure=drop` keeps out of training, as unsuccessful attempts (eval/dropped_episodes)."""
    log.warning(
        "%d of %d held-out episode(s) %s: env.on_failure=drop keeps such episodes out of training, evaluation counts "
        "them as unsuccessful attempts (in eval/n and eval/accuracy; eval/dropped_episodes)",
        dropped,
        total,
        how,
    )


def has_outcome(t: Trajectory, drop_failures: bool = False) -> bool:
    """Whether episode `t` has an outcome the reward and episode metrics count: not `untrained`, attempted (its
    reset did not fail, its first prompt fit the context: `_episode_drops.no_attempt`), and not an environment
    failure under `on_failure: drop` (`drop_failures`, training only)."""
    if t.untrained or no_attempt(t.turns, t.end) is not None:
        return False
    return not (drop_failures and t.end in ENV_FAILURES)


def episode_metrics(
    trajs: list[Trajectory],
    before: dict[str, int] | None,
    after: dict[str, int] | None,
    drop_failures: bool = False,
) -> dict[str, float]:
    """Success rate, turns, invalid actions, tool calls (and the env's other info counters), lengths and end
    reasons of finished episodes; with `before`/`after` environment counters, their change (env/<counter>).

    Every metric but the end reasons (episode/end_<reason>, over all episodes) is over the episodes with an outcome
    (`has_outcome`): an `untrained` one (end `abort`: a turn aborted for good cut it) has a partial reward and a
    shortened length that describe the engine, not the policy (they pulled reward/mean and the success rate down); nor
    has one the policy never had a turn in (a failed reset, a first prompt over the context); so has an episode an
    environment failure ended when `drop_failures` (`on_failure: drop` in training: the episode is not trained, and the
    metrics describe what was). With no episode left, those metrics (reward/*, the episode/ rates and means,
    response/length_mean) are absent: reward/mean 0.0 over no episode read as a policy scoring 0."""
    ends = Counter(t.end for t in trajs)
    n_all = max(len(trajs), 1)
    resumed = sum(t.resumed_turns for t in trajs)
    trajs = [t for t in trajs if has_outcome(t, drop_failures)]
    if not trajs:  # nothing to average: the end reasons, the resumed turns and the env counters only
        out = {"episode/resumed_turns": float(resumed)}
        return _ends_and_counters(out, ends, n_all, before, after)
    n = len(trajs)
    turns = sum(t.turns for t in trajs)
    rewards = [t.reward for t in trajs]
    mean = sum(rewards) / n
    std = (sum((r - mean) ** 2 for r in rewards) / (n - 1)) ** 0.5 if n > 1 else 0.0
    out = {
        "reward/mean": mean,
        "reward/std": std,
        "reward/accuracy": sum(t.success for t in trajs) / n,
        "episode/success_rate": sum(t.success for t in trajs) / n,
        "episode/turns_mean": turns / n,
        "episode/invalid_action_rate": sum(t.invalid_actions for t in trajs) / max(turns, 1),
        "episode/tool_calls_mean": sum(t.tool_calls for t in trajs) / n,
        # the env's info counters (roll_core.interfaces.agentic.INFO_COUNTERS), per episode as tool_calls
        **{f"episode/{k}_mean": sum(t.counters.get(k, 0) for t in trajs) / n for k in INFO_COUNTERS},
        "episode/cut_turn_rate": sum(t.cut_turns for t in trajs) / max(turns, 1),  # by max_tokens_per_turn
        # by the context: a budget cut to what was left of max_context_length, or the engine's own context
        "episode/context_cut_turn_rate": sum(t.context_cut_turns for t in trajs) / max(turns, 1),
        "episode/length_mean": sum(t.length for t in trajs) / n,
        "response/length_mean": sum(sum(t.mask) for t in trajs) / max(turns, 1),  # generated tokens per turn
        "episode/resumed_turns": float(resumed),  # turn requests an abort interrupted, resumed (partial rollout)
    }
    return _ends_and_counters(out, ends, n_all, before, after)


def _ends_and_counters(
    out: dict[str, float],
    ends: Counter[str],
    n_all: int,
    before: dict[str, int] | None,
    after: dict[str, int] | None,
) -> dict[str, float]:
    """`out` with the end reasons' shares of all `n_all` episodes and the environment counters' change."""
    for reason, count in ends.items():
        out[f"episode/end_{reason}"] = count / n_all
    if before is not None and after is not None:
        for k in after:
            out[f"env/{k}"] = float(after[k] - before.get(k, 0))
    return out
