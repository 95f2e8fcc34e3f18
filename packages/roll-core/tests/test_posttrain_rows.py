"""Post-training rows (roll_core.posttrain): files to batches for SFT, preference pairs and offline distillation.

Real tokenizers of the chat-template families (roll_core.testing.chat_templates: character-level, so the expected
ids are spelt out by hand), real files (JSONL, JSON, CSV, Parquet, a datasets folder). Masks are checked by
decoding exactly the tokens under them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from roll_core.errors import ConfigError
from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.source import load_rows
from roll_core.posttrain.tokenize import tokenizer_fingerprint
from roll_core.testing.chat_templates import family_tokenizer

# The token each family's model ends a turn with (tiny: the tokenizer's eos, which its template does not spell).
END = {
    "chatml": "<|im_end|>",
    "llama3": "<|eot_id|>",
    "qwen3": "<|im_end|>",
    "gemma3": "<end_of_turn>",
    "phi3": "<|end|>",
    "tiny": "</s>",
}
TOKS = {name: family_tokenizer(name) for name in END}


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def load(kind: str, tok, *, max_prompt: int = 400, max_response: int = 400, seed: int = 0, **data):
    return load_rows(
        kind, DataConfig(**data), tok, max_prompt_length=max_prompt, max_response_length=max_response, seed=seed
    )


def masked_segments(tok, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Decoded runs of consecutive mask-1 tokens."""
    segs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            cur.append(t)
        elif cur:
            segs.append(cur)
            cur = []
    if cur:
        segs.append(cur)
    return [tok.decode(s) for s in segs]


def check_layout(batch, pad_id: int) -> None:
    """roll_core.protocol's layout: prompt left-padded, response right-padded, attention on every real token."""
    p = batch["prompts"].shape[1]
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], 1))
    att = batch["attention_mask"]
    for i in range(len(batch)):
        prompt_att, resp_att = att[i, :p], att[i, p:]
        n_p, n_r = int(prompt_att.sum()), int(resp_att.sum())
        assert prompt_att[p - n_p :].all() and resp_att[:n_r].all()  # left-/right-aligned
        assert (batch["response_mask"][i, n_r:] == 0).all()
        assert (batch["responses"][i, n_r:] == pad_id).all()
        real = batch["position_ids"][i][att[i].bool()]
        assert real.tolist() == list(range(n_p + n_r))


# ---- SFT: chat rows ---------------------------------------------------------------------------------------------
THINK = {"qwen3": ("<think>\nadd them\n</think>\n\n", "<think>\nsix\n</think>\n\n")}


@pytest.mark.parametrize("family", list(END))
def test_chat_rows_train_exactly_the_assistant_turns(tmp_path, family):
    tok = TOKS[family]
    t1, t3 = THINK.get(family, ("", ""))
    a1, a2, a3 = t1 + "It is 4.", "I will not say.", t3 + "6"
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": "And 5+5?"},
        {"role": "assistant", "content": a2, "train": False},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": a3},
        {"role": "user", "content": "trailing question, nothing to train after it"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    src = load("sft", tok, path=path).train
    batch = src.batch([0])
    end = END[family]
    # exactly the trained assistant turns, each with the end-of-turn token the model must learn to emit
    assert masked_segments(tok, batch["responses"][0], batch["response_mask"][0]) == [a1 + end, a3 + end]
    prompt = tok.decode(batch["prompts"][0])
    assert prompt.endswith(tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)[-40:])
    assert "What is 2+2?" in prompt and a1 not in prompt
    response = tok.decode(batch["responses"][0][batch["attention_mask"][0, batch["prompts"].shape[1] :].bool()])
    assert "And 5+5?" in response and a2 in response and "And 3+3?" in response  # context (mask 0), attended
    assert "trailing" not in response and response.endswith(a3 + end)
    check_layout(batch, src.pad_id)


