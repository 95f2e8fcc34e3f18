"""roll-eval of an agent program (pipeline=agent, env=openai_agent): `evaluate_model` asked every non-agentic task
for `eval_set()`, which an agent program does not have (it has `eval_rows()`), so every such evaluation was an
AttributeError before a model was loaded; and `--samples` was ignored there (every held-out row was evaluated).
The engine, cluster and tokenizer are stubbed; the collector's evaluation is the real AgentCollector's over
stubbed episodes (rows 0 and 1 succeed, the others fail).

By hand: --samples 3 keeps rows 0, 1, 2: rate 2/3, standard error sqrt((2/3)(1/3)/2) = 1/3; all 10 rows: rate
0.2, standard error sqrt(0.2 * 0.8 / 9) = 0.13333..."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

import roll_core.evaluate as evaluate
import roll_core.multimodal.processor as processor
from roll_core.agentic.trajectory import Trajectory
from roll_core.config import load_config
from roll_core.errors import ConfigError
from roll_core.interfaces import SamplingParams
from roll_core.pipelines.collectors.agents import AgentCollector, Episode

ROWS = 10


class _ProgramTask:
    """An agent-program task as evaluate_model sees it: held-out rows, no `eval_set`."""

    is_agent_program = True
    name = "toy_agent"

    def __init__(self, rows: int) -> None:
        self.rows = [{"row": i} for i in range(rows)]

    def eval_rows(self) -> list[dict[str, Any]]:
        return list(self.rows)


def _episode(row: dict[str, Any]) -> Episode:
    success = row["row"] < 2
    t = Trajectory(env_seed=row["row"], group=0, prompt_ids=[1], end="terminated", success=success)
    t.add_response([5, 6], [-0.1] * 2)
    t.turn_rewards.append(float(success))
    counters = dict.fromkeys(
        ("requests", "engine_errors", "rewrites", "replays", "dropped_turns", "invalid_tool_calls"), 0
    )
    session = SimpleNamespace(**counters, constrained_turns=0, resumed=0)
    return Episode(row, t, float(success), None, session)  # type: ignore[arg-type]


def _collector(ctx: Any) -> AgentCollector:
    """The real AgentCollector's `evaluate`, its episodes stubbed (no endpoint, no program)."""
    c = AgentCollector.__new__(AgentCollector)
    c.cfg, c.ctx, c.task = ctx.cfg, SimpleNamespace(sampling=SamplingParams(max_new_tokens=4)), ctx.task
    c.run = lambda runs, params: [_episode(row) for row, _ in runs]  # type: ignore[method-assign]
    c.close = lambda: None  # type: ignore[method-assign]
    return c


_collector.check = lambda cfg, task: None  # type: ignore[attr-defined]


class _Cluster:
    def __init__(self, *args: Any) -> None:
        self.platform = SimpleNamespace(name="cpu")

    def group(self, *args: Any, **kwargs: Any) -> None:
        return None

    def shutdown(self) -> None:
        return None


@pytest.fixture
def program(monkeypatch: pytest.MonkeyPatch) -> Any:
    """evaluate_model with the engine side stubbed; returns a function (rows, samples) -> its result."""
    monkeypatch.setattr(evaluate, "registry", SimpleNamespace(load=lambda group, name: _collector))
    monkeypatch.setattr(evaluate, "resolve_model_path", lambda path: "/model")
    monkeypatch.setattr(evaluate, "tokenizer_and_sampling", lambda cfg, path: (None, None))
    monkeypatch.setattr(evaluate, "Cluster", _Cluster)
    monkeypatch.setattr(processor, "engine_pixels", lambda model, path: {})
    cfg = load_config(["model=tiny"])

    def run(rows: int, samples: int | None) -> dict[str, Any]:
        monkeypatch.setattr(evaluate, "build", lambda env: _ProgramTask(rows))
        return evaluate.evaluate_model(cfg, samples=samples)

    return run


def test_an_agent_program_is_evaluated_on_the_first_samples_rows(program: Any) -> None:
    res = program(ROWS, 3)  # was: AttributeError: '_ProgramTask' object has no attribute 'eval_set'
    assert res["n"] == 3 and res["task"] == "toy_agent"
    assert res["accuracy"] == pytest.approx(2 / 3)
    assert res["accuracy_stderr"] == pytest.approx(1 / 3)


def test_an_agent_program_without_samples_is_evaluated_on_every_row(program: Any) -> None:
    res = program(ROWS, None)
    assert res["n"] == ROWS
    assert res["accuracy"] == pytest.approx(0.2)
    assert res["accuracy_stderr"] == pytest.approx(math.sqrt(0.2 * 0.8 / 9))
    assert program(ROWS, 50)["n"] == ROWS  # more than there are: all of them


def test_an_agent_program_without_held_out_rows_is_one_config_error(program: Any) -> None:
    with pytest.raises(ConfigError, match="toy_agent has no held-out rows"):
        program(0, None)
