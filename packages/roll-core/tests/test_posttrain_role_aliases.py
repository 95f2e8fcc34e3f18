"""Other data sets' role names in post-training rows (roll_core.posttrain.row_values' `role_alias`).

A `messages` row written with ShareGPT's or Gemma's role names as `role` ("human", "gpt", "model", or "Human",
" GPT " and other case / space variants of exactly those names) was an `unknown_role` skip, though roll reads the
same names from ShareGPT's `from` (`SHAREGPT_ROLES`). They are read as the role they name, so the row tokenises
exactly as the row written with user / assistant does (checked on several template families, every row kind with
messages), counted per rename and example (`RowSource.renamed_roles`, "human->user") and said once per load; a
misspelling ("assitant", "Assistant") stays a skip naming the role meant. Character-level family tokenizers
(roll_core.testing.chat_templates), real JSONL files."""

from __future__ import annotations

import logging

import pytest

from roll_core.posttrain.row_values import chat_messages, role_alias
from roll_core.testing.chat_templates import family_tokenizer
from roll_core.testing.posttrain_rows import load, write_jsonl

SOURCE_LOG = "roll_core.posttrain.source"
STANDARD = {"human": "user", "gpt": "assistant", "model": "assistant"}
TEACHER = {"teacher_topk_ids": [[3, 4], [5, 6]], "teacher_topk_logprobs": [[-0.1, -3.0], [-0.2, -3.0]]}


def msg(role: str, text: str) -> dict:
    return {"role": role, "content": text}


def standard(messages: list[dict]) -> list[dict]:
    """`messages` with the standard roles written out (what an aliased row must tokenise as)."""
    return [{**m, "role": STANDARD.get(m["role"].strip().casefold(), m["role"])} for m in messages]


def tensors(source) -> list[dict]:
    """Each example's batch tensors as lists (every example of `source`, in order)."""
    out = []
    for i in range(len(source)):
        batch = source.batch([i])
        out.append({k: batch[k].tolist() for k in ("prompts", "responses", "response_mask", "input_ids")})
    return out


@pytest.mark.parametrize(
    ("role", "meant"),
    [("human", "user"), ("Human", "user"), (" HUMAN ", "user"), ("gpt", "assistant"), ("GPT", "assistant"),
     ("model", "assistant"), ("Model ", "assistant")],
)  # fmt: skip
def test_an_alias_names_its_standard_role(role, meant):
    assert role_alias(role) == meant


@pytest.mark.parametrize("role", ["user", "assistant", "Assistant", "assitant", "humans", "gtp", "critic", "models"])
def test_a_known_role_a_misspelling_or_another_name_is_no_alias(role):
    assert role_alias(role) is None


@pytest.mark.parametrize("family", ["chatml", "llama3", "phi3"])
def test_a_row_with_aliased_roles_tokenises_as_the_row_with_standard_roles(tmp_path, caplog, family):
    """Each aliased row was an unknown_role skip; now its ids and mask equal the standard row's, token for token."""
    tok = family_tokenizer(family)
    rows = [
        [msg("human", "q1"), msg("gpt", "a1"), msg("Human", "q2"), msg(" GPT ", "a2")],
        [msg("system", "s"), msg("user", "q"), msg("model", "a")],
        [msg("human", "q"), msg("assistant", "a")],
        [msg("user", "q"), msg("assistant", "plain")],
    ]
    with caplog.at_level(logging.INFO, logger=SOURCE_LOG):
        aliased = load("sft", tok, path=write_jsonl(tmp_path / "a.jsonl", [{"messages": r} for r in rows]))
    written = load("sft", tok, path=write_jsonl(tmp_path / "s.jsonl", [{"messages": standard(r)} for r in rows]))
    assert aliased.train.skipped == {} and len(aliased.train) == len(rows)
    assert tensors(aliased.train) == tensors(written.train)
    assert aliased.train.renamed_roles == {"gpt->assistant": 1, "human->user": 2, "model->assistant": 1}
    assert aliased.train.other_roles == {} and written.train.renamed_roles == {}
    said = [r.getMessage() for r in caplog.records if r.name == SOURCE_LOG and "another data set" in r.getMessage()]
    assert said == [
        "data.path: read roles named by another data set as the standard ones (examples): gpt->assistant (1), "
        "human->user (2), model->assistant (1)"
    ]