def test_openai_weight_zero_turns_are_context_like_train_false(tmp_path):
    """OpenAI's fine-tuning files mark assistant turns not to learn with `"weight": 0`: read like `"train": false`
    (the key was ignored and those turns were trained); a weight other than 0/1, or one contradicting `train`, is a
    counted wrong_type skip."""
    tok = TOKS["chatml"]
    end = END["chatml"]

    def chat(weight: object, **extra: object) -> dict:
        return {
            "messages": [
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "I will not say.", "weight": weight, **extra},
                {"role": "user", "content": "Please?"},
                {"role": "assistant", "content": "It is 4.", "weight": 1},
            ]
        }

    rows = [chat(0), chat(0.5), chat(1, train=False), chat(1)]
    src = load("sft", tok, path=write_jsonl(tmp_path / "openai.jsonl", rows)).train
    assert len(src) == 2 and src.skipped == {"wrong_type": 2}
    segments = [
        masked_segments(tok, src.batch([i])["responses"][0], src.batch([i])["response_mask"][0]) for i in (0, 1)
    ]
    assert sorted(segments) == [["I will not say." + end, "It is 4." + end], ["It is 4." + end]]


def test_qwen3_thinking_as_the_template_renders_it(tmp_path):
    tok = TOKS["qwen3"]
    rows = [{"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]}]
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    # Qwen3 renders a last turn without reasoning with an empty think block: what the model writes when it does
    # not think (its generation header stops at "assistant\n")
    b = load("sft", tok, path=path).train.batch([0])
    assert masked_segments(tok, b["responses"][0], b["response_mask"][0]) == ["<think>\n\n</think>\n\n6<|im_end|>"]
    # enable_thinking=false puts the empty block in the prompt: the model learns the answer alone
    b = load("sft", tok, path=path, chat_template_kwargs={"enable_thinking": False}).train.batch([0])
    assert tok.decode(b["prompts"][0]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert masked_segments(tok, b["responses"][0], b["response_mask"][0]) == ["6<|im_end|>"]


def test_prompt_completion_forms(tmp_path):
    tok = TOKS["chatml"]
    rows = [
        {"prompt": "2+2?", "completion": "4"},
        {
            "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "3+3?"}],
            "completion": [{"role": "assistant", "content": "6"}],
        },
    ]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    b = load("sft", tok, path=path).train.batch([0, 1])
    assert tok.decode(b["prompts"][0][b["attention_mask"][0, : b["prompts"].shape[1]].bool()]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert masked_segments(tok, b["responses"][0], b["response_mask"][0]) == ["4<|im_end|>"]
    assert tok.decode(b["prompts"][1]).endswith(
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert masked_segments(tok, b["responses"][1], b["response_mask"][1]) == ["6<|im_end|>"]
    # raw text: no template, the completion ends with eos; one id per character (the tiny tokenizer)
    raw = load("sft", TOKS["tiny"], path=path, chat_template=False)
    assert len(raw.train) == 2 and raw.train.skipped == {}  # the message-list row still goes through the template
    b = raw.train.batch([0])
    assert b["prompts"][0].tolist() == TOKS["tiny"]("2+2?", add_special_tokens=False)["input_ids"]
    assert b["responses"][0].tolist() == [TOKS["tiny"].convert_tokens_to_ids("4"), TOKS["tiny"].eos_token_id]
    assert b["response_mask"][0].tolist() == [1, 1]


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


# ---- preference pairs -------------------------------------------------------------------------------------------
def test_preference_rows_explicit_and_implicit_prompt(tmp_path):
    tok = TOKS["chatml"]
    user = {"role": "user", "content": "2+2?"}
    rows = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5"},
        {
            "chosen": [user, {"role": "assistant", "content": "four"}],
            "rejected": [user, {"role": "assistant", "content": "five"}],
        },
        {
            "chosen": [user, {"role": "assistant", "content": "x"}],
            "rejected": [user, {"role": "assistant", "content": "x"}],
        },
        {"prompt": "2+2?", "chosen": "4"},
    ]
    src = load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", rows)).train
    assert len(src) == 2 and src.skipped == {"same_response": 1, "missing_field": 1}
    b = src.batch([1, 0])
    assert b["pair_index"].tolist() == [0, 0, 1, 1] and b["is_chosen"].tolist() == [True, False, True, False]
    got = [masked_segments(tok, b["responses"][i], b["response_mask"][i]) for i in range(4)]
    assert got == [["four<|im_end|>"], ["five<|im_end|>"], ["4<|im_end|>"], ["5<|im_end|>"]]
    assert torch.equal(b["prompts"][0], b["prompts"][1]) and torch.equal(b["prompts"][2], b["prompts"][3])
    assert tok.decode(b["prompts"][0]).endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    check_layout(b, src.pad_id)


def test_conversations_that_hold_the_prompt_do_not_repeat_it(tmp_path):
    """A prompt column beside chosen/rejected conversations that already start with it (HuggingFaceH4/
    ultrafeedback_binarized: a text prompt, [user, assistant] lists) is not rendered a second time; lists that do
    not hold it (assistant turns only, or a conversation continuing a message-list prompt) stay explicit."""
    tok = TOKS["chatml"]
    user = {"role": "user", "content": "2+2?"}
    one_user = tok.apply_chat_template([user], tokenize=False, add_generation_prompt=True)

    def side(content):
        return [user, {"role": "assistant", "content": content}]

    first = [user, {"role": "assistant", "content": "4"}]
    follow = {"role": "user", "content": "and 3+3?"}
    rows = [
        {"prompt": "2+2?", "chosen": side("four"), "rejected": side("five")},  # text prompt, whole conversations
        {"prompt": [user], "chosen": side("four"), "rejected": side("five")},  # message prompt they start with
        {"prompt": "2+2?", "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"},  # explicit
        {
            "prompt": first,  # a conversation continued by a new user turn: the lists do not repeat the prompt
            "chosen": [follow, {"role": "assistant", "content": "6"}],
            "rejected": [follow, {"role": "assistant", "content": "7"}],
        },
    ]
    src = load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", rows)).train
    assert len(src) == 4 and src.skipped == {}
    b = src.batch(range(4))
    for i in (0, 2, 4):
        assert tok.decode(b["prompts"][i][b["attention_mask"][i, : b["prompts"].shape[1]].bool()]) == one_user
    got = [masked_segments(tok, b["responses"][i], b["response_mask"][i]) for i in range(8)]
    assert got[:6] == [["four<|im_end|>"], ["five<|im_end|>"]] * 2 + [["4<|im_end|>"], ["5<|im_end|>"]]
    assert got[6:] == [["6<|im_end|>"], ["7<|im_end|>"]]
    continued = tok.decode(b["prompts"][6])
    assert continued.count("2+2?") == 1 and continued.endswith("and 3+3?<|im_end|>\n<|im_start|>assistant\n")


def test_pairs_from_rollout_rows(tmp_path):
    tok = TOKS["tiny"]
    rows = []
    for pid in range(4):
        # prompt 0: 2 correct, 2 incorrect; prompt 1: 1 correct, 3 incorrect; prompt 2: all incorrect; 3: all correct
        correct = {0: [1, 0, 1, 0], 1: [0, 0, 1, 0], 2: [0, 0, 0, 0], 3: [1, 1, 1, 1]}[pid]
        for s, c in enumerate(correct):
            rows.append(
                {"prompt_id": pid, "prompt_ids": [5, 5 + pid], "response_ids": [10 + s], "correct": c, "reward": 0.0}
            )
    path = write_jsonl(tmp_path / "rollout.jsonl", rows)
    src = load("preference", tok, path=path, pairs_per_prompt=2, seed=3).train
    assert src.stats == {"prompts": 4, "prompts_without_pair": 2, "pairs": 4}
    got = set()
    for p in src.items:
        c, r = p.chosen, p.rejected
        assert c.prompt_ids == r.prompt_ids
        pid = c.prompt_ids[1] - 5
        sample = {(row["prompt_id"], row["response_ids"][0]): row["correct"] for row in rows}
        assert sample[(pid, c.response_ids[0])] == 1 and sample[(pid, r.response_ids[0])] == 0
        got.add((pid, c.response_ids[0], r.response_ids[0]))
    # prompt 0: two disjoint pairs (fresh samples first); prompt 1: its one correct sample against two others
    p0 = sorted(x for x in got if x[0] == 0)
    assert len(p0) == 2 and {p0[0][1], p0[1][1]} == {10, 12} and {p0[0][2], p0[1][2]} == {11, 13}
    assert len([x for x in got if x[0] == 1]) == 2 and all(x[1] == 12 for x in got if x[0] == 1)

    def pairs(seed, file):
        items = load("preference", tok, path=file, pairs_per_prompt=1, seed=seed).train.items
        return sorted((p.chosen.prompt_ids[1], p.chosen.response_ids[0], p.rejected.response_ids[0]) for p in items)

    for seed in range(6):  # samples not yet in a pair come first: prompt 0's two pairs never share a sample
        again = load("preference", tok, path=path, pairs_per_prompt=2, seed=seed).train.items
        p0 = [(p.chosen.response_ids[0], p.rejected.response_ids[0]) for p in again if p.chosen.prompt_ids[1] == 5]
        assert len(p0) == 2 and len({x for pair in p0 for x in pair}) == 4
    shuffled = write_jsonl(tmp_path / "shuffled.jsonl", rows[8:] + rows[:8])  # prompt order in the file
    assert pairs(3, path) == pairs(3, path) == pairs(3, shuffled)
    assert len({tuple(pairs(s, path)) for s in range(8)}) > 1  # the seed chooses among the candidates
    b = src.batch([0, 1])
    assert b["input_ids"].shape == (4, 3) and b["pair_index"].tolist() == [0, 0, 1, 1]
    # rollout-only's Parquet layout: a folder of parts, one table; a prompt's samples may sit in different parts
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "rows.parquet").mkdir()
    for part, chunk in enumerate((rows[:6], rows[6:])):
        pq.write_table(pa.Table.from_pylist(chunk), tmp_path / "rows.parquet" / f"part-{part:07d}.parquet")
    assert pairs(3, str(tmp_path / "rows.parquet")) == pairs(3, path)


# ---- distillation rows ------------------------------------------------------------------------------------------
def _teacher(n: int, k: int = 2, lp: tuple = (-0.5, -1.5)) -> tuple[list, list]:
    return [[3 + j for j in range(k)] for _ in range(n)], [list(lp[:k]) for _ in range(n)]


def test_distill_rows_validated_and_batched(tmp_path):
    tok = TOKS["tiny"]
    good_ids, good_lps = _teacher(3)
    base = {"prompt_ids": [5, 6], "response_ids": [7, 8, 9], "response_mask": [1, 0, 1]}
    rows = [
        {**base, "teacher_topk_ids": good_ids, "teacher_topk_logprobs": good_lps},
        {**base, "teacher_topk_ids": good_ids[:2], "teacher_topk_logprobs": good_lps[:2]},  # 2 positions for 3
        {**base, "teacher_topk_ids": good_ids, "teacher_topk_logprobs": [[0.5, -1.0]] * 3},  # log-prob > 0
        {**base, "teacher_topk_ids": good_ids, "teacher_topk_logprobs": [[-0.1, -0.2]] * 3},  # mass 1.72
        {**base, "teacher_topk_ids": good_ids, "teacher_topk_logprobs": [[float("nan"), -1.0]] * 3},
        {**base, "teacher_topk_ids": [[3, 3]] * 3, "teacher_topk_logprobs": good_lps},  # duplicate id
        {**base, "teacher_topk_ids": [[3, 4, 5]] * 3, "teacher_topk_logprobs": [[-1.0, -2.0, -3.0]] * 3},  # K=3
        {**base, "teacher_topk_ids": [[3], [4, 5], [6, 7]], "teacher_topk_logprobs": good_lps},  # ragged
        {**base, "teacher_topk_ids": good_ids},  # no log-probs
        {
            "prompt_ids": [5],
            "response_ids": [7, 8, 9, 10, 11],
            "teacher_topk_ids": _teacher(5)[0],
            "teacher_topk_logprobs": [[-0.1 * (j + 1), -3.0] for j in range(5)],
        },  # cut to 4 with its response
    ]
    src = load("distill", tok, path=write_jsonl(tmp_path / "d.jsonl", rows), max_response=4).train
    assert src.skipped == {
        "teacher_length": 1,
        "teacher_positive_logprob": 1,
        "teacher_mass": 1,
        "teacher_nonfinite": 1,
        "teacher_duplicate_ids": 1,
        "teacher_k": 2,
        "missing_field": 1,
    }
    assert len(src) == 2 and src.truncated == 1
    b = src.batch([0, 1])
    ids, lps = b["teacher_topk_ids"], b["teacher_topk_logprobs"]
    assert ids.shape == (2, 4, 2) and ids.dtype == torch.long and lps.dtype == torch.float32
    assert ids[0].tolist() == [[3, 4], [0, 0], [3, 4], [0, 0]]  # masked context token and padding are 0
    assert lps[0].tolist() == [[-0.5, -1.5], [0.0, 0.0], [-0.5, -1.5], [0.0, 0.0]]
    assert torch.allclose(lps[1], torch.tensor([[-0.1 * (j + 1), -3.0] for j in range(4)]))


def test_distill_tokenizer_column_and_fingerprint(tmp_path):
    chatml, qwen3 = TOKS["chatml"], TOKS["qwen3"]
    assert tokenizer_fingerprint(chatml) == tokenizer_fingerprint(family_tokenizer("chatml"))
    assert tokenizer_fingerprint(chatml) != tokenizer_fingerprint(qwen3)
    other = family_tokenizer("chatml")
    other.chat_template = other.chat_template.replace("helpful", "useful")
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(chatml)
    added = family_tokenizer("chatml")
    added.add_tokens(["<extra>"])
    assert tokenizer_fingerprint(added) != tokenizer_fingerprint(chatml)
    # padding set on the backend by a call does not change the fingerprint
    chatml(["a", "abc"], padding=True)
    assert tokenizer_fingerprint(chatml) == tokenizer_fingerprint(family_tokenizer("chatml"))
    ids, lps = _teacher(2)
    row = {"prompt": "hi", "completion": "4", "teacher_topk_ids": ids, "teacher_topk_logprobs": lps}
    ok = write_jsonl(tmp_path / "ok.jsonl", [{**row, "tokenizer": tokenizer_fingerprint(chatml)}])
    b = load("distill", chatml, path=ok).train.batch([0])  # "4<|im_end|>": two response tokens
    assert b["teacher_topk_ids"].shape == (1, 2, 2)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{**row, "tokenizer": tokenizer_fingerprint(qwen3)}])
    with pytest.raises(
        ConfigError,
        match=rf"{tokenizer_fingerprint(qwen3)} is not the student's "
        rf"{tokenizer_fingerprint(chatml)}",
    ):
        load("distill", chatml, path=bad)


@pytest.mark.parametrize("family", ["chatml", "llama3", "phi3"])
def test_two_assistant_turns_in_a_row_have_the_templates_header_between_them(tmp_path, family):
    """A1 then A2: the model is trained on A1's end of turn, then (context) the next assistant header, then A2, as
    the template renders them; it was trained to write A2 right after its end-of-turn token."""
    tok = TOKS[family]
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A1"}]
    messages.append({"role": "assistant", "content": "A2"})
    batch = load("sft", tok, path=write_jsonl(tmp_path / "two.jsonl", [{"messages": messages}])).train.batch([0])
    n = int(batch["attention_mask"][0, batch["prompts"].shape[1] :].sum())
    response = tok.decode(batch["responses"][0][:n])
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert response == rendered[rendered.index("A1") : rendered.index("A2") + 2] + END[family]
    assert masked_segments(tok, batch["responses"][0], batch["response_mask"][0]) == [f"A1{END[family]}"] * 1 + [
        f"A2{END[family]}"
    ]


def test_a_template_that_drops_the_reasoning_skips_the_row_and_says_so(tmp_path):
    """DeepSeek-R1's template strips <think> from assistant turns: trained as rendered, the row would teach the
    answer without its reasoning. Such rows are skipped and counted; a row without reasoning is kept."""
    tok = family_tokenizer("deepseek_r1")
    rows = [
        {
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            ]
        },
        {"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]},
    ]
    src = load("sft", tok, path=write_jsonl(tmp_path / "r1.jsonl", rows)).train
    assert len(src) == 1 and src.skipped == {"template_drops_content": 1}
    # A header that opens <think> for a turn whose reasoning the template drops: the mismatch names what differs
    qwq = family_tokenizer("qwen3")
    qwq.chat_template = (
        "{%- for m in messages -%}{%- if m.role == 'assistant' -%}"
        "{{- '<|im_start|>assistant\\n' + m.content.split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
    )
    with pytest.raises(ConfigError, match=r"template_mismatch: .*the generation prompt ends '<think>\\n'"):
        load("sft", qwq, path=write_jsonl(tmp_path / "qwq.jsonl", rows[1:]))


def test_a_train_flag_that_is_not_a_boolean_is_a_counted_skip(tmp_path):
    """`"train": 0` or `"false"` trained the turn (only the literal false counted); null is absent (Parquet)."""
    tok = TOKS["chatml"]

    def row(flag):
        return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "BAD", "train": flag},
                             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "GOOD"}]}  # fmt: skip

    src = load("sft", tok, path=write_jsonl(tmp_path / "f.jsonl", [row(0), row("false"), row(None), row(False)])).train
    assert src.skipped == {"wrong_type": 2} and len(src) == 2
    got = [masked_segments(tok, src.batch([i])["responses"][0], src.batch([i])["response_mask"][0]) for i in (0, 1)]
    assert got == [["BAD<|im_end|>", "GOOD<|im_end|>"], ["GOOD<|im_end|>"]]


