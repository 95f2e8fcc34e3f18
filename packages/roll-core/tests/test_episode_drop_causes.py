"""Why the episode collectors (pipeline=agentic, pipeline=agent) left an episode out, and what has an outcome
(roll_core.pipelines.collectors._episode_drops):

- data/dropped_episodes stays the total, and one metric per cause tells them apart (data/aborted_episodes,
  data/reset_failed_episodes, data/failure_dropped_episodes, data/context_refused_episodes, data/unsampled_episodes);
- an episode whose environment reset failed, or whose first prompt the context refused, was never an attempt of the
  policy: out of reward/mean (it weighed 0.0 there under on_failure=score: 3 successes + 1 failed reset read 0.75)
  and out of eval/n, counted apart;
- an evaluation none of whose episodes had an outcome logs eval/n 0 and no accuracy (it logged 0.0, a model that
  failed them all), with a warning naming why;
- pipeline=agent's evaluation reports its failures by kind under training's names (eval/failed_timeout ...).

The agentic episodes run for real (AgenticRollout, EnvManager) against a scripted environment and engine: seed 0 wins
on its first reply, seed 1's step raises, seeds 5 and 7 raise at reset, seeds 6 and 8 start with an observation
longer than the context.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.agentic.chat import TurnTemplate
from roll_core.agentic.env_manager import EnvManager
from roll_core.agentic.rollout import AgenticRollout, EpisodeLimits
from roll_core.agentic.trajectory import Trajectory
from roll_core.errors import ConfigError
from roll_core.interfaces import SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.collectors.agents import AgentCollector, Episode
from roll_core.pipelines.collectors.episodes import EpisodeCollector
from roll_core.pipelines.metrics import StepLog
from roll_core.testing.agent_endpoint import ScriptedTextEngine

FAILURE_REWARD = -0.5
RESET_FAILS, TOO_LONG = (5, 7), (6, 8)
_CFG = SimpleNamespace(
    pipeline=SimpleNamespace(eval_temperature=0.0, seed=1, rollout_batch_size=2),
    algo=SimpleNamespace(group_size=2),
)
CAUSES = ("aborted", "reset_failed", "failure_dropped", "context_refused", "unsampled")


class _Scripted:
    """See the module docstring."""

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        if seed in RESET_FAILS:
            raise RuntimeError("the environment's service is down")
        self.seed = seed
        return ("word " * 200 if seed in TOO_LONG else f"board {seed}"), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.seed == 1:
            raise RuntimeError("the tool crashed")
        return "won", 1.0, True, False, {"success": True}


@pytest.fixture
def agentic() -> Any:
    """A factory of episodes collectors (held-out seeds, on_failure) over the scripted environment and engine."""
    made: list[EpisodeCollector] = []

    def make(seeds: list[int], on_failure: str) -> EpisodeCollector:
        tok = build_tiny_tokenizer()
        c = EpisodeCollector.__new__(EpisodeCollector)
        c.cfg, c.sampling, c._counters = _CFG, SamplingParams(max_new_tokens=8), {}
        c.task = SimpleNamespace(on_failure=on_failure, failure_reward=FAILURE_REWARD)
        c.ctx = SimpleNamespace(samples=lambda step, rows: None)
        c.tokenizer = tok
        c.envs = EnvManager(_Scripted, 0, step_timeout_s=5.0, threads=8)
        engine = ScriptedTextEngine(tok, ["go"] * 64)
        # a first prompt of "board N" fits 512 tokens, one of 200 words does not
        c.rollout = AgenticRollout(engine, c.envs, TurnTemplate(tok, "Play."), tok, EpisodeLimits(2, 512, 8))
        c.eval_seeds = seeds
        made.append(c)
        return c

    yield make
    for c in made:
        c.envs.close()


def _train(c: EpisodeCollector, seeds: list[int]) -> tuple[Any, StepLog]:
    out = StepLog()
    trajs = c.rollout.run(seeds, [i // 2 for i in range(len(seeds))], SamplingParams(max_new_tokens=8))
    return c.collected(1, trajs, out), out


def test_a_failed_reset_does_not_weigh_in_reward_mean_under_score(agentic: Any) -> None:
    """3 episodes that win (reward 1.0) and 1 whose reset failed, on_failure=score: reward/mean 1.0 and the success
    rate 1.0 over the 3 attempts (old: 0.75 and 0.75, the reset scored 0.0), the reset counted in its own metric."""
    collected, out = _train(agentic([], "score"), [0, 0, 0, 5])
    assert len(collected.batch) == 3 and collected.scores.tolist() == [1.0, 1.0, 1.0]
    assert out["reward/mean"] == 1.0 and out["episode/success_rate"] == 1.0  # old: 0.75, 0.75
    assert out["data/reset_failed_episodes"] == 1 and out["data/dropped_episodes"] == 1
    assert out["episode/end_env_error"] == 0.25  # still counted among the end reasons, over every episode
    assert out["env/env_errors"] == 1.0


def test_data_dropped_episodes_is_the_total_of_one_metric_per_cause(agentic: Any) -> None:
    """Under drop: a win, a failed step (dropped per on_failure), a failed reset and a first prompt over the context
    are told apart (old: data/dropped_episodes 3 alone); the per-cause counts add up to the total."""
    collected, out = _train(agentic([], "drop"), [0, 1, 5, 6])
    assert len(collected.batch) == 1
    assert out["data/dropped_episodes"] == 3
    counts = {c: out[f"data/{c}_episodes"] for c in CAUSES}
    assert counts == {"aborted": 0, "reset_failed": 1, "failure_dropped": 1, "context_refused": 1, "unsampled": 0}
    assert sum(counts.values()) == out["data/dropped_episodes"]
    assert out["reward/mean"] == 1.0  # the context-refused episode scored 0.0 in it before (old: 0.5)


def test_agentic_evaluation_leaves_unattempted_episodes_out_of_eval_n(agentic: Any) -> None:
    """One win, one failed reset, one first prompt over the context: a success rate of 1.0 on eval/n 1, the other two
    counted apart (old: 1/3 on eval/n 3, the reset counted in eval/failed_episodes)."""
    m = agentic([0, 5, 6], "score").evaluate(1)
    assert (m["eval/n"], m["eval/accuracy"], m["eval/success_rate"]) == (1.0, 1.0, 1.0)
    assert (m["eval/reset_failed_episodes"], m["eval/context_refused_episodes"]) == (1.0, 1.0)
    assert (m["eval/failed_episodes"], m["eval/aborted_episodes"]) == (0.0, 0.0)


@pytest.mark.parametrize(
    ("seeds", "why"),
    [(list(RESET_FAILS), "2 environment reset(s) failed"), (list(TOO_LONG), "2 first prompt(s) over the context")],
)
def test_an_agentic_evaluation_with_nothing_attempted_logs_no_accuracy(
    agentic: Any, seeds: list[int], why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every reset failed, or every first prompt is over the context: eval/n 0 and no eval/accuracy, reward or rate
    (old: eval/accuracy 0.0 as if the model had failed them all), with a warning naming why; roll-eval refuses to
    report a rate, naming the cause (it blamed the inference engine)."""
    from roll_core.evaluate import episode_result

    with caplog.at_level("WARNING"):
        m = agentic(seeds, "score").evaluate(1)
    assert m["eval/n"] == 0.0
    absent = ("eval/accuracy", "eval/success_rate", "eval/reward", "eval/accuracy_stderr", "eval/mean_turns")
    assert not [k for k in absent if k in m], sorted(m)  # old: eval/accuracy 0.0
    assert f"nothing evaluated: none of the 2 held-out episode(s) had an outcome ({why}" in caplog.text
    with pytest.raises(ConfigError, match="no held-out episode had an outcome") as err:
        episode_result(m, "scripted", agentic=True)
    assert "inference engine" not in str(err.value).split("(", 1)[1].split(")")[0]
    assert ("failed at their environment's reset" if seeds == list(RESET_FAILS) else "over the context") in str(
        err.value
    )


