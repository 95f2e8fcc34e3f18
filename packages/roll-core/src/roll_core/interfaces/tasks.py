"""The task and reward contract: what the `reward` role hosts and what the pipeline samples prompts from.

A task is a fixed, seeded list of training problems, a disjoint held-out list, the chat messages of a problem,
and a reward. A reward scores many decoded responses at once and counts its failures (timeouts, crashes), so a
reward worker that silently returns zeros is visible in the metrics.

Context: besides responses and answers, a reward may take `prompts` (the problem's prompt text, the user message
before any chat template) and `metadata` (the row's metadata: its `domain` and every other column of its data
row) as keyword arguments. The reward role passes each only to a `score` that declares it (`reward_kwargs`), so a
reward written for `score(responses, answers)` keeps working.

Data counts: any task may say what loading and splitting its data left out (`DataCounts`: bad rows skipped, training
rows left out as held out); the collectors put them in the run's metrics and summary (`data_counts`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class RewardResult:
    """Scores of one batch. `scores[i]`, `correct[i]` (0/1, strict correctness) and `formatted[i]` (0/1, the
    answer had the required form) belong to response i; `counters` counts failures by kind."""

    scores: list[float]
    correct: list[float]
    formatted: list[float]
    counters: dict[str, int] = field(default_factory=dict)
    #: Optional, per response: True where the score is a fallback, not a verdict (the scorer failed on that row:
    #: roll's reward guard and the remote verifier set it); None: every row was scored. A reward that can only
    #: count its failures (`counters["unscored"]` beyond the rows it flags) gets its remaining rows flagged when the
    #: count covers them all, else its batch scored again row by row (roll_core.cluster.reward_guard): a failed row
    #: is never counted without its flag. Each entry must be a bool (a string "false" is refused, not read as True).
    failed: list[bool] | None = None

    def __post_init__(self) -> None:
        if not (len(self.scores) == len(self.correct) == len(self.formatted)):
            raise ValueError("scores, correct and formatted must have one entry per response")
        if self.failed is not None and len(self.failed) != len(self.scores):
            raise ValueError("failed must have one entry per response")
        if self.failed is not None and not all(isinstance(f, bool) or f in (0, 1) for f in self.failed):
            bad = next(f for f in self.failed if not (isinstance(f, bool) or f in (0, 1)))
            raise ValueError(f"failed holds {bad!r}: each entry must be a bool (or 0/1)")


@runtime_checkable
class ProblemLike(Protocol):
    """One prompt with its ground truth; `id` is stable across runs."""

    id: str
    prompt: str
    answer: str


@runtime_checkable
class Reward(Protocol):
    def score(self, responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        """Score `responses[i]` against ground truth `answers[i]`; never raises for a malformed response.

        May also declare keyword arguments `prompts: Sequence[str]` (prompt i's text) and
        `metadata: Sequence[Mapping[str, Any]]` (row i's metadata, incl. its `domain`): see the module docstring."""
        ...


#: The context keyword arguments a reward's `score` may declare. `time_budget_s` (float): the seconds the caller
#: gives the call (roll's reward guard cuts a call off after them, losing every score it had); a reward that
#: declares it returns what it has scored by then, its unfinished rows counted as its own failures. It is given
#: only to a `score` that names it (never through **kwargs).
CONTEXT_ARGS = ("prompts", "metadata", "time_budget_s")
_NAMED_ONLY = ("time_budget_s",)


def reward_kwargs(reward: Any, **context: Any) -> dict[str, Any]:
    """The subset of `context` (prompts=..., metadata=...) that `reward.score` declares (all of it when `score`
    takes **kwargs); None values are left out."""
    import inspect

    unknown = set(context) - set(CONTEXT_ARGS)
    if unknown:
        raise TypeError(f"unknown reward context {sorted(unknown)}; known: {', '.join(CONTEXT_ARGS)}")
    try:
        params = inspect.signature(reward.score).parameters
    except (TypeError, ValueError):  # a builtin or C-implemented score: give it nothing extra
        return {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in context.items() if v is not None and (k in params or (takes_all and k not in _NAMED_ONLY))}


def answer_reader(extract: Callable[..., str | None]) -> Callable[[str, Any], str | None]:
    """A reward's (or task's) `extract_answer` as `(response, metadata) -> answer`: given the row's metadata
    `choices` when `extract` declares a `choices` parameter (the visual reward: the last of the row's choices
    named), else the response alone; so whoever reads a reply's answer (roll-eval's votes, QAEnv's "has an answer")
    reads the one the reward grades, which `score` finds with the row's metadata."""
    import inspect

    try:
        takes_choices = "choices" in inspect.signature(extract).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the response alone
        takes_choices = False
    if not takes_choices:
        return lambda text, meta: extract(text)
    return lambda text, meta: extract(text, choices=(meta or {}).get("choices"))


@runtime_checkable
class Task(Protocol):
    name: str
    reward: Reward

    def train_set(self) -> Sequence[ProblemLike]:
        """Training problems in a fixed order for a given config."""
        ...

    def eval_set(self) -> Sequence[ProblemLike]:
        """Held-out problems, disjoint from `train_set()`."""
        ...

    def messages(self, problem: ProblemLike) -> list[dict[str, str]]:
        """Chat messages of a problem (the pipeline applies the model's chat template)."""
        ...


@runtime_checkable
class DataCounts(Protocol):
    """Optional attributes of any task (`Task`, `AgenticTask`, an agent-program task): what loading and splitting
    its data left out. The RLVR and agentic collectors read them with `data_counts` and report them in every
    training step's metrics (`data/skipped_rows`, `data/also_held_out`) and in the run summary (`skipped_rows`,
    `also_held_out`); the post-training collectors (sft, dpo, distill_offline) report their data files' counts
    under the same names (roll_core.posttrain.source.PostTrainData: skips by reason, and training rows whose
    prompt the held-out file holds too, which they keep and train on). A task without them reports
    `skipped_rows` {} and no `also_held_out`.

    - `skipped_rows`: bad data rows skipped at load, per data file ({} when none).
    - `also_held_out`: training rows left out because a held-out row is the same problem but for whitespace (and
      so would be trained on and measured as held out); None where the task draws disjoint splits itself
      (generated problems, environment seeds) and so has nothing to count.
    - `unused_held_out` (optional: not a member, so tasks written before it still match): held-out rows neither
      trained on nor evaluated (a file's hash split beyond `env.eval_size`, env=multi's held-out rows of a domain
      no training row has); reported as `unused_held_out` / `data/unused_held_out` when a task sets it. A task
      counts only its own split, not the run's `pipeline.eval_size` cut: evaluation samples the first
      `pipeline.eval_size` problems of `eval_set()` and the collector adds the rest to the run's `unused_held_out`
      (the RLVR collectors to their task's count; sft, dpo and distill_offline, which count their data files, the
      env task's problems beyond the cut when they sample it for eval/accuracy: collectors._eval_cut)."""

    skipped_rows: Mapping[str, int]
    also_held_out: int | None


def data_counts(task: Any) -> dict[str, Any]:
    """The run summary's entries of `task`'s optional `DataCounts`: `skipped_rows` ({file: rows}; {} when the
    task has none) and `also_held_out` (an int; absent when the task does not say). A value of the wrong type is
    a TypeError naming the task: a count the run cannot read is not reported as 0. `unused_held_out`, when the
    task sets it, likewise."""
    what = type(task).__name__
    skipped = getattr(task, "skipped_rows", None) or {}
    if not isinstance(skipped, Mapping) or not all(_count(n) for n in skipped.values()):
        raise TypeError(f"{what}.skipped_rows must map data files to row counts (ints >= 0), got {skipped!r}")
    out: dict[str, Any] = {"skipped_rows": {str(f): int(n) for f, n in skipped.items()}}
    for key in ("also_held_out", "unused_held_out"):
        n = getattr(task, key, None)
        if n is not None:
            if not _count(n):
                raise TypeError(f"{what}.{key} must be a row count (an int >= 0) or None, got {n!r}")
            out[key] = int(n)
    return out


def data_metrics(counts: Mapping[str, Any]) -> dict[str, float]:
    """A training step's metrics of `data_counts(task)`: `data/skipped_rows` (all files) and, when the task
    counts them, `data/also_held_out` and `data/unused_held_out`."""
    out = {"data/skipped_rows": float(sum(counts["skipped_rows"].values()))}
    for key in ("also_held_out", "unused_held_out"):
        if key in counts:
            out[f"data/{key}"] = float(counts[key])
    return out


def _count(n: Any) -> bool:
    """Whether `n` is a row count: an int >= 0 (numpy's too), not a bool."""
    import numbers

    return isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 0


@runtime_checkable
class AgenticTask(Protocol):
    """What `pipeline=agentic` needs of an `env` group: an environment factory, seeds, limits and prompts
    (roll_envs.agentic.AgenticTask is the built-in implementation). Optional: `on_failure` ("score" | "drop") and
    `failure_reward` (float), how an episode whose environment step failed is trained (default: scored 0.0)."""

    name: str
    # Episode limits: turns, tokens of the whole context, tokens of one response.
    max_turns: int
    max_context_length: int
    max_tokens_per_turn: int
    # Environment calls: timeout of one reset/step, calls at once, and environment workers (0: in the controller).
    step_timeout_s: float
    env_threads: int
    num_workers: int

    def make_env(self) -> Any:
        """A fresh environment (roll_core.interfaces.Env)."""
        ...

    def system_prompt(self) -> str | None:
        """The system message of every episode (None: none)."""
        ...

    def examples(self) -> list[dict[str, str]]:
        """Demonstration messages placed before the first observation (may be empty)."""
        ...

    def train_seeds(self, count: int, seed: int) -> list[int]:
        """`count` distinct training environment seeds drawn with `seed`."""
        ...

    def eval_seeds(self) -> list[int]:
        """The held-out environment seeds."""
        ...
