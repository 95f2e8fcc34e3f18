"""Multi-domain RLVR: several tasks in one run, each with its own reward, mixed by weights or fixed batch counts.

`env=multi` composes any single-turn tasks under `env.tasks.<domain>` (each a whole env node: `arithmetic`,
`code`, `instruct`, `file`, ...). Contract:
- Routing (`route`): `task` (default): every problem of sub-task `t` has domain `t`; `column`: a problem keeps its
  own domain (a data file's `domain` column), so one file can hold several domains (a file row that names none
  has its sub-task's domain `t`, not the file task's default "math"); its reward is
  `env.rewards.<domain>` when given, else the reward of the sub-task named like the domain. A domain without a
  reward is a ConfigError when the task loads (naming the domains and the rows' counts), never a silent 0.
- Each problem is served as a `DomainProblem` (id prefixed `<domain>/`) with the sub-task's own chat messages (its
  system prompt and worked examples), metadata and pictures.
- `reward` is a `DomainReward`: each row is scored by the reward of its domain (rows grouped per domain, one call
  per domain, prompts/metadata passed to rewards that declare them, and what is left of the caller's
  `time_budget_s` to those that declare it); a row whose domain has no reward (a row from outside this task, or
  one whose metadata names no domain) is no answer: it scores 0, is flagged `failed` (the reward guard counts it
  in `failed_unscored`, evaluation as a failure, never a wrong answer), counts in `unknown_domain` and is logged
  (once per domain and reward). The sub-rewards' counters add up, and their `failed` rows (a remote verifier that
  gave up) stay failed.
- Sampling (`roll_core.data.DomainSampler`, built by the prompts collectors from `domain_slices()` and
  `mixture()`): `counts` gives each domain a fixed number of prompts per batch (summing to
  `pipeline.rollout_batch_size`); otherwise `weights` (a domain not named weighs 1: default equal) draws each
  prompt's domain at random, seeded and checkpointed. Every domain keeps its own epoch order.
- `advantage_scale[d]` multiplies the advantages of domain d's rows (default 1: group-normalised as always).
- Training and held-out sets share no problem: a training problem another sub-task holds out (same prompt and
  pictures) is left out of training, with a warning per sub-task, and counted with the sub-tasks' own in
  `also_held_out` (the run's data/also_held_out).
- The held-out set interleaves the domains (round robin; held-out rows of a domain no training row has are left
  out, with a warning, and counted with the sub-tasks' own in `unused_held_out`, the run's data/unused_held_out)
  so `pipeline.eval_size` keeps them balanced; evaluation
  and step metrics are reported per domain (`domain/<d>/...`, `eval/<d>/accuracy`).
"""

from __future__ import annotations

import itertools
import logging
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll_core.errors import ConfigError
from roll_core.interfaces.tasks import reward_kwargs
from roll_envs.rewards.base import Reward, RewardResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DomainProblem:
    """A sub-task's problem served by a multi-domain task; `source` is the sub-task's own problem and `task` the
    sub-task's key (its chat messages come from there: with route=column a domain may hold several sub-tasks'
    rows, whose own ids may coincide)."""

    id: str
    prompt: str
    answer: str
    domain: str
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    source: Any = field(default=None, compare=False, hash=False)
    task: str = ""
    # The sub-task problem's pictures (a visual or pictured file task as a domain): the prompt encoder reads them.
    images: Sequence[Any] = field(default=(), compare=False, hash=False)


