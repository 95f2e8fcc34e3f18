"""SFT chat rows whose trained assistant turn reasons, then ends without an answer (roll_core.posttrain.tokenize).

A blank trained turn is an `empty` skip: trained, the model would learn to end its turn without answering. A turn
that is only a think block (`<think>\\n\\n</think>\\n\\n`: Qwen3's empty reasoning, the very text its template renders
for a blank turn; or reasoning and nothing after `</think>`) teaches the same, and was trained. Real tokenizers of
the chat-template families (character-level), real JSONL files."""

from __future__ import annotations

import pytest

from roll_core.testing.chat_templates import family_tokenizer
from roll_core.testing.posttrain_rows import load, masked_segments, write_jsonl


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, **extra) -> dict:
    return {"role": "assistant", "content": text, **extra}


ADD = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "d", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("family", ["qwen3", "chatml"])
@pytest.mark.parametrize("content", ["<think>\n\n</think>\n\n", "<think>\nadd them\n</think>", "<think>r</think>  \n"])
def test_a_trained_turn_with_reasoning_and_no_answer_is_an_empty_skip(tmp_path, family, content):
    tok = family_tokenizer(family)
    rows = [{"messages": [user("2+2?"), assistant(content)]}, {"messages": [user("3+3?"), assistant("6")]}]
    data = load("sft", tok, path=write_jsonl(tmp_path / "rows.jsonl", rows))
    assert data.train.skipped == {"empty": 1}
    assert len(data.train) == 1
    batch = data.train.batch([0])
    assert masked_segments(tok, batch["responses"][0], batch["response_mask"][0])[-1].endswith("6<|im_end|>")


def test_reasoning_with_an_answer_or_a_tool_call_is_trained_and_an_untrained_one_is_context(tmp_path):
    tok = family_tokenizer("qwen3")
    rows = [
        {"messages": [user("2+2?"), assistant("<think>\nadd\n</think>\n\n4")]},
        # a call after reasoning is the turn's answer
        {"messages": [user("2+2?"), assistant("<think>\nadd\n</think>", tool_calls=[ADD])], "tools": TOOLS},
        # not trained: context, as the template renders it
        {"messages": [user("a"), assistant("<think>\n\n</think>\n\n", train=False), user("b"), assistant("y")]},
        # the prompt/completion form goes through the same check
        {"messages": [user("2+2?"), assistant("<think>\nadd\n</think>\n\n")]},
    ]
    data = load("sft", tok, path=write_jsonl(tmp_path / "rows.jsonl", rows), max_prompt=2000)
    assert data.train.skipped == {"empty": 1}
    trained = [
        masked_segments(tok, data.train.batch([i])["responses"][0], data.train.batch([i])["response_mask"][0])
        for i in range(len(data.train))
    ]
    assert trained[0] == ["<think>\nadd\n</think>\n\n4<|im_end|>"]
    assert trained[1][0].startswith("<think>\nadd\n</think>\n\n<tool_call>") and trained[1][0].endswith("<|im_end|>")
    assert trained[2] == ["<think>\n\n</think>\n\ny<|im_end|>"]
    pc = [{"prompt": "2+2?", "completion": "<think>\nadd\n</think>"}, {"prompt": "3+3?", "completion": "6"}]
    assert load("sft", tok, path=write_jsonl(tmp_path / "pc.jsonl", pc)).train.skipped == {"empty": 1}


def test_a_preference_row_keeps_a_rejected_answer_that_only_reasons(tmp_path):
    """A rejected response that thinks and stops is a lesson to unlearn: the pair is kept."""
    tok = family_tokenizer("qwen3")
    pair = {"prompt": [user("2+2?")], "chosen": [assistant("4")], "rejected": [assistant("<think>\nadd\n</think>")]}
    src = load("preference", tok, path=write_jsonl(tmp_path / "pairs.jsonl", [pair])).train
    assert len(src) == 1 and not src.skipped


def test_qwen3_trains_every_turn_with_its_reasoning_and_keeps_it_in_later_context(tmp_path):
    """As docs/recipes/post-training.md says: Qwen3's template drops earlier turns' reasoning when it re-renders a
    whole conversation, but each turn is trained as the model generates it, the reasoning kept (no skip)."""
    tok = family_tokenizer("qwen3")
    turns = [user("a"), assistant("<think>r1</think>x"), user("b"), assistant("<think>r2</think>y")]
    data = load("sft", tok, path=write_jsonl(tmp_path / "rows.jsonl", [{"messages": turns}]))
    assert len(data.train) == 1 and not data.train.skipped
    batch = data.train.batch([0])
    first, second = masked_segments(tok, batch["responses"][0], batch["response_mask"][0])
    assert (first, second) == ("<think>\nr1\n</think>\n\nx<|im_end|>", "<think>\nr2\n</think>\n\ny<|im_end|>")
    assert "r1" not in tok.apply_chat_template(turns, tokenize=False)  # what a full re-rendering would show


def test_an_answer_that_spells_the_closing_tag_is_an_answer(tmp_path):
    """The reasoning ends at the first `</think>`: an answer ending in the tag's own text ("It is </think>") is
    trained where the template renders it (ChatML), and a template that drops it (Qwen3 splits at the last tag)
    says so (`template_drops_content`). Read after the last `</think>`, it was an `empty` skip in both. A second
    whole think block after the first, with nothing else, is still no answer."""
    spelled = [user("Which tag closes a reasoning block?"), assistant("<think>The tag.</think>\n\nIt is </think>")]
    rows = [{"messages": spelled}, {"messages": [user("q"), assistant("<think>a</think>\n\n<think>b</think>")]}]
    chatml = family_tokenizer("chatml")
    data = load("sft", chatml, path=write_jsonl(tmp_path / "chatml.jsonl", rows))
    assert data.train.skipped == {"empty": 1} and len(data.train) == 1
    batch = data.train.batch([0])
    trained = masked_segments(chatml, batch["responses"][0], batch["response_mask"][0])
    assert trained == ["<think>The tag.</think>\n\nIt is </think><|im_end|>"]
    qwen3 = family_tokenizer("qwen3")
    path = write_jsonl(tmp_path / "qwen3.jsonl", [*rows, {"messages": [user("q"), assistant("ok")]}])
    assert load("sft", qwen3, path=path).train.skipped == {"template_drops_content": 1, "empty": 1}
