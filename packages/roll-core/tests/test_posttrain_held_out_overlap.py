"""data.eval_path and data.path sharing prompts (sft, dpo): the training examples whose prompt the held-out file
holds too are counted (`stats["also_held_out"]`) and logged (the held-out metrics then measure trained prompts;
nothing said so). They are kept: evaluating on (a copy of) the training rows is a use of its own. Real JSONL files
read by `load_rows` with roll's tiny tokenizer."""

from __future__ import annotations

import logging

from roll_core.testing.chat_templates import family_tokenizer
from roll_core.testing.posttrain_rows import load, write_jsonl

TOK = family_tokenizer("tiny")


def test_training_rows_whose_prompt_is_held_out_are_counted_and_logged(tmp_path, caplog) -> None:
    rows = [{"prompt": f"question {i % 10}?", "completion": f"answer {i}"} for i in range(40)]  # 10 prompts x 4
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    # the held-out file: two of the training prompts (other completions) and one of its own
    held = [{"prompt": "question 3?", "completion": "x"}, {"prompt": "question 7?", "completion": "y"}]
    ev = write_jsonl(tmp_path / "test.jsonl", [*held, {"prompt": "unseen?", "completion": "z"}])
    with caplog.at_level(logging.WARNING, logger="roll_core.posttrain.source"):
        data = load("sft", TOK, path=path, eval_path=ev)
    assert len(data.eval) == 3 and len(data.train) == 40
    assert data.train.stats["also_held_out"] == 8
    assert "8 of its 40 examples have a prompt that data.eval_path holds too" in caplog.text
    # preference pairs: by the pair's prompt
    pairs = [{"prompt": f"q{i}?", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]
    p_path, p_ev = write_jsonl(tmp_path / "p.jsonl", pairs), write_jsonl(tmp_path / "pe.jsonl", pairs[:2])
    assert load("preference", TOK, path=p_path, eval_path=p_ev).train.stats["also_held_out"] == 2
    # disjoint files: nothing counted, nothing said
    caplog.clear()
    other = load(
        "sft", TOK, path=path, eval_path=write_jsonl(tmp_path / "o.jsonl", [{"prompt": "new?", "completion": "n"}])
    )
    assert "also_held_out" not in other.train.stats and "data.eval_path holds too" not in caplog.text
