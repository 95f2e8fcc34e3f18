"""The bad-input corpus's machinery, shared by tests/e2e/test_bad_inputs_*.py (each holds rows of some kinds: configs;
runs, data, rewards, environments, model outputs and roll-eval): the row types, the probes, and the runner that
tries the rows and prints the table. Not a test module itself.

A corpus is a list of rows; every row is (id, a probe that feeds the bad input to roll, the expected outcome):
- `error`: roll refuses it with an exception whose message matches the row's regex; the regexes ask for the
  offending key, file or row and for the fix. An exception of a "crash" type (RecursionError, KeyError, a
  UnicodeDecodeError, Hydra's InstantiationException wrapper, ...) never counts as a clear error.
- `counted`: roll goes on, and the counter the row names is > 0 (a metric such as reward/errors, a reward's own
  counter, an env manager's env_errors, or `FileTask.skipped`, the data rows skipped and logged); a probe that runs
  the pipeline checks that the run finished.
- `passed`: roll handles it as ordinary input (a known crash that is fixed, an odd but valid row).

Most probes are cheap (config composition, a loader, a reward call); the few pipeline runs are shared: one RLVR run
meets bad data rows, huge prompts, rewards that raise, return NaN and hang, an inference rank given no prompt and an
evaluation of a single held-out prompt, all at once (it starts, lazily, at the first row that asks for it, so only
rows of one module may use it). At the end each module prints a table of every row it tried and how it ended; a row
that ends any other way than expected fails its test.

A test module puts this folder on sys.path and registers this module for pytest's assertion rewriting before it
imports it (the probes' asserts then explain themselves as they would in a test module), and uses `check` in its
test with the module-scoped `corpus` fixture of tests/e2e/conftest.py (`open_corpus`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pytest

from roll_core.testing import tiny_overrides

sys.path.insert(0, str(Path(__file__).parent))  # bad_input_helpers, agentic_toy: named in configs by module
from agentic_toy import SAY_DIGIT_OVERRIDES

ERROR, COUNTED, PASSED, CRASH = "error", "counted", "passed", "crash"
#: Exception types that mean "crashed somewhere inside", whatever their message says.
CRASH_TYPES = (
    "RecursionError",
    "MemoryError",
    "KeyError",
    "IndexError",
    "AttributeError",
    "NameError",
    "TypeError",
    "ZeroDivisionError",
    "UnicodeDecodeError",
    "InstantiationException",
    "AssertionError",
    "HFValidationError",
)


@dataclass(frozen=True)
class Seen:
    """What a probe that did not raise observed: counters, and text (reasons, logs, output) for the row's regex."""

    counters: Mapping[str, float] = field(default_factory=dict)
    text: str = ""


@dataclass(frozen=True)
class Case:
    """One row of the corpus (see the module docstring)."""

    id: str
    probe: Callable[[Corpus], Seen | None]
    expect: str
    #: error: the regex the message must match; counted/passed: a regex the observed text must match ("" = any).
    match: str = ""
    #: counted: the counter that must be > 0.
    counter: str = ""


@dataclass
class Result:
    case: Case
    outcome: str
    detail: str
    seconds: float
    ok: bool


class Corpus:
    """Per-module context: a scratch folder, the tiny task and model, and the shared pipeline runs (lazy)."""

    def __init__(self, tmp: Path, seven: Path) -> None:
        self.tmp, self.seven = tmp, seven
        self.results: list[Result] = []
        self._n = 0

    def path(self, name: str) -> Path:
        self._n += 1
        folder = self.tmp / f"{self._n:03d}"
        folder.mkdir()
        return folder / name

    def write(self, name: str, content: str | bytes) -> Path:
        p = self.path(name)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        return p

    def jsonl(self, name: str, rows: list[Any], extra: bytes = b"") -> Path:
        """Good rows, then `extra` raw bytes (the bad line under test, line number len(rows) + 1)."""
        return self.write(name, "".join(json.dumps(r) + "\n" for r in rows).encode() + extra)

    def parquet(self, name: str, columns: dict[str, list[Any]]) -> Path:
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        p = self.path(name)
        pq.write_table(pa.table(columns), p)
        return p

    def pipeline(self, *extra: str, data: Path | None = None, agentic: bool = False) -> Any:
        """A built (not run) pipeline on the tiny task (or a tiny agentic one) with `extra` overrides; the caller
        shuts it down."""
        from roll_core.cli import pipeline_class
        from roll_core.config import load_config

        out = self.path("run")
        base = agentic_overrides(out, *extra) if agentic else tiny_overrides(data or self.seven, out, *extra)
        cfg = load_config(base)
        return pipeline_class(cfg.pipeline.name)(cfg)

    def run(self, *extra: str, data: Path | None = None, agentic: bool = False) -> tuple[Any, list[dict[str, Any]]]:
        """Build and run a pipeline; (the pipeline, after shutdown; its per-step metrics)."""
        from roll_core.tracking import Tracker

        pipeline = self.pipeline(*extra, data=data, agentic=agentic)
        try:
            pipeline.run()
        finally:
            pipeline.shutdown()
        return pipeline, [h for h in Tracker.read_metrics(Path(pipeline.out) / "metrics.jsonl") if h["step"] > 0]

    @cached_property
    def shared(self) -> SharedRun:
        return SharedRun.start(self)


