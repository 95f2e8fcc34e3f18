"""Batch protocol edge cases a user meets: empty batches, masks vs indices, concat/union conflicts, compact pickles,
sequence layout checks, routed-expert layout and the dynamic-sampling helpers (roll_core.pipelines.sampling)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from roll_core.pipelines.sampling import group_rows, informative_groups, merge_scored, pad_right
from roll_core.protocol import Batch, build_sequences, pad_left
from roll_core.routing import UNROUTED, routing_layout


def make(n: int, width: int = 2) -> Batch:
    return Batch(
        {"x": torch.arange(n).float(), "y": torch.arange(width * n).view(n, width)},
        {"id": [f"p{i}" for i in range(n)]},
        {"step": 3},
    )


def rows(b: Batch) -> list[tuple]:
    return [(b["x"][i].item(), tuple(b["y"][i].tolist()), b["id"][i]) for i in range(len(b))]


# ---- Batch: row operations ------------------------------------------------------------------------------------
@given(n=st.integers(0, 30), parts=st.integers(1, 40), chunk=st.integers(1, 12))
@settings(max_examples=80, deadline=None)
def test_split_chunks_concat_round_trip_any_part_count(n: int, parts: int, chunk: int) -> None:
    b = make(n)
    pieces = b.split(parts)  # more parts than rows gives empty parts, never an error
    assert len(pieces) == parts and sum(map(len, pieces)) == n
    assert all(p["y"].shape[1:] == (2,) for p in pieces)
    back = Batch.concat(pieces)
    assert rows(back) == rows(b) and back.meta == {"step": 3}
    assert rows(Batch.concat(b.chunks(chunk))) == rows(b) if n else list(b.chunks(chunk)) == []


@given(mask=st.lists(st.booleans(), min_size=0, max_size=12))
@settings(max_examples=60, deadline=None)
def test_index_bool_mask_selects_true_rows(mask: list[bool]) -> None:
    b = make(len(mask))
    want = [r for r, keep in zip(rows(b), mask) if keep]
    assert rows(b.index(torch.tensor(mask, dtype=torch.bool))) == want
    assert rows(b.index(np.array(mask, dtype=bool))) == want
    if mask:  # an empty list is an empty index list, not a mask
        assert rows(b.index(mask)) == want


def test_index_mask_length_and_range_are_checked() -> None:
    b = make(4)
    with pytest.raises(ValueError, match="mask has 3 entries, batch has 4"):
        b.index(torch.tensor([True, False, True]))
    with pytest.raises(IndexError, match=r"rows \[7\] out of range for a batch of 4"):
        b.index([0, 7])
    with pytest.raises(IndexError, match="out of range for a batch of 1"):
        Batch(fields={"id": ["a"]}).index([3])  # a fields-only batch names the batch too
    with pytest.raises(ValueError, match="1-d"):
        b.index(torch.zeros(2, 2, dtype=torch.long))
    assert b.index([-1, 0])["id"] == ["p3", "p0"] and b.index(torch.tensor(2))["id"] == ["p2"]
    assert b.index(slice(None, None, -2))["id"] == ["p3", "p1"]


def test_empty_batch_through_every_operation() -> None:
    e = make(0)
    assert len(e) == 0 and e["y"].shape == (0, 2)
    assert [len(p) for p in e.split(3)] == [0, 0, 0] and len(Batch.concat(e.split(3))) == 0
    assert len(e.index([])) == 0 and len(e.index(torch.zeros(0, dtype=torch.bool))) == 0
    assert e.select("x").keys() == ["x"] and len(e.repeat_interleave(4)) == 0 and list(e.chunks(2)) == []
    assert set(e.union(Batch({"z": torch.zeros(0)})).keys()) == {"x", "y", "id", "z"}
    assert len(e.to("cpu")) == 0 and len(pickle.loads(pickle.dumps(e))) == 0
    # An empty part in a concat never constrains the others' widths.
    assert Batch.concat([make(0, width=5), make(2)])["y"].shape == (2, 2)


def test_an_empty_batch_with_entries_keeps_zero_rows() -> None:
    e = make(0)
    with pytest.raises(ValueError, match="'z' has 3 rows, batch has 0"):
        e["z"] = ["a", "b", "c"]  # was accepted: a 0-row batch holding a 3-row field
    with pytest.raises(ValueError, match="'z' has 3 rows, batch has 0"):
        e["z"] = torch.zeros(3)
    fresh = Batch()
    fresh["z"] = ["a", "b", "c"]  # a batch without entries takes its first entry's row count
    assert len(fresh) == 3


def test_construction_errors_name_the_entries() -> None:
    with pytest.raises(ValueError, match=r"'x': 3, 'y': 3, 'id': 2"):
        Batch({"x": torch.zeros(3), "y": torch.zeros(3, 4)}, {"id": ["a", "b"]})
    with pytest.raises(ValueError, match=r"'id': 2, '<TensorDict batch_size>': 5"):
        Batch(TensorDict({}, batch_size=[5]), {"id": ["a", "b"]})
    with pytest.raises(ValueError, match="0-d"):
        Batch({"x": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="0-d"):
        make(2)["s"] = torch.tensor(1.0)


def test_chunks_rejects_a_non_positive_size() -> None:
    with pytest.raises(ValueError, match="chunk size must be >= 1, got -1"):
        list(make(4).chunks(-1))  # was: no chunks at all, every row silently lost
    with pytest.raises(ValueError, match="chunk size must be >= 1, got 0"):
        list(make(4).chunks(0))


# ---- Batch: concat and union ----------------------------------------------------------------------------------
def test_concat_rejects_dtype_and_width_mismatches_naming_the_key() -> None:
    a, b = Batch({"x": torch.zeros(2, dtype=torch.long)}), Batch({"x": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"tensor 'x'.*torch.int64\(2,\).*torch.float32\(2,\)"):
        Batch.concat([a, b])  # was: silently promoted to float32
    with pytest.raises(ValueError, match=r"tensor 'r'.*\(2, 3\).*\(2, 4\)"):
        Batch.concat([Batch({"r": torch.zeros(2, 3)}), Batch({"r": torch.zeros(2, 4)})])
    with pytest.raises(ValueError, match="tensors \\['x'\\], fields \\[\\] and tensors \\[\\], fields \\['x'\\]"):
        Batch.concat([Batch({"x": torch.zeros(2)}), Batch(fields={"x": [1, 2]})])
    with pytest.raises(ValueError, match="cannot concat"):
        Batch.concat([make(2), make(2).select("x", "y")])


def test_concat_keeps_the_first_batchs_meta() -> None:
    a, b = Batch({"x": torch.zeros(1)}, meta={"a": 1, "split_index": 0}), Batch({"x": torch.zeros(1)}, meta={"a": 2})
    assert Batch.concat([a, b]).meta == {"a": 1} and Batch.concat([]).keys() == []


def test_union_conflicts() -> None:
    with pytest.raises(ValueError, match="tensor in one batch and a field in the other"):
        Batch({"x": torch.zeros(2)}).union(Batch(fields={"x": [1, 2]}))  # was: 'x' in both tensors and fields
    with pytest.raises(ValueError, match=r"'x' differs.*float32\(2,\) vs torch.int64\(2,\)"):
        Batch({"x": torch.zeros(2)}).union(Batch({"x": torch.zeros(2, dtype=torch.long)}))
    nan = torch.tensor([float("nan"), 1.0])
    assert torch.equal(Batch({"x": nan}).union(Batch({"x": nan.clone()}))["x"].isnan(), nan.isnan())
    with pytest.raises(ValueError, match="field 'id' differs"):
        make(2).union(Batch(fields={"id": ["p0", "other"]}))
    merged = Batch({"x": torch.zeros(1)}, meta={"a": 1, "b": 1}).union(Batch({"z": torch.ones(1)}, meta={"b": 2}))
    assert merged.meta == {"a": 1, "b": 2}  # documented: the other batch's meta wins


# ---- Batch: pickling and devices ------------------------------------------------------------------------------
def test_pickle_ships_a_view_without_its_whole_storage() -> None:
    big = torch.arange(1_000_000, dtype=torch.float32).view(1000, 1000)
    for view in (big[:2], big[:, :2], big[5:7, 10:20], big.t()[:2], big[:, 3]):
        ids = [str(i) for i in range(view.shape[0])]
        blob = pickle.dumps(Batch({"v": view}, {"id": ids}))
        assert len(blob) < 100_000, (tuple(view.shape), len(blob))  # was ~4 MB: the whole 1000x1000 storage
        back = pickle.loads(blob)
        assert torch.equal(back["v"], view) and back["v"].is_contiguous() and back["id"] == ids
    own = torch.arange(6).view(3, 2)
    assert Batch({"o": own}).__getstate__()["tensors"]["o"] is own  # a compact tensor is not copied


def test_device_moves_keep_fields_and_meta() -> None:
    b = make(3)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        moved = b.to(dev)
        assert moved["x"].device.type == dev and moved["id"] == b["id"] and moved.meta == b.meta
        assert rows(moved.to("cpu")) == rows(b)


# ---- sequences ------------------------------------------------------------------------------------------------
@given(
    prompts=st.lists(st.lists(st.integers(1, 50), min_size=0, max_size=6), min_size=1, max_size=5),
    lengths=st.data(),
)
@settings(max_examples=60, deadline=None)
def test_sequence_layout_properties(prompts: list[list[int]], lengths: st.DataObject) -> None:
    r = lengths.draw(st.integers(0, 5))
    resp_lens = [lengths.draw(st.integers(0, r)) for _ in prompts]
    ids, mask = pad_left(prompts, pad_id=0)
    responses = torch.tensor([[100 + j if j < n else 0 for j in range(r)] for n in resp_lens], dtype=torch.long)
    rmask = (torch.arange(r)[None, :] < torch.tensor(resp_lens)[:, None]).long()
    seq = build_sequences(ids, mask, responses.view(len(prompts), r), rmask.view(len(prompts), r))
    p = ids.shape[1]
    for i, (toks, n) in enumerate(zip(prompts, resp_lens)):
        att = seq["attention_mask"][i].bool()
        # The attended tokens are exactly the prompt then the response; positions count them from 0.
        assert seq["input_ids"][i][att].tolist() == toks + [100 + j for j in range(n)]
        assert seq["position_ids"][i][att].tolist() == list(range(len(toks) + n))
        assert att[: p - len(toks)].sum() == 0 and att[p + n :].sum() == 0


def test_build_sequences_rejects_masks_of_the_wrong_shape() -> None:
    ids, mask = pad_left([[5, 6, 7], [8]], pad_id=0)
    resp, rmask = torch.tensor([[1, 2], [3, 0]]), torch.tensor([[1, 1], [1, 0]])
    with pytest.raises(ValueError, match=r"prompts \(2, 3\) vs prompt_mask \(2, 2\)"):
        build_sequences(ids, mask[:, 1:], resp, rmask)  # was: an attention mask one column short, silently
    with pytest.raises(ValueError, match="masks must match their ids"):
        build_sequences(ids, mask, resp, rmask[:, :1])
    with pytest.raises(ValueError, match="2 prompt rows but 1 response rows"):
        build_sequences(ids, mask, resp[:1], rmask[:1])


# ---- routed experts -------------------------------------------------------------------------------------------
def test_routing_layout_aligns_with_input_ids_and_marks_the_rest_unrouted() -> None:
    layers, k = 2, 3
    # Row 0: prompt 2, 3 generated -> 4 positions (the last token is never fed back). Row 1: prompt 3, 6 generated,
    # cut at R=4.
    r0 = torch.arange(4 * layers * k, dtype=torch.int32).view(4, layers, k)
    r1 = torch.arange(8 * layers * k, dtype=torch.int64).view(8, layers, k) + 100
    out = routing_layout([r0, r1], [2, 3], prompt_width=3, response_width=4)
    assert out.shape == (2, 7, layers, k) and out.dtype == torch.int16
    assert (out[0, 0] == UNROUTED).all() and torch.equal(out[0, 1:5], r0.to(torch.int16))
    assert (out[0, 5:] == UNROUTED).all()
    assert torch.equal(out[1], r1[:7].to(torch.int16))  # prompt fills P, response cut at R
    empty = routing_layout([], [], 3, 4)
    assert empty.shape == (0, 7, 0, 0)


def test_routing_row_that_stops_inside_its_prompt() -> None:
    # An aborted request that generated nothing: routing for 2 of its 3 prompt tokens.
    r = torch.full((2, 1, 2), 7, dtype=torch.int16)
    out = routing_layout([r], [3], prompt_width=4, response_width=2)  # was: RuntimeError (shape mismatch)
    assert out[0, :, 0, 0].tolist() == [UNROUTED, 7, 7, UNROUTED, UNROUTED, UNROUTED]
    with pytest.raises(ValueError, match="not \\(positions, layers, top_k\\)"):
        routing_layout([torch.zeros(3, dtype=torch.int16)], [1], 2, 2)
    with pytest.raises(ValueError, match="more than P=2"):
        routing_layout([r], [3], 2, 2)


# ---- dynamic sampling -----------------------------------------------------------------------------------------
def test_pad_right_never_cuts() -> None:
    t = torch.ones(2, 3)
    assert pad_right(t, 3) is t and pad_right(t, 5, value=-1)[:, 3:].eq(-1).all()
    with pytest.raises(ValueError, match=r"cannot pad \(2, 3\) to width 2"):
        pad_right(t, 2)  # was: the (2, 3) tensor back, not the (2, 2) asked for


def test_informative_groups_and_group_rows() -> None:
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    inf = informative_groups(scores, 2)
    assert inf.tolist() == [False, True, False]
    assert group_rows(inf, 2).tolist() == [2, 3]
    with pytest.raises(ValueError, match="NaN scores in groups \\[1\\]"):
        informative_groups(torch.tensor([0.0, 1.0, float("nan"), 1.0]), 2)  # was: group 1 silently "uniform"
    assert informative_groups(torch.tensor([True, True, False, True]), 2).tolist() == [False, True]  # bool scores
    assert informative_groups(torch.zeros(0), 4).shape == (0,)
    with pytest.raises(ValueError, match="do not form groups of 4"):
        informative_groups(torch.zeros(6), 4)
    with pytest.raises(ValueError, match="bool mask"):
        group_rows(torch.tensor([0, 2]), 2)  # group indices read as a 0/1 mask would pick group 1 only


def _scored(prompts: list[list[int]], responses: list[list[int]], scores: list[float], **extra: list) -> Batch:
    width = max(map(len, responses))
    resp = torch.tensor([r + [0] * (width - len(r)) for r in responses], dtype=torch.long)
    mask = (resp != 0).long()
    n = len(prompts)
    b = Batch(
        {
            "responses": resp,
            "behaviour_logprobs": -mask.float(),
            "response_mask": mask,
            "truncated": torch.zeros(n, dtype=torch.long),
            "scores": torch.tensor(scores),
            "correct": torch.tensor(scores) > 0,
            "formatted": torch.ones(n, dtype=torch.bool),
        },
        {
            "prompt_ids": prompts,
            "answer": ["a"] * n,
            "problem_id": [f"q{i}" for i in range(n)],
            "prompt_text": ["t"] * n,
            "metadata": [{}] * n,
            "finish_reason": ["stop"] * n,
            **extra,
        },
    )
    return b


def test_merge_scored_pads_and_keeps_rows_in_order() -> None:
    tok = SimpleNamespace(pad_token_id=0)
    a = _scored([[5, 6], [5, 6]], [[1, 2], [3]], [1.0, 0.0])
    b = _scored([[7]], [[4, 4, 4, 4]], [0.5])
    out = merge_scored(tok, [a, b])
    assert out["responses"].tolist() == [[1, 2, 0, 0], [3, 0, 0, 0], [4, 4, 4, 4]]
    assert out["scores"].tolist() == [1.0, 0.0, 0.5] and out["prompt_ids"] == [[5, 6], [5, 6], [7]]
    assert out["input_ids"].tolist()[2] == [0, 7, 4, 4, 4, 4]
    c = b.select(*[k for k in b.keys() if k != "metadata"])
    with pytest.raises(ValueError, match="\\['metadata'\\] are in only some"):
        merge_scored(tok, [a, c])  # was: 'metadata' silently dropped from every row


def test_merge_scored_fills_missing_pictures_with_none() -> None:
    tok = SimpleNamespace(pad_token_id=0, convert_tokens_to_ids=lambda name: None)  # no picture tokens
    a = _scored([[5]], [[1]], [1.0], mm_inputs=[None])
    b = _scored([[7]], [[4, 4]], [0.5])  # a text-only round: no mm_inputs field at all
    out = merge_scored(tok, [a, b])
    assert out["mm_inputs"] == [None, None]  # was: mm_inputs dropped from every row
