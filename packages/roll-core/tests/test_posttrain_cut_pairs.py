"""Degenerate rows at the length limits: a rollout response its generation cut is a truncated response (counted;
skipped with data.truncate=false), a pair equal up to its last trained token is a `same_response` skip, and
multi-turn preference sides that first differ at a user turn answer different messages (`prompt_not_shared`)."""

from __future__ import annotations

from roll_core.testing.chat_templates import family_tokenizer
from roll_core.testing.posttrain_rows import load, masked_segments, write_jsonl

TOK = family_tokenizer("chatml")
EOS = TOK.convert_tokens_to_ids("<|im_end|>")


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def rollout(pid: int, response: list[int], correct: int, finish: str = "stop", mask: list[int] | None = None) -> dict:
    row = {"prompt_id": pid, "prompt_ids": [5, 6 + pid], "response_ids": response, "correct": correct, "reward": 0.0}
    row["finish_reason"] = finish
    if mask is not None:
        row["response_mask"] = mask
    return row


def test_a_rollout_response_cut_at_its_generation_limit_is_counted_as_truncated(tmp_path):
    """A correct sample cut by the rollout's length limit (no end-of-turn) was trained as a finished answer with
    truncated_rows 0, even with data.truncate=false."""
    rows = [
        rollout(0, [10, 11, 12, 13], 1, finish="length"),
        rollout(0, [10, 11, EOS], 1),
        rollout(0, [14, EOS], 0),
    ]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    src = load("sft", TOK, path=path, max_response=4, min_score=1).train
    assert len(src) == 2 and src.truncated == 1 and [t.truncated for t in src.items] == [True, False]
    strict = load("sft", TOK, path=path, max_response=4, min_score=1, truncate=False).train
    assert [t.response_ids for t in strict.items] == [[10, 11, EOS]]
    assert strict.skipped == {"response_too_long": 1, "below_min_score": 1}
    pairs = load("preference", TOK, path=path, max_response=4, pairs_per_prompt=2).train
    assert len(pairs) == 2 and pairs.truncated == 1  # the cut sample is chosen in one of the two pairs


def test_a_pair_equal_up_to_its_last_trained_token_is_a_same_response_skip(tmp_path):
    """Two samples that train the same tokens after the same context and differ only in the untrained observation
    after them (cut there) made a pair: equal policy and reference log-probs, a loss of log 2, no gradient."""
    rows = [
        rollout(0, [10, 11, 20, 21], 1, mask=[1, 1, 0, 0]),
        rollout(0, [10, 11, 22, 23], 0, mask=[1, 1, 0, 0]),
        rollout(1, [10, 11, 20], 1, mask=[1, 1, 0]),
        rollout(1, [10, 12, 20], 0, mask=[1, 1, 0]),  # differs in a trained token: a pair
    ]
    src = load("preference", TOK, path=write_jsonl(tmp_path / "rows.jsonl", rows)).train
    assert src.stats == {"prompts": 2, "prompts_without_pair": 1, "pairs": 1}
    assert [(p.chosen.response_ids, p.rejected.response_ids) for p in src.items] == [([10, 11, 20], [10, 12, 20])]


def test_multi_turn_sides_that_first_differ_at_a_user_turn_are_prompt_not_shared(tmp_path):
    """Explicit-prompt sides [x, follow-up, answer] sharing x but not the follow-up compared answers to different
    questions (their implicit form was already a counted skip); sides differing from their first answer on are a
    pair, and a limit that cuts both inside shared context is `same_response`."""
    other_followups = {
        "prompt": "q",
        "chosen": [assistant("x"), user("one more"), assistant("good")],
        "rejected": [assistant("x"), user("two more"), assistant("bad")],
    }
    same_followup = {
        "prompt": "q",
        "chosen": [assistant("x"), user("more"), assistant("good")],
        "rejected": [assistant("y"), user("more"), assistant("bad")],
    }
    path = write_jsonl(tmp_path / "p.jsonl", [other_followups, same_followup])
    src = load("preference", TOK, path=path).train
    assert len(src) == 1 and src.skipped == {"prompt_not_shared": 1}
    b = src.batch([0])
    got = [masked_segments(TOK, b["responses"][i], b["response_mask"][i]) for i in range(2)]
    assert got == [["x<|im_end|>", "good<|im_end|>"], ["y<|im_end|>", "bad<|im_end|>"]]
    shared = {**same_followup, "rejected": [assistant("x"), user("more"), assistant("bad")]}
    cut = load("preference", TOK, path=write_jsonl(tmp_path / "c.jsonl", [shared, same_followup]), max_response=6)
    assert cut.train.skipped == {"same_response": 1}