def agentic_overrides(out: Path, *extra: str) -> list[str]:
    """A two-step agentic run of the tiny model on a toy two-turn environment (tests/e2e/agentic_toy.py)."""
    return [
        *SAY_DIGIT_OVERRIDES,
        "env.eval_size=2",
        "algo.group_size=2",
        "pipeline.rollout_batch_size=3",
        "pipeline.max_steps=2",
        "pipeline.eval_every=0",
        "pipeline.progress=false",
        f"pipeline.output_dir={out}",
        "train_engine.micro_batch_size=16",
        *extra,
    ]


# ---- the shared RLVR run ----------------------------------------------------------------------------------------
HUGE = 10_000_000  # characters of the huge prompt: far past model.max_prompt_length, skipped without tokenising
SHARED_STEPS = 7


@dataclass
class SharedRun:
    """One RLVR run on cluster=local that meets many bad inputs at once (see `start`)."""

    pipeline: Any
    history: list[dict[str, Any]]
    log: str

    @classmethod
    def start(cls, corpus: Corpus) -> SharedRun:
        """Training rows: answers that make the reward raise, return NaN and hang, two good rows, a 10 MB and a 1 MB
        prompt, and four bad lines (broken JSON, not UTF-8, a list answer, a blank prompt). Held out: one prompt.
        One prompt per step x 2 samples on 2 inference ranks (rank 1 gets no prompt), 7 steps (a whole epoch: each
        row is drawn), evaluation every 3 steps of the single held-out prompt on 2 ranks."""
        good = [{"prompt": f"say {a}", "answer": a} for a in ("raise", "nan", "hang", "7", "7")]
        huge = [{"prompt": "x" * HUGE, "answer": "7"}, {"prompt": "y" * 1_000_000, "answer": "7"}]
        bad = b'{"prompt": "broken\n{"prompt": "\xff\xfe", "answer": "7"}\n'
        bad += (json.dumps({"prompt": "a list", "answer": [7]}) + "\n").encode()
        bad += (json.dumps({"prompt": "  ", "answer": "7"}) + "\n").encode()
        data = corpus.jsonl("train.jsonl", good + huge, bad)
        held = corpus.jsonl("held.jsonl", [{"prompt": "say 7", "answer": "7"}])
        handler = _ListHandler()
        logging.getLogger().addHandler(handler)
        try:
            pipeline, history = corpus.run(
                f"env.eval_path={held}",
                "env.reward._target_=bad_input_helpers.AnswerFaultReward",
                "infer_engine.world_size=2",
                "pipeline.rollout_batch_size=1",
                "algo.group_size=2",
                f"pipeline.max_steps={SHARED_STEPS}",
                "pipeline.eval_every=3",
                "pipeline.reward_batch_timeout_s=1",
                "pipeline.reward_timeout_s=0.5",
                # Steps whose one prompt is a fault row fail on every row, several in a row: this run counts them
                # (the failure budget that stops such a run is tested in test_run_guards.py).
                "pipeline.max_reward_failure_steps=0",
                data=data,
            )
        finally:
            logging.getLogger().removeHandler(handler)
        return cls(pipeline, history, "\n".join(handler.lines))

    def total(self, key: str) -> float:
        return sum(h.get(key) or 0.0 for h in self.history)

    def finished(self) -> None:
        assert [h["step"] for h in self.history] == list(range(1, SHARED_STEPS + 1)), self.history


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def shared_metric(key: str) -> Callable[[Corpus], Seen]:
    def probe(c: Corpus) -> Seen:
        run = c.shared
        run.finished()
        return Seen({key: run.total(key)}, run.log)

    return probe


