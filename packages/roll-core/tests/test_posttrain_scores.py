"""Which score `data.min_score` and `data.pair_margin` read on rollout rows (roll_core.posttrain.pairs.score_column):
the 0/1 `correct` flag when the rows have it, the reward with `data.correct_key=null`, one column for every row of a
load; values that mean nothing on the flag are errors, not silent thresholds of a 0/1 value. And pairs built from
rollout rows are distinct (a response sampled twice gives one pair).

Rows as rollout-only writes them (roll_core.posttrain.writer): both `reward` (continuous here: a judge's or a reward
model's score) and `correct` (the task's threshold of it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from roll_core.errors import ConfigError
from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.source import load_rows
from roll_core.posttrain.writer import ROW_FIELDS, RolloutWriter
from roll_core.testing.chat_templates import family_tokenizer

TOK = family_tokenizer("tiny")
#: One prompt's samples: (response token, judge score); `correct` is score >= 0.5 (the judge's threshold).
SCORES = [(10, 0.9), (11, 0.75), (12, 0.6), (13, 0.2)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rollout_rows(scores=SCORES, pid: str = "p0") -> list[dict]:
    return [
        {"prompt_id": pid, "prompt_ids": [5, 6], "response_ids": [t], "reward": s, "correct": s >= 0.5}
        for t, s in scores
    ]


def load(kind: str, path, **data):
    return load_rows(kind, DataConfig(path=path, **data), TOK, max_prompt_length=64, max_response_length=64)


def pairs_of(src) -> list[tuple[int, int]]:
    return sorted((p.chosen.response_ids[0], p.rejected.response_ids[0]) for p in src.items)


def test_min_score_between_0_and_1_on_the_correct_flag_is_an_error(tmp_path):
    """min_score=0.7 on rows with a continuous reward and a `correct` flag compared 0.7 with the flag: it kept the
    samples the flag calls correct (scores 0.9, 0.75 and 0.6), as min_score=1 does, silently."""
    path = write_jsonl(tmp_path / "rollout.jsonl", rollout_rows())
    for kind in ("sft", "distill"):
        with pytest.raises(ConfigError, match=r"data.min_score=0.7 is compared with the rows' 0/1 'correct' flag"):
            load(kind, path, min_score=0.7)
    # 1 on the flag keeps the correct samples, as documented
    assert [t.response_ids for t in load("sft", path, min_score=1.0).train.items] == [[10], [11], [12]]
    # correct_key=null thresholds the reward itself
    src = load("sft", path, min_score=0.7, correct_key=None).train
    assert [t.response_ids for t in src.items] == [[10], [11]] and src.skipped == {"below_min_score": 2}
    # the skip says which column fell short
    with pytest.raises(ConfigError, match=r"first: rollout.jsonl:1: below_min_score: reward 0.9 < data.min_score=0.95"):
        load("sft", path, min_score=0.95, correct_key=None)


def test_pair_margin_on_the_correct_flag_is_an_error_and_reads_the_reward_when_asked(tmp_path):
    """pair_margin=0.2 compared differences of the 0/1 flag (0 or 1): it gave correct-over-incorrect pairs whatever
    the judge's scores, e.g. 0.6 over 0.2 but never 0.9 over 0.6."""
    path = write_jsonl(tmp_path / "rollout.jsonl", rollout_rows())
    with pytest.raises(ConfigError, match=r"data.pair_margin=0.2 is compared with differences of the rows' 0/1"):
        load("preference", path, pair_margin=0.2, pairs_per_prompt=10)
    src = load("preference", path, pair_margin=0.2, pairs_per_prompt=10, correct_key=None).train
    # every pair of the four scores more than 0.2 apart, the higher chosen: 0.9>0.6, 0.9>0.2, 0.75>0.2, 0.6>0.2
    assert pairs_of(src) == [(10, 12), (10, 13), (11, 13), (12, 13)]
    assert src.stats == {"prompts": 1, "prompts_without_pair": 0, "pairs": 4}
    # margin 0 on the reward: every pair of distinct scores (6 of them); on the flag: correct over incorrect (3)
    assert len(load("preference", path, pairs_per_prompt=10, correct_key=None).train) == 6
    assert pairs_of(load("preference", path, pairs_per_prompt=10).train) == [(10, 13), (11, 13), (12, 13)]


def test_a_judge_without_a_correct_threshold_says_how_to_pair_by_reward(tmp_path):
    """A judge template without a threshold writes correct=false on every row: no pair on the flag, and the error
    names data.correct_key=null."""
    rows = [{**r, "correct": False} for r in rollout_rows()]
    path = write_jsonl(tmp_path / "rollout.jsonl", rows)
    with pytest.raises(ConfigError, match=r"no usable pairs .*data.correct_key=null scores them by 'reward'"):
        load("preference", path)
    assert len(load("preference", path, correct_key=None).train) == 1


