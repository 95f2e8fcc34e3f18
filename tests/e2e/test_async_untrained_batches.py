"""An asynchronous prompts collector whose batch is handed out but not trained (no weight sync follows): the groups of
that batch are given back to the rollout's budget at the next batch, so the rollout keeps its lead of
`pipeline.async_ratio` batches. `pipeline=distill` drops a batch whose rows all lack a field of
`distill.teacher_prompt`: each such step took the rollout's budget of one batch for good, and after async_ratio + 1
of them the next batch waited for groups that never started (`pipeline.async_batch_timeout_s`, an hour in a run)."""

from __future__ import annotations

import json
from pathlib import Path

from roll_core.testing import run_pipeline, tiny_overrides


def test_batches_a_wrapper_drops_untrained_give_their_budget_back(tmp_path: Path) -> None:
    data = tmp_path / "rare.jsonl"  # one problem of 40 has the teacher prompt's field: nearly every batch is dropped
    rows = [{"prompt": f"Q{i}: say 7", "answer": "7", **({"example": "7"} if i == 0 else {})} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary, history = run_pipeline(
        tiny_overrides(
            data,
            tmp_path / "run",
            "pipeline=distill",
            "distill.teacher_prompt='{example} {prompt}'",
            "pipeline.rollout_batch_size=1",
            "algo.group_size=2",
            "pipeline.async_ratio=1",
            "pipeline.async_batch_timeout_s=60",
            "pipeline.max_empty_steps=0",  # the dropped batches are empty steps: not what this test stops on
            "pipeline.max_steps=6",
            "pipeline.eval_every=0",
            "pipeline.trackers=[]",
        )
    )
    steps = [h for h in history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5, 6]  # (the old code: a TimeoutError at step 3)
    # A dropped batch (its one group of 2 rows skipped) goes back to the budget at the next step, as a discard.
    dropped = [h["step"] for h in steps[:-1] if h["data/skipped_teacher_prompt_rows"] == 2]
    assert len(dropped) >= 2
    assert sum(h["async/discarded_groups"] for h in steps) == len(dropped)
    assert summary["status"] == "finished"
