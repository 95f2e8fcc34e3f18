"""Post-training data files and filters (roll_core.posttrain): token rows with bad ids, data.min_score, length
limits and truncation, counted skips, file errors, CSV / JSON / Parquet / datasets folders, lists and globs of
files, held-out splits. Row forms and what each template trains: test_posttrain_rows.py.

Real tokenizers (roll_core.testing.chat_templates: character-level, so the expected ids are spelt out by hand),
real files (roll_core.testing.posttrain_rows writes the JSONL ones and loads them as a run does)."""

from __future__ import annotations

import json

import pytest
import torch

from roll_core.errors import ConfigError
from roll_core.posttrain.config import DataConfig
from roll_core.testing.chat_templates import family_tokenizer
from roll_core.testing.posttrain_rows import load, masked_segments, write_jsonl

# The families these tests read rows with (test_posttrain_rows.py's TOKS holds every family).
TOKS = {name: family_tokenizer(name) for name in ("tiny", "chatml")}


def test_token_rows_min_score_and_bad_ids(tmp_path):
    tok = TOKS["tiny"]
    v = len(tok)
    rows = [
        {"prompt_ids": [5, 6], "response_ids": [7, 8, 9], "response_mask": [1, 0, 1], "reward": 1.0},
        {"prompt_ids": [5, 6], "response_ids": [7], "reward": 0.0},  # below min_score
        {"prompt_ids": [5, v], "response_ids": [7], "reward": 1.0},  # id outside the vocabulary
        {"prompt_ids": [5], "response_ids": [7, 8], "response_mask": [1, 2], "reward": 1.0},
        {"prompt_ids": "5 6", "response_ids": [7], "reward": 1.0},
        {"prompt_ids": [5], "response_ids": [7, 8], "response_mask": [0, 0], "reward": 1.0},
    ]
    src = load("sft", tok, path=write_jsonl(tmp_path / "t.jsonl", rows), min_score=0.5).train
    assert len(src) == 1
    assert src.skipped == {
        "below_min_score": 1,
        "bad_token_id": 1,
        "bad_mask": 1,
        "wrong_type": 1,
        "no_trained_tokens": 1,
    }
    b = src.batch([0])
    assert b["prompts"].tolist() == [[5, 6]] and b["responses"].tolist() == [[7, 8, 9]]
    assert b["response_mask"].tolist() == [[1, 0, 1]] and b["attention_mask"].tolist() == [[1] * 5]


def test_min_score_filters_distillation_rows_and_is_refused_for_pairs(tmp_path):
    """data.min_score keeps only the rollout rows that reached it for distillation too (it was ignored there: the
    student distilled on the wrong samples), and is refused for preference pairs (ignored as well)."""
    tok = TOKS["tiny"]
    topk = {"teacher_topk_ids": [[7, 8]], "teacher_topk_logprobs": [[-0.1, -2.5]]}
    rows = [{"prompt_ids": [5, 6], "response_ids": [7], "reward": r, **topk} for r in (1.0, 0.0, 0.0)]
    src = load("distill", tok, path=write_jsonl(tmp_path / "d.jsonl", rows), min_score=1.0).train
    assert len(src) == 1 and src.skipped == {"below_min_score": 2}
    pairs = [{"prompt": "q", "chosen": "a", "rejected": "b"}]
    with pytest.raises(ConfigError, match=r"holds preference rows for preference pairs"):
        load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", pairs), min_score=1.0)


def test_a_file_whose_rows_all_fall_below_min_score_is_not_a_bad_file(tmp_path):
    """A rollout's Parquet parts are one file per step: a step without a correct sample left a part whose every row
    fell below data.min_score, and the whole load failed as if that file were unreadable."""
    tok = TOKS["tiny"]
    low = write_jsonl(tmp_path / "part-1.jsonl", [{"prompt_ids": [5], "response_ids": [7], "reward": 0.0}] * 2)
    good = write_jsonl(tmp_path / "part-2.jsonl", [{"prompt_ids": [5], "response_ids": [8], "reward": 1.0}])
    src = load("sft", tok, path=[low, good], min_score=1.0).train
    assert len(src) == 1 and src.skipped == {"below_min_score": 2}
    with pytest.raises(ConfigError, match=r"no usable rows"):  # nothing at all above it: still an error
        load("sft", tok, path=[low], min_score=1.0)


