"""Multi-domain tasks: each row scored by its domain's reward (with prompts and metadata where declared), routing
by sub-task or by a data column, mixtures checked, held-out set balanced, each sub-task's own chat messages."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from roll_core.cluster.reward_guard import GuardedReward
from roll_core.errors import ConfigError
from roll_envs.rewards.base import Reward, RewardResult
from roll_envs.rewards.math import MathReward
from roll_envs.tasks.arithmetic import ArithmeticTask
from roll_envs.tasks.dataset import FileTask
from roll_envs.tasks.multi import DomainReward, MultiTask


class Echo(Reward):
    """Scores `base` + the row's metadata["bonus"]; records what it was given."""

    def __init__(self, base: float) -> None:
        self.base, self.calls = base, []

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        self.calls.append((list(responses), [dict(m) for m in metadata or []]))
        s = [self.base + float(m.get("bonus", 0)) for m in metadata or [{}] * len(responses)]
        return RewardResult(s, [1.0] * len(s), [1.0] * len(s), {"errors": 1})


class Plain(Reward):
    """An old-style reward: `score(responses, answers)` only."""

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        s = [float(r == a) for r, a in zip(responses, answers)]
        return RewardResult(s, s, [1.0] * len(s), {"errors": 2})


def test_rows_go_to_their_domains_reward_with_their_context() -> None:
    a, b = Echo(10.0), Plain()
    reward = DomainReward({"a": a, "b": b})
    meta = [{"domain": "a", "bonus": 1}, {"domain": "b"}, {"domain": "a"}, {"domain": "zzz"}]
    res = reward.score(["r0", "x", "r2", "r3"], ["", "x", "", ""], prompts=["p0", "p1", "p2", "p3"], metadata=meta)
    assert res.scores == [11.0, 1.0, 10.0, 0.0]
    assert res.correct == [1.0, 1.0, 1.0, 0.0]
    assert res.counters == {"unknown_domain": 1, "errors": 3}  # each domain's counters add up
    assert a.calls == [(["r0", "r2"], [{"domain": "a", "bonus": 1}, {"domain": "a"}])]
    # Through the reward role's guard (a forked child): the context crosses the process boundary.
    guarded = GuardedReward(DomainReward({"a": Echo(1.0)}), name="multi")
    try:
        out = guarded.score(["r"], [""], prompts=["p"], metadata=[{"domain": "a", "bonus": 2}])
    finally:
        guarded.close()
    assert out.scores == [3.0] and out.counters["failed_rows"] == 0


class Budgeted(Reward):
    """Scores each row with the time budget it was given (after `nap` seconds); rows answering "?" are failed."""

    def __init__(self, nap: float = 0.0) -> None:
        self.nap = nap

    def score(self, responses: Sequence[str], answers: Sequence[str], time_budget_s: float = -1.0) -> RewardResult:
        time.sleep(self.nap)
        n = len(responses)
        return RewardResult([time_budget_s] * n, [0.0] * n, [0.0] * n, failed=[r == "?" for r in responses])


def test_sub_rewards_get_what_is_left_of_the_time_budget_and_their_failed_rows_stay_failed() -> None:
    reward = DomainReward({"slow": Budgeted(nap=0.3), "b": Budgeted(), "p": Plain()})
    meta = [{"domain": d} for d in ("slow", "b", "b", "p")]
    res = reward.score(["r", "?", "r", "x"], ["", "", "", "x"], metadata=meta, time_budget_s=2.0)
    assert res.scores[0] == pytest.approx(2.0, abs=0.05)  # the first domain: the whole budget
    assert 1.0 < res.scores[1] == res.scores[2] <= 1.7  # the next: the budget less the first domain's 0.3 s
    assert res.failed == [False, True, False, False]  # a remote verifier's given-up row is not a wrong answer
    assert (
        reward.score(["r"], [""], metadata=meta[:1]).scores == [-1.0]
        and reward.score(["r"], [""], metadata=meta[:1]).failed is None
    )  # no budget given: none passed on; nothing failed: failed is None
    # Through the reward role's guard: the budget within its batch timeout arrives, the failed row is counted
    guarded = GuardedReward(reward, name="multi", batch_timeout_s=4.0)
    try:
        out = guarded.score(["?", "r"], ["", ""], metadata=meta[1:3])
    finally:
        guarded.close()
    assert 2.0 < out.scores[1] <= 3.6 and out.failed == [True, False] and out.counters["failed_unscored"] == 1