class DomainReward(Reward):
    """Routes each row to the reward of its `metadata["domain"]` (see the module docstring)."""

    def __init__(self, rewards: Mapping[str, Any]) -> None:
        if not rewards:
            raise ValueError("a multi-domain reward needs at least one domain")
        self.rewards = dict(rewards)
        self._logged: set[str] = set()  # domains without a reward already logged (a step's rows would repeat it)

    def score(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        prompts: Sequence[str] | None = None,
        metadata: Sequence[Mapping[str, Any]] | None = None,
        time_budget_s: float | None = None,
    ) -> RewardResult:
        deadline = None if time_budget_s is None else time.monotonic() + time_budget_s
        n = len(responses)
        if len(answers) != n:
            raise ValueError(f"{n} responses but {len(answers)} answers")
        if metadata is None or len(metadata) != n:
            raise ValueError("a multi-domain reward needs each row's metadata (its domain)")
        scores, correct, formatted, failed = [0.0] * n, [0.0] * n, [0.0] * n, [False] * n
        counters: dict[str, int] = {"unknown_domain": 0}
        rows: dict[str, list[int]] = {}
        unknown: dict[str, int] = {}
        for i, meta in enumerate(metadata):
            domain = meta.get("domain")
            if domain in self.rewards:
                rows.setdefault(domain, []).append(i)
            else:  # no reward to ask: a failed row (its 0 read as a wrong answer, unflagged and unlogged, before)
                counters["unknown_domain"] += 1
                failed[i] = True
                unknown[repr(domain)] = unknown.get(repr(domain), 0) + 1
        if unknown.keys() - self._logged:
            self._logged |= unknown.keys()
            log.warning(
                "env=multi: %d of %d rows are of domain(s) without a reward here (%s; this task's domains: %s): "
                "scored 0 and flagged failed, counted in reward/unknown_domain and reward/failed_unscored "
                "(logged once per domain)",
                sum(unknown.values()),
                n,
                ", ".join(f"{d}: {c}" for d, c in unknown.items()),
                sorted(self.rewards),
            )
        for domain, idx in rows.items():
            reward = self.rewards[domain]
            context = {
                "prompts": None if prompts is None else [prompts[i] for i in idx],
                "metadata": [metadata[i] for i in idx],
                # what is left of the caller's budget (domains are scored one after another)
                "time_budget_s": None if deadline is None else max(0.0, deadline - time.monotonic()),
            }
            res = reward.score(
                [responses[i] for i in idx], [answers[i] for i in idx], **reward_kwargs(reward, **context)
            )
            if len(res.scores) != len(idx):
                raise ValueError(f"the reward of domain {domain!r} returned {len(res.scores)} scores for {len(idx)}")
            for j, i in enumerate(idx):
                scores[i], correct[i], formatted[i] = res.scores[j], res.correct[j], res.formatted[j]
                failed[i] = bool(res.failed[j]) if res.failed is not None else False
            for k, v in res.counters.items():
                counters[k] = counters.get(k, 0) + v
        return RewardResult(
            scores=scores,
            correct=correct,
            formatted=formatted,
            counters=counters,
            failed=failed if any(failed) else None,
        )


