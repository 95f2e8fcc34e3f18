"""The tiny pipeline=sft run of the SFT end-to-end tests (test_sft.py, test_resume_engine_switch.py): its data (40
rows teaching the boxed answer of roll_core.testing's constant-answer task) and its overrides. The test modules put
this folder on sys.path."""

from __future__ import annotations

import json
from pathlib import Path

from roll_core.testing import constant_answer_task, tiny_overrides

#: What every SFT row trains: the answer the env's math reward verifies (`correct` needs the box).
COMPLETION = "\\boxed{7}"
STEPS, BATCH = 4, 8


def sft_data(folder: Path) -> dict[str, Path]:
    """`rows`: the SFT rows, the env task's prompts (constant_answer_task: "Q{i}: say 7") as user turns and the
    boxed answer as completion; `seven`: that env task, which evaluates the run."""
    rows = folder / "sft.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q{i}: say 7", "completion": COMPLETION}) + "\n" for i in range(40)))
    return {"seven": constant_answer_task(folder / "seven.jsonl"), "rows": rows}


def sft_overrides(
    data: dict[str, Path],
    out: Path,
    *extra: str,
    lr_schedule: str = "constant",
    eval_every: int = STEPS,
    save_every: int = STEPS // 2,
) -> list[str]:
    """The overrides of a STEPS-step SFT run of BATCH rows a step (2 optimizer steps each) on `data` (`sft_data`)
    into `out`, `extra` last; `lr_schedule`, `eval_every` and `save_every` are what the callers' runs differ in."""
    dropped = ("model.max_response_length", "algo.", "pipeline.max_steps", "pipeline.eval_every", "env.eval_size")
    base = [o for o in tiny_overrides(data["seven"], out) if not o.startswith(dropped)]
    return [
        *base,
        "pipeline=sft",
        f"data.path={data['rows']}",
        "data.eval_size=8",
        "model.max_response_length=12",
        "env.eval_size=8",
        "algo.lr=3e-3",
        f"algo.lr_schedule={lr_schedule}",
        "algo.num_mini_batches=2",
        f"pipeline.rollout_batch_size={BATCH}",
        f"pipeline.max_steps={STEPS}",
        f"pipeline.eval_every={eval_every}",
        f"pipeline.save_every={save_every}",
        *extra,
    ]