def test_one_score_column_for_every_row_of_a_load(tmp_path):
    """A row without the flag, beside rows with it, was scored by its reward: a 0/1 flag compared with a reward
    (0.4 paired under a correct sample and over an incorrect one). It is a counted missing_field skip."""
    rows = rollout_rows([(10, 1.0), (11, 0.0)])
    rows.append({"prompt_id": "p0", "prompt_ids": [5, 6], "response_ids": [12], "reward": 0.4})
    path = write_jsonl(tmp_path / "rollout.jsonl", rows)
    src = load("preference", path, pairs_per_prompt=3).train
    assert pairs_of(src) == [(10, 11)] and src.skipped == {"missing_field": 1}
    sft = load("sft", path, min_score=1.0).train
    assert [t.response_ids for t in sft.items] == [[10]] and sft.skipped == {"below_min_score": 1, "missing_field": 1}


def test_a_response_sampled_twice_gives_one_pair(tmp_path):
    """Two samples with the same response (common at low temperature) gave the same (chosen, rejected) pair twice
    when pairs_per_prompt allowed two: one pair trained twice as hard, no other pair."""
    rows = rollout_rows([(10, 1.0), (10, 1.0), (11, 0.0)])
    src = load("preference", write_jsonl(tmp_path / "rollout.jsonl", rows), pairs_per_prompt=2).train
    assert pairs_of(src) == [(10, 11)] and src.stats["pairs"] == 1
    # distinct responses still give their distinct pairs
    rows = rollout_rows([(10, 1.0), (10, 1.0), (11, 0.0), (12, 0.0)])
    src = load("preference", write_jsonl(tmp_path / "more.jsonl", rows), pairs_per_prompt=4).train
    assert pairs_of(src) == [(10, 11), (10, 12)]


def test_correct_key_null_is_a_config_value():
    """`data.correct_key=null` on the command line: the structured config took only text there."""
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), OmegaConf.from_dotlist(["correct_key=null"]))
    assert cfg.correct_key is None


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet"])
def test_rollout_output_with_continuous_rewards_loads_back_for_sft_and_dpo(tmp_path, name):
    """What RolloutWriter writes, read back by the SFT and DPO readers on the reward (correct_key=null): the samples
    whose judge score reached min_score, and pairs ordered by score, across steps (Parquet: one part per step)."""
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    w = RolloutWriter(tmp_path / name)
    w.start(resume=False)
    for step, pid in enumerate(("p0", "p1"), start=1):
        scores = [(10 + k + 4 * (step - 1), s) for k, (_, s) in enumerate(SCORES)]
        rows = []
        for k, r in enumerate(rollout_rows(scores, pid)):
            full = {
                **dict.fromkeys(ROW_FIELDS),
                **r,
                "prompt": "q",
                "answer": "a",
                "response": "x",
                "response_logprobs": [-1.0],
                "formatted": True,
                "finish_reason": "stop",
                "metadata": {},
                "sample": k,
                "shard": 0,
            }
            rows.append({f: full[f] for f in ROW_FIELDS})
        w.write(step, rows)
    path = str(tmp_path / name)
    sft = load("sft", path, min_score=0.7, correct_key=None).train
    assert [t.response_ids for t in sft.items] == [[10], [11], [14], [15]]
    dpo = load("preference", path, pair_margin=0.5, pairs_per_prompt=4, correct_key=None).train
    # per prompt only its best two (0.9, 0.75) are more than 0.5 above the worst (0.2)
    assert pairs_of(dpo) == [(10, 13), (11, 13), (14, 17), (15, 17)]


def test_a_rollout_file_whose_every_row_is_bad_is_an_error_beside_good_ones(tmp_path):
    """A shard written with another tokenizer (every id outside this vocabulary) was dropped whole with a warning
    when pairs were built, though SFT rows refuse such a file: one bad file is an error even beside good ones."""
    good = write_jsonl(tmp_path / "shard-0.jsonl", rollout_rows())
    bad_rows = [{**r, "response_ids": [len(TOK) + 1]} for r in rollout_rows(pid="p1")]
    bad = write_jsonl(tmp_path / "shard-1.jsonl", bad_rows)
    with pytest.raises(ConfigError, match=r"data.path \(.*shard-1.jsonl\): no usable rows .*bad_token_id"):
        load("preference", [good, bad])
    # a bad row beside good ones in its file stays a counted skip
    mixed = write_jsonl(tmp_path / "mixed.jsonl", rollout_rows() + bad_rows[:1])
    assert load("preference", mixed).train.skipped == {"bad_token_id": 1}


def test_a_preference_row_with_the_same_answer_twice_says_so(tmp_path):
    """chosen == rejected (not cut) was reported as "identical after truncation to max_response_length", sending
    the user to the length limit."""
    rows = [{"prompt": "q", "chosen": "same", "rejected": "same"}]
    with pytest.raises(
        ConfigError, match=r"same_response: chosen and rejected train the same tokens \(the same answer"
    ):
        load("preference", write_jsonl(tmp_path / "p.jsonl", rows))