@pytest.mark.parametrize("family", list(END))
def test_a_blank_answer_is_a_counted_skip(tmp_path, family):
    """An empty or whitespace answer is bad data under every template: ChatML rendered "   " as a trained
    "   <|im_end|>" and Qwen3 "" as a trained empty think block, teaching the model to end its turn without
    answering, where Llama 3 and Gemma 3 skipped the same rows. Tool calls with empty text are an answer."""
    tok = TOKS[family]
    user = {"role": "user", "content": "q"}
    chat = [
        {"messages": [user, {"role": "assistant", "content": ""}]},
        {"messages": [user, {"role": "assistant", "content": "  \n "}]},
        {"messages": [user, {"role": "assistant", "content": "ok"}, user, {"role": "assistant", "content": " "}]},
        {"messages": [user, {"role": "assistant", "content": "ok"}]},
    ]
    src = load("sft", tok, path=write_jsonl(tmp_path / "s.jsonl", chat)).train
    assert src.skipped == {"empty": 3} and len(src) == 1
    text = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "completion": "   "}, {"prompt": "q", "completion": "a"}])
    for template in (True, False):
        src = load("sft", tok, path=text, chat_template=template).train
        assert src.skipped == {"empty": 1} and len(src) == 1
    pairs = [{"prompt": "q", "chosen": " ", "rejected": "no"}, {"prompt": "q", "chosen": "yes", "rejected": "no"}]
    assert load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", pairs)).train.skipped == {"empty": 1}


def test_a_tool_call_with_empty_text_is_trained(tmp_path):
    tok = family_tokenizer("qwen2.5")
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
    answer = {"role": "assistant", "content": "", "tool_calls": [call]}
    row = {"messages": [{"role": "user", "content": "2+2?"}, answer]}
    src = load("sft", tok, path=write_jsonl(tmp_path / "t.jsonl", [row])).train
    b = src.batch([0])
    assert src.skipped == {} and masked_segments(tok, b["responses"][0], b["response_mask"][0]) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>'
    ]
