"""Instruction following with verifiable constraints: generated prompts, or your rows with a `constraints` column.

Generated (no `path`): each problem is a short request ("Describe the ocean.") followed by 1-3 constraints in plain
words ("Answer in at most 20 words. Include the word "river".", roll_envs.rewards.ifeval). The constraint types
drawn are `types`; pairs that cannot hold together in one short answer (JSON and bullets, bullets and a first
word, ...) are never drawn, and a problem is kept only when `satisfying_response` writes a response that
meets all of its constraints, so every generated problem can be solved. A problem is held out when a stable hash of
its request and constraints falls below `eval_fraction`, so the split does not depend on the seed or the sizes
asked for; the seed picks which problems are drawn (the held-out draw has its own derived seed).

From files (`path`, JSONL / Parquet / a datasets folder): each row has a prompt (`prompt_key`, used as written: it
should state its constraints; chat messages are read as env=file reads them) and `constraints_key`, a list of
constraint objects or its JSON text. A row that is not an object, has no prompt, a prompt already chat-templated, a
`domain` that is not text, or text holding a lone surrogate (a `\\ud800` escape) in its prompt, its constraints or
another column is skipped, counted (`skipped`) and logged, as env=file does; a row whose
constraints are missing, of an unknown type or with bad arguments is a ConfigError naming the file and line, before
anything runs.
The held-out split is env=file's (base.held_out_split): `eval_path`, else a stable-hash fraction of the rows; a
training row that repeats a held-out row's prompt but for whitespace is left out of training, counted
(`also_held_out`) and logged. A datasets folder's split is chosen as env=file chooses it (env.split /
env.eval_split: roll_envs.tasks._datasets_folder).

Every problem has domain "instruct" (a file row's `domain` column wins), `metadata["constraints"]` (the validated
list; a file row's other columns are kept too) and `answer` = the constraints as JSON, so the ifeval reward scores
it with or without metadata (a row of env=file with a `constraints` column works as well).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from roll_core.errors import ConfigError
from roll_core.seeds import Purpose, derive_seed
from roll_envs.rewards.base import Reward
from roll_envs.rewards.ifeval import IFEVAL_HINT, KINDS, bounds, check, describe, parse_constraints, words
from roll_envs.tasks.base import Problem, Task, eval_file_name, stable_fraction

#: Short open requests a small model can answer in a few words or sentences.
REQUESTS = [
    "Describe the ocean.", "Tell me about your favorite food.", "Explain why sleep is important.",
    "Describe a sunny day.", "Give advice to a new student.", "Describe your ideal weekend.",
    "Explain what a library is.", "Describe a cat.", "Tell me about the moon.", "Describe a forest in autumn.",
    "Explain how to make tea.", "Describe a busy city street.", "Tell me why people like music.",
    "Describe a rainy morning.", "Give a tip for staying healthy.", "Describe a good friend.",
    "Explain what a computer does.", "Tell me about a trip to the beach.", "Describe the color blue.",
    "Explain why trees are useful.", "Describe a birthday party.", "Tell me about winter.",
    "Describe a quiet evening at home.", "Explain how to plant a seed.", "Describe a mountain.",
    "Tell me about your morning routine.", "Explain why water is important.", "Describe a garden in spring.",
    "Give a reason to read books.", "Describe a train journey.", "Tell me about a famous animal.",
    "Explain what a farmer does.", "Describe the night sky.", "Give advice for a job interview.",
    "Describe a small village.", "Explain why exercise helps.", "Tell me about the sun.", "Describe a river.",
    "Explain how bees help flowers.", "Describe your favorite season.",
]  # fmt: skip
#: Words a `keywords` constraint asks for.
KEYWORDS = [
    "ocean", "river", "light", "green", "happy", "music", "garden", "friend", "window", "bread", "stone", "cloud",
    "summer", "simple", "bright", "water", "forest", "smile", "journey", "morning", "honey", "silver", "gentle",
    "planet", "story", "colour", "dream", "family", "peace", "energy",
]  # fmt: skip
#: Words a `forbidden` constraint bans (filler words small models overuse; none appear in the other lists).
FORBIDDEN = ["very", "really", "just", "thing", "stuff", "basically", "actually", "literally", "totally", "maybe"]
START_WORDS = ["Sure", "Yes", "Okay", "Well", "Hello"]
END_PHRASES = ["That is all", "Thank you", "The end", "Have a nice day"]
#: Words `satisfying_response` fills answers with (none is a keyword or forbidden).
FILLER = ["calm", "blue", "day", "sun", "tree", "rain", "bird", "lake", "soft", "wind", "warm", "road"]

#: The types drawn by default: the ones a 135M model can learn to meet in a few steps.
DEFAULT_TYPES = [
    "word_count", "sentence_count", "keywords", "forbidden", "json", "bullets", "case", "starts_with", "ends_with",
    "no_commas",
]  # fmt: skip
# Types never drawn together: one short answer cannot be both (JSON starts with "{", bullets with "-", ...).
_CONFLICTS = {
    frozenset(pair)
    for pair in [
        ("json", "bullets"), ("json", "sentence_count"), ("json", "paragraphs"), ("json", "starts_with"),
        ("json", "ends_with"), ("json", "quotation"), ("json", "no_commas"), ("bullets", "sentence_count"),
        ("bullets", "paragraphs"), ("bullets", "quotation"), ("bullets", "starts_with"),
        ("sentence_count", "paragraphs"),
    ]
}  # fmt: skip
# Quotation marks go with a first or last phrase: starts_with and ends_with read inside the quotes around the
# answer (roll_envs.rewards.ifeval), and IFEval draws startend:quotation with startend:end_checker.


def _draw_constraint(kind: str, rng: random.Random, chosen: set[str]) -> dict[str, Any]:
    """One constraint of type `kind` with drawn arguments (`chosen`: the problem's other types)."""
    if kind == "word_count":
        return {"type": kind, "max": rng.choice([10, 15, 20, 30])} if rng.random() < 0.75 else {
            "type": kind, "min": rng.choice([5, 8, 10])
        }  # fmt: skip
    if kind == "sentence_count":
        return {"type": kind, **rng.choice([{"count": 1}, {"count": 2}, {"max": 2}, {"min": 2, "max": 3}])}
    if kind == "paragraphs":
        return {"type": kind, "count": rng.choice([2, 3])}
    if kind == "bullets":
        return {"type": kind, "count": rng.randint(2, 4)}
    if kind == "keywords":
        return {"type": kind, "include": rng.sample(KEYWORDS, 1 if rng.random() < 0.8 else 2)}
    if kind == "forbidden":
        return {"type": kind, "words": [rng.choice(FORBIDDEN)]}
    if kind == "json":
        return {"type": kind, "keys": ["answer"]}
    if kind == "case":  # the JSON key "answer" is lowercase: never upper with json
        return {"type": kind, "mode": "lower" if "json" in chosen else rng.choice(["lower", "upper"])}
    if kind == "starts_with":
        return {"type": kind, "phrase": rng.choice(START_WORDS)}
    if kind == "ends_with":
        return {"type": kind, "phrase": rng.choice(END_PHRASES)}
    return {"type": kind}  # no_commas, quotation: no arguments


def draw_constraints(rng: random.Random, types: list[str], k: int) -> list[dict[str, Any]]:
    """Up to `k` constraints of distinct, compatible types from `types`, in the canonical order of `KINDS`."""
    chosen: list[str] = []
    for _ in range(k):
        pool = [t for t in types if t not in chosen and all(frozenset((t, c)) not in _CONFLICTS for c in chosen)]
        if not pool:
            break
        chosen.append(rng.choice(pool))
    order = list(KINDS)
    chosen.sort(key=order.index)
    return [_draw_constraint(t, rng, set(chosen)) for t in chosen]


def satisfying_response(constraints: list[dict[str, Any]]) -> str:
    """A response that meets `constraints` for the combinations the generator draws (every generated problem
    is checked with it before it is kept; also the task's conformance response). May fail to meet unusual
    combinations from data files: callers check it."""
    by = {c["type"]: c for c in constraints}
    content: list[str] = []
    if "keywords" in by:
        for w in by["keywords"]["include"]:
            content += [w] * by["keywords"].get("min_count", 1)
    banned = {w.casefold() for w in by.get("forbidden", {}).get("words", [])}
    filler = [w for w in FILLER if w not in banned]
    layout = next((t for t in ("bullets", "sentence_count", "paragraphs") if t in by), None)
    units = max(1, bounds(by[layout])[0]) if layout else 1
    start = by["starts_with"]["phrase"] if "starts_with" in by else ""
    end = by["ends_with"]["phrase"] if "ends_with" in by else ""
    fixed = len(words(start)) + len(words(end)) + sum(len(words(k)) for k in by.get("json", {}).get("keys", []))
    least = bounds(by["word_count"])[0] if "word_count" in by else 0
    body = content + filler[: max(0, units - len(content))]
    while len(body) + fixed < least:
        body.append(filler[len(body) % len(filler)])
    # Deal the body words round-robin over the units (each unit gets at least one).
    parts = [body[i::units] for i in range(units)]
    parts[0] = ([start] if start else []) + parts[0]
    parts[-1] = parts[-1] + ([end] if end else [])
    if layout == "bullets":
        text = "\n".join("- " + " ".join(p) for p in parts)
    else:
        sep = "\n\n" if layout == "paragraphs" else " "
        text = sep.join(" ".join(p) + "." for p in parts)
    if "json" in by:
        keys = by["json"].get("keys") or ["answer"]
        text = json.dumps({k: text if i == 0 else "" for i, k in enumerate(keys)})
    if "quotation" in by:
        text = f'"{text}"'
    if "case" in by:
        text = text.lower() if by["case"]["mode"] == "lower" else text.upper()
    return text


class InstructTask(Task):
    """Generated or file-backed instruction-following problems (see the module docstring)."""

    def __init__(
        self,
        reward: Reward,
        name: str = "instruct",
        path: str | None = None,
        eval_path: str | None = None,
        prompt_key: str = "prompt",
        constraints_key: str = "constraints",
        types: list[str] | tuple[str, ...] = tuple(DEFAULT_TYPES),
        min_constraints: int = 1,
        max_constraints: int = 3,
        train_size: int = 2000,
        eval_size: int = 100,
        eval_fraction: float = 0.2,
        seed: int = 0,
        system_prompt: str | None = None,
        split: str | None = None,
        eval_split: str | None = None,
    ) -> None:
        super().__init__(reward)
        self.name, self.system_prompt = name, system_prompt
        if (split is not None and path is None) or (eval_split is not None and not eval_path):
            raise ConfigError(
                f"env.split={split!r} / env.eval_split={eval_split!r} name splits of env.path / "
                "env.eval_path (a datasets folder), which are not set"
            )
        if path is not None:
            self._load_files(path, eval_path, prompt_key, constraints_key, eval_fraction, eval_size, split, eval_split)
            return
        _check_types(types, min_constraints, max_constraints)
        self.types, self.min_constraints, self.max_constraints = list(types), min_constraints, max_constraints
        self._train = self._draw(random.Random(seed), train_size, held_out=False, fraction=eval_fraction)
        held_rng = random.Random(derive_seed(seed, Purpose.HELD_OUT))
        self._eval = self._draw(held_rng, eval_size, held_out=True, fraction=eval_fraction)

    @classmethod
    def conformance_task(cls, seed: int, workdir: Path) -> InstructTask:
        """A small instance for roll_core.testing.tasks' suite. Its types are the ones garbage cannot meet by
        chance (a required word, JSON, bullets, a first or last phrase): the suite checks that malformed
        responses ("x" * 100000, control characters) are never correct, and "x" does meet "at most 20 words"."""
        from roll_envs.rewards.ifeval import InstructionReward

        types = ["keywords", "json", "bullets", "starts_with", "ends_with"]
        return cls(InstructionReward(), types=types, train_size=200, eval_size=40, seed=seed)

    def conformance_response(self, problem: Problem) -> str:
        """A response meeting all of `problem`'s constraints, for roll_core.testing.tasks' suite."""
        return satisfying_response(parse_constraints(problem.answer))

    def _draw(self, rng: random.Random, n: int, *, held_out: bool, fraction: float) -> list[Problem]:
        """`n` problems of one split, distinct while the draw finds new ones (then repeats are allowed)."""
        out: list[Problem] = []
        seen: set[str] = set()
        attempts = 0
        while len(out) < n:
            attempts += 1
            if attempts > 200 * max(n, 1):
                raise ValueError(
                    f"cannot draw {n} {'held-out' if held_out else 'training'} problems from env.types={self.types} "
                    f"with {self.min_constraints}-{self.max_constraints} constraints each"
                )
            request = rng.choice(REQUESTS)
            constraints = draw_constraints(rng, self.types, rng.randint(self.min_constraints, self.max_constraints))
            if len(constraints) < self.min_constraints:
                continue
            key = request + json.dumps(constraints, sort_keys=True)
            if (stable_fraction(key) < fraction) != held_out:
                continue
            if key in seen and attempts < 20 * max(n, 1):
                continue
            response = satisfying_response(constraints)
            if not all(check(c, response) for c in constraints):
                continue  # a combination the generator cannot answer: not a problem worth training on
            seen.add(key)
            prompt = " ".join([request, *(describe(c) for c in constraints)])
            out.append(
                Problem(
                    id=f"{self.name}:{hashlib.blake2b(key.encode(), digest_size=8).hexdigest()}",
                    prompt=prompt,
                    answer=json.dumps(constraints),
                    domain="instruct",
                    metadata={"constraints": constraints},
                )
            )
        return out

    def _load_files(
        self,
        path: str,
        eval_path: str | None,
        prompt_key: str,
        constraints_key: str,
        eval_fraction: float,
        eval_size: int,
        split: str | None = None,
        eval_split: str | None = None,
    ) -> None:
        for key, value in (("env.path", path), ("env.eval_path", eval_path)):
            if value and not Path(value).exists():
                raise ConfigError(f"data file {value} does not exist: check {key}")
        problems = self._load(path, prompt_key, constraints_key, self.name, split=split, key="env.split")
        held = None
        if eval_path:
            name = eval_file_name(self.name, path, eval_path)
            held = self._load(
                eval_path, prompt_key, constraints_key, name, split=eval_split, key="env.eval_split", held=True
            )
        # split_held_out keeps the split's counts on the task: the rows left out as held-out rows' whitespace twins
        # were logged while the task's also_held_out stayed 0, as if none were.
        self._train, self._eval = self.split_held_out(
            problems,
            held,
            eval_fraction=eval_fraction,
            eval_size=eval_size,
            path=path,
            eval_path=eval_path,
        )

    def _load(
        self,
        path: str,
        prompt_key: str,
        constraints_key: str,
        name: str,
        *,
        split: str | None = None,
        key: str | None = None,
        held: bool = False,
    ) -> list[Problem]:
        """Problems of one file (ids `<name>:<file name>:<line>`, a datasets folder's split as env=file names it);
        unreadable rows and rows without a prompt go to `skipped`. `split` (set by the config key `key`) and `held`
        choose a datasets folder's split as env=file does (roll_envs.tasks._datasets_folder)."""
        from roll_envs.tasks.dataset import (
            _chat_prompt,
            _metadata_problem,
            _read_rows,
            _row_domain,
            _templated,
            _text_problem,
            log_skipped,
        )

        rows, bad, label = _read_rows(Path(path), split, key, held=held)
        # Only JSON text holds a lone surrogate (a `\ud800` escape): Parquet and `datasets` strings are UTF-8. The
        # constraints are checked whatever the file: given as JSON text (a Parquet string column) they hold escapes.
        check_text = not Path(path).is_dir() and Path(path).suffix in (".jsonl", ".json")
        skipped = list(bad)
        problems = []
        for lineno, row in rows:
            if not isinstance(row, dict):
                skipped.append((lineno, f"row is {type(row).__name__}, not an object"))
                continue
            prompt, context, why = _chat_prompt(prompt_key, row.get(prompt_key))
            why = why or _text_problem(prompt_key, prompt, numbers=False) or _templated(prompt_key, prompt, context)
            domain, why = _row_domain(row) if why is None else (None, why)
            if why is not None:
                skipped.append((lineno, why))
                continue
            if constraints_key not in row:
                ifeval = f": {IFEVAL_HINT}" if "instruction_id_list" in row else ""
                raise ConfigError(
                    f"{path} line {lineno}: no {constraints_key!r} column (the row's constraints; "
                    f"env.constraints_key){ifeval}"
                )
            try:
                constraints = parse_constraints(row[constraints_key])
            except ValueError as exc:
                raise ConfigError(f"{path} line {lineno}: bad {constraints_key!r}: {exc}") from None
            # A surrogate in a keyword asks for text no response holds; in another column it failed mid-run
            # wherever the metadata was encoded (a remote reward's request, the samples written to disk).
            others = {k: v for k, v in row.items() if k not in (prompt_key, constraints_key, "domain")}
            why = _metadata_problem({**(others if check_text else {}), constraints_key: constraints})
            if why is not None:
                skipped.append((lineno, why))
                continue
            problems.append(
                Problem(
                    id=f"{name}:{Path(path).name}{label}:{lineno}",
                    prompt=prompt,
                    answer=json.dumps(constraints),
                    domain=domain or "instruct",  # (a null column was the domain "None")
                    metadata={**others, "constraints": constraints},
                    context=context,
                )
            )
        log_skipped(path, sorted(skipped))
        self.skipped += [(str(path), n, why) for n, why in sorted(skipped)]
        if not problems:
            raise ConfigError(f"{path}: no usable rows (each needs {prompt_key!r} and {constraints_key!r})")
        return problems


def _check_types(types: Any, min_constraints: int, max_constraints: int) -> None:
    """Refuse unknown constraint types and bad counts, naming their config keys."""
    unknown = [t for t in types if t not in KINDS]
    if unknown or not types:
        raise ConfigError(f"env.types={list(types)}: unknown or none ({unknown}); choose from {', '.join(KINDS)}")
    if not 1 <= min_constraints <= max_constraints:
        raise ConfigError(
            f"env.min_constraints={min_constraints}, env.max_constraints={max_constraints}: need 1 <= min <= max"
        )


@dataclass
class InstructEnvConfig:
    """Instruction following with verifiable constraints (IFEval-style): generated prompts or your rows."""

    _target_: str = "roll_envs.tasks.instruct.InstructTask"
    name: str = "instruct"
    # Your rows (a prompt and a `constraints` list each); null: generated problems.
    path: str | None = None
    # Held-out rows; null: a stable-hash fraction of `path` (generated: of the problem space).
    eval_path: str | None = None
    prompt_key: str = "prompt"
    constraints_key: str = "constraints"
    # Split of a datasets folder `path` to train on; null: its only split, or `train` (several splits and none
    # `train`: an error naming them).
    split: str | None = None
    # Split of a datasets folder `eval_path` to hold out; null: its only split, or the one beside `train`.
    eval_split: str | None = None
    # Generated: constraint types drawn (roll_envs.rewards.ifeval.KINDS), and how many per problem.
    types: list[str] = field(default_factory=lambda: list(DEFAULT_TYPES))
    min_constraints: int = 1
    max_constraints: int = 3
    # Generated: training problems.
    train_size: int = 2000
    # Held-out problems at most.
    eval_size: int = 100
    # Fraction of the problems held out (by stable hash).
    eval_fraction: float = 0.2
    # Seed of the draw (the held-out split does not depend on it).
    seed: int = 0
    system_prompt: str | None = None
    # The reward: a node of the env/reward group (this option's default is in its YAML's defaults list).
    reward: Any = MISSING

    def __post_init__(self) -> None:
        from roll_envs.config import _check_split, _check_split_keys, reward_node
        from roll_envs.rewards.ifeval import InstructionRewardConfig

        _check_split(self, train_size=self.train_size)
        _check_split_keys(self)
        _check_types(self.types, self.min_constraints, self.max_constraints)
        self.reward = reward_node(self.reward, InstructionRewardConfig)

    def check_installed(self) -> None:
        from roll_envs.config import _check_data_file

        _check_data_file(self.path)
        _check_data_file(self.eval_path)
