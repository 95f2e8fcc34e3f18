"""Conformance suite of the task and reward contract (`roll_core.interfaces.Task` / `Reward`).

Checks: seeded determinism, disjoint train/held-out splits, chat messages ending with the problem's prompt, a
correct response scores as correct, and malformed responses (empty, garbage, huge, control characters, lone
surrogates) score as incorrect with finite scores instead of raising.

roll's tests run it over every installed `roll.envs` entry point (packages/roll-envs/tests/test_task_conformance.py),
so an installed out-of-tree task is checked as well (its reward with it). Tasks have no common constructor (each
takes its reward and its own options), so a task class says how to build a small instance with a classmethod hook,
and may say what a correct response to one of its problems is::

    class MyTask:
        @classmethod
        def conformance_task(cls, seed: int, workdir: Path) -> MyTask:
            # A small instance (a few hundred problems at most); `workdir` is an empty folder for its data files.
            # Raise roll_core.testing.CannotRunHere (or ImportError) when it cannot be built here: the suite skips.
            return cls(MyReward(), train_size=200, eval_size=40, seed=seed)

        def conformance_response(self, problem: Problem) -> str:  # optional; default: "\\\\boxed{answer}"
            return f"\\\\boxed{{{problem.answer}}}"

A task class without `conformance_task` is skipped with that reason. To run the suite on one task by hand,
subclass it and set `task_class`, or override `build_task` (and `correct_response`)::

    from roll_core.testing.tasks import TaskTestSuite

    class TestMyTask(TaskTestSuite):
        @classmethod
        def build_task(cls, seed: int):
            return MyTask(MyReward(), seed=seed)

        @classmethod
        def correct_response(cls, problem) -> str:  # a response the reward must count as correct
            return f"\\\\boxed{{{problem.answer}}}"

A task's `conformance_response`, when it has one, takes precedence over `correct_response`.

`AgenticTaskTestSuite` checks the agentic task contract (`roll_core.interfaces.tasks.AgenticTask`, what
`pipeline=agentic` builds from the `env` group): the protocol, with episode limits and worker settings in range;
`train_seeds(count, seed)` gives `count` distinct ints, the same for a seed and different across seeds, never a
held-out one; `eval_seeds()` is a fixed list of distinct ints; `make_env()` gives a new `Env` each call, whose
`reset(seed)` is reproducible (across instances and after steps); `system_prompt()` is non-empty text or None;
`examples()` is a list of chat messages (a copy: changing it changes nothing). roll-envs' tests run it over its
`AgenticTask` for every installed agentic environment (packages/roll-envs/tests/test_agentic_task_conformance.py)::

    from roll_core.testing.tasks import AgenticTaskTestSuite

    class TestMyAgenticTask(AgenticTaskTestSuite):
        @classmethod
        def build_agentic_task(cls):
            return MyAgenticTask(max_turns=4, train_seed_range=100)

Build the task with a small training-seed space where it has one (a few times `draw_count`): drawing 64 of a
million seeds would rarely hit a held-out one even when the split is wrong.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import pytest

from roll_core.interfaces import Env, ProblemLike, RewardResult, Task
from roll_core.interfaces.tasks import AgenticTask
from roll_core.testing import CannotRunHere

__all__ = ["MALFORMED", "AgenticTaskTestSuite", "TaskTestSuite", "build_conformance_task"]

MALFORMED = ["", "\\boxed{", "}}}{{{", "x" * 100_000, "\x00\x07\x1b[31m", "\ud800 lone surrogate", "\\boxed{\\boxed{}}"]
#: Names of the hooks on a task class: the classmethod that builds a small instance, the method that answers.
HOOK, RESPONSE_HOOK = "conformance_task", "conformance_response"


def build_conformance_task(task_class: type, seed: int, workdir: Path) -> Task:
    """`task_class.conformance_task(seed, folder)` with an empty folder of its own under `workdir`; skips the
    calling test when the class has no hook or the task cannot be built here."""
    build = getattr(task_class, HOOK, None)
    if build is None:
        pytest.skip(
            f"task {task_class.__qualname__} defines no `{HOOK}(seed, workdir)` classmethod saying how to build a "
            "small instance (roll_core.testing.tasks)"
        )
    folder = workdir / f"{task_class.__module__}.{task_class.__qualname__}-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return build(seed, folder)
    except (ImportError, CannotRunHere) as exc:
        pytest.skip(f"task {task_class.__qualname__} cannot run here: {type(exc).__name__}: {exc}")


class TaskTestSuite:
    """Shared tests; subclasses set `task_class` or implement `build_task` (and, if the default does not fit,
    `correct_response`)."""

    #: Problems scored by the correctness check (keep it fast).
    sample: ClassVar[int] = 20
    #: The task under test (built with `build_conformance_task`).
    task_class: ClassVar[type | None] = None
    #: Scratch folder of the class for tasks' data files (set by a fixture).
    workdir: ClassVar[Path | None] = None

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _workdir(cls, tmp_path_factory: pytest.TempPathFactory) -> None:
        cls.workdir = tmp_path_factory.mktemp("task-conformance")

    @classmethod
    def build_task(cls, seed: int) -> Task:
        if cls.task_class is None:
            raise NotImplementedError("subclasses set task_class or return a task for seed")
        assert cls.workdir is not None
        return build_conformance_task(cls.task_class, seed, cls.workdir)

    @classmethod
    def correct_response(cls, problem: Any) -> str:
        return f"The answer is \\boxed{{{problem.answer}}}."

    def test_satisfies_protocol(self) -> None:
        task = self.build_task(0)
        assert isinstance(task, Task) and task.name
        assert task.train_set() and task.eval_set()
        assert all(isinstance(p, ProblemLike) for p in [*task.train_set()[:5], *task.eval_set()[:5]])

    def test_seeded_and_disjoint(self) -> None:
        a, b = self.build_task(0), self.build_task(0)
        assert [p.id for p in a.train_set()] == [p.id for p in b.train_set()]
        assert [p.id for p in a.eval_set()] == [p.id for p in b.eval_set()]
        train, held = {p.id for p in a.train_set()}, {p.id for p in a.eval_set()}
        assert not train & held, "a held-out problem is also a training problem"
        assert not {p.prompt for p in a.train_set()} & {p.prompt for p in a.eval_set()}

    def test_messages_end_with_the_prompt(self) -> None:
        task = self.build_task(0)
        p = task.eval_set()[0]
        msgs = task.messages(p)
        assert msgs[-1] == {"role": "user", "content": p.prompt}
        assert all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str) for m in msgs)

    def test_correct_responses_score_correct(self) -> None:
        task = self.build_task(0)
        probs = list(task.eval_set()[: self.sample])
        respond = getattr(task, RESPONSE_HOOK, self.correct_response)
        res = task.reward.score([respond(p) for p in probs], [p.answer for p in probs])
        assert isinstance(res, RewardResult)
        assert res.correct == [1.0] * len(probs), res
        assert all(s > 0 for s in res.scores)

    def test_malformed_responses_score_incorrect_without_raising(self) -> None:
        task = self.build_task(0)
        p = task.eval_set()[0]
        res = task.reward.score(MALFORMED, [p.answer] * len(MALFORMED))
        assert len(res.scores) == len(MALFORMED)
        assert all(math.isfinite(s) for s in res.scores)
        assert res.correct[:-1] == [0.0] * (len(MALFORMED) - 1)  # the last one may parse as an empty box


class AgenticTaskTestSuite:
    """Shared tests of an agentic task; subclasses implement `build_agentic_task`."""

    #: Draw seeds the seed checks use, and how many training seeds each draws.
    draw_seeds: ClassVar[tuple[int, ...]] = (0, 1, 2)
    draw_count: ClassVar[int] = 64
    #: Replies stepped after a reset, whose observations must repeat too (hidden targets show only in replies).
    probe_actions: ClassVar[tuple[str, ...]] = ("", "\\boxed{1}", "\\boxed{50}", "1")

    @classmethod
    def build_agentic_task(cls) -> AgenticTask:
        raise NotImplementedError("subclasses return a small agentic task")

    def test_satisfies_protocol(self) -> None:
        task = self.build_agentic_task()
        assert isinstance(task, AgenticTask), f"{type(task).__name__} lacks members of roll's AgenticTask protocol"
        assert isinstance(task.name, str) and task.name, f"name {task.name!r}"
        for limit in ("max_turns", "max_context_length", "max_tokens_per_turn", "env_threads"):
            value = getattr(task, limit)
            assert isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"{limit}={value!r}"
        assert task.max_tokens_per_turn <= task.max_context_length, "one turn cannot exceed the whole context"
        assert isinstance(task.num_workers, int) and task.num_workers >= 0, f"num_workers={task.num_workers!r}"
        assert isinstance(task.step_timeout_s, (int, float)) and task.step_timeout_s > 0

    def test_train_seeds_are_seeded_and_never_held_out(self) -> None:
        task = self.build_agentic_task()
        held_out = task.eval_seeds()
        assert held_out and all(isinstance(s, int) for s in held_out), f"eval_seeds() gave {held_out[:5]!r}"
        assert len(set(held_out)) == len(held_out), "eval_seeds() repeats a seed"
        assert task.eval_seeds() == held_out, "eval_seeds() changed between calls"
        draws = []
        for seed in self.draw_seeds:
            seeds = task.train_seeds(self.draw_count, seed)
            assert len(seeds) == self.draw_count and len(set(seeds)) == self.draw_count, f"seed {seed}: {seeds[:5]}"
            assert all(isinstance(s, int) for s in seeds)
            assert seeds == task.train_seeds(self.draw_count, seed), f"train_seeds(..., {seed}) is not seeded"
            clash = sorted(set(seeds) & set(held_out))
            assert not clash, f"train_seeds(..., {seed}) drew held-out seeds {clash[:5]}"
            draws.append(seeds)
        assert len({tuple(d) for d in draws}) == len(draws), "different draw seeds gave the same training seeds"

    def test_make_env_resets_reproducibly(self) -> None:
        task = self.build_agentic_task()
        a, b = task.make_env(), task.make_env()
        assert a is not b, "make_env() must return a new environment each call"
        assert isinstance(a, Env), f"make_env() gave {type(a).__name__}, not an Env"

        def episode(env: Env, seed: int) -> tuple[tuple[str, ...], ...]:
            # Observations are text or text with pictures (roll_core.agentic.observation): compare text and digests.
            from roll_core.testing.envs import EnvTestSuite

            obs, info = env.reset(seed=seed)
            key = EnvTestSuite.observation_key(obs)
            assert key[0].strip() and isinstance(info, dict), f"reset gave {obs!r:.80}, {info}"
            steps = (EnvTestSuite.observation_key(env.step(action)[0]) for action in self.probe_actions)
            return (key, *steps)

        for seed in (task.train_seeds(1, 0)[0], task.eval_seeds()[0]):
            first = episode(a, seed)
            assert episode(b, seed) == first, f"seed {seed}: two environments differ"
            assert episode(a, seed) == first, f"seed {seed}: a second reset of one environment differs"

    def test_prompts(self) -> None:
        task = self.build_agentic_task()
        system = task.system_prompt()
        assert system is None or (isinstance(system, str) and system.strip()), f"system_prompt() gave {system!r}"
        examples = task.examples()
        assert isinstance(examples, list), f"examples() gave {type(examples).__name__}"
        for m in examples:
            assert isinstance(m, dict) and m.get("role") in ("system", "user", "assistant"), m
            assert isinstance(m.get("content"), str), m
        examples.append({"role": "user", "content": "changed"})
        assert task.examples() == examples[:-1], "examples() must return a copy"
