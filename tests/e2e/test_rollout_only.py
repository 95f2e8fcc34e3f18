"""Rollout-only runs (`pipeline=rollout`) on the tiny model and the arithmetic task: no training model, complete and
consistent rows (token ids decode to the text, behaviour log-probs equal plain transformers' teacher-forced ones),
shards that partition the prompts, a stopped-and-resumed run that writes the uninterrupted run's bytes, Parquet
parts pyarrow reads as one table, and the writer's resume rule on its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from roll_core.errors import ConfigError
from roll_core.posttrain.writer import ROW_FIELDS, RolloutWriter, read_rollout

PROMPTS = 7  # rollout.max_prompts (the task holds 10 training prompts)
BATCH = 3  # prompts per step: 3 steps for the unsharded run
SAMPLES = 2


def overrides(out: Path, *extra: str) -> list[str]:
    return [
        "pipeline=rollout",
        "model=tiny",
        "model.max_response_length=6",
        "env=arithmetic",
        "env.train_size=10",
        "env.eval_size=4",
        f"pipeline.rollout_batch_size={BATCH}",
        "pipeline.progress=false",
        "pipeline.trackers=[]",
        f"pipeline.output_dir={out}",
        f"rollout.samples_per_prompt={SAMPLES}",
        f"rollout.max_prompts={PROMPTS}",
        *extra,
    ]


def run(overrides: list[str]) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    """Compose, build and run in this process; returns (pipeline, summary, history)."""
    from roll_core.cli import pipeline_class
    from roll_core.config import load_config
    from roll_core.tracking import Tracker

    cfg = load_config(overrides)
    pipeline = pipeline_class(cfg.pipeline.name)(cfg)
    try:
        summary = pipeline.run()
    finally:
        pipeline.shutdown()
    return pipeline, summary, Tracker.read_metrics(Path(pipeline.out) / "metrics.jsonl")


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any], list[dict[str, Any]], Path]:
    """The unsharded, uninterrupted run (JSONL output in its run folder)."""
    out = tmp_path_factory.mktemp("full")
    pipeline, summary, history = run(overrides(out))
    return pipeline, summary, history, out / "rollout.jsonl"


def test_rows_are_complete_and_consistent_without_an_actor(full, tiny_model: str) -> None:
    from transformers import AutoTokenizer

    from roll_core.testing import teacher_forced_logprobs

    pipeline, summary, history, path = full
    assert pipeline.roles.actor_train is None and pipeline.roles.reference is None  # nothing trains, nothing loads
    rows = read_rollout(path)
    assert len(rows) == PROMPTS * SAMPLES
    assert all(tuple(r) == ROW_FIELDS for r in rows)
    train = pipeline.task.train_set()
    # The task's first 7 prompts in order, each with samples 0..1 next to each other.
    assert [r["prompt_id"] for r in rows] == [str(p.id) for p in train[:PROMPTS] for _ in range(SAMPLES)]
    assert [r["sample"] for r in rows] == [0, 1] * PROMPTS
    tok = AutoTokenizer.from_pretrained(tiny_model)
    temperature = pipeline.cfg.infer_engine.temperature
    for i, (r, p) in enumerate(zip(rows, [p for p in train[:PROMPTS] for _ in range(SAMPLES)], strict=True)):
        assert r["prompt"] == p.prompt and r["answer"] == p.answer and r["shard"] == 0
        assert r["metadata"]["domain"] == p.domain
        messages = pipeline.task.messages(p)
        assert r["prompt_ids"] == tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert 1 <= len(r["response_ids"]) <= 6 and len(r["response_logprobs"]) == len(r["response_ids"])
        assert tok.decode(r["response_ids"], skip_special_tokens=True) == r["response"]
        assert r["finish_reason"] in ("stop", "length")
        assert (r["finish_reason"] == "length") == (len(r["response_ids"]) == 6)
        assert isinstance(r["correct"], bool) and isinstance(r["formatted"], bool)
        if i % 3 == 0:  # both samples, every step (each call loads the model: not all 14 rows)
            ref = teacher_forced_logprobs(tiny_model, r["prompt_ids"], r["response_ids"], temperature)
            assert r["response_logprobs"] == pytest.approx(ref, abs=1e-4)
    # A prompt's samples differ (sampled, not copied).
    assert any(rows[2 * i]["response_ids"] != rows[2 * i + 1]["response_ids"] for i in range(PROMPTS))
    # The run ends when the shard is done: ceil(7 / 3) = 3 steps, whatever pipeline.max_steps says.
    steps = [h for h in history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2, 3] and pipeline.collector.total_steps == 3
    assert [h["rollout/rows"] for h in steps] == [6.0, 12.0, 14.0]
    assert [h["rollout/prompts_done"] for h in steps] == [3.0, 6.0, 7.0]
    assert all(h["rollout/prompts_total"] == PROMPTS for h in steps)
    for h, chunk in zip(steps, (rows[:6], rows[6:12], rows[12:]), strict=True):
        assert h["reward/mean"] == pytest.approx(sum(r["reward"] for r in chunk) / len(chunk), abs=1e-6)
        assert h["reward/accuracy"] == pytest.approx(sum(r["correct"] for r in chunk) / len(chunk), abs=1e-6)
    assert summary["rollout"] == {
        "output": str(path),
        "rows": 14,
        "prompts_done": PROMPTS,
        "prompts_total": PROMPTS,
        "skipped_prompts": 0,
        "reward_failed_rows": 0,
    }
    assert len(list((path.parent / "checkpoints").iterdir())) >= 1  # the end was checkpointed


def test_shards_partition_the_prompts_and_parquet_reads_as_one_table(full, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    _, _, _, path = full
    ids = [r["prompt_id"] for r in read_rollout(path)]
    shards, rows = [], tmp_path / "rows.parquet"
    for shard in (0, 1):
        pipeline, _, history = run(
            overrides(
                tmp_path / f"s{shard}", f"rollout.shard={shard}", "rollout.num_shards=2", f"rollout.output={rows}"
            )
        )
        folder = tmp_path / f"rows.shard-{shard}-of-2.parquet"  # each shard writes its own output
        table = pq.read_table(folder)  # every part of the folder, as one table
        assert table.num_rows == len(read_rollout(folder)) and table.column_names == list(ROW_FIELDS)
        shards.append(read_rollout(folder))
        assert all(r["shard"] == shard for r in shards[-1])
        assert pipeline.collector.exhausted and len([h for h in history if h["step"] > 0]) == {0: 2, 1: 1}[shard]
    a, b = ({r["prompt_id"] for r in s} for s in shards)
    assert not a & b and a | b == set(ids)
    # the next stage reads every shard with one glob (data.path='rows.shard-*-of-2.parquet'), shard 0's rows first
    from roll_core.posttrain.rows import Skips, read_rows

    both = read_rows([str(tmp_path / "rows.shard-*-of-2.parquet")], "data.path", Skips())
    assert [r.row["prompt_id"] for r in both] == [r["prompt_id"] for r in shards[0] + shards[1]]
    assert [r["prompt_id"] for r in shards[0]][::SAMPLES] == ids[::SAMPLES][0::2]  # every 2nd prompt from 0
    assert [r["prompt_id"] for r in shards[1]][::SAMPLES] == ids[::SAMPLES][1::2]


def test_stopped_and_resumed_run_writes_the_uninterrupted_rows(full, tmp_path: Path) -> None:
    _, _, full_history, path = full
    out = tmp_path / "resumed"
    run(overrides(out, "pipeline.save_every=1", "pipeline.max_steps=2"))
    # "Crash" after step 2's rows were written, before its checkpoint: the latest checkpoint is step 1's.
    shutil.rmtree(out / "checkpoints" / "step_000002")
    assert len(read_rollout(out / "rollout.jsonl")) == 12
    pipeline, _, history = run(overrides(out, "pipeline.save_every=1", "pipeline.resume=true"))
    assert pipeline.start_step == 2 and pipeline.collector.total_steps == 3
    assert (out / "rollout.jsonl").read_bytes() == path.read_bytes()  # step 2's rows dropped, then written again
    assert [h["step"] for h in history if h["step"] > 0] == [1, 2, 3]
    by_step = {h["step"]: h for h in full_history}
    for h in history:
        if h["step"] > 0:
            assert h["reward/mean"] == by_step[h["step"]]["reward/mean"]
            assert h["rollout/rows"] == by_step[h["step"]]["rollout/rows"]


def test_a_fresh_run_refuses_an_output_holding_rows(full, tmp_path: Path) -> None:
    from roll_core.cli import pipeline_class
    from roll_core.config import load_config

    _, _, _, path = full
    cfg = load_config(overrides(tmp_path, f"rollout.output={path}"))
    with pytest.raises(ConfigError, match=r"already holds rows: delete it, choose another rollout.output"):
        pipeline_class(cfg.pipeline.name)(cfg)
    # resume=true without a checkpoint of its own (another run folder): the rows are another run's, refused too
    # (the output was emptied: a job script that always passes resume=true lost a finished run's rows)
    before = path.read_bytes()
    with pytest.raises(ConfigError, match=r"already holds rows"):
        run(overrides(tmp_path / "other", f"rollout.output={path}", "pipeline.resume=true"))
    assert path.read_bytes() == before


def test_prompts_too_long_are_counted_skips_and_the_shard_still_ends(tmp_path: Path) -> None:
    _, summary, history = run(overrides(tmp_path, "model.max_prompt_length=8", "rollout.max_prompts=4"))
    steps = [h for h in history if h["step"] > 0]
    assert [h["data/skipped_long_prompts"] for h in steps] == [3.0, 1.0]  # never cut: skipped and counted
    assert [h["rollout/rows"] for h in steps] == [0.0, 0.0]
    assert summary["rollout"]["skipped_prompts"] == 4 and summary["rollout"]["prompts_done"] == 4
    assert not (tmp_path / "rollout.jsonl").exists()
    # Prompts (70 tokens) that fill the engine's context: counted as prompts, not as their samples
    _, summary, history = run(overrides(tmp_path / "ctx", "infer_engine.max_model_len=70", "rollout.max_prompts=4"))
    steps = [h for h in history if h["step"] > 0]
    assert [h["data/skipped_context_prompts"] for h in steps] == [3.0, 1.0]
    assert summary["rollout"]["skipped_prompts"] == 4 and summary["rollout"]["rows"] == 0


def _row(i: int) -> dict[str, Any]:
    return {
        "prompt_id": f"p{i}",
        "prompt": "What is 1 + 2?",
        "answer": "3",
        "prompt_ids": [1, 2, 3],
        "response": "x",
        "response_ids": [4, 5],
        "response_logprobs": [-0.5, -1.25],
        "reward": float(i),
        "correct": i % 2 == 0,
        "formatted": True,
        "finish_reason": "stop",
        "metadata": {"domain": "math", "k": i},
        "sample": 0,
        "shard": 0,
    }


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet"])
def test_writer_restores_the_checkpoint_extent(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    w = RolloutWriter(path)
    w.start(resume=False)
    w.write(1, [_row(0), _row(1)])
    state = json.loads(json.dumps(w.state_dict()))  # as state.json holds it
    w.write(2, [_row(2)])
    assert [r["prompt_id"] for r in read_rollout(path)] == ["p0", "p1", "p2"]
    # A resumed writer cuts back to the checkpoint, then appends as the uninterrupted run would.
    again = RolloutWriter(path)
    again.restore(state)
    assert [r["prompt_id"] for r in read_rollout(path)] == ["p0", "p1"] and again.rows == 2
    again.write(2, [_row(3)])
    rows = read_rollout(path)
    assert [r["prompt_id"] for r in rows] == ["p0", "p1", "p3"] and again.rows == 3
    assert rows[2] == _row(3)  # every field round-trips (Parquet: float32 log-probs are exact here)
    # Starting fresh on it is refused; a resumed run without a checkpoint drops what it finds.
    with pytest.raises(ConfigError, match="already holds rows"):
        RolloutWriter(path).start(resume=False)
    RolloutWriter(path).start(resume=True)
    assert not path.exists() or read_rollout(path) == []


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet"])
def test_metadata_json_cannot_hold_is_written_as_text(tmp_path: Path, name: str) -> None:
    """A data column JSON cannot hold (a Parquet dataset's timestamp) failed the rollout at step 1, though RL ran
    on the same data: it is written as its text."""
    import datetime

    w = RolloutWriter(tmp_path / name)
    w.start(resume=False)
    row = _row(0)
    row["metadata"] = {"domain": "math", "created": datetime.datetime(2026, 12, 5, 12, 0)}
    row["response"] = "a\u2028b"  # a line separator JSON leaves unescaped: one row still (it split the line)
    w.write(1, [row])
    (got,) = read_rollout(tmp_path / name)
    assert got["metadata"]["created"] == "2026-12-05 12:00:00" and got["response"] == "a\u2028b"


def test_writer_refuses_an_output_shorter_than_its_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    w = RolloutWriter(path)
    w.start(resume=False)
    w.write(1, [_row(0), _row(1)])
    state = w.state_dict()
    path.write_bytes(path.read_bytes()[:-10])  # cut by hand
    with pytest.raises(ConfigError, match="the file was moved, cut or replaced"):
        RolloutWriter(path).restore(state)
    path.write_text(json.dumps(_row(5)) + "\n" + "x" * 2000)  # replaced by a file of another shape
    with pytest.raises(ConfigError, match="is not a line end"):
        RolloutWriter(path).restore(state)


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet"])
def test_sft_and_dpo_readers_take_the_output(tmp_path: Path, tiny_model: str, name: str) -> None:
    """What H3's readers (roll_core.posttrain.source) build from a rollout output: SFT token rows of the correct
    samples (data.min_score=1) and preference pairs (correct over incorrect) grouped by prompt_id."""
    from transformers import AutoTokenizer

    from roll_core.posttrain.config import DataConfig
    from roll_core.posttrain.source import load_rows

    path = tmp_path / name
    w = RolloutWriter(path)
    w.start(resume=False)
    rows = []
    for i in range(4):  # prompt p<k>: samples 0 and 1, sample 0 correct for p0 and p1 only
        r = {**_row(i), "prompt_id": f"p{i // 2}", "sample": i % 2, "prompt_ids": [5, 6, 7 + i // 2]}
        rows.append({**r, "response_ids": [8, 9 + i], "correct": i in (0, 2), "response_logprobs": [-1.0, -2.0]})
    w.write(1, rows[:2])
    w.write(2, rows[2:])
    data_path = str(path)  # the JSONL file, or the Parquet folder (its parts read as one table)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    limits = {"max_prompt_length": 16, "max_response_length": 8}
    sft = load_rows("sft", DataConfig(path=data_path, min_score=1.0), tok, **limits).train
    assert [(t.prompt_ids, t.response_ids) for t in sft.items] == [([5, 6, 7], [8, 9]), ([5, 6, 8], [8, 11])]
    pairs = load_rows("preference", DataConfig(path=data_path), tok, **limits).train
    got = [(p.chosen.prompt_ids, p.chosen.response_ids, p.rejected.response_ids) for p in pairs.items]
    assert got == [([5, 6, 7], [8, 9], [8, 10]), ([5, 6, 8], [8, 11], [8, 12])]


def test_samples_the_reward_could_not_score_are_not_written(tmp_path: Path) -> None:
    """A reward failing on some rows scores them error_score (0, incorrect): written, they read as wrong answers
    (DPO's rejected side, dropped by data.min_score). They are left out, counted and logged; the others written."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))  # digit_reward: named in the config by module
    reward = [
        "env/reward=custom",
        "env.reward._target_=digit_reward.OddAnswersFail",
        "pipeline.reward_isolation=inline",
    ]
    _, summary, _ = run(overrides(tmp_path, *reward))
    rows = read_rollout(tmp_path / "rollout.jsonl")
    odd = summary["rollout"]["reward_failed_rows"]
    assert odd > 0 and len(rows) + odd == PROMPTS * SAMPLES, (len(rows), odd)
    assert rows and all(r["answer"].strip()[-1] in "02468" for r in rows)


def test_a_rollout_cut_by_max_steps_says_its_output_is_partial(tmp_path: Path) -> None:
    """pipeline.max_steps (every experiment preset sets one) stopping a rollout before its last prompt: the summary
    and report.md say the output is partial (it read "finished", exit 0, with a third of the rows)."""
    _, summary, _ = run(overrides(tmp_path, "pipeline.max_steps=1"))
    assert summary["incomplete"] is True and summary["rollout"]["prompts_done"] < PROMPTS
    assert "stopped at pipeline.max_steps=1 before the job was done" in (tmp_path / "report.md").read_text()


def test_a_task_with_pictures_is_refused_naming_what_the_rows_would_lose(tmp_path: Path) -> None:
    """A vision-language model on a pictured task: refused before any generation, without calling the model a text
    model (the error the encoder gave when the collector built text prompts)."""
    from roll_core.cli import pipeline_class
    from roll_core.config import load_config

    cfg = load_config(
        ["experiment=vlm_quickstart", "pipeline=rollout", f"pipeline.output_dir={tmp_path}", "pipeline.progress=false"]
    )
    with pytest.raises(ConfigError, match=r"pipeline=rollout does not take pictures yet \(problem visual:colour:"):
        pipeline_class(cfg.pipeline.name)(cfg)
    assert not list(tmp_path.rglob("rollout.*"))
