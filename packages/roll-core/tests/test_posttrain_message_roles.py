"""Message roles of post-training rows (roll_core.posttrain.row_values' role rule) and raw-text completions that only
reason (roll_core.posttrain.tokenize).

A role one of `KNOWN_ROLES` but for case or a small misspelling ("assitant", "Assistant", "usr") rendered under a header
of its own as untrained context: the row's turns of that role were never trained, and nothing said so (another data
set's name for one, "gpt" or "model", is read as the role it names: test_posttrain_role_aliases.py). It is an
`unknown_role` skip naming the role meant, for every row kind whose messages go through `check_messages` (SFT,
distillation, preference prompts and answers). Any other role is kept as context, counted per role
(`RowSource.other_roles`) and warned about once per role. Real tokenizers of the chat-template families
(character-level), real JSONL files."""

from __future__ import annotations

import logging

import pytest

from roll_core.posttrain.row_values import KNOWN_ROLES, role_rule
from roll_core.testing.chat_templates import family_tokenizer
from roll_core.testing.posttrain_rows import load, masked_segments, write_jsonl

SOURCE_LOG = "roll_core.posttrain.source"


def msg(role: str, text: str) -> dict:
    return {"role": role, "content": text}


def trained_text(tok, source, i: int) -> list[str]:
    batch = source.batch([i])
    return masked_segments(tok, batch["responses"][0], batch["response_mask"][0])


def conversation(second_role: str) -> list[dict]:
    return [msg("user", "q1"), msg("assistant", "a1"), msg("user", "q2"), msg(second_role, "a2")]


@pytest.mark.parametrize(
    ("role", "meant"),
    [
        ("assitant", "assistant"),
        ("Assistant", "assistant"),
        ("asistant", "assistant"),
        ("assistnat", "assistant"),  # two letters swapped
        ("ASSISTANT ", "assistant"),
        ("gpt", "assistant"),
        ("model", "assistant"),
        ("usr", "user"),
        ("sytem", "system"),
        ("Tool", "tool"),
        ("Developer", "developer"),
    ],
)
def test_role_rule_names_the_role_meant(role, meant):
    assert role_rule(role) == meant


@pytest.mark.parametrize("role", [*KNOWN_ROLES, "critic", "narrator", "environment", "toy", "bot"])
def test_role_rule_keeps_known_roles_and_unlike_ones(role):
    assert role_rule(role) is None


@pytest.mark.parametrize("family", ["chatml", "llama3", "phi3"])
@pytest.mark.parametrize("role", ["assitant", "Assistant", "usr"])
def test_a_misspelt_role_is_an_unknown_role_skip_naming_the_role_meant(tmp_path, caplog, family, role):
    """The row's second assistant turn was rendered as a turn of its own, untrained (a1 alone was trained)."""
    tok = family_tokenizer(family)
    rows = [{"messages": conversation(role)}, {"messages": conversation("assistant")}]
    with caplog.at_level(logging.WARNING, logger="roll_core.posttrain"):
        data = load("sft", tok, path=write_jsonl(tmp_path / "rows.jsonl", rows), max_prompt=2000)
    assert data.train.skipped == {"unknown_role": 1}
    assert len(data.train) == 1
    assert [s.startswith(("a1", "a2")) for s in trained_text(tok, data.train, 0)] == [True, True]
    meant = "user" if role == "usr" else "assistant"
    assert f"'messages'[3] has role {role!r}: {meant!r} meant?" in caplog.text