def shared_skipped_rows(c: Corpus) -> Seen:
    run = c.shared
    run.finished()
    reasons = "\n".join(f"line {n}: {why}" for _, n, why in run.pipeline.task.skipped)
    return Seen({"FileTask.skipped": len(run.pipeline.task.skipped)}, reasons + "\n" + run.log)


def shared_evals(c: Corpus) -> Seen:
    run = c.shared
    run.finished()
    evals = [h["step"] for h in run.history if "eval/accuracy" in h]
    assert evals == [3, 6, 7], evals  # (and step 0, logged before training)
    assert len(run.pipeline.collector.eval_set) == 1
    return Seen(text=f"evaluated at steps {evals}")


def shared_one_prompt_two_ranks(c: Corpus) -> Seen:
    run = c.shared
    run.finished()
    assert all(h["data/trained_groups"] == 1 for h in run.history if "data/trained_groups" in h)
    return Seen(text=f"{len(run.history)} steps of 1 prompt x 2 samples on 2 inference ranks")


# ---- probes -----------------------------------------------------------------------------------------------------
def compose(*overrides: str) -> Callable[[Corpus], Seen]:
    """load_config(overrides): composition plus every schema check."""

    def probe(c: Corpus) -> Seen:
        from roll_core.config import load_config

        load_config(list(overrides))
        return Seen(text="composed")

    return probe


def build(*extra: str, agentic: bool = False) -> Callable[[Corpus], Seen]:
    """Build the pipeline on the tiny task (and shut it down): for checks that need the world (paths, engines)."""

    def probe(c: Corpus) -> Seen:
        c.pipeline(*extra, agentic=agentic).shutdown()
        return Seen(text="built")

    return probe


def run_steps(*extra: str) -> Callable[[Corpus], Seen]:
    """Run the pipeline on the tiny task; errors during the run surface as errors."""

    def probe(c: Corpus) -> Seen:
        _, history = c.run(*extra)
        return Seen({"steps": len(history)}, f"{len(history)} steps")

    return probe


def file_task(make: Callable[[Corpus], Path], **kwargs: Any) -> Callable[[Corpus], Seen]:
    """FileTask over the file `make` writes; counts its skipped rows (`FileTask.skipped`: file, line, reason) and
    checks that they were logged."""

    def probe(c: Corpus) -> Seen:
        from roll_envs.rewards.math import MathReward
        from roll_envs.tasks.dataset import FileTask

        path = make(c)
        handler = _ListHandler()
        logger = logging.getLogger("roll_envs.tasks.dataset")
        logger.addHandler(handler)
        try:
            task = FileTask(MathReward(), str(path), **kwargs)
        finally:
            logger.removeHandler(handler)
        if task.skipped:  # a skip is logged with file and line, never silent
            assert any(str(path) in line and "skipped" in line for line in handler.lines), handler.lines
        reasons = "\n".join(f"{f}: line {n}: {why}" for f, n, why in task.skipped)
        answers = ",".join(p.answer for p in task.train_set() + task.eval_set())
        return Seen({"FileTask.skipped": len(task.skipped)}, f"{reasons}\nanswers: {answers}")

    return probe


