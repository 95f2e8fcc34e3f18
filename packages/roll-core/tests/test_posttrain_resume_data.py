"""Resuming the post-training collectors (sft, dpo, distill_offline) onto their data: the checkpoint holds a
fingerprint of the tokenised training rows, and a data file edited in place (same number of rows, other rows or
another order: the saved position would point at other examples) is a warning when the run resumes, as in the RLVR
collectors; the same file, and a checkpoint saved before the fingerprint existed, resume quietly. `data/epoch` is
the epochs drawn, fractional. Real files read by `load_rows` with roll's tiny tokenizer; no model."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.data import PromptSampler
from roll_core.pipelines.collectors.distill_offline import OfflineDistillCollector
from roll_core.pipelines.collectors.dpo import DPOCollector
from roll_core.pipelines.collectors.sft import SFTCollector
from roll_core.pipelines.metrics import StepLog
from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.source import load_rows
from roll_core.testing.chat_templates import family_tokenizer

TOK = family_tokenizer("tiny")
N, BATCH = 6, 4  # a step of 4 rows: epoch 4/6 after step 1, 8/6 after step 2


def _sft_rows(n: int = N) -> list[dict]:
    return [{"prompt": f"question {i}?", "completion": f"answer {i}"} for i in range(n)]


def _pair_rows(n: int = N) -> list[dict]:
    return [{"prompt": f"q{i}?", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(n)]


def _distill_rows(n: int = N) -> list[dict]:
    rows = []
    for i in range(n):
        response = [10 + i, 20 + i, 30 + i]
        rows.append({"prompt_ids": [5, 6, 7 + i], "response_ids": response,
                     "teacher_topk_ids": [[t, 3] for t in response],
                     "teacher_topk_logprobs": [[-0.1, -2.5] for _ in response]})  # fmt: skip
    return rows


#: kind of rows, rows of the file, the collector built around its training rows.
KINDS = {
    "sft": ("sft", _sft_rows),
    "dpo": ("preference", _pair_rows),
    "distill_offline": ("distill", _distill_rows),
}


def _collector(name: str, path: Path, rows: list[dict]) -> Any:
    """The named collector over `rows` written to `path` (its data part only: no model, no engines)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kind = KINDS[name][0]
    data = load_rows(kind, DataConfig(path=str(path)), TOK, max_prompt_length=64, max_response_length=64, seed=0)
    cls = {"sft": SFTCollector, "dpo": DPOCollector, "distill_offline": OfflineDistillCollector}[name]
    c = object.__new__(cls)
    c.cfg = SimpleNamespace(pipeline=SimpleNamespace(rollout_batch_size=BATCH, seed=0))
    c.data = data  # (the run's data counts)
    if name == "sft":
        c.train = data.train
    elif name == "dpo":
        c.train_pairs = data.train
    else:
        c.data, c.teacher, c.cache = data, None, {}
    c.sampler = PromptSampler(len(data.train), seed=0)
    return c


def _resume(name: str, path: Path, rows: list[dict], state: dict, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Warnings of a collector over `rows` (written to `path` in place) resuming from `state`."""
    c = _collector(name, path, rows)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        c.load_state_dict(state)
    assert c.sampler.state_dict() == state["sampler"]
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("name", list(KINDS))
def test_rows_edited_in_place_warn_on_resume(name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    make = KINDS[name][1]
    path = tmp_path / "rows.jsonl"
    c = _collector(name, path, make())
    c.next(1, StepLog())
    state = c.state_dict()
    assert isinstance(state["data"], str) and len(state["data"]) == 16
    what = "pairs" if name == "dpo" else "rows"
    # The same file: quiet.
    assert _resume(name, path, make(), state, caplog) == []
    # One row changed, same number of rows.
    edited = make()
    edited[2] = make(N + 1)[N]
    msgs = _resume(name, path, edited, state, caplog)
    assert len(msgs) == 1 and f"the training {what} differ" in msgs[0] and f"same {N} in number" in msgs[0]
    # The same rows in another order.
    msgs = _resume(name, path, make()[::-1], state, caplog)
    assert len(msgs) == 1 and "repeated or skipped" in msgs[0]
    # A checkpoint from before the fingerprint: resumes quietly onto its position.
    old = {"sampler": state["sampler"]}
    assert _resume(name, path, edited, old, caplog) == []


@pytest.mark.parametrize("name", list(KINDS))
def test_data_epoch_is_fractional(name: str, tmp_path: Path) -> None:
    c = _collector(name, tmp_path / "rows.jsonl", KINDS[name][1]())
    epochs = []
    for step in (1, 2, 3):
        out = StepLog()
        c.next(step, out)
        epochs.append(out["data/epoch"])
    assert epochs == pytest.approx([BATCH / N, 2 * BATCH / N, 3 * BATCH / N])


def test_fingerprint_is_the_same_in_another_process(tmp_path: Path) -> None:
    """Token ids, not Python's string hash: another process with another PYTHONHASHSEED gets the same value."""
    path = tmp_path / "rows.jsonl"
    here = {name: _saved_fingerprint(name, path) for name in KINDS}
    assert len(set(here.values())) == 3
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import test_posttrain_resume_data as t; "
        "from pathlib import Path; "
        "print(json.dumps({n: t._saved_fingerprint(n, Path(sys.argv[2])) for n in t.KINDS}))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    got = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), str(path)],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert json.loads(got.stdout.strip().splitlines()[-1]) == here


def _saved_fingerprint(name: str, path: Path) -> str:
    return _collector(name, path, KINDS[name][1]()).state_dict()["data"]


def test_an_sft_batch_straddling_two_epochs_holds_no_row_twice(tmp_path: Path) -> None:
    """The collector's own sampler (built in __init__) keeps any `rollout_batch_size` rows in a row distinct
    (roll_core.data.PromptSampler's window): a step that crosses an epoch boundary trained a row twice."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _sft_rows()))
    data = load_rows("sft", DataConfig(path=str(path)), TOK, max_prompt_length=64, max_response_length=64, seed=0)
    pipeline = SimpleNamespace(seed=0, rollout_batch_size=BATCH, eval_size=0, eval_every=0)
    cfg = SimpleNamespace(pipeline=pipeline, sft=SimpleNamespace(eval_task=False), env=SimpleNamespace(name="sft"))
    collector = SFTCollector(SimpleNamespace(cfg=cfg, tokenizer=TOK, task=None), data)
    drawn = [collector.sampler.next(BATCH) for _ in range(30)]  # 20 epochs of 6 rows, most steps cross one
    assert all(len(set(batch)) == BATCH for batch in drawn), [b for b in drawn if len(set(b)) < BATCH]
    flat = [i for batch in drawn for i in batch]
    assert all(sorted(flat[e * N : (e + 1) * N]) == list(range(N)) for e in range(20))  # each epoch: every row once
