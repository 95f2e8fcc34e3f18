"""data.eval_path and data.path sharing prompts (sft, dpo): the training examples whose prompt the held-out file
holds too are counted (`stats["also_held_out"]`) and logged (the held-out metrics then measure trained prompts;
nothing said so). They are kept: evaluating on (a copy of) the training rows is a use of its own. Real JSONL files
read by `load_rows` with roll's tiny tokenizer."""

from __future__ import annotations

import logging
import re

import pytest

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


# ---- prompts equal but for whitespace ("Q?" and "Q?\n"), as the RL tasks' held-out split sees them ---------------
CHATML = family_tokenizer("chatml")  # its <|im_start|> / <|im_end|> are added tokens: whitespace meets them


def _question(tok, item) -> str:
    """The problem a row's prompt asks ("question 7"), whatever whitespace its text had."""
    return re.search(r"question \d+", tok.decode(item.prompt_ids)).group()


def test_loose_prompt_keys_equal_prompts_but_for_whitespace_only() -> None:
    from roll_core.posttrain.tokenize import loose_prompt_keys

    def ids(tok, text: str) -> list[int]:
        return tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )

    for tok in (TOK, CHATML):
        same = loose_prompt_keys(tok, [ids(tok, t) for t in ("Q?", "Q?\n", "Q? \n  ")])
        assert len(set(same)) == 1
        other = loose_prompt_keys(tok, [ids(tok, t) for t in ("Q?", "Q ?", "q?", "Q? A", "Q?A")])
        assert len(set(other)) == 5  # whitespace inside a word, or none, is another prompt
    # ChatML's header ends with a newline: leading whitespace meets it (the tiny template's text markers do not)
    assert len(set(loose_prompt_keys(CHATML, [ids(CHATML, "  Q?"), ids(CHATML, "\nQ?")]))) == 1
    # a system message is part of the prompt: another one is another prompt
    sys = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}]
    with_sys = CHATML.apply_chat_template(sys, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(set(loose_prompt_keys(CHATML, [with_sys, ids(CHATML, "Q?")]))) == 2


@pytest.mark.parametrize("tok", [TOK, CHATML], ids=["tiny", "chatml"])
def test_held_out_prompts_but_for_whitespace_are_counted_as_shared(tmp_path, tok) -> None:
    """ "Q?\\n" in data.path and "Q?" in data.eval_path are one prompt: counted in also_held_out (it was 0: their ids
    differ), for SFT rows and for preference pairs."""
    train = [{"prompt": f"question {i}?" + ("\n" if i < 2 else ""), "completion": f"a {i}"} for i in range(6)]
    held = [{"prompt": "question 0?", "completion": "x"}, {"prompt": "question 1? ", "completion": "y"}]
    data = load(
        "sft", tok, path=write_jsonl(tmp_path / "t.jsonl", train), eval_path=write_jsonl(tmp_path / "e.jsonl", held)
    )
    assert data.train.stats["also_held_out"] == 2 and len(data.train) == 6  # counted, kept
    pairs = [{"prompt": f"q{i}?\n", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(4)]
    p_ev = write_jsonl(tmp_path / "pe.jsonl", [{**pairs[0], "prompt": "q0?"}])
    assert (
        load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", pairs), eval_path=p_ev).train.stats[
            "also_held_out"
        ]
        == 1
    )


def test_an_eval_size_split_keeps_prompts_equal_but_for_whitespace_on_one_side(tmp_path, caplog) -> None:
    """Each of 30 prompts also as its whitespace twin ("Q?\\n", "Q?  "): by the exact ids' hash a twin fell on the
    other side of the data.eval_size split (a held-out problem trained on); now every twin is held out with it."""
    rows = []
    for i in range(30):
        rows += [
            {"prompt": f"question {i}?", "completion": "a"},
            {"prompt": f"question {i}?" + "\n  "[i % 2 :], "completion": "b"},
        ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="roll_core.posttrain.rows"):
        data = load("sft", CHATML, path=path, eval_size=8)
    assert data.eval is not None
    train = {_question(CHATML, x) for x in data.train.items}
    held = {_question(CHATML, x) for x in data.eval.items}
    assert held and not train & held
    assert len(data.train) + len(data.eval) == 60 and len(data.eval) % 2 == 0  # every prompt with its twin
    assert "repeat a held-out row's prompt but for whitespace: held out with it" in caplog.text
    assert data.also_held_out == 0


def test_prompts_without_whitespace_twins_keep_their_side(tmp_path) -> None:
    """The exact ids' hash still decides a side: a split without twins is the split it was (a resumed run keeps its
    rows), and beside twins every prompt that has none stays where the exact split put it."""
    from roll_core.posttrain.rows import held_out
    from roll_core.posttrain.tokenize import loose_prompt_keys

    rows = [{"prompt": f"question {i}?", "completion": "a"} for i in range(40)]
    rows += [{"prompt": f"question {i}?\n", "completion": "b"} for i in range(5)]  # twins of the first five
    items = load("sft", CHATML, path=write_jsonl(tmp_path / "t.jsonl", rows)).train.items
    keys = [x.key for x in items]
    loose = loose_prompt_keys(CHATML, [x.prompt_ids for x in items])
    exact_train, exact_held = held_out(items, keys, 10, "data.path")
    train, held = held_out(items, keys, 10, "data.path", loose)
    twins = {loose[i] for i in range(len(items)) if loose.count(loose[i]) > 1}
    alone = [x for x, k in zip(items, loose, strict=True) if k not in twins]
    assert [x for x in train if x in alone] == [x for x in exact_train if x in alone]
    assert [x for x in held if x in alone] == [x for x in exact_held if x in alone]
    # no twins at all: the very split of the exact keys
    assert held_out(items[:40], keys[:40], 10, "d", loose[:40]) == held_out(items[:40], keys[:40], 10, "d")
