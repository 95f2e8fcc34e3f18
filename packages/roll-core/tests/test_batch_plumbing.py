"""Batch plumbing between the controller and the role groups: row masks given as lists, batches that cross the
local backend and Ray alike, responses padded as the engine pads them, and train metrics weighed by the rows each
data-parallel replica trained."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from roll_core.cluster.mesh import Mesh
from roll_core.cluster.roles import InferGroup, InferWorker, TrainGroup, TrainWorker
from roll_core.cluster.worker import Dispatch, Worker, by_value, dispatch
from roll_core.interfaces import GenerateOutput, RequestOutput, SamplingParams
from roll_core.protocol import Batch


def _batch() -> Batch:
    return Batch({"x": torch.arange(5)}, {"s": list("abcde")})


@pytest.mark.parametrize(
    "mask",
    [
        list(np.array([True, False, True, False, False])),  # numpy bools
        list(torch.tensor([True, False, True, False, False])),  # 0-d bool tensors
        tuple(np.array([True, False, True, False, False])),
    ],
    ids=["numpy-bools", "bool-tensors", "numpy-tuple"],
)
def test_a_mask_given_as_a_list_of_numpy_or_tensor_bools_selects_rows(mask) -> None:
    """`batch.index(list(mask))`: each entry read as 0/1 picked rows [1, 0, 1, 0, 0] ('b', 'a', 'b', 'a', 'a')."""
    got = _batch().index(mask)
    assert got["s"] == ["a", "c"] and got["x"].tolist() == [0, 2]
    with pytest.raises(ValueError, match="boolean mask has 4 entries"):
        _batch().index(mask[:4])


class _Numpy1Bool:
    """numpy 1.x's bool scalar as the protocol sees it: type named `bool_` in module `numpy`, an int-like 0/1."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __bool__(self) -> bool:
        return self.value

    def __index__(self) -> int:
        return int(self.value)

    def __int__(self) -> int:
        return int(self.value)


_Numpy1Bool.__name__ = _Numpy1Bool.__qualname__ = "bool_"
_Numpy1Bool.__module__ = "numpy"


def test_a_mask_of_numpy_1x_bools_selects_rows() -> None:
    """numpy 1.x names its bool scalar `bool_` (numpy 2: `bool`); such a list was read as row numbers 1, 0, 1, 0, 0."""
    got = _batch().index([_Numpy1Bool(v) for v in (True, False, True, False, False)])
    assert got["s"] == ["a", "c"]


def test_a_uint8_index_tensor_is_refused_not_read_as_indices() -> None:
    """torch reads a uint8 tensor as a mask; Batch.index read its values as row numbers (rows 1, 0, 1, 0, 0)."""
    with pytest.raises(ValueError, match="uint8"):
        _batch().index(torch.tensor([1, 0, 1, 0, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        _batch().index(np.array([1, 0, 1, 0, 0], dtype=np.uint8))
    assert _batch().index(torch.tensor([1, 0], dtype=torch.long))["s"] == ["b", "a"]  # indices as before


def test_a_batch_crosses_the_local_backend_as_it_crosses_ray() -> None:
    """A TensorDict without a batch dimension indexed after Ray's round trip (pickled with [n]) but raised on the
    local backend; one with two batch dimensions kept them locally and lost the second over Ray."""
    flat = Batch(TensorDict({"a": torch.arange(3)}, batch_size=[]), {"f": [1, 2, 3]})
    fields_only = Batch(TensorDict({}), {"f": [1, 2]})
    for b in (flat, by_value(flat), pickle.loads(pickle.dumps(flat))):
        assert b.index([2, 0])["a"].tolist() == [2, 0] and b.index([2, 0])["f"] == [3, 1]
    for b in (fields_only, by_value(fields_only), pickle.loads(pickle.dumps(fields_only))):
        assert b.index([1])["f"] == [2]
    wide = Batch(TensorDict({"m": torch.ones(3, 4)}, batch_size=[3, 4]))
    assert by_value(wide).td.batch_size == pickle.loads(pickle.dumps(wide)).td.batch_size == torch.Size([3, 4])


class _PadEngine:
    """Each prompt's one response is its length in tokens 1..len; pads with 99, as a real engine pads with its own
    pad id (roll_core.testing.infer_engine checks `responses[mask == 0] == pad_id`)."""

    pad_id = 99

    def generate(self, prompts, params, n, first_row: int = 0, **_):
        outs = [
            RequestOutput(f"r{k}", list(p), list(range(1, len(p) + 1)), [-0.5] * len(p), "stop")
            for k, p in enumerate(prompts)
            for _ in range(n)
        ]
        return GenerateOutput.from_requests(outs, self.pad_id)

    def shutdown(self) -> None:
        pass


class _PadWorker(InferWorker):
    def __init__(self, **base) -> None:
        Worker.__init__(self, **base)
        self.engine = _PadEngine()


@pytest.mark.parametrize("engines", [2, 3])
def test_generate_pads_a_narrower_rank_with_the_engine_pad_id_whatever_the_engine_count(engines: int) -> None:
    """Ranks return responses of their own widths; the group padded the narrower ones with token 0 (a real token),
    so 2 engines gave [[1, 2, 3], [1, 0, 0]] where 1 engine gave [[1, 2, 3], [1, 99, 99]]."""
    prompts = Batch({}, {"prompt_ids": [[5, 6, 7], [8], [9, 9]]})
    params = SamplingParams(max_new_tokens=4)
    one = InferGroup(_PadWorker, 1, "local", name="actor_infer").generate(prompts, params, n=2)
    many = InferGroup(_PadWorker, engines, "local", name="actor_infer").generate(prompts, params, n=2)
    assert one["responses"].tolist() == [[1, 2, 3]] * 2 + [[1, 99, 99]] * 2 + [[1, 2, 99]] * 2
    for k in ("responses", "behaviour_logprobs", "response_mask"):
        assert torch.equal(many[k], one[k]), k
    assert (many["responses"][many["response_mask"] == 0] == 99).all()
    assert "pad_id" not in many.meta and "generate_seconds" in many.meta


class _MeanWorker(TrainWorker):
    """A trainer whose loss is the mean `x` of its rows (no engine)."""

    def __init__(self, **base) -> None:
        Worker.__init__(self, **base)

    def on_setup(self) -> None:
        pass

    @dispatch(Dispatch.DP)
    def train(self, batch, loss_fn, mini_batches, epochs, temperature, shuffle_seed) -> dict[str, float]:
        return {"loss": float(batch["x"].float().mean())} if len(batch) else {}


class _InProcessTrainGroup(TrainGroup):
    one_process_per_rank = False  # (a test double: its ranks need no torch.distributed)


def test_train_metrics_of_a_tensor_parallel_mesh_weigh_each_replica_by_its_rows() -> None:
    """dp=2 x tp=2: replica 0 (ranks 0, 1) trains rows [1, 1], replica 1 (ranks 2, 3) row [4]. The merge weighed
    the replicas by `sizes[dp_rank(d)]` for replica index d read as a global rank: rank 1 is replica 0's second TP
    rank, so both weighed 2 rows and the loss was 2.5, not (1 + 1 + 4) / 3 = 2."""
    group = _InProcessTrainGroup(_MeanWorker, 4, "local", name="actor_train", mesh=Mesh(dp=2, tp=2))
    batch = Batch({"x": torch.tensor([1, 1, 4])})
    metrics = group.train(batch, None, mini_batches=1, epochs=1, temperature=1.0, shuffle_seed=0)
    assert metrics == {"loss": pytest.approx(2.0)}
