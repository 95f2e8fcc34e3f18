"""Post-training row values (roll_core.posttrain.row_values) and the template probes of roll_core.posttrain.tokenize:
LLaMA-Factory's ShareGPT rows (function_call / observation turns, system and tools columns), text a tokenizer cannot
encode, the tool-support probe run once per template, and preference rows whose sides disagree on their form or
their prompt. Character-level family tokenizers (roll_core.testing.chat_templates), real JSONL files."""

from __future__ import annotations

import json

import pytest
import torch

from roll_core.errors import ConfigError
from roll_core.testing.chat_templates import CHATML, family_tokenizer
from roll_core.testing.posttrain_rows import load, masked_segments, write_jsonl

ADD = {"name": "add", "description": "Add two numbers", "parameters": {"type": "object", "properties": {}}}


# ---- LLaMA-Factory's ShareGPT ------------------------------------------------------------------------------------
def _factory_row(**extra: object) -> dict:
    """A row of LLaMA-Factory's `sharegpt` format with a tool call: tools and system as columns."""
    return {
        "conversations": [
            {"from": "human", "value": "2+2?"},
            {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2, "b": 2}})},
            {"from": "observation", "value": "4"},
            {"from": "gpt", "value": "It is 4."},
        ],
        "system": "Be brief.",
        "tools": json.dumps([ADD]),
        **extra,
    }


def test_llama_factory_sharegpt_function_call_and_observation_turns(tmp_path):
    """`function_call` is the assistant's tool call (JSON name/arguments) and `observation` the tool's result; the
    `system` column is the system prompt. The role names were kept as they were (a template rendered a
    `function_call` turn, or refused it as a template_error) and the system column was dropped. The row now trains
    exactly what the same conversation in OpenAI's form trains."""
    tok = family_tokenizer("qwen2.5")
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
    openai = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "It is 4."},
        ],
        "tools": [ADD],
    }
    src = load("sft", tok, path=write_jsonl(tmp_path / "f.jsonl", [_factory_row(), openai]), max_prompt=1000).train
    assert src.skipped == {} and len(src) == 2
    b = src.batch([0, 1])
    assert torch.equal(b["input_ids"][0], b["input_ids"][1])
    assert torch.equal(b["response_mask"][0], b["response_mask"][1])
    assert masked_segments(tok, b["responses"][0], b["response_mask"][0]) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call><|im_end|>',
        "It is 4.<|im_end|>",
    ]
    prompt = tok.decode(b["prompts"][0])
    assert prompt.startswith("<|im_start|>system\nBe brief.") and '"name": "add"' in prompt
    response = tok.decode(b["responses"][0][b["attention_mask"][0, b["prompts"].shape[1] :].bool()])
    assert "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>" in response  # the tool's result


def test_sharegpt_turns_that_cannot_be_read_are_counted_skips_naming_the_role(tmp_path):
    """An unknown `from` (old ShareGPT dumps' "bing") is an unknown_role skip naming it (it was kept as a role); a
    function_call that is not a call's JSON, or a system column beside a different system turn, is wrong_type; a
    template without tool support skips the function_call turn (never trains it as an empty answer)."""
    tok = family_tokenizer("qwen2.5")
    bing = {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "bing", "value": "4"}]}
    not_json = _factory_row()
    not_json["conversations"][1] = {"from": "function_call", "value": "add(2, 2)"}
    two_systems = _factory_row()
    two_systems["conversations"] = [{"from": "system", "value": "Be long."}, *two_systems["conversations"]]
    rows = [_factory_row(), bing, not_json, two_systems]
    src = load("sft", tok, path=write_jsonl(tmp_path / "s.jsonl", rows), max_prompt=1000).train
    assert len(src) == 1 and src.skipped == {"unknown_role": 1, "wrong_type": 2}
    with pytest.raises(ConfigError, match=r"unknown_role: 'conversations'\[1\] is from 'bing'"):
        load("sft", tok, path=write_jsonl(tmp_path / "b.jsonl", [bing]))
    chatml = family_tokenizer("chatml")
    with pytest.raises(ConfigError, match=r"template_drops_tools: "):
        load("sft", chatml, path=write_jsonl(tmp_path / "c.jsonl", [_factory_row(system=None)]), max_prompt=1000)
    no_tools = _factory_row(system=None, tools=None)
    with pytest.raises(ConfigError, match=r"template_drops_tool_calls: .*call of \['add'\]"):
        load("sft", chatml, path=write_jsonl(tmp_path / "n.jsonl", [no_tools]), max_prompt=1000)


# ---- text a tokenizer cannot encode -------------------------------------------------------------------------------
def test_a_lone_surrogate_is_a_counted_bad_text_skip(tmp_path):
    """JSON's "\\ud83d" without its pair decodes to a lone surrogate the tokenizer refuses: text rows without a
    template crashed the whole load (TypeError: TextEncodeInput must be ...), chat rows were template_error skips
    blaming the template."""
    tok = family_tokenizer("chatml")
    good = {"prompt": "2+2?", "completion": "4"}
    rows = [good, {"prompt": "2+2? \ud83d", "completion": "4"}, {"prompt": "2+2?", "completion": "4 \udc00"}]
    src = load("sft", tok, path=write_jsonl(tmp_path / "t.jsonl", rows), chat_template=False).train
    assert len(src) == 1 and src.skipped == {"bad_text": 2}

    def chat(text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "4"}]}

    src = load("sft", tok, path=write_jsonl(tmp_path / "c.jsonl", [chat("hi"), chat("hi \ud83d")])).train
    assert len(src) == 1 and src.skipped == {"bad_text": 1}


