"""User data as a task: JSONL, Parquet or a Hugging Face `datasets` folder with prompt and answer columns.

Bad rows (not JSON, not an object, missing or empty prompt/answer, non-text values) are skipped, counted and
reported with their 1-based line (or row) numbers in `skipped`, and a summary is logged: never silently
dropped, never a crash halfway through a file. An empty result after skipping is an error.
The held-out split is `eval_path` when given, else a stable-hash fraction of the rows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from roll_envs.rewards.base import Reward
from roll_envs.tasks.base import Problem, Task, stable_fraction

log = logging.getLogger(__name__)


def _rows(path: Path) -> tuple[list[tuple[int, Any]], list[tuple[int, str]]]:
    """(row number, row) pairs and (row number, reason) for rows that could not even be read."""
    bad: list[tuple[int, str]] = []
    if path.is_dir():
        try:
            import datasets
        except ImportError as exc:
            raise ImportError(f"{path} is a folder: reading HF datasets folders needs `pip install datasets`") from exc
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return [(i + 1, row) for i, row in enumerate(ds)], bad
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise ImportError(f"reading {path} needs `pip install pyarrow` (roll-envs[data])") from exc
        return [(i + 1, row) for i, row in enumerate(pq.read_table(path).to_pylist())], bad
    if path.suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((lineno, json.loads(line)))
                except json.JSONDecodeError as exc:
                    bad.append((lineno, f"invalid JSON ({exc.msg})"))
        return rows, bad
    raise ValueError(f"unsupported data file {path}: use .jsonl, .parquet or a datasets folder")


def load_problems(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    name: str = "data",
    domain: str = "math",
) -> tuple[list[Problem], list[tuple[int, str]]]:
    """Read problems from a file; returns (problems, skipped) with skipped = [(row number, reason)]."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    rows, skipped = _rows(path)
    problems = []
    for lineno, row in rows:
        if not isinstance(row, dict):
            skipped.append((lineno, f"row is {type(row).__name__}, not an object"))
            continue
        prompt, answer = row.get(prompt_key), row.get(answer_key)
        if not isinstance(prompt, str) or not prompt.strip():
            skipped.append((lineno, f"missing or empty {prompt_key!r}"))
            continue
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            skipped.append((lineno, f"missing or empty {answer_key!r}"))
            continue
        problems.append(
            Problem(
                id=f"{name}:{path.name}:{lineno}",
                prompt=prompt,
                answer=answer.strip(),
                domain=str(row.get("domain", domain)),
            )
        )
    skipped.sort()
    if skipped:
        shown = "; ".join(f"line {n}: {why}" for n, why in skipped[:10])
        more = f" (and {len(skipped) - 10} more)" if len(skipped) > 10 else ""
        log.warning("%s: skipped %d bad row(s): %s%s", path, len(skipped), shown, more)
    if not problems:
        raise ValueError(
            f"{path}: no usable rows ({len(skipped)} skipped); expected keys {prompt_key!r}, {answer_key!r}"
        )
    return problems, skipped


class FileTask(Task):
    """Problems from user files; `skipped` lists every bad row as (file, row number, reason)."""

    def __init__(
        self,
        reward: Reward,
        path: str,
        name: str = "data",
        eval_path: str | None = None,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        eval_fraction: float = 0.1,
        eval_size: int = 100,
        system_prompt: str | None = None,
    ) -> None:
        super().__init__(reward)
        self.name, self.system_prompt = name, system_prompt
        problems, skipped = load_problems(path, prompt_key=prompt_key, answer_key=answer_key, name=name)
        self.skipped = [(str(path), n, why) for n, why in skipped]
        if eval_path:
            held, eval_skipped = load_problems(eval_path, prompt_key=prompt_key, answer_key=answer_key, name=name)
            self.skipped += [(str(eval_path), n, why) for n, why in eval_skipped]
            self._train = problems
        else:
            self._train = [p for p in problems if stable_fraction(p.prompt) >= eval_fraction]
            held = [p for p in problems if stable_fraction(p.prompt) < eval_fraction]
        self._eval = held[:eval_size]
        if not self._train:
            raise ValueError(f"{path}: every row fell in the held-out split; lower eval_fraction or give eval_path")