# ---- pipeline=agent ------------------------------------------------------------------------------------------

_ENDS = {None: "terminated", "timeout": "env_timeout", "error": "env_error", "no_reward": "terminated"}


def _episode(i: int, failure: str | None, turns: int = 1, end: str | None = None, aborted: bool = False) -> Episode:
    """An agent-program episode as `AgentCollector.episode` leaves it: `failure` None succeeded (reward 1), else
    failed (reward failure_reward); `turns` 0 sampled nothing (`end` max_context: its first request was refused)."""
    t = Trajectory(env_seed=i, group=i // 2, prompt_ids=[1, 2], end=end or _ENDS[failure], untrained=aborted)
    for _ in range(turns):
        t.add_response([5, 6], [-0.1] * 2)
        t.turn_rewards.append(0.0)
        t.state_keys.append(f"s{i}")
    reward = 1.0 if failure is None and turns and not aborted else FAILURE_REWARD if failure else 0.0
    if t.turn_rewards:
        t.turn_rewards[-1] = reward
    t.success = reward >= 1.0
    counters = dict.fromkeys(("requests", "engine_errors", "rewrites", "replays", "dropped_turns"), 0)
    session = SimpleNamespace(**counters, invalid_tool_calls=0, constrained_turns=0, resumed=0)
    session.requests = max(turns, 1)
    return Episode({"row": i}, t, reward, failure, session)  # type: ignore[arg-type]


def _agent(episodes: list[Episode], on_failure: str) -> AgentCollector:
    c = AgentCollector.__new__(AgentCollector)
    c.cfg, c.tokenizer = _CFG, build_tiny_tokenizer()
    c.ctx = SimpleNamespace(sampling=SamplingParams(max_new_tokens=4), samples=lambda step, rows: None)
    c.task = SimpleNamespace(
        on_failure=on_failure,
        eval_rows=lambda: [{"row": i} for i in range(len(episodes))],
        train_rows=lambda count, seed: [{"row": i} for i in range(count)],
    )
    c.sessions = SimpleNamespace(gate=SimpleNamespace(stats=dict))
    c.run = lambda runs, params: episodes  # type: ignore[method-assign]
    return c


def test_agent_training_counts_each_drop_cause_and_leaves_context_refusals_out_of_reward() -> None:
    """Under score: 2 wins and 1 episode whose first request the context refused read reward/mean 1.0 (old: 2/3).
    Under drop: a win, a timed-out episode with a turn, a program error before any request, a refused first
    request and an engine-aborted episode are each counted in their cause; the causes add up to the total."""
    scored = StepLog()
    refused = _episode(2, None, turns=0, end="max_context")
    _agent([_episode(0, None), _episode(1, None), refused], "score").next(1, scored)
    assert scored["reward/mean"] == 1.0 and scored["episode/success_rate"] == 1.0  # old: 2/3, 2/3
    assert scored["data/context_refused_episodes"] == 1 and scored["data/dropped_episodes"] == 1
    out = StepLog()
    episodes = [
        _episode(0, None),
        _episode(1, "timeout"),
        _episode(2, "error", turns=0),
        _episode(3, None, turns=0, end="max_context"),
        _episode(4, None, end="abort", aborted=True),
        _episode(5, None, turns=0, end="terminated"),  # a program that reported a reward without asking anything
    ]
    collected = _agent(episodes, "drop").next(1, out)
    assert len(collected.batch) == 1 and out["data/dropped_episodes"] == 5
    counts = {c: out[f"data/{c}_episodes"] for c in CAUSES}
    assert counts == {"aborted": 1, "reset_failed": 0, "failure_dropped": 2, "context_refused": 1, "unsampled": 1}


def test_agent_evaluation_reports_failures_by_kind_under_training_names() -> None:
    """pipeline=agent's eval reports eval/failed_timeout, eval/failed_error, eval/failed_no_reward and the end
    reasons, as training's agent/failed_* and episode/end_* (old: eval/failed_episodes only)."""
    outcomes = [None, "timeout", "timeout", "error", "no_reward"]
    episodes = [_episode(i, f) for i, f in enumerate(outcomes)]
    m = _agent(episodes, "score").evaluate(1)
    train = StepLog()
    _agent(episodes, "score").next(1, train)
    kinds = ("failed_timeout", "failed_error", "failed_no_reward", "failed_episodes", "aborted_episodes")
    assert {k: m[f"eval/{k}"] for k in kinds} == {k: train[f"agent/{k}"] for k in kinds}
    assert (m["eval/failed_timeout"], m["eval/failed_error"], m["eval/failed_no_reward"]) == (2.0, 1.0, 1.0)
    assert m["eval/end_env_timeout"] == 0.4 and m["eval/end_env_error"] == 0.2
    assert (m["eval/n"], m["eval/accuracy"]) == (5.0, 0.2)


def test_an_agent_evaluation_with_every_first_request_refused_logs_no_accuracy(caplog: Any) -> None:
    """Every held-out row's first request is over the context: eval/n 0, no eval/accuracy (old: 0.0 on eval/n 2),
    a warning naming why."""
    with caplog.at_level("WARNING"):
        m = _agent([_episode(i, None, turns=0, end="max_context") for i in range(2)], "score").evaluate(1)
    assert m["eval/n"] == 0.0 and m["eval/context_refused_episodes"] == 2.0
    assert "eval/accuracy" not in m and "eval/reward" not in m and "eval/success_rate" not in m
    assert "2 first prompt(s) over the context limit" in caplog.text


def test_an_empty_step_names_failed_resets_and_refused_first_prompts() -> None:
    """A step whose every episode failed at reset, or had its first prompt refused, names that cause in its
    empty-step warning (old: only data/dropped_episodes, "no sampled turn, aborted, or failed ...")."""
    from roll_core.pipelines.empty_steps import reasons

    named = [r[0] for r in reasons({"data/reset_failed_episodes": 4, "data/context_refused_episodes": 0})]
    assert named == ["data/reset_failed_episodes=4"]
    assert [r[0] for r in reasons({"data/context_refused_episodes": 2})] == ["data/context_refused_episodes=2"]


# ---- review (REVAG): a refused first request with a failure after it, failure kinds, the final accuracy -------


@pytest.mark.parametrize("on_failure", ["score", "drop"])
def test_a_refused_first_request_is_no_attempt_whatever_the_program_did_after(
    on_failure: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A win and an episode whose first request the context refused, after which the program returned a non-finite
    reward (a failure `error`): never attempted, under either policy. Old: eval/failed_episodes 1 (and, under drop,
    eval/dropped_episodes 1 with a warning that counted it "in eval/n") while eval/n 1 held only the win; in training
    its cause followed on_failure (failure_dropped under drop, context_refused under score)."""
    episodes = [_episode(0, None), _episode(1, "error", turns=0, end="max_context")]
    with caplog.at_level("WARNING"):
        m = _agent(episodes, on_failure).evaluate(1)
    assert (m["eval/n"], m["eval/accuracy"], m["eval/context_refused_episodes"]) == (1.0, 1.0, 1.0)
    assert (m["eval/failed_episodes"], m["eval/failed_error"], m["eval/dropped_episodes"]) == (0.0, 0.0, 0.0)
    assert "unsuccessful attempts" not in caplog.text  # old: the drop warning, under drop
    out = StepLog()
    _agent(episodes, on_failure).next(1, out)
    counts = {c: out[f"data/{c}_episodes"] for c in CAUSES}
    assert counts == {"aborted": 0, "reset_failed": 0, "failure_dropped": 0, "context_refused": 1, "unsampled": 0}
    assert out["agent/failed_episodes"] == 0.0 and out["reward/mean"] == 1.0


def test_an_all_failed_agent_evaluation_names_every_failure_kind(caplog: pytest.LogCaptureFixture) -> None:
    """roll-eval's warning when every held-out agent episode failed names the kinds from eval/failed_<kind>: 1
    timeout and 2 no_reward (old: "1 env_timeout", from the end reasons, where no_reward ends `terminated`)."""
    from roll_core.evaluate import episode_result

    m = _agent([_episode(i, f) for i, f in enumerate(["timeout", "no_reward", "no_reward"])], "score").evaluate(1)
    with caplog.at_level("WARNING"):
        episode_result(m, "agent", agentic=False)
    assert "every one of the 3 held-out episode(s) of agent" in caplog.text
    assert "(1 timeout, 2 no_reward)" in caplog.text, caplog.text


def test_an_all_failed_agentic_evaluation_keeps_failed_resets_apart(
    agentic: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Held out: seed 1's step raises (an attempt, in eval/n 1), seed 5's reset fails (not in eval/n): the warning
    names 1 env_error among the episodes in n and the reset apart (old: "2 env_error" for eval/n 1)."""
    from roll_core.evaluate import episode_result

    m = agentic([1, 5], "score").evaluate(1)
    assert (m["eval/n"], m["eval/failed_episodes"], m["eval/reset_failed_episodes"]) == (1.0, 1.0, 1.0)
    with caplog.at_level("WARNING"):
        episode_result(m, "scripted", agentic=True)
    assert "every one of the 1 held-out episode(s) of scripted" in caplog.text
    assert "(1 env_error; 1 more failed at reset, not in n)" in caplog.text, caplog.text


def test_a_final_evaluation_with_nothing_attempted_has_no_final_accuracy() -> None:
    """The last evaluation had no outcome (eval/n 0, no eval/accuracy: every reset failed): the run's
    final_eval_accuracy (what sweepers optimise) is None, not the earlier evaluation's 0.5 passing for the final
    model's; the best and first are still the evaluations that had a rate."""
    from roll_core.pipelines._run_summary import run_summary

    history = [
        {"step": 0, "eval/accuracy": 0.25, "eval/n": 4.0},
        {"step": 1, "eval/accuracy": 0.5, "eval/n": 4.0},
        {"step": 2, "reward/mean": 1.0, "eval/n": 0.0, "eval/reset_failed_episodes": 4.0},
    ]
    s = run_summary(history, [], wall_seconds=1.0, output_dir="run", signum=None, late=None, collector_summary={})
    assert s["final_eval_accuracy"] is None  # old: 0.5, step 1's
    assert (s["best_eval_accuracy"], s["first_eval_accuracy"]) == (0.5, 0.25)
    # a step that did not evaluate leaves the last evaluation's accuracy final
    untouched = [*history[:2], {"step": 2, "reward/mean": 1.0}]
    last = run_summary(untouched, [], wall_seconds=1.0, output_dir="run", signum=None, late=None, collector_summary={})
    assert last["final_eval_accuracy"] == 0.5


def test_the_progress_bar_shows_no_earlier_accuracy_after_an_evaluation_without_one() -> None:
    """A step whose evaluation had no outcome (eval/n 0) shows no eval_acc (old: the previous evaluation's 0.50
    stayed, as after a step that did not evaluate); one that did not evaluate keeps it."""
    from roll_core.pipelines._console import progress_fields

    previous = {"eval_acc": "0.50"}
    assert "eval_acc" not in progress_fields({"reward/mean": 1.0, "eval/n": 0.0}, previous)
    assert progress_fields({"reward/mean": 1.0}, previous)["eval_acc"] == "0.50"
