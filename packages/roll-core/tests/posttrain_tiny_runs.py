"""The tiny one-step post-training run (pipeline=sft, dpo, distill_offline) that test_posttrain_data_counts.py and
test_posttrain_eval_size_cut.py both run, and the data rows of each pipeline (a test module puts this folder on
sys.path to import it: pytest's importlib mode does not).

- `ROWS[name](i)`: data row i of pipeline `name` (its prompt names i: rows of different i are different prompts);
- `N`: how many training rows the tests write;
- `tiny_posttrain_overrides(name, folder, train, task_rows, *options)`: the overrides of one step of pipeline `name`
  on the data file `train`, the env task a `constant_answer_task` of `task_rows` rows, written in `folder`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from roll_core.testing import constant_answer_task, tiny_overrides

N = 8  # training rows of data.path


def _sft(i: int) -> dict:
    return {"prompt": f"Q{i}: say 7", "completion": "7"}


def _pair(i: int) -> dict:
    return {"prompt": f"Q{i}: answer", "chosen": "123", "rejected": "abc"}


def _distill(i: int) -> dict:
    response = [10 + i, 20 + i, 30 + i]
    return {"prompt_ids": [5, 6, 7 + i], "response_ids": response,
            "teacher_topk_ids": [[t, 3] for t in response],
            "teacher_topk_logprobs": [[-0.1, -2.5] for _ in response]}  # fmt: skip


ROWS: dict[str, Callable[[int], dict]] = {"sft": _sft, "dpo": _pair, "distill_offline": _distill}


def tiny_posttrain_overrides(name: str, folder: Path, train: str, task_rows: int, *options: str) -> list[str]:
    """Overrides of a one-step run of pipeline `name` (4 rows a step, responses of at most 8 tokens, no trackers)
    on the data file `train`; its env task (`constant_answer_task` of `task_rows` rows) is written to
    folder/task.jsonl and the run to folder/run. `options` come last (a later override of a key wins)."""
    return tiny_overrides(
        constant_answer_task(folder / "task.jsonl", rows=task_rows),
        folder / "run",
        f"pipeline={name}",
        f"data.path={train}",
        "model.max_response_length=8",
        "pipeline.max_steps=1",
        "pipeline.rollout_batch_size=4",
        "pipeline.trackers=[]",
        *options,
    )