class MultiTask:
    """Several single-turn tasks as one (see the module docstring)."""

    def __init__(
        self,
        tasks: Mapping[str, Any],
        name: str = "multi",
        weights: Mapping[str, float] | None = None,
        counts: Mapping[str, int] | None = None,
        advantage_scale: Mapping[str, float] | None = None,
        route: str = "task",
        rewards: Mapping[str, Any] | None = None,
    ) -> None:
        if not tasks:
            raise ConfigError("env=multi needs at least one task: +env@env.tasks.<domain>=<env option>")
        if route not in ("task", "column"):
            raise ConfigError(f"env.route={route!r}: use task (a domain per sub-task) or column (the rows' domain)")
        self.name, self.route = name, route
        self.tasks = dict(tasks)
        for t, task in self.tasks.items():
            if not hasattr(task, "train_set") or not hasattr(task, "messages"):
                raise ConfigError(f"env.tasks.{t} is not a single-turn task (a multi-turn env cannot be a domain)")
        # (sub-task, problem) pairs -> domain problems; the sub-task stays reachable for its chat messages.
        train = [self._wrap(t, p) for t in self.tasks for p in self.tasks[t].train_set()]
        held = [[self._wrap(t, p) for p in self.tasks[t].eval_set()] for t in self.tasks]
        kept = _without_others_held_out(train, [p for ps in held for p in ps])
        # Training rows left out as held out (roll_core.interfaces.tasks.DataCounts): each sub-task's own and those
        # another sub-task holds out; None when no sub-task splits rows and none were left out here.
        own = [n for n in (getattr(t, "also_held_out", None) for t in self.tasks.values()) if n is not None]
        left_out = len(train) - len(kept)
        self.also_held_out: int | None = sum(own) + left_out if own or left_out else None
        train = kept
        self.domains = list(dict.fromkeys(p.domain for p in train))
        own_rewards = {t: task.reward for t, task in self.tasks.items()}
        extra = dict(rewards or {})
        found = {**own_rewards, **extra}
        missing = [d for d in self.domains if d not in found]
        if missing:
            rows = {d: sum(p.domain == d for p in train) for d in missing}
            raise ConfigError(
                f"env=multi: rows of domain(s) {rows} have no reward: give each one "
                f"(+env/reward@env.rewards.<domain>=<reward>) or name a sub-task like the domain"
            )
        self.reward = DomainReward({d: found[d] for d in self.domains})
        # Training problems grouped by domain (stable), so each domain is one slice for the sampler.
        self._train = sorted(train, key=lambda p: self.domains.index(p.domain))
        self.weights, self.counts = _mixture(self.domains, weights or {}, counts or {})
        scale = dict(advantage_scale or {})
        _check_known("advantage_scale", scale, self.domains)
        for d, s in scale.items():
            if not math.isfinite(s) or s < 0:
                raise ConfigError(f"env.advantage_scale.{d}={s} must be a finite number >= 0")
        self.advantage_scale = {d: float(scale.get(d, 1.0)) for d in self.domains}
        for t in self.tasks:
            if not self.tasks[t].train_set():
                raise ConfigError(f"env.tasks.{t}: the training set is empty")
        per_domain = [[p for ps in held for p in ps if p.domain == d] for d in self.domains]
        unevaluated = [d for d, ps in zip(self.domains, per_domain) if not ps]
        if unevaluated and len(unevaluated) < len(self.domains):
            # eval/accuracy then averages the other domains only, and eval/<d>/* never appears, which nothing said.
            log.warning(
                "env=multi: domain(s) %s have no held-out rows: evaluation (eval/accuracy) covers %s only; give "
                "them held-out problems (their sub-task's eval_size or eval_path)",
                unevaluated,
                [d for d in self.domains if d not in unevaluated],
            )
        untrained: dict[str, int] = {}
        for p in (p for ps in held for p in ps if p.domain not in self.domains):
            untrained[p.domain] = untrained.get(p.domain, 0) + 1
        if untrained:  # (route=column: a held-out file's domain that no training row has; they were dropped unsaid)
            log.warning(
                "env=multi: held-out rows of domain(s) %s, which no training row has, are not evaluated (the "
                "domains of this run: %s)",
                untrained,
                self.domains,
            )
        # Held-out rows neither trained nor evaluated (DataCounts): the sub-tasks' own (a hash split beyond its
        # eval_size) and those of an untrained domain; None when no sub-task counts and none were left out here.
        unused = [n for n in (getattr(t, "unused_held_out", None) for t in self.tasks.values()) if n is not None]
        self.unused_held_out: int | None = sum(unused) + sum(untrained.values()) if unused or untrained else None
        # Round robin, so that pipeline.eval_size (a prefix) keeps every domain.
        self._eval = [p for row in itertools.zip_longest(*per_domain) for p in row if p is not None]

    def _wrap(self, task: str, p: Any) -> DomainProblem:
        domain = task
        if self.route == "column" and p.id not in getattr(self.tasks[task], "default_domain_ids", ()):
            domain = str(getattr(p, "domain", task))
        # Column routing: two sub-tasks' rows may share a domain and an id (two files named alike): the sub-task
        # is part of the id.
        ident = f"{domain}/{task}/{p.id}" if self.route == "column" else f"{domain}/{p.id}"
        return DomainProblem(
            id=ident,
            prompt=p.prompt,
            answer=p.answer,
            domain=domain,
            metadata=dict(getattr(p, "metadata", None) or {}),
            source=p,
            task=task,
            images=tuple(getattr(p, "images", None) or ()),
        )

    # ---- the Task contract ----------------------------------------------------------------------------------
    def train_set(self) -> list[DomainProblem]:
        """Every domain's training problems, domain after domain (the sampler mixes them)."""
        return self._train

    def eval_set(self) -> list[DomainProblem]:
        """Every domain's held-out problems, interleaved."""
        return self._eval

    def messages(self, problem: DomainProblem) -> list[dict[str, str]]:
        """The sub-task's own chat messages (its system prompt and worked examples)."""
        return self.tasks[problem.task].messages(problem.source)

    @property
    def skipped_rows(self) -> dict[str, int]:
        """Bad rows the sub-tasks skipped, per data file (roll_core.interfaces.tasks.DataCounts)."""
        out: dict[str, int] = {}
        for task in self.tasks.values():
            for file, n in (getattr(task, "skipped_rows", None) or {}).items():
                out[file] = out.get(file, 0) + n
        return out

    # ---- what the prompts collectors read ----------------------------------------------------------------
    def domain_slices(self) -> dict[str, range]:
        """Each domain's positions in `train_set()`."""
        out, start = {}, 0
        for d in self.domains:
            n = sum(p.domain == d for p in self._train)
            out[d] = range(start, start + n)
            start += n
        return out

    def mixture(self) -> tuple[dict[str, float], dict[str, int]]:
        """(weights, counts): exactly one is non-empty; counts are prompts per batch."""
        return dict(self.weights), dict(self.counts)


