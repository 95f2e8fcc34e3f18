"""Post-training rows (roll_core.posttrain): rows to batches for SFT, preference pairs and offline distillation: the
chat, prompt/completion and token row forms, what each template trains (masks), pairs built from rollout rows,
teacher top-k rows. Files, formats, filters and held-out splits: test_posttrain_files.py.

Real tokenizers of the chat-template families (roll_core.testing.chat_templates: character-level, so the expected
ids are spelt out by hand), real JSONL files (roll_core.testing.posttrain_rows). Masks are checked by decoding
exactly the tokens under them."""

from __future__ import annotations

import pytest
import torch

from roll_core.errors import ConfigError
from roll_core.posttrain.tokenize import tokenizer_fingerprint
from roll_core.testing.chat_templates import family_tokenizer
from roll_core.testing.posttrain_rows import load, masked_segments, write_jsonl

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


def test_implicit_prompts_that_are_not_one_prompt_are_counted_for_what_they_are(tmp_path):
    """Message lists whose shared first messages end on an assistant turn, or that first differ at a user turn, do
    not answer one prompt: counted under their own reasons (they were prompt_mismatch, blaming the template, or
    template_error), and a file of nothing else says which."""
    tok = TOKS["chatml"]
    user, a = {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}

    def turn(role, content):
        return {"role": role, "content": content}

    good = {"chosen": [user, turn("assistant", "four")], "rejected": [user, turn("assistant", "five")]}
    on_assistant = [
        {  # a shared turn, then different follow-up questions
            "chosen": [user, a, turn("user", "and 3+3?"), turn("assistant", "6")],
            "rejected": [user, a, turn("user", "and 4+4?"), turn("assistant", "8")],
        },
        {"chosen": [user, a, turn("assistant", "sure")], "rejected": [user, a, turn("assistant", "no")]},
    ]
    other_prompt = {
        "chosen": [user, turn("user", "x?"), turn("assistant", "6")],
        "rejected": [user, turn("user", "y?"), turn("assistant", "6")],
    }
    src = load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", [good, *on_assistant, other_prompt])).train
    assert len(src) == 1 and src.skipped == {"prompt_ends_on_assistant": 2, "prompt_not_shared": 1}
    with pytest.raises(ConfigError, match=r"prompt_ends_on_assistant: 'chosen' and 'rejected' share 2 first "
                       r"message\(s\), the last an assistant message, then differ at a 'user' / 'user' message: "
                       r"the implicit prompt .* must end on the non-assistant message"):  # fmt: skip
        load("preference", tok, path=write_jsonl(tmp_path / "a.jsonl", on_assistant[:1]))
    with pytest.raises(ConfigError, match=r"prompt_not_shared: .* then differ at a 'user' / 'user' message, not at "
                       r"the two assistant answers: they answer different prompts"):  # fmt: skip
        load("preference", tok, path=write_jsonl(tmp_path / "b.jsonl", [other_prompt]))


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


def test_a_llama31_builtin_tool_call_turn_ends_with_eom(tmp_path):
    """Llama 3.1's template ends an assistant turn that calls a built-in tool with <|eom_id|> (builtin_tools set),
    where other turns end with <|eot_id|>: such a row was a template_mismatch skip (its turn did not end with the
    usual closing). Trained, the turn ends with <|eom_id|> under mask 1 (what the model samples there), and the
    row's ids are the template's rendering of the conversation, token for token (no second end)."""
    from roll_core.testing.chat_templates import LLAMA3

    tok = family_tokenizer("llama3")
    tok.add_special_tokens({"additional_special_tokens": ["<|eom_id|>", "<|end_of_text|>"]})
    eot = "{{- '<|eot_id|>' -}}"
    at = LLAMA3.rindex(eot)  # the end of each message (Llama 3.1: eom after a tool call in ipython mode)
    tok.chat_template = (
        LLAMA3[:at]
        + "{%- if m.tool_calls and builtin_tools is defined -%}{{- '<|eom_id|>' -}}{%- else -%}"
        + eot
        + "{%- endif -%}"
        + LLAMA3[at + len(eot) :]
    )
    call = {"type": "function", "function": {"name": "brave_search", "arguments": {"query": "2+2"}}}
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "It is 4."},
    ]
    kwargs = {"builtin_tools": ["brave_search"]}
    src = load(
        "sft", tok, path=write_jsonl(tmp_path / "t.jsonl", [{"messages": messages}]), chat_template_kwargs=kwargs
    )
    b = src.train.batch([0])
    assert src.train.skipped == {}
    assert masked_segments(tok, b["responses"][0], b["response_mask"][0]) == [
        '{"name": "brave_search", "parameters": {"query": "2+2"}}<|eom_id|>',
        "It is 4.<|eot_id|>",
    ]
    att = b["attention_mask"][0].bool()
    rendered = tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert b["input_ids"][0][att].tolist() == list(rendered)
    # without builtin_tools the template ends that turn with <|eot_id|>, as before
    plain = load("sft", tok, path=write_jsonl(tmp_path / "p.jsonl", [{"messages": messages}])).train.batch([0])
    assert masked_segments(tok, plain["responses"][0], plain["response_mask"][0])[0].endswith("}}<|eot_id|>")


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}