def test_gemma_renders_model_and_assistant_alike(tmp_path):
    """Gemma's template names the assistant `model`: a row in its own words trains as the standard row."""
    tok = family_tokenizer("gemma3")
    rows = [[msg("user", "q1"), msg("model", "a1"), msg("user", "q2"), msg("Model", "a2")]]
    aliased = load("sft", tok, path=write_jsonl(tmp_path / "a.jsonl", [{"messages": r} for r in rows]))
    written = load("sft", tok, path=write_jsonl(tmp_path / "s.jsonl", [{"messages": standard(r)} for r in rows]))
    assert aliased.train.skipped == {}
    assert tensors(aliased.train) == tensors(written.train)
    assert sum(sum(m) for m in tensors(aliased.train)[0]["response_mask"]) > 0
    assert aliased.train.renamed_roles == {"model->assistant": 1}


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_every_row_kind_with_messages_reads_aliases(tmp_path, family):
    """prompt/completion, preference (explicit and implicit prompts) and distillation rows alike; a pair counts as
    one example."""
    tok = family_tokenizer(family)
    pc = [
        {"prompt": [msg("Human", "q")], "completion": [msg("gpt", "a")]},
        {"prompt": "q2", "completion": [msg("model", "b")]},
    ]
    pairs = [
        {"prompt": [msg("human", "q")], "chosen": "yes", "rejected": "no"},
        {"chosen": [msg("human", "q"), msg("gpt", "yes")], "rejected": [msg("human", "q"), msg("gpt", "no")]},
        {"prompt": "q3", "chosen": [msg("human", "q3"), msg("gpt", "yes")], "rejected": [msg("user", "q3"),
         msg("assistant", "no")]},
    ]  # fmt: skip
    distill = [{"messages": [msg("human", "hi"), msg("gpt", "4")], **TEACHER}]

    def both(kind: str, rows: list[dict], name: str):
        def written(row: dict) -> dict:
            return {k: standard(v) if isinstance(v, list) and k in ("prompt", "completion", "chosen", "rejected",
                    "messages") else v for k, v in row.items()}  # fmt: skip

        a = load(kind, tok, path=write_jsonl(tmp_path / f"{name}.jsonl", rows)).train
        s = load(kind, tok, path=write_jsonl(tmp_path / f"{name}-s.jsonl", [written(r) for r in rows])).train
        assert a.skipped == {} and len(a) == len(rows)
        assert tensors(a) == tensors(s)
        return a.renamed_roles

    assert both("sft", pc, "pc") == {"gpt->assistant": 1, "human->user": 1, "model->assistant": 1}
    assert both("preference", pairs, "pairs") == {"gpt->assistant": 2, "human->user": 3}
    assert both("distill", distill, "d") == {"gpt->assistant": 1, "human->user": 1}


def test_the_pair_checks_compare_aliased_roles_as_the_standard_ones():
    """`chat_messages` (what the preference checks compare before tokenising) reads an alias as its role."""
    got = chat_messages([msg(" Human", "q"), {"from": "gpt", "value": "a"}, msg("critic", "c")], "chosen")
    assert got == [msg("user", "q"), msg("assistant", "a"), msg("critic", "c")]


@pytest.mark.parametrize("role", ["assitant", "Assistant", "usr"])
def test_a_misspelling_is_still_an_unknown_role_skip(tmp_path, role):
    tok = family_tokenizer("chatml")
    rows = [{"messages": [msg("user", "q"), msg(role, "a")]}, {"messages": [msg("human", "q"), msg("gpt", "a")]}]
    data = load("sft", tok, path=write_jsonl(tmp_path / "rows.jsonl", rows))
    assert data.train.skipped == {"unknown_role": 1} and len(data.train) == 1
    assert data.train.renamed_roles == {"gpt->assistant": 1, "human->user": 1}