def test_a_pair_cut_to_the_same_response_is_a_counted_skip(tmp_path):
    """Chosen and rejected that differ only past max_response_length become identical when cut: such a pair has a
    loss of log 2 and no gradient (it was kept, diluting the batch, and always counted wrong in reward_accuracy)."""
    tok = TOKS["tiny"]
    rows = [
        {"prompt": "q", "chosen": "The answer is 42, because 6*7", "rejected": "The answer is 42, I guess"},
        {"prompt": "q", "chosen": "Yes, it is", "rejected": "No, it is not"},
    ]
    src = load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", rows), max_response=6).train
    assert len(src) == 1 and src.skipped == {"same_response": 1}


def test_length_limits_truncation_and_skips(tmp_path):
    tok = TOKS["tiny"]
    rows = [
        {"prompt_ids": [5] * 3, "response_ids": [7] * 4},
        {"prompt_ids": [5] * 3, "response_ids": [7] * 9},  # cut to 5
        {"prompt_ids": [5] * 8, "response_ids": [7]},  # prompt too long: skipped
        {"prompt_ids": [5]},  # no response_ids
        '{"prompt_ids": [5], "response_ids": ',  # not JSON
        "[1, 2]",  # not an object
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    src = load("sft", tok, path=path, max_prompt=4, max_response=5).train
    assert len(src) == 2 and src.truncated == 1
    assert src.skipped == {"prompt_too_long": 1, "missing_field": 1, "unreadable": 2}
    b = src.batch([1, 0])
    assert b["responses"].shape == (2, 5) and b["response_mask"].sum(1).tolist() == [5, 4]
    strict = load("sft", tok, path=path, max_prompt=4, max_response=5, truncate=False).train
    assert len(strict) == 1 and strict.truncated == 0 and strict.skipped["response_too_long"] == 1


def test_truncated_counts_the_kept_examples_cut_responses(tmp_path):
    """`truncated` (the runs' truncated_rows / truncated_responses) counted every cut made while reading, so rows and
    pairs skipped after their cut (cut to no trained token, cut to the same response) and held-out rows were
    reported as truncated training examples."""
    tok = TOKS["tiny"]
    rows = [
        {"prompt_ids": [5], "response_ids": [7] * 9},  # cut to 5: kept
        {"prompt_ids": [5], "response_ids": [7] * 9, "response_mask": [0] * 6 + [1] * 3},  # cut to no trained token
        {"prompt_ids": [6], "response_ids": [8] * 9},  # cut to 5: kept
        {"prompt_ids": [6], "response_ids": [8] * 2},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    src = load("sft", tok, path=path, max_response=5).train
    assert len(src) == 3 and src.skipped == {"no_trained_tokens": 1} and src.truncated == 2
    split = load("sft", tok, path=path, max_response=5, eval_size=1)  # one prompt's rows on each side
    assert split.train.truncated == 1 and split.eval is not None and split.eval.truncated == 1
    pairs = [
        {"prompt": "q", "chosen": "The answer is 42, because 6*7", "rejected": "The answer is 42, I guess"},  # alike
        {"prompt": "q", "chosen": "Yes, it is", "rejected": "No"},  # chosen cut
    ]
    src = load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", pairs), max_response=6).train
    assert len(src) == 1 and src.skipped == {"same_response": 1} and src.truncated == 1


def test_file_errors(tmp_path):
    tok = TOKS["tiny"]
    with pytest.raises(ConfigError, match=r"does not exist.*local files only"):
        load("sft", tok, path=str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds no rows"):
        load("sft", tok, path=str(tmp_path / "empty.jsonl"))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ConfigError, match="unsupported data file"):
        load("sft", tok, path=str(tmp_path / "x.txt"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt_ids": [5], "response_ids": "x"}] * 2)
    with pytest.raises(ConfigError, match=r"no usable rows .*first: bad.jsonl:1: wrong_type"):
        load("sft", tok, path=bad)
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt_ids": [5], "response_ids": [6]}])
    with pytest.raises(ConfigError, match=r"bad.jsonl\): no usable rows"):  # one bad file beside a good one
        load("sft", tok, path=[good, bad])
    garbage = write_jsonl(tmp_path / "garbage.jsonl", ["{oops", "[1]"])
    with pytest.raises(ConfigError, match=r"no usable rows \(2 skipped .*unreadable: invalid JSON"):
        load("sft", tok, path=garbage)
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "q"}]}])
    with pytest.raises(ConfigError, match=r"data.min_score filters rollout \(token\) rows"):
        load("sft", tok, path=chat, min_score=1.0)
    cols = write_jsonl(tmp_path / "cols.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(ConfigError, match=r"cannot tell the row form.*'answer', 'question'"):
        load("sft", tok, path=cols)
    with pytest.raises(ValueError, match=r"data.format"):
        DataConfig(format="sharegpt")
    with pytest.raises(ValueError, match=r"data.path"):
        DataConfig(path=[1, 2])


def test_a_csv_row_split_at_an_unquoted_comma_is_a_counted_skip(tmp_path):
    """A record with more fields than the header has columns: csv puts the extras under the key None and the row was
    trained on its completion cut at the comma ("Hello" for "Hello, world")."""
    tok = TOKS["chatml"]
    path = tmp_path / "rows.csv"
    path.write_text('prompt,completion\nGreet me,"Hello, world"\nGreet me again,Hello, world\nAnd again,"Hi"\n')
    src = load("sft", tok, path=str(path)).train
    assert src.skipped == {"unreadable": 1} and len(src) == 2
    got = [masked_segments(tok, src.batch([i])["responses"][0], src.batch([i])["response_mask"][0]) for i in (0, 1)]
    assert got == [["Hello, world<|im_end|>"], ["Hi<|im_end|>"]]
    path.write_text("prompt,completion\nGreet me,Hello, world\n")
    with pytest.raises(ConfigError, match=r"rows.csv:2: unreadable: 3 fields for 2 columns"):
        load("sft", tok, path=str(path))


def test_parquet_datasets_json_csv_lists_and_globs_agree(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    datasets = pytest.importorskip("datasets")
    tok = TOKS["chatml"]
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(3)
    ]
    # a context assistant turn: Parquet and datasets give every other message `train: None` (the struct's column)
    rows[2]["messages"][1:1] = [{"role": "assistant", "content": "ctx", "train": False}, rows[2]["messages"][0]]
    want = load("sft", tok, path=write_jsonl(tmp_path / "rows.jsonl", rows)).train.batch([0, 1, 2])
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    assert masked_segments(tok, want["responses"][2], want["response_mask"][2]) == ["a2<|im_end|>"]
    for path in ("rows.parquet", "ds", "rows.json"):
        got = load("sft", tok, path=str(tmp_path / path)).train.batch([0, 1, 2])
        for key in ("input_ids", "attention_mask", "response_mask", "position_ids"):
            assert torch.equal(got[key], want[key]), (path, key)
    # a list of paths is concatenated in order; a glob expands sorted
    both = load("sft", tok, path=[str(tmp_path / "rows.parquet"), str(tmp_path / "rows.jsonl")]).train
    assert len(both) == 6 and both.batch([3])["where"] == ["rows.jsonl:1"]
    assert len(load("sft", tok, path=str(tmp_path / "rows.j*")).train) == 6
    # a glob of folders of Parquet parts (a sharded rollout's rows.shard-<i>-of-<n>.parquet/): every part, in order
    for shard, part_rows in enumerate((rows[:2], rows[2:])):
        folder = tmp_path / f"rows.shard-{shard}-of-2.parquet"
        folder.mkdir()
        for step, row in enumerate(part_rows):
            pq.write_table(pa.Table.from_pylist([row]), folder / f"part-{step:07d}.parquet")
    shards = load("sft", tok, path=str(tmp_path / "rows.shard-*-of-2.parquet")).train
    assert [shards.batch([i])["where"][0] for i in range(3)] == [
        "rows.shard-0-of-2.parquet/part-0000000.parquet:1",
        "rows.shard-0-of-2.parquet/part-0000001.parquet:1",
        "rows.shard-1-of-2.parquet/part-0000000.parquet:1",
    ]
    for key in ("input_ids", "response_mask"):
        assert torch.equal(shards.batch([0, 1, 2])[key], want[key]), key
    (tmp_path / "pc.csv").write_bytes(b'\xef\xbb\xbfprompt,completion\n"2+2?",4\n')  # with a byte-order mark
    b = load("sft", tok, path=str(tmp_path / "pc.csv")).train.batch([0])
    assert masked_segments(tok, b["responses"][0], b["response_mask"][0]) == ["4<|im_end|>"]


def test_a_datasets_folder_of_splits_gives_train_rows_and_held_out_rows(tmp_path):
    """data.eval_path naming a saved DatasetDict read its 'train' split: the held-out metrics were measured on the
    training rows. The held-out rows are its one other split; an ambiguous set of splits is an error."""
    datasets = pytest.importorskip("datasets")
    tok = TOKS["tiny"]

    def split(name: str, n: int) -> object:
        return datasets.Dataset.from_list([{"prompt": f"{name} {i}", "completion": "a"} for i in range(n)])

    folder = str(tmp_path / "dd")
    datasets.DatasetDict({"train": split("train", 4), "test": split("test", 2)}).save_to_disk(folder)
    data = load("sft", tok, path=folder, eval_path=folder)
    assert len(data.train) == 4 and data.eval is not None and len(data.eval) == 2
    assert tok.decode(data.eval.batch([0])["prompts"][0]).startswith("<|user|>test 0")
    three = str(tmp_path / "three")
    datasets.DatasetDict(
        {"train": split("train", 4), "validation": split("v", 2), "test": split("test", 2)}
    ).save_to_disk(three)
    assert len(load("sft", tok, path=three).train) == 4
    with pytest.raises(ConfigError, match=r"data.eval_path: .* holds splits \['train', 'validation', 'test'\]"):
        load("sft", tok, path=three, eval_path=three)
    assert len(load("sft", tok, path=three, eval_path=f"{three}/validation").eval) == 2


def test_a_datasets_folder_of_splits_as_data_path_says_which_it_reads(tmp_path, caplog):
    """data.path naming a saved DatasetDict of several splits read its 'train' split and said nothing of the
    others (a user who meant its 'test' split to be held out got a hash split of 'train' instead); the RL loader
    warns in this case, and so does this one now, with the same words."""
    import logging

    datasets = pytest.importorskip("datasets")
    tok = TOKS["tiny"]
    rows = {s: [{"prompt": f"{s} {i}", "completion": "a"} for i in range(3)] for s in ("train", "test")}
    folder = str(tmp_path / "dd")
    datasets.DatasetDict({s: datasets.Dataset.from_list(r) for s, r in rows.items()}).save_to_disk(folder)
    with caplog.at_level(logging.WARNING, logger="roll_core.posttrain.rows"):
        data = load("sft", tok, path=folder)
    assert len(data.train) == 3 and tok.decode(data.train.batch([0])["prompts"][0]).startswith("<|user|>train 0")
    assert caplog.text.count("holds the splits ['test', 'train']: reading 'train' only") == 1
    assert "its 'test' split is held out only when data.eval_path names this folder too" in caplog.text
    caplog.clear()
    three = str(tmp_path / "three")
    datasets.DatasetDict(
        {s: datasets.Dataset.from_list(rows["train"]) for s in ("train", "validation", "test")}
    ).save_to_disk(three)
    with caplog.at_level(logging.WARNING, logger="roll_core.posttrain.rows"):
        load("sft", tok, path=three)
    assert "holds the splits ['test', 'train', 'validation']: reading 'train' only (point data.eval_path" in (
        caplog.text
    )
    caplog.clear()
    (tmp_path / "one").mkdir()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows["train"])}).save_to_disk(str(tmp_path / "one"))
    with caplog.at_level(logging.WARNING, logger="roll_core.posttrain.rows"):
        load("sft", tok, path=str(tmp_path / "one"))
    assert "holds the splits" not in caplog.text  # one split: nothing left unread


