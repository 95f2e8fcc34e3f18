"""`pipeline.eval_size` below the number of domains: the multi-domain held-out set interleaves the domains, so its
first `eval_size` problems left the last domains out of evaluation entirely (no `eval/<d>/accuracy`,
`eval/accuracy` over the others), unsaid. The cut now warns, naming them and the size that evaluates every domain."""

from __future__ import annotations

import pytest

from roll_core.pipelines.collectors._eval_cut import first_eval_size
from roll_envs.rewards.math import MathReward
from roll_envs.tasks.arithmetic import ArithmeticTask
from roll_envs.tasks.multi import MultiTask

LOGGER = "roll_core.pipelines.collectors._eval_cut"


def _task() -> MultiTask:
    def arith(name: str, seed: int, held: int) -> ArithmeticTask:
        return ArithmeticTask(MathReward(), name=name, train_size=10, eval_size=held, seed=seed)

    return MultiTask({"add": arith("add", 0, 1), "sub": arith("sub", 1, 3), "mul": arith("mul", 2, 3)})


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_an_eval_size_dropping_whole_domains_warns_naming_them(caplog: pytest.LogCaptureFixture) -> None:
    held = _task().eval_set()
    assert [p.domain for p in held] == ["add", "sub", "mul", "sub", "mul", "sub", "mul"]
    with caplog.at_level("WARNING", logger=LOGGER):
        kept, cut = first_eval_size(held, 2)
    assert [p.domain for p in kept] == ["add", "sub"] and cut == 5
    (line,) = _warnings(caplog)
    assert "pipeline.eval_size=2 evaluates held-out problems of domain(s) ['add', 'sub'] only: ['mul']" in line
    assert "pipeline.eval_size=3 evaluates every domain" in line


def test_no_warning_when_every_domain_is_kept_or_nothing_is_evaluated(caplog: pytest.LogCaptureFixture) -> None:
    held = _task().eval_set()
    with caplog.at_level("WARNING", logger=LOGGER):
        assert first_eval_size(held, 3)[1] == 4  # every domain once: the others' rows cut, counted, not warned
        assert len(first_eval_size(held, 2, evaluates=False)[0]) == 2  # pipeline.eval_every=0
        assert first_eval_size(held, 0) == ([], 7)  # nothing evaluated at all: the collectors' checks say so
        one = ArithmeticTask(MathReward(), train_size=10, eval_size=5, seed=0).eval_set()  # a single domain
        assert len(first_eval_size(one, 2)[0]) == 2
    assert _warnings(caplog) == []
