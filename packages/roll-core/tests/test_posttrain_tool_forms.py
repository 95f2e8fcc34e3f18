"""Post-training rows in the forms datasets give them (roll_core.posttrain): flat tool schemas (LLaMA-Factory's
`{"name", "description", "parameters"}`) rendered as OpenAI's `{"type": "function", "function": {...}}`, the form
transformers' `get_json_schema` hands `apply_chat_template` and templates read; a template that shows tools only in
some conversations, beside a user message naming the tool; the tool-support probe after the tokenizer's template
changes; ShareGPT preference conversations beside a prompt column; preference responses that differ only in
whitespace or a trailing end-of-turn. Character-level family tokenizers (roll_core.testing.chat_templates), real
JSONL files."""

from __future__ import annotations

import json

import pytest
import torch

from roll_core.errors import ConfigError
from roll_core.posttrain.row_values import check_tools
from roll_core.posttrain.tokenize import ChatEncoder
from roll_core.testing.chat_templates import CHATML, QWEN25, family_tokenizer
from roll_core.testing.posttrain_rows import load, masked_segments, write_jsonl

PARAMS = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}
FLAT = {"name": "add", "description": "Add two numbers", "parameters": PARAMS}
OPENAI = {"type": "function", "function": FLAT}


def _tool_row(tools: object, question: str = "2+2?") -> dict:
    return {
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "It is 4."}],
        "tools": tools,
    }


def _prompt(tok, row: dict, tmp_path, name: str) -> str:
    src = load("sft", tok, path=write_jsonl(tmp_path / f"{name}.jsonl", [row]), max_prompt=2000).train
    assert src.skipped == {} and len(src) == 1
    return tok.decode(src.batch([0])["prompts"][0])


# ---- flat tool schemas -------------------------------------------------------------------------------------------
def test_flat_tool_schemas_are_rendered_in_openais_form(tmp_path):
    """LLaMA-Factory's flat schema was passed to the template as it was: Qwen2.5's template (`tool | tojson`) showed
    `{"name": "add", ...}` where the model was trained on `{"type": "function", "function": {...}}`, and a
    template reading `tool.function.name` (Hermes', Mistral's) failed on it (a template_error skip). Now the flat
    row renders exactly as the OpenAI-form row does, name and parameters in the prompt."""
    assert check_tools(json.dumps([FLAT])) == [OPENAI]
    assert check_tools([OPENAI]) == [OPENAI]
    tok = family_tokenizer("qwen2.5")
    prompt = _prompt(tok, _tool_row(json.dumps([FLAT])), tmp_path, "flat")
    assert prompt == _prompt(tok, _tool_row([OPENAI]), tmp_path, "openai")
    shown = '{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": '
    assert "<tools>\n" + shown + json.dumps(PARAMS) + "}}\n</tools>" in prompt

    # Hermes / Mistral style: the template reads the nested function's fields
    nested = QWEN25.replace(
        "{{- '\\n' + (tool | tojson) -}}",
        "{{- '\\n' + tool.function.name + ': ' + tool.function.description + ' ' + "
        "(tool.function.parameters | tojson) -}}",
    )
    assert nested != QWEN25
    tok.chat_template = nested
    prompt = _prompt(tok, _tool_row([FLAT]), tmp_path, "nested")
    assert "<tools>\nadd: Add two numbers " + json.dumps(PARAMS) + "\n</tools>" in prompt


def test_a_tool_schema_naming_no_function_is_a_counted_skip(tmp_path):
    tok = family_tokenizer("qwen2.5")
    rows = [_tool_row([FLAT]), _tool_row([{"description": "nameless", "parameters": PARAMS}])]
    rows.append(_tool_row([{"type": "function", "function": {"description": "nameless"}}]))
    src = load("sft", tok, path=write_jsonl(tmp_path / "t.jsonl", rows), max_prompt=2000).train
    assert len(src) == 1 and src.skipped == {"wrong_type": 2}
    with pytest.raises(ConfigError, match=r"wrong_type: a tool schema names no function"):
        load("sft", tok, path=write_jsonl(tmp_path / "n.jsonl", rows[1:2]), max_prompt=2000)


# ---- tools shown only in some conversations ------------------------------------------------------------------------
def test_a_user_message_naming_the_tool_does_not_pass_for_its_rendering(tmp_path):
    """A template that shows tools only without a system message (here: a given system prompt replaces the tools
    block). The probe says it renders tools; the row's prompt spelt the tool's name only because the user asked
    to "use add", and the row trained without its tools. Now the name must be in what the tools add."""
    tok = family_tokenizer("qwen2.5")
    tok.chat_template = QWEN25.replace("{%- if tools -%}", "{%- if tools and messages[0].role != 'system' -%}", 1)
    assert tok.chat_template != QWEN25
    system = {"role": "system", "content": "Be brief."}

    def row(question: str, with_system: bool) -> dict:
        r = _tool_row([FLAT], question)
        if with_system:
            r["messages"].insert(0, system)
        return r

    rows = [row("2+2?", False), row("use add: 2+2?", False), row("2+2?", True), row("use add: 2+2?", True)]
    src = load("sft", tok, path=write_jsonl(tmp_path / "t.jsonl", rows), max_prompt=2000).train
    assert len(src) == 2 and src.skipped == {"template_drops_tools": 2}
    prompts = [tok.decode(src.batch([i])["prompts"][0]) for i in range(2)]
    assert all('"name": "add"' in p and "<tools>" in p for p in prompts)
    assert "use add: 2+2?" in prompts[1]