def test_a_row_without_metadata_is_an_error_not_a_silent_zero() -> None:
    with pytest.raises(ValueError, match="needs each row's metadata"):
        DomainReward({"a": Plain()}).score(["x"], ["x"])


def _arith(name: str, seed: int, **kw: Any) -> ArithmeticTask:
    return ArithmeticTask(MathReward(), name=name, train_size=30, eval_size=6, seed=seed, **kw)


def test_route_by_task_mixture_and_held_out_balance() -> None:
    task = MultiTask(
        {"add": _arith("add", 0), "mul": _arith("mul", 1, ops=["*"], system_prompt="Multiply.")},
        counts={"add": 3, "mul": 1},
        advantage_scale={"mul": 0.5},
    )
    assert task.domains == ["add", "mul"]
    assert {p.domain for p in task.train_set()[:30]} == {"add"}
    assert task.domain_slices() == {"add": range(0, 30), "mul": range(30, 60)}
    assert task.mixture() == ({}, {"add": 3, "mul": 1})
    assert task.advantage_scale == {"add": 1.0, "mul": 0.5}
    assert [p.domain for p in task.eval_set()[:4]] == ["add", "mul", "add", "mul"]
    mul = task.train_set()[30]
    assert mul.id.startswith("mul/") and "*" in mul.prompt
    # Each sub-task's own messages: the multiplication task's system prompt, none for addition.
    assert task.messages(mul)[0] == {"role": "system", "content": "Multiply."}
    assert task.messages(task.train_set()[0])[0]["role"] == "user"
    weights = MultiTask({"add": _arith("add", 0), "mul": _arith("mul", 1)}, weights={"add": 3, "mul": 1})
    assert weights.mixture() == ({"add": 0.75, "mul": 0.25}, {})
    # a domain not named weighs 1 (one named weight gave every other domain 0: dropped from training, silently)
    partial = MultiTask({"add": _arith("add", 0), "mul": _arith("mul", 1)}, weights={"add": 3})
    assert partial.mixture() == ({"add": 0.75, "mul": 0.25}, {})


