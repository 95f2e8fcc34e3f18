"""Batch protocol: uneven splits, concat order, select/union/repeat, pickling, sequence layout."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roll_core.protocol import Batch, build_sequences, pad_left


def make(n: int) -> Batch:
    return Batch(
        {"x": torch.arange(n).float(), "y": torch.arange(2 * n).view(n, 2)},
        {"id": [f"p{i}" for i in range(n)]},
        {"step": 3},
    )


@given(n=st.integers(0, 40), parts=st.integers(1, 9))
@settings(max_examples=60, deadline=None)
def test_uneven_split_then_concat_restores_order(n: int, parts: int) -> None:
    b = make(n)
    pieces = b.split(parts)
    sizes = [len(p) for p in pieces]
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert all(p.meta["split_sizes"] == sizes for p in pieces)
    back = Batch.concat(pieces)
    assert torch.equal(back["x"], b["x"]) and back["id"] == b["id"] and "split_index" not in back.meta


def test_rows_must_agree() -> None:
    with pytest.raises(ValueError, match="disagree on the number of rows"):
        Batch({"x": torch.zeros(3)}, {"id": ["a", "b"]})
    b = make(3)
    with pytest.raises(ValueError, match="has 2 rows, batch has 3"):
        b["z"] = torch.zeros(2)


def test_select_union_repeat_index() -> None:
    b = make(3)
    s = b.select("x", "id")
    assert s.keys() == ["x", "id"]
    with pytest.raises(KeyError, match="no \\['nope'\\]"):
        b.select("nope")
    u = s.union(Batch({"z": torch.ones(3)}))
    assert set(u.keys()) == {"x", "id", "z"}
    with pytest.raises(ValueError, match="differs"):
        s.union(Batch({"x": torch.ones(3)}))
    r = b.repeat_interleave(2)
    assert r["id"] == ["p0", "p0", "p1", "p1", "p2", "p2"] and r["y"].shape == (6, 2)
    i = b.index(torch.tensor([2, 0]))
    assert i["id"] == ["p2", "p0"] and i["x"].tolist() == [2.0, 0.0]
    assert len(b.index([])) == 0


def test_pickle_roundtrip_keeps_everything() -> None:
    b = make(4)
    c = pickle.loads(pickle.dumps(b))
    assert torch.equal(c["y"], b["y"]) and c["id"] == b["id"] and c.meta == b.meta and len(c) == 4


def test_sequence_layout() -> None:
    ids, mask = pad_left([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    resp = torch.tensor([[1, 2], [3, 0]])
    rmask = torch.tensor([[1, 1], [1, 0]])
    seq = build_sequences(ids, mask, resp, rmask)
    assert seq["input_ids"].tolist() == [[5, 6, 7, 1, 2], [0, 0, 8, 3, 0]]
    assert seq["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 0]]
    assert seq["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 1]]


def test_assemble_drops_and_counts_prompts_that_fill_the_engine_context() -> None:
    import torch

    from roll_core.pipelines.rollout import assemble

    class Tok:
        pad_token_id = 0

    prompts = Batch(fields={"prompt_ids": [[1, 2], [3, 4, 5], [6]], "answer": ["a", "b", "c"]})
    gen = Batch(
        {
            "responses": torch.tensor([[7, 8], [0, 0], [9, 0]]),
            "response_mask": torch.tensor([[1, 1], [0, 0], [1, 0]]),
        },
        {"finish_reason": ["stop", "prompt_too_long", "length"]},
    )
    metrics: dict = {}
    batch = assemble(Tok(), prompts, gen, metrics)
    assert metrics["data/skipped_context_prompts"] == 1
    assert batch["answer"] == ["a", "c"] and batch["input_ids"].tolist() == [[1, 2, 7, 8], [0, 6, 9, 0]]
    # a group's samples (repeat_interleave) are one prompt: 2 prompts x 2 samples, the first too long -> 1 prompt
    pairs = Batch(fields={"prompt_ids": [[1, 2], [1, 2], [6], [6]], "answer": ["a", "a", "c", "c"]})
    gen2 = Batch(
        {"responses": torch.tensor([[0], [0], [9], [8]]), "response_mask": torch.tensor([[0], [0], [1], [1]])},
        {"finish_reason": ["prompt_too_long", "prompt_too_long", "stop", "length"]},
    )
    assemble(Tok(), pairs, gen2, metrics)
    assert metrics["data/skipped_context_prompts"] == 1
    only_long = Batch(gen.tensors(), {"finish_reason": ["prompt_too_long"] * 3})
    with pytest.raises(ValueError, match="every prompt fills the inference engine's context"):
        assemble(Tok(), prompts, only_long, {})