def test_held_out_split_is_stable_and_keeps_prompts_together(tmp_path):
    tok = TOKS["tiny"]
    rows = [{"prompt_ids": [5 + i % 10], "response_ids": [7, 8 + i]} for i in range(40)]  # 10 prompts x 4
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    a = load("sft", tok, path=path, eval_size=6)
    b = load("sft", tok, path=path, eval_size=6)
    held = [tuple(r.prompt_ids) for r in a.eval.items]
    assert len(held) == 8 and held == [tuple(r.prompt_ids) for r in b.eval.items]  # two whole prompts
    assert not set(held) & {tuple(r.prompt_ids) for r in a.train.items} and len(a.train) == 32
    ev = write_jsonl(tmp_path / "ev.jsonl", rows[:3])
    c = load("sft", tok, path=path, eval_path=ev)
    assert len(c.train) == 40 and len(c.eval) == 3
    with pytest.raises(ConfigError, match="every row fell in the held-out split"):
        load("sft", tok, path=path, eval_size=40)


def test_eval_size_beside_eval_path_is_an_error(tmp_path):
    """data.eval_path took the held-out side and data.eval_size was silently ignored: the 6 rows the user held out
    of data.path trained (40 training rows, not 32)."""
    rows = [{"prompt_ids": [5 + i % 10], "response_ids": [7, 8 + i]} for i in range(40)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    ev = write_jsonl(tmp_path / "ev.jsonl", rows[:3])
    with pytest.raises(ValueError, match=r"data.eval_size=6 holds rows of data.path out, but data.eval_path is set"):
        DataConfig(path=path, eval_path=ev, eval_size=6)
    assert DataConfig(path=path, eval_path=ev).eval_paths == [ev]  # either one alone is fine
    assert len(load("sft", TOKS["tiny"], path=path, eval_size=6).train) == 32