def test_a_domain_without_held_out_rows_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A sub-task holding nothing out (eval_size 0, a small file's hash split): eval/accuracy averaged the other
    domains only and eval/<d>/* never appeared, which nothing said."""
    with caplog.at_level("WARNING", logger="roll_envs.tasks.multi"):
        task = MultiTask({"add": _arith("add", 0), "mul": ArithmeticTask(MathReward(), name="mul", eval_size=0)})
    assert {p.domain for p in task.eval_set()} == {"add"}  # (what it warns about)
    assert "domain(s) ['mul'] have no held-out rows: evaluation (eval/accuracy) covers ['add'] only" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="roll_envs.tasks.multi"):
        MultiTask({"add": _arith("add", 0), "mul": _arith("mul", 1)})
    assert "held-out rows" not in caplog.text


def test_a_pictured_sub_task_keeps_its_pictures() -> None:
    """A visual task as a domain: its problems reached the model as text with a literal <image> (and a text model
    was accepted, since no problem seemed to have pictures)."""
    from roll_envs.tasks.visual import VisualReward, VisualTask

    task = MultiTask({"vis": VisualTask(VisualReward(), train_size=8, eval_size=4), "add": _arith("add", 0)})
    vis = [p for p in task.train_set() if p.domain == "vis"]
    assert vis and all(len(p.images) == 1 and p.images == tuple(p.source.images) for p in vis)
    assert all(not p.images for p in task.train_set() if p.domain == "add")


def test_route_by_column_reads_each_rows_domain(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}", "answer": str(i), "domain": "easy" if i % 3 else "hard", "level": i} for i in range(60)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    hard = Echo(5.0)
    rewards = {"easy": Plain(), "hard": hard}
    task = MultiTask({"data": FileTask(Plain(), path=str(path))}, route="column", rewards=rewards)
    assert sorted(task.domains) == ["easy", "hard"]
    p = next(p for p in task.train_set() if p.domain == "hard")
    assert p.metadata["level"] % 3 == 0  # the row's other columns are its metadata
    res = task.reward.score(["x"], ["y"], metadata=[{**p.metadata, "domain": "hard"}])
    assert res.scores == [5.0]
    with pytest.raises(ConfigError, match=r"domain\(s\) \{'hard': \d+\} have no reward"):
        MultiTask({"data": FileTask(Plain(), path=str(path))}, route="column", rewards={"easy": Plain()})


def test_column_routing_keeps_sub_tasks_apart_when_their_ids_coincide(tmp_path: Path) -> None:
    """Two file tasks named alike over files named alike: their rows' own ids coincide; each problem still gets
    its own sub-task's messages, and ids stay unique."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        rows = [{"prompt": f"{folder} question {i}", "answer": str(i), "domain": "math"} for i in range(40)]
        (tmp_path / folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = {
        key: FileTask(Plain(), path=str(tmp_path / key / "train.jsonl"), system_prompt=f"SYSTEM {key.upper()}")
        for key in ("a", "b")
    }
    multi = MultiTask(tasks, route="column", rewards={"math": Plain()})
    problems = multi.train_set() + multi.eval_set()
    assert len({p.id for p in problems}) == len(problems)
    for p in problems:
        system = multi.messages(p)[0]["content"]
        assert system == f"SYSTEM {p.prompt[0].upper()}", (p.prompt, system)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"counts": {"add": 1}}, "missing: \\['mul'\\]"),
        ({"counts": {"add": 1, "mul": 1}, "weights": {"add": 1.0}}, "not both"),
        ({"weights": {"nope": 1.0}}, "names \\['nope'\\]"),
        ({"weights": {"add": 0.0, "mul": 0.0}}, "not all 0"),
        ({"weights": {"add": "x", "mul": 1.0}}, "env.weights gives {'add': 'x'}: each weight is a number"),
        ({"weights": {"add": True}}, "env.weights gives {'add': True}"),
        ({"advantage_scale": {"add": -1.0}}, "must be a finite number >= 0"),
        ({"route": "tag"}, "env.route='tag'"),
    ],
)
def test_bad_multi_configs_are_config_errors(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        MultiTask({"add": _arith("add", 0), "mul": _arith("mul", 1)}, **kw)


@pytest.mark.parametrize("counts", [{"add": 2.5, "mul": 1.5}, {"add": 0.5, "mul": 0.5}, {"add": True, "mul": 3}])
def test_counts_that_are_not_whole_prompts_are_config_errors(counts: dict[str, Any]) -> None:
    # int() made them {add: 2, mul: 1} (no longer the batch size they summed to), {0, 0} (no prompt at all), {1, 3}.
    with pytest.raises(ConfigError, match="whole number of prompts per batch"):
        MultiTask({"add": _arith("add", 0), "mul": _arith("mul", 1)}, counts=counts)


def test_whole_float_counts_are_counts() -> None:
    multi = MultiTask({"add": _arith("add", 0), "mul": _arith("mul", 1)}, counts={"add": 3.0, "mul": 1})
    weights, counts = multi.mixture()
    assert weights == {} and counts == {"add": 3, "mul": 1}
    assert all(type(c) is int for c in counts.values())


def test_env_multi_composes_with_its_subtasks_typed() -> None:
    from roll_core.config import load_config

    cfg = load_config(["env=multi", "+env.counts.math=2", "+env.counts.code=1", "+env.counts.instruct=1"])
    assert list(cfg.env.tasks) == ["math", "code", "instruct"]
    assert [type(t).__name__ for t in cfg.env.tasks.values()] == [
        "ArithmeticEnvConfig",
        "CodeEnvConfig",
        "InstructEnvConfig",
    ]
    with pytest.raises(ConfigError, match="digitz"):  # a sub-task's unknown key is an error, as for env=arithmetic
        load_config(["env=multi", "env.tasks.math.digitz=2"])
    cfg = load_config(["experiment=multi_domain"])
    assert cfg.env.counts == {"math": 2, "code": 1, "instruct": 1} and cfg.pipeline.rollout_batch_size == 4