def test_a_template_without_tool_support_skips_tool_rows_and_says_so(tmp_path):
    """ChatML (SmolLM2's template) renders neither `tools` nor `tool_calls`: a row's tool schemas were left out of
    its prompt, and an assistant turn that calls a tool was trained as its text alone ("Let me add." then the end of
    the turn: the model learned to announce a call and stop), silently; a call-only turn was an `empty` skip."""
    tok = TOKS["chatml"]
    ask = {"role": "user", "content": "2+2?"}
    rows = [
        {"messages": [ask, {"role": "assistant", "content": "4"}], "tools": TOOLS},
        {"messages": [ask, {"role": "assistant", "content": "Let me add.", "tool_calls": [CALL]}]},
        {"messages": [ask, {"role": "assistant", "content": "", "tool_calls": [CALL]}]},
        {"messages": [ask, {"role": "assistant", "content": "4"}]},
    ]
    src = load("sft", tok, path=write_jsonl(tmp_path / "t.jsonl", rows)).train
    assert src.skipped == {"template_drops_tools": 1, "template_drops_tool_calls": 2} and len(src) == 1
    b = src.batch([0])
    assert masked_segments(tok, b["responses"][0], b["response_mask"][0]) == ["4<|im_end|>"]
    pairs = [{"prompt": "2+2?", "chosen": "4", "rejected": "5", "tools": t} for t in (TOOLS, None)]
    assert load("preference", tok, path=write_jsonl(tmp_path / "p.jsonl", pairs)).train.skipped == {
        "template_drops_tools": 1
    }


def test_tools_and_tool_calls_as_json_text_are_read_as_lists(tmp_path):
    """Datasets store `tools` (and OpenAI-style `tool_calls`) as JSON text: such a row was a template_error skip
    (transformers' "Tools should either be a JSON schema ..." naming neither column nor row). Now read as the list
    it spells; text that is not a JSON list, or a call that names no function, is a wrong_type skip."""
    import json

    tok = family_tokenizer("qwen2.5")
    ask = {"role": "user", "content": "2+2?"}

    def row(tools: object, calls: object) -> dict:
        return {"messages": [ask, {"role": "assistant", "content": "", "tool_calls": calls}], "tools": tools}

    rows = [
        row(TOOLS, [CALL]),
        row(json.dumps(TOOLS), json.dumps([CALL])),
        row("not json", [CALL]),
        row({"name": "add"}, [CALL]),
        row(TOOLS, [{"type": "function", "function": {"arguments": {"a": 2}}}]),
    ]
    src = load("sft", tok, path=write_jsonl(tmp_path / "t.jsonl", rows), max_prompt=1000).train
    assert src.skipped == {"wrong_type": 3} and len(src) == 2
    a, b = src.batch([0]), src.batch([1])
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["response_mask"], b["response_mask"])
    assert '"name": "add"' in tok.decode(a["prompts"][0])  # the schema is in the prompt
    assert masked_segments(tok, a["responses"][0], a["response_mask"][0]) == [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>'
    ]


@pytest.mark.parametrize("family", list(END))
def test_a_blank_untrained_turn_is_context_and_the_row_still_trains(tmp_path, family):
    """A blank assistant turn marked `train: false` (or `weight: 0`) after a trained one skipped the whole row as
    `empty` ("renders to no text" under ChatML): it is context, rendered as the template renders it (mask 0), and
    the row's trained turns train. Only a blank turn to train is an `empty` skip."""
    tok, end = TOKS[family], END[family]
    t1, t3 = THINK.get(family, ("", ""))

    def row(say: str = " ", **flag: object) -> dict:
        turns = [("q1", t1 + "A1", {}), ("q2", say, flag), ("q3", t3 + "A3", {})]
        return {"messages": [m for q, a, f in turns for m in ({"role": "user", "content": q},
                                                              {"role": "assistant", "content": a, **f})]}  # fmt: skip

    src = load("sft", tok, path=write_jsonl(tmp_path / "b.jsonl", [row("", train=False), row(weight=0), row()])).train
    assert src.skipped == {"empty": 1} and len(src) == 2
    for i in (0, 1):
        b = src.batch([i])
        assert masked_segments(tok, b["responses"][0], b["response_mask"][0]) == [t1 + "A1" + end, t3 + "A3" + end]
        response = tok.decode(b["responses"][0][b["attention_mask"][0, b["prompts"].shape[1] :].bool()])
        assert "q2" in response and "q3" in response
    if family == "chatml":  # the row's ids are the template's rendering of the conversation, blank turn included
        b = src.batch([0])
        clean = [{k: v for k, v in m.items() if k != "train"} for m in row("", train=False)["messages"]]
        rendered = tok.apply_chat_template(clean, tokenize=False)
        assert "<|im_start|>assistant\n<|im_end|>" in rendered
        assert tok.decode(b["input_ids"][0][b["attention_mask"][0].bool()]) == rendered.removesuffix("\n")


