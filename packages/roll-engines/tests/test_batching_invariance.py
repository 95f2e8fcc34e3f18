"""One optimizer step's gradient and metrics do not depend on how its rows are batched: micro-batch size (1, 2, the
whole batch), a token budget, shared-prompt packing, extra padding columns, and data-parallel ranks holding unequal
token counts (units normalised over all ranks), for each loss aggregation with a KL term and an entropy bonus; and
the mini-batches of a step hold, over all ranks, the rows one process gives them.

Rows of 0 to 15 response tokens, so a mean of per-micro-batch means would differ from the batch's mean by far more
than the tolerance. Data-parallel ranks are simulated in one process: each rank's engine sees the other rank's loss
units in its all-reduce and its gradients are averaged, as FSDP averages them (test_fsdp2_ranks runs real ranks)."""

from __future__ import annotations

import math

import pytest
import torch

from roll_core.cluster.roles import merge_rank_metrics
from roll_core.pipelines.objectives import PolicyObjective, ValueObjective
from roll_core.sequences import build_sequences, pad_left
from roll_engines.train._micro import mini_batch_rows
from roll_engines.train.hf import HFTrainEngine

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LENGTHS = [1, 15, 3, 0, 9, 2]  # response tokens per row (one row empty)
RANKS = ([1], [0, 2, 3, 4, 5])  # 15 tokens on one rank, 15 on the other over five rows
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


class _SimulatedRank(HFTrainEngine):
    """One of two data-parallel ranks: its all-reduce adds `other_units`, the other rank's loss units."""

    other_units = 0.0

    @property
    def dp_size(self) -> int:
        return 2

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t + self.other_units


def _repad(batch: dict[str, torch.Tensor], left: int, right: int) -> dict[str, torch.Tensor]:
    """`batch` with `left` more prompt padding columns and `right` more response padding columns."""
    r = batch["responses"].shape[1]
    out = {}
    for k, v in batch.items():
        if k in ("input_ids", "attention_mask", "position_ids"):
            pads = [torch.zeros((len(v), n), dtype=v.dtype) for n in (left, right)]
            out[k] = torch.cat([pads[0], v, pads[1]], 1)
        elif v.dim() == 2 and v.shape[1] == r:
            out[k] = torch.cat([v, torch.zeros((len(v), right), dtype=v.dtype)], 1)
        else:
            out[k] = v
    return out


