"""A corpus of bad inputs, one row each: configs, data files, rewards, environments and model outputs that are wrong
on purpose, with the outcome each must have.

Every row is (id, a probe that feeds the bad input to roll, the expected outcome):
- `error`: roll refuses it with an exception whose message matches the row's regex; the regexes ask for the
  offending key, file or row and for the fix. An exception of a "crash" type (RecursionError, KeyError, a
  UnicodeDecodeError, Hydra's InstantiationException wrapper, ...) never counts as a clear error.
- `counted`: roll goes on, and the counter the row names is > 0 (a metric such as reward/errors, a reward's own
  counter, an env manager's env_errors, or `FileTask.skipped`, the data rows skipped and logged); a probe that runs
  the pipeline checks that the run finished.
- `passed`: roll handles it as ordinary input (a known crash that is fixed, an odd but valid row).

Most probes are cheap (config composition, a loader, a reward call); the few pipeline runs are shared: one RLVR run
meets bad data rows, huge prompts, rewards that raise, return NaN and hang, an inference rank given no prompt and an
evaluation of a single held-out prompt, all at once. At the end the module prints a table of every row tried and how
it ended; a row that ends any other way than expected fails its test.
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


GOOD7 = [{"prompt": f"say 7 #{i}", "answer": "7"} for i in range(30)]  # 30 good rows; the bad line is line 31

CASES: list[Case] = [
    # -- configs: unknown keys and options ------------------------------------------------------------------------
    E("cfg/unknown-key", compose("algo.lrr=1e-5"), r"Key 'lrr' not in 'AlgoConfig'.*Did you mean 'algo\.lr'\?"),
    E(
        "cfg/unknown-key-forced-with-plus",
        compose("+pipeline.max_stepz=3"),
        r"Key 'max_stepz' not in 'PipelineConfig' \(full_key: pipeline\.max_stepz\)\. "
        r"Did you mean 'pipeline\.max_steps'",
    ),
    E("cfg/unknown-top-level-key", compose("foo=1"), r"Key 'foo' not in 'RLVRConfig'.*Valid keys here: .*pipeline"),
    E("cfg/unknown-algo-preset", compose("algo=grpoo"), r"Could not find 'algo/grpoo'.*Available options.*\bgrpo\b"),
    E(
        "cfg/unknown-infer-engine",
        compose("infer_engine=vllmm"),
        r"Could not find 'infer_engine/vllmm'.*Did you mean 'infer_engine=vllm'\?",
    ),
    E("cfg/override-without-value", compose("algo.lr"), r"Error parsing override 'algo\.lr'.*override_grammar"),
    E("cfg/override-bad-token", compose("env.ops=[^]"), r"env\.ops=\[\^\].*token recognition error at: '\^'"),
    # -- configs: wrong types --------------------------------------------------------------------------------------
    E(
        "cfg/lr-not-a-number",
        compose("algo.lr=abc"),
        r"algo\.lr=abc.*could not be converted to Float.*full_key: algo\.lr",
    ),
    E(
        "cfg/max-steps-float",
        compose("pipeline.max_steps=1.5"),
        r"pipeline\.max_steps=1\.5.*could not be converted to Integer.*full_key: pipeline\.max_steps",
    ),
    E(
        "cfg/group-size-word",
        compose("algo.group_size=eight"),
        r"could not be converted to Integer.*full_key: algo\.group_size",
    ),
    E(
        "cfg/bool-word",
        compose("pipeline.progress=maybe"),
        r"'maybe' is not a valid bool.*full_key: pipeline\.progress",
    ),
    E("cfg/file-env-without-path", compose("env=file"), r"missing mandatory value: path.*full_key: env\.path"),
    # -- configs: out of range -------------------------------------------------------------------------------------
    E("cfg/lr-negative", compose("algo.lr=-1e-6"), r"algo\.lr=-1e-06 must be > 0"),
    E("cfg/lr-nan", compose("algo.lr=nan"), r"algo\.lr=nan must be a finite number > 0"),
    E("cfg/lr-inf", compose("algo.lr=inf"), r"algo\.lr=inf must be a finite number > 0"),
    E("cfg/critic-lr-negative", compose("algo=ppo", "algo.critic_lr=-1"), r"algo\.critic_lr=-1\.0 must be > 0"),
    E("cfg/warmup-negative", compose("algo.warmup_steps=-5"), r"algo\.warmup_steps=-5 must be >= 0"),
    E("cfg/weight-decay-negative", compose("algo.weight_decay=-0.1"), r"algo\.weight_decay=-0\.1 must be >= 0"),
    E("cfg/group-size-0", compose("algo.group_size=0"), r"algo\.group_size=0 must be >= 1"),
    E(
        "cfg/temperature-negative",
        compose("infer_engine.temperature=-0.5"),
        r"infer_engine\.temperature=-0\.5 must be > 0",
    ),
    E("cfg/temperature-nan", compose("infer_engine.temperature=nan"), r"infer_engine\.temperature=nan must be > 0"),
    E("cfg/top-p-0", compose("infer_engine.top_p=0"), r"infer_engine\.top_p=0\.0 must be in \(0, 1\]"),
    E("cfg/top-k-negative", compose("infer_engine.top_k=-1"), r"infer_engine\.top_k=-1 must be >= 0"),
    E("cfg/eval-every-negative", compose("pipeline.eval_every=-1"), r"pipeline\.eval_every=-1 must be >= 0"),
    E("cfg/eval-size-negative", compose("pipeline.eval_size=-1"), r"pipeline\.eval_size=-1 must be >= 0"),
    E(
        "cfg/eval-temperature-negative",
        compose("pipeline.eval_temperature=-1"),
        r"pipeline\.eval_temperature=-1\.0 must be >= 0",
    ),
    E("cfg/async-ratio-negative", compose("pipeline.async_ratio=-1"), r"pipeline\.async_ratio=-1 must be >= 0"),
    E("cfg/clip-inverted", compose("algo.clip_low=0.3", "algo.clip_high=-0.1"), r"algo\.clip_high=-0\.1 must be > 0"),
    E("cfg/clip-low-above-1", compose("algo.clip_low=1.5"), r"algo\.clip_low=1\.5 must be < 1"),
    E("cfg/dual-clip-below-1", compose("algo.dual_clip=0.5"), r"algo\.dual_clip=0\.5 must be > 1"),
    E("cfg/value-clip-negative", compose("algo.value_clip=-1"), r"algo\.value_clip=-1\.0 must be > 0"),
    E("cfg/advantage-clip-0", compose("algo.advantage_clip=0"), r"algo\.advantage_clip=0\.0 must be > 0"),
    E("cfg/reward-clip-negative", compose("algo.reward_clip=-1"), r"algo\.reward_clip=-1\.0 must be > 0"),
    E("cfg/ratio-cap-0", compose("algo.ratio_cap=0"), r"algo\.ratio_cap=0\.0 must be > 0"),
    E("cfg/kl-coef-negative", compose("algo.kl_coef=-0.1"), r"algo\.kl_coef=-0\.1 must be >= 0"),
    E("cfg/kl-target-negative", compose("algo.kl_target=-1"), r"algo\.kl_target=-1\.0 must be > 0"),
    E("cfg/kl-horizon-0", compose("algo.kl_horizon=0"), r"algo\.kl_horizon=0 must be > 0"),
    E("cfg/gamma-above-1", compose("algo.gamma=2"), r"algo\.gamma=2\.0 and algo\.lam=1\.0 must lie in \[0, 1\]"),
    E("cfg/max-steps-0", compose("pipeline.max_steps=0"), r"pipeline\.max_steps=0 must be > 0"),
    E("cfg/rollout-batch-0", compose("pipeline.rollout_batch_size=0"), r"pipeline\.rollout_batch_size=0 must be > 0"),
    E("cfg/prompt-length-0", compose("model.max_prompt_length=0"), r"model\.max_prompt_length=0 must be > 0"),
    E("cfg/dtype-unknown", compose("model.dtype=fp8"), r"model\.dtype='fp8' is not one of 'auto', 'float32'"),
    E("cfg/infer-world-size-0", compose("infer_engine.world_size=0"), r"infer_engine\.world_size \(hf\)=0 must be > 0"),
    E(
        "cfg/micro-batch-0",
        compose("train_engine.micro_batch_size=0"),
        r"train_engine\.micro_batch_size .* must be >= 1",
    ),
    E(
        "cfg/megatron-context-parallel",
        compose("train_engine=megatron", "train_engine.context_parallel_size=2"),
        r"world_size=1 is not a multiple of .* x context_parallel_size = 1 x 1 x 2",
    ),
    E(
        "cfg/megatron-context-parallel-0",
        compose("train_engine=megatron", "train_engine.context_parallel_size=0"),
        r"context_parallel_size must be >= 1",
    ),
    E(
        "cfg/megatron-expert-parallel",
        compose("train_engine=megatron", "train_engine.expert_model_parallel_size=2"),
        r"expert_model_parallel_size=2 must divide the data-parallel size .* = 1",
    ),
    E(
        "cfg/megatron-lora-splits-fused-qkv",
        compose(
            "train_engine=megatron", "train_engine.lora_rank=4", "train_engine.lora_target_modules=[q_proj,v_proj]"
        ),
        r"fuses q_proj/k_proj/v_proj into one layer \(linear_qkv\) that shares one LoRA A",
    ),
    E("cfg/sleep-level-3", compose("infer_engine.sleep_level=3"), r"infer_engine\.sleep_level=3 is not one of 0, 1, 2"),
    E(
        "cfg/backend-unknown",
        compose("cluster.backend=slurm"),
        r"cluster\.backend='slurm' is not one of 'local', 'ray'",
    ),
    E("cfg/platform-unknown", compose("hw.platform=tpu"), r"hw\.platform='tpu' is not installed; installed: .*cpu"),
    E("cfg/reward-timeout-0", compose("pipeline.reward_timeout_s=0"), r"pipeline\.reward_timeout_s=0\.0 must be > 0"),
    E("cfg/env-eval-size-negative", compose("env.eval_size=-1"), r"env\.eval_size=-1 must be >= 0"),
    E("cfg/env-train-size-0", compose("env.train_size=0"), r"env\.train_size=0 must be >= 1"),
    E(
        "cfg/file-eval-fraction-above-1",
        compose("env=file", "env.path=x.jsonl", "env.eval_fraction=1.5"),
        r"env\.eval_fraction=1\.5 must be in \[0, 1\)",
    ),
    E("cfg/countdown-max-number-0", compose("env=countdown", "env.max_number=0"), r"env\.max_number=0 must be >= 1"),
    E(
        "cfg/agentic-turn-longer-than-context",
        compose("pipeline=agentic", "env=agentic", "env.env=sokoban", "env.max_tokens_per_turn=4096"),
        r"env\.max_tokens_per_turn must be below env\.max_context_length",
    ),
    E(
        "cfg/correction-with-truncated-sampling",
        compose("model=qwen3", "algo.off_policy_correction=geo_mask"),
        r"algo\.off_policy_correction=geo_mask with truncated sampling \(infer_engine\.top_p=0\.95, top_k=20",
    ),
    E(
        "cfg/megatron-float16",
        compose("train_engine=megatron", "model.dtype=float16"),
        r"train_engine=megatron with model\.dtype=float16 is not supported: use model\.dtype=bfloat16",
    ),
    E(
        "cfg/distill-topk-1-without-tail",
        compose("pipeline=distill_offline", "distill.topk=1", "distill.tail=false"),
        r"distill\.topk=1 with distill\.tail=false gives a loss of 0 whatever the student",
    ),
    E(
        "cfg/agentic-on-failure-unknown",
        compose("pipeline=agentic", "env=agentic", "env.env=sokoban", "env.on_failure=retry"),
        r"env\.on_failure='retry' must be score or drop",
    ),
    E(
        "cfg/agentic-failure-reward-nan",
        compose("pipeline=agentic", "env=agentic", "env.env=sokoban", "env.failure_reward=nan"),
        r"env\.failure_reward must be a finite number, got nan",
    ),
    # -- configs: incompatible combinations ------------------------------------------------------------------------
    E(
        "cfg/grpo-group-size-1",
        compose("algo=grpo", "algo.group_size=1"),
        r"algo\.adv_estimator=grpo .*set algo\.group_size >= 2",
    ),
    E(
        "cfg/ppo-with-gigpo",
        compose("algo=ppo", "algo.adv_estimator=gigpo"),
        r"adv_estimator=gigpo .*set algo\.group_size >= 2",
    ),
    E(
        "cfg/partial-rollout-without-async",
        compose("pipeline.partial_rollout=true"),
        r"pipeline\.partial_rollout .* need asynchronous training: set pipeline\.async_ratio >= 1",
    ),
    E(
        "cfg/tail-groups-without-async",
        compose("pipeline.tail_groups=2"),
        r"need asynchronous training: set pipeline\.async_ratio >= 1",
    ),
    E(
        "cfg/kl-in-reward-with-grpo",
        compose("algo.kl_in_reward=true", "algo.kl_coef=0.1"),
        r"algo\.kl_in_reward=true needs a token-reward estimator .* not grpo",
    ),
    E(
        "cfg/mini-batch-size-and-count",
        compose("algo.mini_batch_size=8", "algo.num_mini_batches=2"),
        r"set algo\.mini_batch_size or algo\.num_mini_batches, not both",
    ),
    E(
        "cfg/more-mini-batches-than-samples",
        compose("algo.num_mini_batches=1000"),
        r"algo\.num_mini_batches=1000 exceeds the 64 samples of a rollout batch \(pipeline\.rollout_batch_size=8 x "
        r"algo\.group_size=8\): lower it",
    ),
    E(
        "cfg/overlong-buffer-past-response",
        compose("algo.overlong_buffer=100"),
        r"algo\.overlong_buffer=100 exceeds model\.max_response_length=16: lower the buffer",
    ),
    E(
        "cfg/address-with-local",
        compose("cluster.address=auto"),
        r"cluster\.address is set but cluster\.backend=local: use cluster=ray",
    ),
    E(
        "cfg/sglang-top-p",
        compose("infer_engine=sglang", "infer_engine.top_p=0.9"),
        r"infer_engine=sglang reports log-probs before top-k/top-p truncation",
    ),
    # -- runs refused at build: the world disagrees with the config ------------------------------------------------
    E(
        "run/model-path-missing",
        build("model.path=/nonexistent/model"),
        r"model\.path=/nonexistent/model does not exist .*point model\.path at a Hugging Face model folder",
    ),
    E(
        "run/model-folder-without-config",
        lambda c: build(f"model.path={empty_dir(c)}")(c),
        r"model\.path=.*not-a-model is a folder without config\.json: point model\.path at",
    ),
    E(
        "run/model-builtin-unknown",
        build("model.path=builtin:nope"),
        r"model\.path=builtin:nope: unknown builtin model 'nope'; builtins: tiny",
    ),
    E(
        "run/data-file-missing",
        lambda c: build(f"env.path={c.path('missing.jsonl')}")(c),
        r"data file .*missing\.jsonl does not exist: check env\.path",
    ),
    E(
        "run/eval-file-missing",
        lambda c: build(f"env.eval_path={c.path('held.jsonl')}")(c),
        r"data file .*held\.jsonl does not exist: check env\.eval_path",
    ),
    E(
        "run/empty-eval-set-with-eval-every",  # once reported as "every prompt exceeds max_prompt_length"
        build("env.eval_size=0", "pipeline.eval_every=1"),
        r"^pipeline\.eval_every=1 but the held-out set of env=data is empty .*set pipeline\.eval_every=0",
    ),
    E(
        "run/gigpo-with-rlvr",
        build("algo.adv_estimator=gigpo"),
        r"algo\.adv_estimator=gigpo groups steps of multi-turn episodes: use pipeline=agentic",
    ),
    E(
        "run/ppo-with-agentic",
        build("algo=ppo", agentic=True),
        r"algo\.adv_estimator=gae has no trajectory form: use one of .*grpo",
    ),
    E("run/agentic-with-file-env", build("pipeline=agentic"), r"pipeline=agentic needs an agentic env .*got FileTask"),
    E(
        "run/dapo-filtering-with-agentic",
        build("algo.drop_uniform_groups=true", "algo.reward_clip=1.0", agentic=True),
        r"algo\.drop_uniform_groups=true, algo\.reward_clip=1\.0: dynamic sampling and reward shaping apply to "
        r"single-turn prompts \(pipeline=rlvr\), not to pipeline=agentic's episodes",
    ),
    E(
        "run/async-with-sleeping-engine",
        build("pipeline.async_ratio=1", "infer_engine.sleep_level=1"),
        r"pipeline\.async_ratio=1 keeps the engines generating .* set infer_engine\.sleep_level=0",
    ),
    E(
        "run/fsdp2-on-local",
        build("train_engine=fsdp2"),
        r"actor_train: world_size=2 .* local backend cannot give: use cluster=ray",
    ),
    E(
        "run/every-prompt-too-long",  # a whole pass over the data is tried first, then the limit is named
        run_steps("model.max_prompt_length=4", "pipeline.max_steps=1"),
        r"every prompt exceeds model\.max_prompt_length=4 \(shortest: \d+ tokens\): raise model\.max_prompt_length",
    ),
    # -- data rows (FileTask, JSONL and Parquet) -------------------------------------------------------------------
    C(
        "data/broken-json-line",
        file_task(lambda c: c.jsonl("a.jsonl", GOOD7, b'{"prompt": "x", "answer": \n')),
        "FileTask.skipped",
        r"a\.jsonl: line 31: invalid JSON",
    ),
    C(
        "data/not-utf8-line",
        file_task(
            lambda c: c.jsonl(
                "a.jsonl", GOOD7, b'{"prompt": "\xff\xfe", "answer": "7"}\n' + json.dumps(GOOD7[0]).encode() + b"\n"
            )
        ),
        "FileTask.skipped",
        r"a\.jsonl: line 31: not UTF-8 text",
    ),
    C(
        "data/missing-prompt-key",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"question": "x", "answer": "7"}])),
        "FileTask.skipped",
        r"line 31: missing or empty 'prompt'",
    ),
    C(
        "data/blank-prompt",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"prompt": " \n\t", "answer": "7"}])),
        "FileTask.skipped",
        r"line 31: missing or empty 'prompt'",
    ),
    C(
        "data/prompt-is-a-list",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"prompt": [{"role": "user"}], "answer": "7"}])),
        "FileTask.skipped",
        r"line 31: 'prompt' has type list .*expected text",
    ),
    C(
        "data/missing-answer",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"prompt": "x"}])),
        "FileTask.skipped",
        r"line 31: missing or empty 'answer'",
    ),
    C(
        "data/answer-is-a-list",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"prompt": "x", "answer": [1, 2]}])),
        "FileTask.skipped",
        r"line 31: 'answer' has type list \(\[1, 2\]\), expected text or a number",
    ),
    C(
        "data/answer-is-a-bool",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, {"prompt": "x", "answer": True}])),
        "FileTask.skipped",
        r"line 31: 'answer' has type bool",
    ),
    C(
        "data/answer-is-nan",
        file_task(lambda c: c.jsonl("a.jsonl", GOOD7, b'{"prompt": "x", "answer": NaN}\n')),
        "FileTask.skipped",
        r"line 31: 'answer' is nan, not a number",
    ),
    P(
        "data/answer-is-a-number",
        file_task(lambda c: c.jsonl("a.jsonl", [{"prompt": f"q{i}", "answer": 7} for i in range(30)])),
        r"answers: 7(,7)+$",
    ),
    C(
        "data/row-not-an-object",
        file_task(lambda c: c.jsonl("a.jsonl", [*GOOD7, [1, 2]])),
        "FileTask.skipped",
        r"line 31: row is list, not an object",
    ),
    C(
        "data/parquet-null-prompt",
        file_task(
            lambda c: c.parquet("a.parquet", {"prompt": [f"q{i}" for i in range(29)] + [None], "answer": ["7"] * 30})
        ),
        "FileTask.skipped",
        r"a\.parquet: line 30: missing or empty 'prompt'",
    ),
    E(
        "data/empty-file",
        file_task(lambda c: c.write("a.jsonl", "")),
        r"a\.jsonl: no usable rows: the file is empty; fill it or point env\.path",
    ),
    E(
        "data/blank-lines-only",
        file_task(lambda c: c.write("a.jsonl", "\n \n\n")),
        r"a\.jsonl: no usable rows: the file is empty",
    ),
    E(
        "data/every-line-broken",
        file_task(lambda c: c.write("a.jsonl", "{\n{\n")),
        r"a\.jsonl: no usable rows \(2 skipped, first: line 1: invalid JSON .*\); expected keys 'prompt', 'answer'",
    ),
    E(
        "data/parquet-wrong-columns",
        file_task(lambda c: c.parquet("a.parquet", {"question": ["q"] * 3, "solution": ["7"] * 3})),
        r"a\.parquet: no usable rows .*the rows have keys 'question', 'solution': fix the rows or set env\.prompt_key",
    ),
    E(
        "data/parquet-corrupt",
        file_task(lambda c: c.write("a.parquet", b"PAR1 not really")),
        r"a\.parquet: cannot read it as Parquet .*check the file or env\.path",
    ),
    E(
        "data/unsupported-format",
        file_task(lambda c: c.write("a.csv", "prompt,answer\nx,7\n")),
        r"unsupported data file .*a\.csv \(env\.path / env\.eval_path\): use \.jsonl, \.parquet",
    ),
    E(
        "data/every-row-held-out",
        file_task(lambda c: c.jsonl("a.jsonl", GOOD7[:3]), eval_fraction=0.999),
        r"a\.jsonl: every row fell in the held-out split; lower env\.eval_fraction or give env\.eval_path",
    ),
    C(
        "data/huge-prompt-10MB",
        huge_prompt,
        "data/skipped_long_prompts",
        r"tokenised prompts of \[\d+, \d+\] characters",
    ),
    # -- the shared run: bad data, faulty rewards, a rank without prompts, one held-out prompt ----------------------
    C(
        "run/bad-rows-skipped",
        shared_skipped_rows,
        "FileTask.skipped",
        r"(?m)^line 8: invalid JSON.*\n^line 9: not UTF-8",
    ),
    C("run/huge-prompts-skipped", shared_metric("data/skipped_long_prompts"), "data/skipped_long_prompts"),
    C(
        "run/reward-raises",
        shared_metric("reward/errors"),
        "reward/errors",
        r"failed on row \d+: .*RuntimeError: a reward bug",
    ),
    C("run/reward-returns-nan", shared_metric("reward/nonfinite"), "reward/nonfinite", r"returned nan for row"),
    C("run/reward-hangs", shared_metric("reward/timeouts"), "reward/timeouts", r"did not score row \d+ within 0\.5s"),
    P("run/infer-rank-given-no-prompt", shared_one_prompt_two_ranks),  # once crashed: world_size=2, one prompt
    P("run/eval-one-held-out-prompt", shared_evals),  # once crashed: one held-out prompt on two ranks
    # -- rewards behind the guard ----------------------------------------------------------------------------------
    C("reward/raises", guarded(["raise", "7"]), "errors"),
    C("reward/returns-nan", guarded(["nan", "7"]), "nonfinite"),
    C("reward/returns-inf", guarded(["inf", "7"]), "nonfinite"),
    C("reward/hangs", guarded(["hang", "7"]), "timeouts"),
    C("reward/returns-none", guarded(["none", "7"]), "errors"),
    C("reward/kills-its-process", guarded(["exit", "7"]), "errors"),
    P("reward/one-score-short", guarded(["short", "7"]), r"scores \[0\.0, 1\.0\]"),  # rescored row by row: exact
    # -- model output adversarial for parsers ----------------------------------------------------------------------
    C(
        "parse/countdown-100k-long-product",
        scored("countdown", "\\boxed{" + "*".join(["1"] * 100_000) + "}", "1|1"),
        "errors",
    ),
    C(
        "parse/countdown-5000-nested-parens",
        scored("countdown", "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}", "1|1"),
        "errors",
    ),
    C(
        "parse/countdown-900-deep-product",
        scored("countdown", "\\boxed{" + "*".join(["1"] * 450) + "}", "1|1"),
        "wrong_numbers",
    ),
    C("parse/countdown-10k-digits", scored("countdown", "\\boxed{" + "9" * 10_000 + "}", "7|1,2,4"), "errors"),
    C("parse/countdown-power-tower", scored("countdown", "\\boxed{9**9**9**9}", "7|1,2,4"), "errors"),
    C("parse/countdown-division-by-zero", scored("countdown", "\\boxed{1/(2-2)+4}", "7|1,2,2,4"), "errors"),
    C(
        "parse/countdown-code-in-box",
        scored("countdown", "\\boxed{__import__('os').system('true')}", "7|1,2,4"),
        "errors",
    ),
    C("parse/countdown-bad-ground-truth", scored("countdown", "\\boxed{1+2+4}", "seven"), "errors"),  # once uncaught
    C("parse/countdown-unterminated-box", scored("countdown", "\\boxed{1+2+4", "7|1,2,4"), "no_boxed"),
    P("parse/countdown-right-answer", scored("countdown", "\\boxed{(1+2)+4}", "7|1,2,4", want=1.0)),
    P("parse/math-huge-output", scored("math", "a" * HUGE + " \\boxed{7}", "7", want=1.0)),
    C("parse/math-unterminated-box", scored("math", "so \\boxed{7", "7"), "no_boxed"),
    C("parse/math-100k-box-openers", scored("math", "\\boxed{" * 100_000, "7"), "no_boxed"),
    C(
        "parse/math-100k-nested-braces",
        scored("math", "\\boxed{" + "{" * 100_000 + "7" + "}" * 100_000 + "}", "7"),
        "errors",  # refused by length at once: math-verify's SIGALRM timeout once let it run for 10 minutes
    ),
    C(
        "parse/math-5000-nested-parens",
        scored("math", "\\boxed{" + "(" * 5000 + "7" + ")" * 5000 + "}", "7"),
        "errors",
    ),
    P("parse/math-10k-digits", scored("math", "\\boxed{" + "9" * 10_000 + "}", "7", want=0.0)),
    # -- environments ----------------------------------------------------------------------------------------------
    C("env/step-raises", env_manager(StepRaises), "env_errors", r"env_error: environment step raised RuntimeError"),
    C("env/reset-raises", env_manager(ResetRaises, method="reset"), "env_errors", r"environment reset raised OSError"),
    C(
        "env/step-hangs",
        env_manager(StepHangs, timeout_s=0.2),
        "env_timeouts",
        r"env_timeout: environment step did not return within 0\.2s",
    ),
    C(
        "env/step-malformed-result",
        env_manager(malformed_env),
        "env_errors",
        r"raised ValueError: not enough values to unpack",
    ),
    C(
        "env/step-nan-reward",
        env_manager(malformed_env),
        "env_errors",
        r"step returned the reward nan; rewards must be finite",
    ),
    C(
        "env/step-reward-not-a-number",
        env_manager(malformed_env),
        "env_errors",
        r"could not convert string to float: 'lots'",
    ),
    C("env/agentic-run-malformed-env", agentic_malformed, "env/env_errors", r"2 steps"),
    # -- roll-eval -------------------------------------------------------------------------------------------------
    P(
        "eval/dtype-auto",
        roll_eval("builtin:tiny", "model=tiny", "model.dtype=auto", "--samples", "2"),
        r"accuracy [\d.]+ on 2 held-out",
    ),
    E(
        "eval/empty-eval-set",
        roll_eval("builtin:tiny", "model=tiny", "env.eval_size=0"),
        r"exit 2: .*env=arithmetic has no held-out problems to evaluate .*\(env\.eval_size, env\.eval_path\)",
    ),
    E(
        "eval/model-missing",
        roll_eval("/nonexistent/model", "model=tiny"),
        r"exit 2: .*model\.path=/nonexistent/model does not exist",
    ),
    E("eval/bad-override", roll_eval("builtin:tiny", "model=tiny", "algo.lr=abc"), r"exit 2: .*full_key: algo\.lr"),
]


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


@pytest.fixture(scope="module")
def corpus(
    tmp_path_factory: pytest.TempPathFactory, seven_task: Path, request: pytest.FixtureRequest
) -> Iterator[Corpus]:
    c = Corpus(tmp_path_factory.mktemp("bad-inputs"), seven_task)
    yield c
    _print_table(c.results, request.config)


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


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, corpus: Corpus) -> None:
    result = classify(case, corpus)
    corpus.results.append(result)
    want = f"{case.expect} matching {case.match!r}" if case.match else case.expect
    if case.counter:
        want += f" with {case.counter} > 0"
    assert result.ok, f"{case.id}: ended as {result.outcome} ({result.detail[:2000]}), expected {want}"


def test_case_ids_are_unique() -> None:
    assert len({c.id for c in CASES}) == len(CASES)