# ---- the tool-support probe ----------------------------------------------------------------------------------------
def _count_renders(tok) -> list[int]:
    calls = [0]
    render = tok.apply_chat_template

    def counted(*args, **kwargs):
        calls[0] += 1
        return render(*args, **kwargs)

    tok.apply_chat_template = counted
    return calls


def test_the_tool_support_probe_renders_once_per_template_not_per_row(tmp_path):
    """Whether a template renders tools and tool calls was tested on every row (its prompt rendered with and without
    the tools, each tool-call turn without its calls): 3 more renders per row. Probed once per tokenizer and
    template, a tool row costs the renders a row of the same shape without tools costs; a new template is probed
    anew (ChatML's drops the tools)."""
    tok = family_tokenizer("qwen2.5")
    calls = _count_renders(tok)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}

    def tool_row(i: int) -> dict:
        return {
            "messages": [
                {"role": "user", "content": f"{i}+2?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "4"},
                {"role": "assistant", "content": "It is 4."},
            ],
            "tools": [ADD],
        }

    def plain_row(i: int) -> dict:
        row = tool_row(i)
        row["messages"][1] = {"role": "assistant", "content": "Let me add."}
        return {"messages": row["messages"]}

    def renders(make, n: int) -> int:
        before = calls[0]
        rows = [make(i) for i in range(n)]
        src = load("sft", tok, path=write_jsonl(tmp_path / f"r{n}.jsonl", rows), max_prompt=1000).train
        assert len(src) == n and src.skipped == {}
        return calls[0] - before

    renders(tool_row, 1)  # the probes run here (and the encoder's own setup)
    per_tool_row = (renders(tool_row, 9) - renders(tool_row, 3)) / 6
    per_plain_row = (renders(plain_row, 9) - renders(plain_row, 3)) / 6
    assert per_tool_row == per_plain_row
    tok.chat_template = CHATML  # another template: probed again, and it renders no tools
    src = load("sft", tok, path=write_jsonl(tmp_path / "c.jsonl", [tool_row(0), plain_row(0)]), max_prompt=1000)
    assert src.train.skipped == {"template_drops_tools": 1} and len(src.train) == 1


# ---- preference rows --------------------------------------------------------------------------------------------
def test_preference_sides_of_mixed_forms_or_prompts(tmp_path):
    """chosen as text and rejected as messages (data.chat_template=false) went one side raw, one through the template:
    a prompt_mismatch skip blaming the template, or for the same answer a pair of equal answers never compared.
    Both go through the template now. A system prompt in one side only was prompt_mismatch / no_prompt, now
    prompt_not_shared naming it; an empty message list is `empty` like blank text; a text prompt that
    conversations with their own prompt messages do not hold is a counted skip (it was dropped silently)."""
    tok = family_tokenizer("chatml")
    sys, user = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}

    def ans(text: str) -> dict:
        return {"role": "assistant", "content": text}

    mixed = {"prompt": "2+2?", "chosen": "4", "rejected": [ans("5")]}
    src = load("preference", tok, path=write_jsonl(tmp_path / "m.jsonl", [mixed]), chat_template=False).train
    assert src.skipped == {} and len(src) == 1
    b = src.batch([0])
    assert torch.equal(b["prompts"][0], b["prompts"][1])
    assert tok.decode(b["prompts"][0]).endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    got = [masked_segments(tok, b["responses"][i], b["response_mask"][i]) for i in (0, 1)]
    assert got == [["4<|im_end|>"], ["5<|im_end|>"]]
    same = {"prompt": "2+2?", "chosen": "4", "rejected": [ans("4")]}
    rows = [
        same,
        {"chosen": [sys, user, ans("4")], "rejected": [user, ans("5")]},  # implicit prompt
        {"prompt": "2+2?", "chosen": [sys, ans("4")], "rejected": "5"},  # explicit prompt
        {"prompt": "2+2?", "chosen": [], "rejected": "5"},
        {"prompt": "2+2?", "chosen": [sys, ans("4")], "rejected": [sys, ans("5")]},  # the prompt text held nowhere
        mixed,
    ]
    src = load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", rows), chat_template=False).train
    assert len(src) == 1
    assert src.skipped == {"same_response": 1, "prompt_not_shared": 2, "empty": 1, "prompt_not_in_conversation": 1}
    for i, (reason, detail) in enumerate(
        [
            ("prompt_not_shared", r"a system prompt only in 'chosen'"),
            ("prompt_not_shared", r"a system prompt only in 'chosen'"),
            ("empty", r"'chosen' is an empty list of messages"),
            ("prompt_not_in_conversation", r"'prompt' is text that 'chosen'.* does not hold"),
        ]
    ):
        with pytest.raises(ConfigError, match=rf"{reason}: {detail}"):
            load("preference", tok, path=write_jsonl(tmp_path / f"{i}.jsonl", [rows[i + 1]]))