@pytest.fixture(scope="module")
def batch(tiny: str) -> dict[str, torch.Tensor]:
    """Rows of LENGTHS response tokens after prompts of 1-5 tokens, with per-token advantages of both signs, old
    log-probs off the policy's (both clip fractions act), reference log-probs, values and returns."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 99, (1 + i % 5,), generator=g).tolist() for i in range(len(LENGTHS))]
    r = max(LENGTHS)
    mask = (torch.arange(r)[None] < torch.tensor(LENGTHS)[:, None]).long()
    responses = torch.randint(3, 99, mask.shape, generator=g) * mask
    p_ids, p_mask = pad_left(prompts, 0)
    out = build_sequences(p_ids, p_mask, responses, mask)
    out.update(responses=responses, response_mask=mask)
    logp = HFTrainEngine(tiny, role="reference", pack_sequences=False).compute_logprobs(out)["logprobs"]
    noise = torch.rand(mask.shape, generator=g) - 0.5
    out["advantages"] = torch.randn(mask.shape, generator=g) * mask
    out["old_logprobs"] = (logp + noise) * mask
    out["ref_logprobs"] = (logp - noise.abs()) * mask
    out["values"] = torch.randn(mask.shape, generator=g) * 0.1 * mask
    out["returns"] = torch.randn(mask.shape, generator=g) * mask
    return out


def _grads(tiny: str, batch: dict, objective, role: str = "actor", **kwargs) -> dict[str, torch.Tensor]:
    return HFTrainEngine(tiny, role=role, lr=0.0, **kwargs).compute_gradients(batch, objective)


def _rank_grads(tiny: str, batch: dict, objective, role: str = "actor", **kwargs) -> dict[str, torch.Tensor]:
    """The gradient of two simulated ranks holding RANKS' rows: the mean of theirs, as FSDP's reduction."""
    parts = [{k: v[rows] for k, v in batch.items()} for rows in RANKS]
    units = [objective.units(p) for p in parts]
    total: dict[str, torch.Tensor] = {}
    for i, part in enumerate(parts):
        engine = _SimulatedRank(tiny, role=role, lr=0.0, **kwargs)
        engine.other_units = units[1 - i]
        for name, g in engine.compute_gradients(part, objective).items():
            total[name] = total.get(name, 0) + g / 2
    return total


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys() and any(g.abs().sum() > 0 for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"{what}: {name}")


@pytest.mark.parametrize("agg", AGGS)
def test_a_steps_gradient_is_the_whole_batchs_however_batched(tiny: str, batch: dict, agg: str) -> None:
    objective = PolicyObjective(agg=agg, norm_length=16, kl_loss_coef=0.1, entropy_coef=0.01)
    whole = _grads(tiny, batch, objective, micro_batch_size=6, pack_sequences=False)
    cuts = {
        "micro 1": dict(micro_batch_size=1, pack_sequences=False),
        "micro 2 packed": dict(micro_batch_size=2),
        "16-token budget packed": dict(micro_batch_tokens=16),
    }
    for what, kwargs in cuts.items():
        _assert_same(_grads(tiny, batch, objective, **kwargs), whole, what)
    _assert_same(_grads(tiny, _repad(batch, 3, 5), objective, micro_batch_size=2), whole, "extra padding")
    _assert_same(_rank_grads(tiny, batch, objective, micro_batch_size=1), whole, "two ranks")
    value = ValueObjective(clip=0.05, agg=agg, norm_length=16)
    whole_v = _grads(tiny, batch, value, "critic", micro_batch_size=6, pack_sequences=False)
    _assert_same(_rank_grads(tiny, batch, value, "critic", micro_batch_size=1), whole_v, "critic, two ranks")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_a_steps_metrics_are_the_whole_batchs_however_batched(tiny: str, batch: dict, agg: str) -> None:
    """(test_seq_mean_metric_weights checks the other two aggregations.)"""
    objective = PolicyObjective(agg=agg, norm_length=16, kl_loss_coef=0.1, entropy_coef=0.01)

    def step(rows: list[int], mini_batches: int = 1, **kwargs) -> dict[str, float]:
        part = {k: v[rows] for k, v in batch.items()}
        return HFTrainEngine(tiny, lr=0.0, **kwargs).train_step(part, objective, mini_batches=mini_batches)

    whole = step(list(range(6)), micro_batch_size=6, pack_sequences=False)
    keys = [k for k in whole if k.startswith("actor/")]
    assert whole["actor/clipfrac_low"] > 0 and whole["actor/clipfrac_high"] > 0 and "actor/kl_loss" in keys
    runs = {
        "micro 1": step(list(range(6)), micro_batch_size=1, pack_sequences=False),
        "micro 2, 3 mini-batches": step(list(range(6)), 3, micro_batch_size=2),
        "two ranks": merge_rank_metrics([step(rows, micro_batch_size=1) for rows in RANKS], [1, 5]),
    }
    for what, got in runs.items():
        for k in keys:
            assert math.isclose(got[k], whole[k], rel_tol=1e-5, abs_tol=1e-7), (what, k, got[k], whole[k])


@pytest.mark.parametrize(
    ("counts", "mini_batches"),
    [([2, 2], 4), ([3, 3], 2), ([4, 2], 2), ([2, 2, 2, 2, 1, 1, 1, 1], 2), ([2] * 8, 4), ([0, 3], 2), ([7], 3)],
)
def test_mini_batches_hold_one_processs_rows_over_any_ranks(counts: list[int], mini_batches: int) -> None:
    """Each rank cut its own rows with tensor_split: 2 ranks of 2 rows with 4 mini-batches took 2 optimizer steps of
    2 rows (the LR schedule counts 4), 2 ranks of 3 rows with 2 mini-batches steps of 4 and 2 rows, not 3 and 3."""
    n = sum(counts)
    want = [len(c) for c in torch.tensor_split(torch.arange(n), mini_batches)]
    parts = []
    for rank, c in enumerate(counts):
        order = torch.randperm(c, generator=torch.Generator().manual_seed(rank))
        mine = mini_batch_rows(order, counts, rank, mini_batches)
        assert len(mine) == mini_batches and torch.equal(torch.cat(mine), order)  # each row once, in order
        for i, rows in enumerate(mine):  # a share within a row of the rank's proportion
            assert abs(len(rows) - c * want[i] / n) < 1 + 1e-9, (rank, i)
        parts.append([len(rows) for rows in mine])
    assert [sum(p[i] for p in parts) for i in range(mini_batches)] == want
    if len(counts) == 1:  # one process: tensor_split's cut, unchanged
        order = torch.arange(counts[0])
        got = mini_batch_rows(order, counts, 0, mini_batches)
        assert [r.tolist() for r in got] == [r.tolist() for r in torch.tensor_split(order, mini_batches)]
    with pytest.raises(ValueError, match="holds 1 rows"):
        mini_batch_rows(torch.arange(1), [2, 2], 0, 2)