def test_sharegpt_rows_are_read_as_messages(tmp_path):
    """ShareGPT rows (`conversations` of `{"from": "human" | "gpt" | "system", "value"}`) gave no_assistant_turn
    skips (or wrong_type: no 'role') saying nothing of the roles: read as the messages they spell. Roles that are
    not the template's still skip, now naming the roles seen and the ones expected."""
    tok = TOKS["chatml"]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"from": names[m["role"]], "value": m["content"]} for m in messages]
    rows = [{"conversations": sharegpt}, {"messages": sharegpt}, {"messages": messages}]
    src = load("sft", tok, path=write_jsonl(tmp_path / "s.jsonl", rows)).train
    assert src.skipped == {} and len(src) == 3
    b = src.batch([0, 1, 2])
    assert torch.equal(b["input_ids"][0], b["input_ids"][2]) and torch.equal(b["input_ids"][1], b["input_ids"][2])
    assert masked_segments(tok, b["responses"][0], b["response_mask"][0]) == ["4<|im_end|>"]
    odd = [{"messages": [{"role": "human", "content": "2+2?"}, {"role": "gpt", "content": "4"}]}]
    # ShareGPT's names as chat roles: read as the roles they name, counted (row_values' role_alias)
    aliased = load("sft", tok, path=write_jsonl(tmp_path / "odd.jsonl", odd)).train
    assert aliased.renamed_roles == {"gpt->assistant": 1, "human->user": 1}
    plain = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}]
    written = load("sft", tok, path=write_jsonl(tmp_path / "plain.jsonl", plain)).train
    assert torch.equal(aliased.batch([0])["input_ids"], written.batch([0])["input_ids"])


def test_tool_call_arguments_as_json_text_are_not_double_encoded(tmp_path):
    """Qwen2.5's own template writes `arguments | tojson`: arguments given as JSON text (OpenAI's form) rendered as
    a quoted string of escaped JSON, which the model learned to write. Parsed where the template tojsons them (text
    that is not JSON is then a wrong_type skip); a template that writes text as it is gets the text."""
    from roll_core.testing.chat_templates import QWEN25

    passthrough = (
        "{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}"
        "{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}"
    )
    assert passthrough in QWEN25
    real = family_tokenizer("qwen2.5")
    real.chat_template = QWEN25.replace(passthrough, "{{- tool_call.arguments | tojson -}}")
    ask = {"role": "user", "content": "2+2?"}

    def row(arguments: object) -> dict:
        call = {"type": "function", "function": {"name": "add", "arguments": arguments}}
        return {"messages": [ask, {"role": "assistant", "content": "", "tool_calls": [call]}]}

    rows = [row({"a": 2}), row('{"a": 2}'), row("a=2")]
    expected = ['<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>']
    src = load("sft", real, path=write_jsonl(tmp_path / "r.jsonl", rows)).train
    assert src.skipped == {"wrong_type": 1} and len(src) == 2
    for i in (0, 1):
        b = src.batch([i])
        assert masked_segments(real, b["responses"][0], b["response_mask"][0]) == expected
    # a flat call ({"name", "arguments"}) and tool_calls as JSON text too
    flat = {"messages": [ask, {"role": "assistant", "content": "", "tool_calls": '[{"name": "add", "arguments": '
                                                                               '"{\\"a\\": 2}"}]'}]}  # fmt: skip
    b = load("sft", real, path=write_jsonl(tmp_path / "f.jsonl", [flat])).train.batch([0])
    assert masked_segments(real, b["responses"][0], b["response_mask"][0]) == expected
    # the fixture's template writes text arguments as they are: nothing parsed, nothing skipped
    src = load("sft", family_tokenizer("qwen2.5"), path=write_jsonl(tmp_path / "p.jsonl", rows)).train
    assert src.skipped == {} and len(src) == 3