def test_the_probe_follows_a_template_set_after_the_encoder(tmp_path):
    """The probe results were looked up once, when the encoder was made: a template set on the tokenizer afterwards
    kept the old template's answers. They are looked up by the template the tokenizer has now."""
    tok = family_tokenizer("qwen2.5")
    enc = ChatEncoder(tok)
    assert enc.renders("tools") is True and enc.renders("tool_calls") is True
    tok.chat_template = CHATML
    assert enc.renders("tools") is False and enc.renders("tool_calls") is False
    tok.chat_template = QWEN25
    assert enc.renders("tools") is True
    # and a template that tojsons text arguments, set after: parsed (its probe said no for the first template)
    tojson = QWEN25.replace("{%- if tool_call.arguments is string -%}", "{%- if false -%}")
    assert tojson != QWEN25 and enc.tojsons_arguments() is False
    tok.chat_template = tojson
    assert enc.tojsons_arguments() is True


# ---- preference rows ----------------------------------------------------------------------------------------------
def _sharegpt(*turns: tuple[str, str]) -> list[dict]:
    return [{"from": who, "value": text} for who, text in turns]


def test_sharegpt_preference_conversations_beside_a_prompt(tmp_path):
    """chosen / rejected as ShareGPT conversations holding the prompt: beside a text prompt they were a
    prompt_not_in_conversation skip (their messages had no role nor content to look in), beside a message-list
    prompt the prompt was rendered a second time before them. They train what the chat-form row trains."""
    tok = family_tokenizer("chatml")
    user = {"role": "user", "content": "2+2?"}
    reference = {
        "chosen": [user, {"role": "assistant", "content": "4"}],
        "rejected": [user, {"role": "assistant", "content": "5"}],
    }
    chosen, rejected = _sharegpt(("human", "2+2?"), ("gpt", "4")), _sharegpt(("human", "2+2?"), ("gpt", "5"))
    rows = [
        reference,
        {"prompt": "2+2?", "chosen": chosen, "rejected": rejected},
        {"prompt": [user], "chosen": chosen, "rejected": rejected},
        {"prompt": _sharegpt(("human", "2+2?")), "chosen": chosen, "rejected": rejected},
    ]
    src = load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", rows)).train
    assert src.skipped == {} and len(src) == 4
    b = src.batch([0, 1, 2, 3])  # each row's chosen, then its rejected
    want = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    want += "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    for i in range(8):
        assert tok.decode(b["prompts"][i]).replace("<pad>", "") == want
        assert torch.equal(b["responses"][i], b["responses"][i % 2])
        assert torch.equal(b["response_mask"][i], b["response_mask"][i % 2])
    assert masked_segments(tok, b["responses"][0], b["response_mask"][0]) == ["4<|im_end|>"]
    assert masked_segments(tok, b["responses"][1], b["response_mask"][1]) == ["5<|im_end|>"]


def test_responses_that_differ_only_in_whitespace_are_the_same_response(tmp_path):
    """chosen "It is 4." and rejected "It is  4.\\n" made a pair with next to no preference signal; rollout
    samples differing only in a trailing end-of-turn did too. A same_response skip as identical answers are (the
    whitespace rule of roll_core.near_duplicates), and no pair from such rollout samples."""
    tok = family_tokenizer("chatml")

    def pair(chosen: str, rejected: str) -> dict:
        return {"prompt": "2+2?", "chosen": chosen, "rejected": rejected}

    rows = [pair("It is 4.", "It is 5."), pair("It is 4.", "It is  4.\n"), pair("It is 4.", " It is 4.")]
    src = load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", rows)).train
    assert len(src) == 1 and src.skipped == {"same_response": 2}
    with pytest.raises(ConfigError, match=r"same_response: .*the same answer but for whitespace"):
        load("preference", tok, path=write_jsonl(tmp_path / "w.jsonl", rows[1:2]))
    with pytest.raises(ConfigError, match=r"same_response: .*\(the same answer\)"):
        load("preference", tok, path=write_jsonl(tmp_path / "s.jsonl", [pair("It is 4.", "It is 4.")]))

    end = tok.convert_tokens_to_ids("<|im_end|>")
    text = tok("It is 4.", add_special_tokens=False)["input_ids"]
    other = tok("It is 5.", add_special_tokens=False)["input_ids"]
    space = tok(" ", add_special_tokens=False)["input_ids"]

    def sample(group: int, response: list[int], correct: bool) -> dict:
        return {"prompt_ids": [5, 6, 7 + group], "response_ids": response, "correct": correct, "uid": group}

    rollout = [
        sample(0, [*text, end], True),
        sample(0, text, False),  # the same answer, not ended: no pair
        sample(1, [*text, end], True),
        sample(1, [*text, *space, end], False),  # the same answer and a space: no pair
        sample(2, [*text, end], True),
        sample(2, [*other, end], False),  # a pair
    ]
    src = load("preference", tok, path=write_jsonl(tmp_path / "r.jsonl", rollout), group_key="uid").train
    assert len(src) == 1 and src.stats["prompts_without_pair"] == 2
    assert masked_segments(tok, src.batch([0])["responses"][1], src.batch([0])["response_mask"][1]) == [
        "It is 5.<|im_end|>"
    ]