def test_every_row_kind_with_messages_applies_the_rule(tmp_path):
    tok = family_tokenizer("chatml")
    pc = [
        {"prompt": [msg("usr", "q")], "completion": [msg("assistant", "a")]},
        {"prompt": "q", "completion": [msg("Assistant", "a")]},
        {"prompt": "q", "completion": [msg("assistant", "a")]},
    ]
    assert load("sft", tok, path=write_jsonl(tmp_path / "pc.jsonl", pc)).train.skipped == {"unknown_role": 2}
    pairs = [
        {"prompt": [msg("sytem", "s"), msg("user", "q")], "chosen": "yes", "rejected": "no"},
        {"chosen": [msg("user", "q"), msg("asistant", "yes")], "rejected": [msg("user", "q"), msg("assistant", "no")]},
        {"prompt": [msg("user", "q")], "chosen": "yes", "rejected": "no"},
    ]
    pref = load("preference", tok, path=write_jsonl(tmp_path / "pairs.jsonl", pairs)).train
    assert pref.skipped == {"unknown_role": 2} and len(pref) == 1
    # distillation: "4<|im_end|>" is two response tokens, one top-k list each
    teacher = {"teacher_topk_ids": [[3, 4], [5, 6]], "teacher_topk_logprobs": [[-0.1, -3.0], [-0.2, -3.0]]}
    distill = [
        {"messages": [msg("user", "hi"), msg("assistant", "4")], **teacher},
        {"messages": [msg("user", "hi"), msg("assitant", "4")], **teacher},
    ]
    src = load("distill", tok, path=write_jsonl(tmp_path / "d.jsonl", distill)).train
    assert src.skipped == {"unknown_role": 1} and len(src) == 1


def test_other_roles_are_context_counted_per_example_and_warned_once_per_role(tmp_path, caplog):
    tok = family_tokenizer("chatml")
    critic = [msg("user", "q"), msg("critic", "be brief"), msg("assistant", "a")]
    tools = [msg("user", "q"), msg("ipython", "42"), msg("developer", "d"), msg("assistant", "a")]
    rows = [
        {"messages": critic},
        {"messages": [msg("narrator", "n"), *critic, msg("user", "q2"), msg("assistant", "b")]},
        {"messages": tools},  # known roles: not counted
        {"messages": [msg("user", "q"), msg("assistant", "a")]},
    ]
    with caplog.at_level(logging.WARNING, logger=SOURCE_LOG):
        data = load("sft", tok, path=write_jsonl(tmp_path / "rows.jsonl", rows), max_prompt=2000)
    assert not data.train.skipped and len(data.train) == 4
    assert data.train.other_roles == {"critic": 2, "narrator": 1}
    assert trained_text(tok, data.train, 1) == ["a<|im_end|>", "b<|im_end|>"]  # the critic's turns are context
    warned = [r.getMessage() for r in caplog.records if r.name == SOURCE_LOG]
    assert len(warned) == 2
    assert "2 of 4 examples have turns of role 'critic'" in warned[0]
    assert "1 of 4 examples have turns of role 'narrator'" in warned[1]
    # a pair counts once, its prompt rendered on both sides; a held-out split counts each side's own
    pairs = [{"prompt": [msg("critic", "c"), msg("user", "q")], "chosen": "yes", "rejected": "no"}]
    assert load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", pairs)).train.other_roles == {"critic": 1}
    split = load("sft", tok, path=write_jsonl(tmp_path / "rows.jsonl", rows), max_prompt=2000, eval_size=2)
    assert split.train.other_roles.get("critic", 0) + split.eval.other_roles.get("critic", 0) == 2


@pytest.mark.parametrize("completion", ["<think>r</think>", "<think>r</think>\n", "<think>r</think><|im_end|>"])
def test_a_raw_text_completion_that_only_reasons_is_an_empty_skip(tmp_path, completion):
    """data.chat_template=false trained it as it was (the templated path skips such a turn)."""
    tok = family_tokenizer("chatml")
    rows = [{"prompt": "2+2?", "completion": completion}, {"prompt": "3+3?", "completion": "<think>r</think>6"}]
    data = load("sft", tok, path=write_jsonl(tmp_path / "rows.jsonl", rows), chat_template=False)
    assert data.train.skipped == {"empty": 1}
    assert trained_text(tok, data.train, 0) == ["<think>r</think>6<|im_end|>"]
    # preference rows keep such a rejected answer (a lesson to unlearn)
    pair = [{"prompt": "2+2?", "chosen": "4", "rejected": completion}]
    pref = load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", pair), chat_template=False).train
    assert len(pref) == 1 and not pref.skipped