def huge_prompt(c: Corpus) -> Seen:
    """The loader keeps a 10 MB prompt whole; the prompt builder skips it (counted) without truncating it, and
    without tokenising it (17 s for the tiny tokenizer here, at every draw of the row)."""
    from transformers import AutoTokenizer

    from roll_core.models import resolve_model_path
    from roll_core.pipelines.rollout import prompt_batch
    from roll_envs.rewards.math import MathReward
    from roll_envs.tasks.dataset import FileTask

    rows = [{"prompt": "x" * HUGE, "answer": "7"}] + [{"prompt": f"say 7 #{i}", "answer": "7"} for i in range(20)]
    task = FileTask(MathReward(), str(c.jsonl("huge.jsonl", rows)), eval_fraction=0.0)
    problems = task.train_set()
    assert len(problems[0].prompt) == HUGE  # loaded whole: never truncated
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny"))
    tokenised: list[int] = []  # characters of each prompt the tokenizer was given
    template = tokenizer.apply_chat_template

    def spy(messages: list[dict[str, str]], **kwargs: Any) -> Any:
        tokenised.append(sum(len(m["content"]) for m in messages))
        return template(messages, **kwargs)

    tokenizer.apply_chat_template = spy
    metrics: dict[str, Any] = {}
    batch = prompt_batch(tokenizer, task, problems[:3], 128, metrics)
    assert batch["problem_id"] == [p.id for p in problems[1:3]]
    return Seen(metrics, f"tokenised prompts of {tokenised} characters")


def guarded(answers: list[str], **guard: Any) -> Callable[[Corpus], Seen]:
    """AnswerFaultReward behind the reward guard (forked child: hangs are cut off); its counters."""

    def probe(c: Corpus) -> Seen:
        from bad_input_helpers import AnswerFaultReward

        from roll_core.cluster.reward_guard import GuardedReward

        reward = GuardedReward(AnswerFaultReward(hang_s=30), **{"timeout_s": 0.5, "batch_timeout_s": 1.0, **guard})
        try:
            responses = [f"so \\boxed{{{7 if a == '7' else 1}}}" for a in answers]
            res = reward.score(responses, answers)
        finally:
            reward.close()
        assert len(res.scores) == len(answers) and all(s == s for s in res.scores)  # one finite score per row
        assert res.scores[-1] == 1.0, res  # the healthy last row keeps its own score
        return Seen(res.counters, f"scores {res.scores}")

    return probe


def scored(reward: str, response: str, answer: str, *, want: float | None = None) -> Callable[[Corpus], Seen]:
    """One response scored by a task reward directly (no guard): it must not raise, whatever the text."""

    def probe(c: Corpus) -> Seen:
        if reward == "countdown":
            from roll_envs.tasks.countdown import CountdownReward

            res = CountdownReward().score([response], [answer])
        else:
            from roll_envs.rewards.math import MathReward

            res = MathReward(timeout_s=1).score([response], [answer])
        if want is not None:
            assert res.scores == [want], res
        return Seen(res.counters, f"score {res.scores[0]}")

    return probe


def env_manager(env_cls: type, *, method: str = "step", timeout_s: float = 5.0) -> Callable[[Corpus], Seen]:
    """Episodes of seeds 0-5 against an EnvManager: each failing call ends its episode as a counted EnvFailure."""

    def probe(c: Corpus) -> Seen:
        from roll_core.agentic.env_manager import EnvFailure, EnvManager

        manager = EnvManager(env_cls, 6, step_timeout_s=timeout_s)
        kinds = []
        for slot in range(6):
            try:
                manager.reset(slot, seed=slot)
                if method == "step":
                    manager.step(slot, "7")
                kinds.append("ok")
            except EnvFailure as exc:
                kinds.append(f"{exc.kind}: {exc}")
        manager.close()
        return Seen(manager.counters(), "\n".join(kinds))

    return probe


class StepRaises:
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return "obs", {}

    def step(self, action: str) -> Any:
        raise RuntimeError("environment bug")


class ResetRaises(StepRaises):
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        raise OSError("cannot start the game")


class StepHangs(StepRaises):
    def step(self, action: str) -> Any:
        time.sleep(3)
        return "obs", 0.0, True, False, {}


def malformed_env() -> Any:
    from bad_input_helpers import MalformedEnv

    return MalformedEnv()


def agentic_malformed(c: Corpus) -> Seen:
    """A whole agentic run against MalformedEnv: every episode ends as an env_error, the run finishes."""
    _, history = c.run("env.env=py:bad_input_helpers:MalformedEnv", agentic=True)
    assert [h["step"] for h in history] == [1, 2]
    return Seen({"env/env_errors": sum(h.get("env/env_errors", 0) for h in history)}, f"{len(history)} steps")


def roll_eval(*argv: str) -> Callable[[Corpus], Seen]:
    """`roll-eval argv`: exit 0 is passed, another exit status an error whose message is its stderr."""

    def probe(c: Corpus) -> Seen:
        import io

        from roll_core.cli import eval_main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = eval_main(list(argv))
        if rc != 0:
            raise CliError(f"exit {rc}: {err.getvalue()}")
        return Seen(text=out.getvalue())

    return probe


