"""The training-time evaluation of the episode collectors (`pipeline=agentic`, `pipeline=agent`) logs the held-out
success rate with its standard error over the held-out episodes with an outcome (eval/success_rate_stderr and
eval/accuracy_stderr, roll_core.eval_metrics.rate_stderr, as roll-eval's results have it; they logged the rate
alone), and the run's report shows it as `mean ± standard error`. Values by hand: 3 of 8 episodes succeed, rate
0.375, standard error sqrt(0.375 * 0.625 / 7) = sqrt(0.0334821...) = 0.18298...; an aborted episode (no outcome) is
not one of the 8."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.agentic.trajectory import Trajectory
from roll_core.interfaces import SamplingParams
from roll_core.pipelines.collectors.agents import AgentCollector, Episode
from roll_core.pipelines.collectors.episodes import EpisodeCollector

#: 3 of 8: sqrt(p (1 - p) / (n - 1)) by hand = sqrt(0.234375 / 7) = 0.182981...
SE_3_OF_8 = 0.182981
_CFG = SimpleNamespace(pipeline=SimpleNamespace(eval_temperature=0.0, seed=1))


def _traj(i: int, *, success: bool, untrained: bool = False) -> Trajectory:
    t = Trajectory(env_seed=i, group=i, prompt_ids=[1], end="abort" if untrained else "terminated", success=success)
    t.add_response([5, 6], [-0.1] * 2)
    t.turn_rewards.append(1.0 if success else 0.0)
    t.untrained = untrained
    return t


def _outcomes(successes: int, failures: int, aborted: int) -> list[tuple[bool, bool]]:
    """(success, aborted) of each held-out episode."""
    return [(True, False)] * successes + [(False, False)] * failures + [(False, True)] * aborted


def _agentic(outcomes: list[tuple[bool, bool]]) -> dict[str, Any]:
    """`EpisodeCollector.evaluate` over held-out episodes with these outcomes (the rollout stubbed)."""
    c = EpisodeCollector.__new__(EpisodeCollector)
    c.cfg, c.sampling, c._counters = _CFG, SamplingParams(max_new_tokens=4), {}
    c.task = SimpleNamespace(on_failure="score", failure_reward=0.0)
    c.envs = SimpleNamespace(counters=dict)
    c.eval_seeds = list(range(len(outcomes)))
    trajs = [_traj(i, success=s, untrained=a) for i, (s, a) in enumerate(outcomes)]
    c.rollout = SimpleNamespace(run=lambda seeds, groups, params, first_slot=0: trajs)
    return c.evaluate(3)


def _agent(outcomes: list[tuple[bool, bool]]) -> dict[str, Any]:
    """`AgentCollector.evaluate` over held-out agent-program episodes with these outcomes (`run` stubbed)."""
    c = AgentCollector.__new__(AgentCollector)
    c.cfg, c.ctx = _CFG, SimpleNamespace(sampling=SamplingParams(max_new_tokens=4))
    c.task = SimpleNamespace(eval_rows=lambda: [{"row": i} for i in range(len(outcomes))])
    counters = dict.fromkeys(
        ("requests", "engine_errors", "rewrites", "replays", "dropped_turns", "invalid_tool_calls"), 0
    )
    session = SimpleNamespace(**counters, constrained_turns=0, resumed=0)
    episodes = [
        Episode({"row": i}, _traj(i, success=s, untrained=a), float(s), None, session)  # type: ignore[arg-type]
        for i, (s, a) in enumerate(outcomes)
    ]
    c.run = lambda runs, params: episodes  # type: ignore[method-assign]
    return c.evaluate(3)


@pytest.mark.parametrize("evaluate", [_agentic, _agent], ids=["agentic", "agent"])
def test_the_held_out_success_rate_is_logged_with_its_standard_error_over_the_episodes(evaluate: Any) -> None:
    m = evaluate(_outcomes(successes=3, failures=5, aborted=1))  # 9 rows; the aborted one has no outcome
    assert m["eval/n"] == 8.0
    assert m["eval/success_rate"] == 0.375 and m["eval/accuracy"] == 0.375
    assert m["eval/success_rate_stderr"] == pytest.approx(math.sqrt(0.375 * 0.625 / 7))
    assert m["eval/success_rate_stderr"] == pytest.approx(SE_3_OF_8, abs=1e-6)  # not over the 9 rows (0.17116)
    assert m["eval/accuracy_stderr"] == m["eval/success_rate_stderr"]
    # every success (or every failure): no spread; one episode: none to estimate (null, as roll-eval's results)
    assert evaluate(_outcomes(successes=4, failures=0, aborted=0))["eval/success_rate_stderr"] == 0.0
    one = evaluate(_outcomes(successes=1, failures=0, aborted=2))
    assert one["eval/n"] == 1.0 and one["eval/success_rate_stderr"] is None and one["eval/accuracy_stderr"] is None


def test_the_run_report_shows_the_held_out_success_rate_with_its_standard_error(tmp_path: Path) -> None:
    from roll_core.config import load_config
    from roll_core.report import headline, write_run_report

    history = [
        {"step": 0, "eval/success_rate": 0.375, "eval/success_rate_stderr": SE_3_OF_8, "eval/n": 8.0},
        {"step": 1, "reward/mean": 0.5},
        {"step": 2, "eval/success_rate": 0.75, "eval/success_rate_stderr": 0.163663, "eval/accuracy": 0.75},
        {"step": 4, "eval/success_rate": 0.625, "eval/success_rate_stderr": None},  # one episode: no error
    ]
    rows = {r["key"]: r for r in headline(history)}
    rate = rows["eval/success_rate"]
    assert rate["first"] == (0, 0.375) and rate["best"] == (2, 0.75) and rate["last"] == (4, 0.625)
    assert rate["stderr"] == {"first": SE_3_OF_8, "best": 0.163663, "last": None}
    assert rows["eval/accuracy"]["stderr"] == {"first": None, "last": None, "best": None}  # logged none
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    cfg = load_config(["experiment=quickstart", "model=tiny"])
    text = write_run_report(out, cfg, status="finished", wall_seconds=1.0, checkpoints=[]).read_text()
    assert (
        "| held-out success rate (`eval/success_rate`) | 0.3750 ± 0.1830 (0) | 0.6250 (4) | 0.7500 ± 0.1637 (2) | 3 |"
        in text
    )
    assert "| held-out accuracy (`eval/accuracy`) | 0.7500 (2) | 0.7500 (2) | 0.7500 (2) | 1 |" in text