def _without_others_held_out(train: list[DomainProblem], held: list[DomainProblem]) -> list[DomainProblem]:
    """`train` less the problems another sub-task holds out (same `loose_key`: prompt but for whitespace, and
    pictures), with one warning per sub-task. Each sub-task keeps its own splits apart, but not from the others': a
    benchmark given as one sub-task's env.eval_path and also inside another's training file was trained on and
    evaluated (the Task contract: train and held-out never share a problem). A sub-task's own held-out rows are its
    business (a file task whose env.eval_path is its env.path evaluates on its training rows, on purpose). A
    ConfigError when that leaves a sub-task nothing to train on."""
    from roll_envs.tasks.base import loose_key

    held_by: dict[str, set[str]] = {}
    for p in held:
        held_by.setdefault(loose_key(p), set()).add(p.task)
    kept: list[DomainProblem] = []
    dropped: dict[str, int] = {}
    total: dict[str, int] = {}
    for p in train:
        total[p.task] = total.get(p.task, 0) + 1
        if held_by.get(loose_key(p), {p.task}) - {p.task}:
            dropped[p.task] = dropped.get(p.task, 0) + 1
        else:
            kept.append(p)
    for t, n in dropped.items():
        if n == total[t]:
            raise ConfigError(
                f"env.tasks.{t}: every training problem is held out by another sub-task; give it other data"
            )
        log.warning(
            "env=multi: %d of the %d training problems of env.tasks.%s are held out by another sub-task: left out "
            "of training (a held-out problem that is trained on measures nothing)",
            n,
            total[t],
            t,
        )
    return kept


def _check_known(key: str, values: Mapping[str, Any], domains: list[str]) -> None:
    unknown = sorted(set(values) - set(domains))
    if unknown:
        raise ConfigError(f"env.{key} names {unknown}, which are not domains of this run ({domains})")


def _whole(c: Any) -> bool:
    """Whether `c` is a whole number (an int, numpy's too, or a float such as 4.0 that is one), not a bool."""
    if isinstance(c, bool):
        return False
    return isinstance(c, numbers.Integral) or (isinstance(c, numbers.Real) and float(c).is_integer())