class CliError(RuntimeError):
    """A command that exited non-zero (its stderr is the message the user reads)."""


def missing(name: str) -> Callable[[Corpus], Path]:
    return lambda c: c.path(name)


def empty_dir(c: Corpus) -> Path:
    folder = c.path("not-a-model")
    folder.mkdir()
    (folder / "README.md").write_text("weights go here")
    return folder


# ---- the corpus -------------------------------------------------------------------------------------------------
def E(id: str, probe: Callable[[Corpus], Seen | None], match: str) -> Case:
    return Case(id, probe, ERROR, match=match)


def C(id: str, probe: Callable[[Corpus], Seen | None], counter: str, match: str = "") -> Case:
    return Case(id, probe, COUNTED, match=match, counter=counter)


def P(id: str, probe: Callable[[Corpus], Seen | None], match: str = "") -> Case:
    return Case(id, probe, PASSED, match=match)


# ---- the runner -------------------------------------------------------------------------------------------------
def classify(case: Case, corpus: Corpus) -> Result:
    """Run a row's probe and say how it ended, and whether that is the expected way."""
    t0 = time.perf_counter()
    try:
        seen = case.probe(corpus) or Seen()
    except Exception as exc:  # every way out is classified
        name, message = type(exc).__name__, str(exc)
        outcome = CRASH if name in CRASH_TYPES else ERROR
        ok = outcome == case.expect == ERROR and re.search(case.match, message, re.S) is not None
        return Result(case, outcome, f"{name}: {message}", time.perf_counter() - t0, ok)
    counted = bool(case.counter) and (seen.counters.get(case.counter) or 0) > 0
    outcome = COUNTED if counted else PASSED
    ok = outcome == case.expect and (not case.match or re.search(case.match, seen.text, re.S) is not None)
    detail = ", ".join(f"{k}={v:g}" for k, v in seen.counters.items() if v) or seen.text
    return Result(case, outcome, f"{detail} | {seen.text}" if case.match else detail, time.perf_counter() - t0, ok)


def open_corpus(tmp_path_factory: pytest.TempPathFactory, seven: Path, config: pytest.Config) -> Iterator[Corpus]:
    """The body of the module-scoped `corpus` fixture (tests/e2e/conftest.py): a Corpus for a module's rows, then
    its table."""
    c = Corpus(tmp_path_factory.mktemp("bad-inputs"), seven)
    yield c
    _print_table(c.results, config)


def _print_table(results: list[Result], config: pytest.Config) -> None:
    """The corpus table on the terminal (also under output capture): every row tried and how it ended."""
    if not results:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    # A module fixture's teardown runs under output capture (capsys.disabled() is for function scope): lift it.
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        _write_table(results, reporter.write_line if reporter is not None else print)


def _write_table(results: list[Result], write: Callable[[str], Any]) -> None:
    tally = {k: sum(r.outcome == k for r in results) for k in (ERROR, COUNTED, PASSED, CRASH)}
    unexpected = [r for r in results if not r.ok]
    write("")
    write(
        f"bad-input corpus: {len(results)} cases tried: {tally[ERROR]} error, {tally[COUNTED]} counted, "
        f"{tally[PASSED]} passed-through, {tally[CRASH]} crash; {len(unexpected)} unexpected; "
        f"{sum(r.seconds for r in results):.1f}s"
    )
    width = max(len(r.case.id) for r in results)
    for r in results:
        mark = "ok " if r.ok else "BAD"
        detail = " ".join(r.detail.split())[:110]
        write(f"  {mark} {r.case.id:<{width}}  {r.outcome:<7} (want {r.case.expect:<7}) {r.seconds:5.1f}s  {detail}")


def check(case: Case, corpus: Corpus) -> None:
    """Try one row (a test's body): it must end the way it expects."""
    result = classify(case, corpus)
    corpus.results.append(result)
    want = f"{case.expect} matching {case.match!r}" if case.match else case.expect
    if case.counter:
        want += f" with {case.counter} > 0"
    assert result.ok, f"{case.id}: ended as {result.outcome} ({result.detail[:2000]}), expected {want}"
