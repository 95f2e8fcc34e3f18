"""The task interface: a fixed, seeded list of training problems, a disjoint held-out list, and a reward.

Contract: `train_set()` and `eval_set()` are deterministic for a given config (same seed, same problems, same
order) and never share a problem, so held-out accuracy measures generalisation, not memorisation. A problem's
`prompt` is the user message; the pipeline applies the model's chat template. `score()` delegates to the
task's reward and returns a `RewardResult` with counted failures.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from roll_envs.rewards.base import Reward, RewardResult


@dataclass(frozen=True)
class Problem:
    """One prompt with its ground truth. `id` is stable across runs (used for dedup and held-out splits).
    `domain` routes the row in a multi-domain run and names its metrics; `metadata` is everything else a reward may
    need (a data row's other columns, a generated problem's constraints): rewards that declare `metadata` get
    `{**metadata, "domain": domain}`."""

    id: str
    prompt: str
    answer: str
    domain: str = "math"
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


def held_out_split(
    problems: list[Any], held: list[Any] | None, *, eval_fraction: float, eval_size: int, path: str | None
) -> tuple[list[Any], list[Any]]:
    """(train, held-out) of a file-backed task: with `held` (the rows of env.eval_path) every row of `problems`
    trains; without, prompts whose stable hash falls below `eval_fraction` are held out. The held-out list is cut
    to `eval_size`. A ConfigError when nothing is left to train on."""
    from roll_core.errors import ConfigError

    if held is None:
        train = [p for p in problems if stable_fraction(p.prompt) >= eval_fraction]
        held = [p for p in problems if stable_fraction(p.prompt) < eval_fraction]
    else:
        train = problems
    if not train:
        raise ConfigError(
            f"{path}: every row fell in the held-out split; lower env.eval_fraction or give env.eval_path"
        )
    return train, held[:eval_size]


def stable_fraction(key: str) -> float:
    """A number in [0, 1) derived from `key` alone (same on every machine and Python run)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class Task:
    """Base class: subclasses fill `_train` and `_eval` and set `reward`."""

    name: str = "task"
    system_prompt: str | None = None

    def __init__(self, reward: Reward) -> None:
        self.reward = reward
        self._train: list[Problem] = []
        self._eval: list[Problem] = []
        # Worked examples shown before each question as (user, assistant) chat turns: small models learn the
        # answer format from one example far more reliably than from an instruction.
        self.examples: list[tuple[str, str]] = []
        # Bad rows skipped while loading data files: (file, row number, reason); generated tasks have none.
        self.skipped: list[tuple[str, int, str]] = []

    @property
    def skipped_rows(self) -> dict[str, int]:
        """Bad rows skipped per data file ({} when none): for the run's metrics and summary."""
        out: dict[str, int] = {}
        for file, _, _ in self.skipped:
            out[file] = out.get(file, 0) + 1
        return out

    def train_set(self) -> list[Problem]:
        """Training problems in a fixed order (the pipeline shuffles per epoch with its own seed)."""
        return self._train

    def eval_set(self) -> list[Problem]:
        """Held-out problems, disjoint from `train_set()`."""
        return self._eval

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """Chat messages for a problem: system prompt if any, worked examples, then the user prompt."""
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for question, answer in self.examples:
            msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return [*msgs, {"role": "user", "content": problem.prompt}]

    def score(self, responses: Sequence[str], problems: Sequence[Problem]) -> RewardResult:
        """Score responses against their problems' answers."""
        return self.reward.score(responses, [p.answer for p in problems])
