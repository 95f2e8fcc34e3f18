"""The agent-program collector (`pipeline=agent`, synchronous): any program that speaks the OpenAI chat API is an
agentic rollout.

The collector serves roll's inference engines behind an OpenAI-compatible endpoint on 127.0.0.1
(roll_core.agentic.openai_server) for the whole run. A step draws `pipeline.rollout_batch_size` task rows (from
the run seed and the step only) and runs the task's agent program `algo.group_size` times on each, all
concurrently, every episode with a session of its own (`base_url = .../sessions/<id>/v1`; ids `ep<N>`, unique for the
run, resumes included: the count is the collector's checkpointed state). The program reports
its episode's reward by returning it or by POSTing it to the session's reward URL (a returned number wins). The
sessions record the exact ids the engine sampled per turn, token-in-token-out (roll_core.agentic.agent_sessions),
so the batch is trajectories like `pipeline=agentic`'s: the first prompt is the prompt, everything after it the
response with a loss mask of 1 on sampled tokens only, the behaviour log-probs, `group_ids` (one group per task
row) and the turn tensors; the episode's reward sits on its last turn.

Failures end the episode, never the run: a program that raises (`error`, a TimeoutError of its own included: a tool's
socket timeout is the program's failure), outlives `env.episode_timeout_s` (`timeout`: its session is closed, its
request in flight aborted, its next request refused with HTTP 410, and the task's `cancel_episode` stops what it
started, e.g. a command's process group; the task itself raises `EpisodeTimeout` for the same limit) or reports no
reward (`no_reward`) is counted in agent/failed_<kind> and, per `env.on_failure`, scored `env.failure_reward` (`score`)
or dropped (`drop`: out of the batch, counted in data/failure_dropped_episodes, and out of the reward and episode
metrics, as pipeline=agentic drops its environment failures; a step whose every episode was left out logs no reward/* or
episode rate). Evaluation drops nothing: a failed held-out episode is an unsuccessful attempt scored
`env.failure_reward` whatever `on_failure` says, in eval/n and eval/failed_episodes (those `drop` keeps out of training
also in eval/dropped_episodes, with a warning). An episode without a sampled turn gives nothing to train on
(data/unsampled_episodes; a failed one is still scored in the reward metrics, its failure is the program's); one whose
first request the context refused (HTTP 400, no turn sampled) was never an attempt of the policy, whatever the program
did after: out of the reward and episode metrics, agent/failed_* and eval/n too (data/context_refused_episodes,
eval/context_refused_episodes). Every episode left out
of the batch is counted in data/dropped_episodes and in the count of its cause
(roll_core.pipelines.collectors._episode_drops). An episode that ended at `env.max_turns` or the context limit (its last
request refused with HTTP 400) is not a failure, whatever the program did with the refusal, timing out or returning a
value that is no finite number included (that value is logged): it ended there, scored the reward it reported (a
finite number it returned, else one it POSTed), else 0 (the limit is the policy's doing: dropping such episodes hid a
policy that loops on tool calls). An episode whose last request the engine refused (HTTP 503 `engine_aborted`, no turn
sampled after it: the session keeps it `untrained`, end `abort`) is no failure of the agent's, whatever the program did
with the refusal: like `pipeline=agentic`'s untrained episodes it is left out of the batch (its row would train
nothing yet count in its group's reward statistics), counted in data/aborted_episodes (agent/aborted_episodes), not in
agent/failed_*, and out of the reward and episode metrics; only episode/end_abort counts it.

A request in flight when its episode's session closes (the episode timed out) is aborted; one that does not answer
the abort within `pipeline.async_abort_timeout_s`, or whose answer raises, is given up (roll_core.agentic.turn_gate)
and counted per step in async/unanswered_aborts and async/failed_aborts.

Metrics (reward and episode ones over the episodes with an outcome: not aborted, nor dropped): reward, success rate
(reward >= env.success_reward), turns, generated tokens, tool calls, failures by kind, history rewrites and the
turns they dropped, invalid tool-call blocks, turns resumed after the engine's own aborts, why episodes ended (a
timed-out episode is episode/end_env_timeout, its aborted request in flight notwithstanding). Evaluation: one
episode per held-out row (greedy unless pipeline.eval_temperature says otherwise); eval/success_rate (= eval/accuracy)
comes with its standard error over the eval/n episodes with an outcome (eval/success_rate_stderr,
eval/accuracy_stderr: roll_core.eval_metrics.rate_stderr, as roll-eval reports it; None for fewer than two), and
the failures by kind under the training names (agent/failed_timeout -> eval/failed_timeout, every agent/* counter
likewise) and why episodes ended (eval/end_<reason>). An evaluation none of whose episodes had an outcome logs
eval/n 0 and no rate or reward (a 0.0 read as a model that failed them all), with a warning naming why.
What the task's rows lost (DataCounts, roll_core.interfaces.tasks: training rows left out as held out) is in every
step's data/also_held_out and in the summary.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from roll_core.agentic.agent_sessions import AgentSession, AgentSessions, SessionLimits
from roll_core.agentic.trajectory import Trajectory, to_tensors
from roll_core.errors import ConfigError
from roll_core.eval_metrics import rate_stderr
from roll_core.interfaces import SamplingParams
from roll_core.interfaces.tasks import data_counts, data_metrics
from roll_core.pipelines.collectors import Collected, Collector, CollectorContext
from roll_core.pipelines.collectors._episode_drops import drop_cause, drop_metrics, no_attempt, warn_nothing_evaluated
from roll_core.pipelines.metrics import StepLog
from roll_core.protocol import Batch
from roll_core.seeds import Purpose, derive_seed

log = logging.getLogger(__name__)

FAILURES = ("error", "timeout", "no_reward")


class EpisodeTimeout(TimeoutError):
    """An agent program outlived `env.episode_timeout_s` (raised by a task's `run_episode`). A class of its own: any
    other TimeoutError a program raises (a socket or HTTP read timeout in its tools) is the program's error."""


@runtime_checkable
class AgentProgramTask(Protocol):
    """What `pipeline=agent` needs from its env (roll_envs.agentic.openai_agent.OpenAIAgentTask is one)."""

    is_agent_program: bool
    name: str
    max_turns: int
    max_tokens_per_turn: int
    max_context_length: int
    episode_timeout_s: float
    #: Tool-call parser of the model family (roll_core.agentic.openai_server.PARSERS, or module:Class).
    tool_parser: str
    #: restart | refuse (roll_core.agentic.agent_sessions).
    on_rewrite: str
    #: score | drop: what a failed episode becomes.
    on_failure: str
    failure_reward: float
    success_reward: float
    model_name: str
    chat_template_kwargs: dict[str, Any]

    def train_rows(self, count: int, seed: int) -> list[dict[str, Any]]:
        """`count` training task rows drawn with `seed`."""
        ...

    def eval_rows(self) -> list[dict[str, Any]]:
        """The held-out task rows."""
        ...

    def run_episode(self, base_url: str, reward_url: str, row: dict[str, Any]) -> float | None:
        """Run the agent program on one row against `base_url`; its reward or None (reported to `reward_url`, or
        none). Raises when the program fails; `EpisodeTimeout` when it outlived the episode timeout. A task may also
        have `cancel_episode(base_url)`, called when the collector's episode timeout fires: stop what the episode
        started (a command's processes); and `close()`, called when the collector closes: release what the task
        holds for its programs (their HTTP client)."""
        ...


def check_task(cfg: Any, task: Any) -> None:
    """An agent-program task, and a synchronous run."""
    if not getattr(task, "is_agent_program", False) or not isinstance(task, AgentProgramTask):
        raise ConfigError(f"pipeline=agent needs an agent-program env (env=openai_agent), got {type(task).__name__}")
    if cfg.pipeline.async_ratio > 0:
        raise ConfigError("pipeline=agent is synchronous: set pipeline.async_ratio=0")
    from roll_core.pipelines.collectors.episodes import refuse_prompt_only_settings

    refuse_prompt_only_settings(cfg)
    if task.on_failure not in ("score", "drop"):
        raise ConfigError(f"env.on_failure={task.on_failure!r} must be score or drop")


@dataclass
class Episode:
    """One finished episode: its trajectory (reward on the last turn), reward, and failure kind (None: none)."""

    row: dict[str, Any]
    traj: Trajectory
    reward: float
    failure: str | None
    session: AgentSession
    error: str = ""

    @property
    def aborted(self) -> bool:
        """The engine refused the episode's last request (503) and nothing was sampled after: no outcome."""
        return self.traj.untrained

    @property
    def context_refused(self) -> bool:
        """Its first request left no room within the context (HTTP 400): the policy never had a turn, no outcome."""
        return not self.aborted and no_attempt(self.traj.turns, self.traj.end, env_failures=False) is not None

    def drop_cause(self, drop_failures: bool) -> str | None:
        """Why the episode is left out of the batch (roll_core.pipelines.collectors._episode_drops), None: trained."""
        t = self.traj
        return drop_cause(t.untrained, t.turns, t.end, drop_failures and self.failure is not None, env_failures=False)


class AgentCollector:
    """Scored trajectory batches of agent-program episodes (see the module docstring)."""

    plot_keys: tuple[str, ...] = (
        "reward/mean",
        "episode/success_rate",
        "eval/success_rate",
        "episode/turns_mean",
        "agent/failed_episodes",
    )
    trajectories = True

    def __init__(self, ctx: CollectorContext) -> None:
        from roll_core.agentic.chat import TurnTemplate
        from roll_core.agentic.openai_server import OpenAIServer, text_decoder, tool_parser
        from roll_core.agentic.rollout import fit_engine_context

        check_task(ctx.cfg, ctx.task)
        if ctx.train is not None:  # the run-level constraint on every turn: refused as for episodes (roll-eval may)
            from roll_core.pipelines.collectors.episodes import refuse_turn_constraints

            refuse_turn_constraints(ctx.cfg)
        self.cfg, self.ctx, self.task, self.tokenizer = ctx.cfg, ctx, ctx.task, ctx.tokenizer
        task = self.task
        self.limits = SessionLimits(task.max_turns, task.max_tokens_per_turn, task.max_context_length)
        self.limits = fit_engine_context(self.limits, ctx.infer)  # never past the engine's context (warned)
        # The model preset's kwargs (model.chat_template_kwargs), then the task's own on top.
        kwargs = {**self.cfg.model.chat_template_kwargs, **task.chat_template_kwargs}
        template = TurnTemplate(self.tokenizer, chat_template_kwargs=kwargs)
        parser = tool_parser(task.tool_parser)
        self.sessions = AgentSessions(
            ctx.infer,
            template,
            text_decoder(self.tokenizer, tuple(getattr(parser, "markers", ()))),
            parser,
            on_rewrite=task.on_rewrite,
            # how long a request aborted by its session's close may take to answer before it is given up
            abort_timeout_s=self.cfg.pipeline.async_abort_timeout_s,
            # the engine's own aborts of a turn in a row, none with a token, before the agent gets 503 engine_aborted
            max_idle_aborts=self.cfg.pipeline.max_idle_aborts,
        )
        # The endpoint serves a request on a thread of its own until the turn is generated: one per episode running
        # at once (a step's rollout_batch_size x group_size, or the held-out rows), else the surplus waited unseen
        # for a thread (a fixed 256 held back a step of 512 episodes, their episode timeouts running).
        concurrency = max(self.cfg.pipeline.rollout_batch_size * self.cfg.algo.group_size, len(task.eval_rows()), 1)
        self.server = OpenAIServer(self.sessions, model_name=task.model_name, max_workers=concurrency)
        self.server.start()
        # Session ids (`ep<N>`, in the agent program's URLs and logs) are unique for the run, across resumes too: the
        # count is checkpointed (they restarted at ep0, so a program keeping per-session state, or logs joined across
        # the resume, mixed two episodes). A step redone after a resume (one after the checkpoint) reuses its ids.
        self._episodes = 0

    # ---- the collector contract ---------------------------------------------------------------------------
    def next(self, step: int, out: StepLog) -> Collected | None:
        """rollout_batch_size task rows x group_size episodes under the current weights."""
        algo, pipe = self.cfg.algo, self.cfg.pipeline
        rows = self.task.train_rows(pipe.rollout_batch_size, derive_seed(pipe.seed, Purpose.EPISODE_SEEDS, step))
        runs = [(row, g) for g, row in enumerate(rows) for _ in range(algo.group_size)]
        params = self.ctx.sampling.replace(seed=derive_seed(pipe.seed, Purpose.ROLLOUT, step))
        with out.timer("generate"):
            episodes = self.run(runs, params)
        drop = self.task.on_failure == "drop"
        out.update(agent_metrics(episodes, drop_failures=drop))  # the metrics describe what is trained
        out.update(self.sessions.gate.stats())  # aborted requests given up since the last step (its evaluation's too)
        self._log_samples(step, episodes)
        # An aborted episode's row is all masked: it would train nothing, yet its reward joined its group's statistics.
        causes = [e.drop_cause(drop) for e in episodes]
        kept = [e.traj for e, cause in zip(episodes, causes) if cause is None]
        out.update(drop_metrics(causes))  # data/dropped_episodes and its causes (_episode_drops)
        out.update(data_metrics(data_counts(self.task)))  # data/skipped_rows, data/also_held_out
        if not kept:
            return None
        tensors = to_tensors(kept, self.tokenizer.pad_token_id or 0)
        batch = Batch(tensors, {"state_keys": tensors.pop("state_keys"), "env_seed": [t.env_seed for t in kept]})
        out["data/trained_groups"] = len({t.group for t in kept})
        out["perf/rollout_tokens_per_s"] = float(batch["response_mask"].sum()) / max(out.timers["generate"], 1e-9)
        return Collected(batch, batch["episode_rewards"].clone())

    def begin_sync(self) -> None:
        return None  # no episode runs between two steps

    def finish_sync(self, version: int) -> None:
        return None

    def evaluate(self, step: int) -> dict[str, float | None]:
        """One episode per held-out row at the eval temperature (0: greedy); the success rate (also as eval/accuracy)
        with its standard error over the `eval/n` episodes with an outcome (`<rate>_stderr`,
        roll_core.eval_metrics.rate_stderr; None for fewer than two). A failed episode is an unsuccessful attempt
        (scored env.failure_reward) whatever env.on_failure says: in eval/n, and in eval/dropped_episodes (with a
        warning) when `drop` keeps such episodes out of training."""
        from roll_core.pipelines.collectors.episodes import warn_dropped

        t0 = time.perf_counter()
        rows = self.task.eval_rows()
        t = self.cfg.pipeline.eval_temperature
        params = self.ctx.sampling.replace(
            temperature=self.ctx.sampling.temperature if t is None else float(t),
            seed=derive_seed(self.cfg.pipeline.seed, Purpose.EVAL),
        )
        episodes = self.run([(row, i) for i, row in enumerate(rows)], params)
        m = agent_metrics(episodes)
        refused = sum(e.context_refused for e in episodes)
        n = len(episodes) - int(m["agent/aborted_episodes"]) - refused  # with an outcome: the rates are over them
        dropped = int(m["agent/failed_episodes"]) if getattr(self.task, "on_failure", "score") == "drop" else 0
        if dropped:
            warn_dropped(dropped, len(episodes), "failed (agent/failed_*: an error, a timeout, no reward)")
        out: dict[str, float | None] = {
            # the failures by kind and the endpoint's counters, under training's names (agent/failed_timeout ...)
            **{f"eval/{k.removeprefix('agent/')}": v for k, v in m.items() if k.startswith("agent/")},
            "eval/dropped_episodes": float(dropped),  # failed, counted unsuccessful; on_failure=drop skips training
            "eval/context_refused_episodes": float(refused),  # first request over the context: not in eval/n
            **{f"eval/end_{k.removeprefix('episode/end_')}": v for k, v in m.items() if k.startswith("episode/end_")},
            "eval/n": float(n),
        }
        if n:
            stderr = rate_stderr(m["episode/success_rate"], n)  # as roll-eval's (roll_core.evaluate.episode_result)
            out.update(
                {
                    "eval/accuracy": m["episode/success_rate"],  # the summary and sweeps read it
                    "eval/accuracy_stderr": stderr,
                    "eval/success_rate": m["episode/success_rate"],
                    "eval/success_rate_stderr": stderr,
                    "eval/reward": m["reward/mean"],
                    "eval/mean_turns": m["episode/turns_mean"],
                }
            )
        else:  # no rate over nothing: a 0.0 read as a model that failed every episode
            why = {"aborted": int(m["agent/aborted_episodes"]), "context_refused": refused}
            warn_nothing_evaluated(len(episodes), why)
        out["eval/seconds"] = time.perf_counter() - t0
        return out

    def state_dict(self) -> dict[str, Any]:
        """The episodes run so far (the next session id's number); training rows follow from (run seed, step)."""
        return {"episodes": self._episodes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the session ids after the checkpoint's (a checkpoint written before they were saved has none:
        they start at ep0 again, with a warning)."""
        episodes = state.get("episodes")
        if episodes is None:
            log.warning("the checkpoint has no agent session count: session ids restart at ep0 (ids before it repeat)")
            return
        if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 0:
            raise ValueError(f"the checkpoint's agent session count is {episodes!r}, not a count of episodes")
        self._episodes = max(self._episodes, episodes)

    def summary(self) -> dict[str, Any]:
        """The rows the task's files lost (`data_counts`: training rows left out as held out)."""
        return data_counts(self.task)

    def close(self) -> None:
        self.server.close()
        close = getattr(self.task, "close", None)  # what the task holds for its programs (an HTTP client)
        if close is not None:
            close()

    # ---- episodes -----------------------------------------------------------------------------------------
    def run(self, runs: list[tuple[dict[str, Any], int]], params: SamplingParams) -> list[Episode]:
        """One episode per (row, group) pair, all concurrently; episodes in the input order."""
        first = self._episodes
        self._episodes += len(runs)
        with ThreadPoolExecutor(max_workers=max(1, len(runs)), thread_name_prefix="roll-agent-episode") as pool:
            futures = [
                pool.submit(self.episode, f"ep{first + i}", row, group, i, params)
                for i, (row, group) in enumerate(runs)
            ]
            return [f.result() for f in futures]

    def episode(self, sid: str, row: dict[str, Any], group: int, index: int, params: SamplingParams) -> Episode:
        """Run the program once on session `sid`; its failure, if any, is counted, never raised."""
        self.sessions.open(sid, params, self.limits, group=group, index=index)
        result: dict[str, Any] = {}

        def program() -> None:
            try:
                result["reward"] = self.task.run_episode(self.server.base_url(sid), self.server.reward_url(sid), row)
            except BaseException as exc:  # the program's own failure: the episode's, never the run's
                result["error"] = exc

        # A daemon thread: a program stuck outside its requests cannot keep the run from ending.
        thread = threading.Thread(target=program, name=f"roll-agent-{sid}", daemon=True)
        thread.start()
        thread.join(self.task.episode_timeout_s)
        timed_out = thread.is_alive()
        session = self.sessions.close(sid)  # aborts a request in flight; later requests get HTTP 410
        if timed_out:
            cancel = getattr(self.task, "cancel_episode", None)
            if cancel is not None:  # a command's processes would outlive the episode, and the run
                try:
                    cancel(self.server.base_url(sid))
                except Exception:  # the episode is failed either way; the run goes on
                    log.exception("episode %s: cancelling the timed-out program failed", sid)
            thread.join(5.0)  # its pending request now fails: give the program a moment to return
        reward, failure, error = _outcome(result, session, timed_out)
        if session.traj.untrained:  # the engine refused the last request (503): whatever the program did, no outcome
            log.warning("episode %s: the engine refused its last request (503 engine_aborted); not trained", sid)
            reward, failure, error = 0.0, None, ""
        if failure is not None:
            log.warning("episode %s failed (%s): %s", sid, failure, error or "no reward reported")
            reward = self.task.failure_reward
        elif error:  # a limit ended it: what the program returned after is no failure, but is not silently lost
            log.warning("episode %s ended at its %s limit; %s", sid, session.traj.end, error)
        traj = session.finish(reward, _END[failure])
        if failure == "timeout":  # not the `abort` its closing left on a request in flight: the episode timed out
            traj.end = "env_timeout"
        traj.success = failure is None and not traj.untrained and reward >= self.task.success_reward
        return Episode(row, traj, reward, failure, session, error)

    def _log_samples(self, step: int, episodes: list[Episode], k: int = 2) -> None:
        self.ctx.samples(
            step,
            [
                {
                    "task": e.row,
                    "turns": e.traj.turns,
                    "reward": e.reward,
                    "failure": e.failure,
                    "end": e.traj.end,
                    "responses": e.traj.texts,
                }
                for e in episodes[:k]
            ],
        )


_END = {None: "terminated", "error": "env_error", "timeout": "env_timeout", "no_reward": "terminated"}


def _outcome(result: dict[str, Any], session: AgentSession, timed_out: bool) -> tuple[float, str | None, str]:
    """(reward, failure kind or None, error text) of a finished program run. An episode a limit ended (end
    `max_turns`/`max_context`) is no failure whatever the program did: a value it returned that is no finite number
    scores the reward it reported before, else 0, with the text of what it returned (logged, no failure)."""
    exc = result.get("error")
    # The endpoint refused the last request past a limit: the episode ended there, whatever the program did after
    # (checked first: one that then hung until the episode timeout is no failure either, see the module docstring).
    limited = session.traj.end in ("max_turns", "max_context")
    if not limited and isinstance(exc, EpisodeTimeout):
        return 0.0, "timeout", str(exc)
    if not limited and timed_out:
        return 0.0, "timeout", "the program outlived env.episode_timeout_s"
    if exc is not None and not limited:
        return 0.0, "error", f"{type(exc).__name__}: {exc}"
    # A limited episode that raised or timed out: what it reported before counts, nothing it returned after.
    value = None if exc is not None or timed_out else result.get("reward")
    if value is None and limited and session.reward is None:
        return 0.0, None, ""
    if value is None:
        value = session.reward
    if value is None:
        return 0.0, "no_reward", ""
    number = _as_number(value)
    if (number is None or not math.isfinite(number)) and limited:
        # what it returned after the refusal is no failure either (it read `error`, dropped under on_failure=drop):
        # the reward it reported before, else 0; the text is logged, not a failure
        kept = session.reward if session.reward is not None else 0.0
        return kept, None, f"the program returned {value!r}, not a finite number: scored {kept:g}"
    if number is None or not math.isfinite(number):
        return 0.0, "error", f"the program returned {value!r}, not a finite number"
    return number, None, ""


def _as_number(value: Any) -> float | None:
    """A reward the program returned as a float: Python, NumPy or one-element torch numbers (np.float32(1.0) was
    a failed episode); None for anything else (bools, strings, arrays of several values)."""
    if type(value).__name__ in ("bool", "bool_"):  # Python and NumPy booleans are not rewards
        return None
    if isinstance(value, numbers.Real):  # int, float, NumPy scalars
        return float(value)
    if getattr(value, "ndim", None) == 0 or (hasattr(value, "numel") and value.numel() == 1):  # 0-d arrays, tensors
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def agent_metrics(episodes: list[Episode], drop_failures: bool = False) -> dict[str, float]:
    """Reward, success, turns, tokens, tool calls and failures of finished episodes (failed ones with their failure
    reward). The end reasons and the endpoint's counters are over every episode, the failure counts over the attempted
    ones (neither aborted nor context-refused), the rest over those with an outcome: not aborted (an aborted one's
    partial length and reward describe the engine's refusal, not the policy), nor refused its first request by the
    context (`Episode.context_refused`, whatever the program did after), nor failed when `drop_failures`
    (`env.on_failure=drop` in training: the episode is not trained, and the metrics describe what was). With none, the
    reward and episode metrics are absent (a reward/mean of 0.0 over no episode read as a policy scoring 0)."""
    everyone, n_all = episodes, max(len(episodes), 1)
    episodes = [e for e in episodes if not e.aborted]
    aborted = len(everyone) - len(episodes)
    episodes = [e for e in episodes if not e.context_refused]  # never attempted: no outcome (_episode_drops)
    # an attempt's failures only: a refused first request's program that then returned a non-finite reward was
    # counted failed (in eval/failed_episodes, "in eval/n") though out of eval/n (its drop cause is context_refused)
    failures = Counter(e.failure for e in episodes if e.failure)
    if drop_failures:
        episodes = [e for e in episodes if not e.failure]
    n = max(len(episodes), 1)
    rewards = [e.reward for e in episodes] or [0.0]
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5 if len(rewards) > 1 else 0.0
    turns = sum(e.session.requests for e in episodes)
    # Per-turn rates over the turns kept in the trajectories (a history restart drops earlier requests' turns).
    kept = sum(e.traj.turns for e in episodes)
    out = {
        "reward/mean": mean,
        "reward/std": std,
        "reward/accuracy": sum(e.traj.success for e in episodes) / n,
        "episode/success_rate": sum(e.traj.success for e in episodes) / n,
        "episode/turns_mean": turns / n,
        "episode/tokens_mean": sum(sum(e.traj.mask) for e in episodes) / n,  # trained (sampled) tokens
        "episode/tool_calls_mean": sum(e.traj.tool_calls for e in episodes) / n,
        "episode/cut_turn_rate": sum(e.traj.cut_turns for e in episodes) / max(kept, 1),  # by the turn's limit
        # by the context: a budget cut to what was left of max_context_length, or the engine's own context
        "episode/context_cut_turn_rate": sum(e.traj.context_cut_turns for e in episodes) / max(kept, 1),
        "response/length_mean": sum(sum(e.traj.mask) for e in episodes) / max(kept, 1),
        "agent/failed_episodes": float(sum(failures.values())),
        # the engine refused the last request (503): not the agent's failure, not trained
        "agent/aborted_episodes": float(aborted),
        # requests the engine failed (500 engine_error): their episodes ended untrained, counted above
        "agent/engine_errors": float(sum(e.session.engine_errors for e in everyone)),
        "agent/history_rewrites": float(sum(e.session.rewrites for e in everyone)),
        "agent/replayed_requests": float(sum(e.session.replays for e in everyone)),  # client retries answered again
        "agent/dropped_turns": float(sum(e.session.dropped_turns for e in everyone)),
        "agent/invalid_tool_calls": float(sum(e.session.invalid_tool_calls for e in everyone)),
        "agent/constrained_turns": float(sum(e.session.constrained_turns for e in everyone)),
        # turn requests the engine aborted on its own (preemption) and the endpoint resumed
        "agent/resumed_turns": float(sum(e.session.resumed for e in everyone)),
    }
    for kind in FAILURES:
        out[f"agent/failed_{kind}"] = float(failures.get(kind, 0))
    for reason, count in Counter(e.traj.end for e in everyone).items():
        out[f"episode/end_{reason}"] = count / n_all
    if not episodes:  # no episode to average over
        out = {k: v for k, v in out.items() if not k.startswith(_OVER_OUTCOMES)}
    return out


#: The prefixes of `agent_metrics`' keys computed over the episodes with an outcome.
_OVER_OUTCOMES = (
    "reward/",
    "episode/success_rate",
    "episode/turns_mean",
    "episode/tokens_mean",
    "episode/tool_calls_mean",
    "episode/cut_turn_rate",
    "episode/context_cut_turn_rate",
    "response/length_mean",
)


class _Agents:
    """`pipeline=agent`: episodes of an agent program against the OpenAI-compatible endpoint."""

    trajectories = True

    def check(self, cfg: Any, task: Any) -> None:
        check_task(cfg, task)

    def __call__(self, ctx: CollectorContext) -> Collector:
        return AgentCollector(ctx)


agent_collectors = _Agents()