def _mixture(
    domains: list[str], weights: Mapping[str, float], counts: Mapping[str, int]
) -> tuple[dict[str, float], dict[str, int]]:
    if weights and counts:
        raise ConfigError("give env.weights (random shares) or env.counts (fixed prompts per batch), not both")
    if counts:
        _check_known("counts", counts, domains)
        missing = [d for d in domains if d not in counts]
        if missing:
            raise ConfigError(f"env.counts must give every domain a count; missing: {missing}")
        # Whole prompts only: int() truncated 2.5 to 2 and 0.5 to 0 (a domain left out of every batch, the counts
        # no longer summing to the batch size) and True to 1, unsaid. (The YAML path refuses them already.)
        odd = {d: c for d, c in counts.items() if not _whole(c)}
        if odd:
            raise ConfigError(f"env.counts gives {odd}: each count is a whole number of prompts per batch")
        if any(int(c) < 0 for c in counts.values()) or sum(int(c) for c in counts.values()) < 1:
            raise ConfigError(f"env.counts={dict(counts)} must be >= 0 with at least one prompt per batch")
        return {}, {d: int(counts[d]) for d in domains}
    _check_known("weights", weights, domains)
    # A number each (a text "x" ended in a bare ValueError naming no domain, True counted as 1; the YAML path
    # refuses them already).
    odd = {d: v for d, v in weights.items() if isinstance(v, bool) or not isinstance(v, numbers.Real)}
    if odd:
        raise ConfigError(f"env.weights gives {odd}: each weight is a number (a domain's random share)")
    w = {d: float(weights.get(d, 1.0)) for d in domains}  # a domain not named weighs 1 (0 leaves it out)
    if any(not math.isfinite(v) or v < 0 for v in w.values()) or sum(w.values()) <= 0:
        raise ConfigError(f"env.weights={dict(weights)} must be finite, >= 0 and not all 0")
    total = sum(w.values())
    return {d: v / total for d, v in w.items()}, {}


@dataclass
class MultiEnvConfig:
    """Several single-turn tasks in one run (roll_envs.tasks.multi)."""

    _target_: str = "roll_envs.tasks.multi.MultiTask"
    name: str = "multi"
    # Domain name -> a whole env node (env.tasks.math=arithmetic's options, with its own reward).
    tasks: dict[str, Any] = field(default_factory=dict)
    # Random share of each domain per prompt (normalised; a domain not named weighs 1, so {} is equal; 0 leaves a
    # domain out of training). Exclusive with counts.
    weights: dict[str, float] = field(default_factory=dict)
    # Fixed prompts per batch per domain (ROLL's domain_batch_size); must sum to pipeline.rollout_batch_size.
    counts: dict[str, int] = field(default_factory=dict)
    # Multiplies the advantages of a domain's rows (default 1).
    advantage_scale: dict[str, float] = field(default_factory=dict)
    # task: a domain per sub-task; column: each row's own `domain` (one data file holding several domains).
    route: str = "task"
    # Rewards of domains that are not sub-task names (route=column): +env/reward@env.rewards.<domain>=<reward>.
    rewards: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.weights and self.counts:
            raise ValueError("give env.weights (random shares) or env.counts (fixed prompts per batch), not both")
        if self.route not in ("task", "column"):
            raise ValueError(f"env.route={self.route!r}: use task (a domain per sub-task) or column (the rows' domain)")
        if self.route == "task":  # with column routing the domains are known only once the rows are read
            for key in ("weights", "counts", "advantage_scale"):
                unknown = sorted(set(getattr(self, key)) - set(self.tasks)) if self.tasks else []
                if unknown:
                    raise ValueError(f"env.{key} names {unknown}, which are not in env.tasks ({sorted(self.tasks)})")

    def check_installed(self) -> None:
        for node in self.tasks.values():
            check = getattr(node, "check_installed", None)
            if callable(check):
                check()
