"""Token-budget micro-batches (`train_engine.micro_batch_tokens`, roll_engines.train._micro): the cut each budget
implies (derived by hand from the rows' attended lengths), rows sharing a prompt kept together when packing, and
gradients equal to one row per micro-batch and to one micro-batch of every row (hf, megatron at TP=PP=1)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from roll_core.models import resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.testing.batches import toy_batch
from roll_engines.train._micro import micro_batches, token_budget_rows
from roll_engines.train.hf import HFTrainEngine

#: toy_batch's attended lengths (prompt + response) per row; rows (0, 1), (2, 3), (4, 5) share a prompt.
LENGTHS = [15, 19, 7, 3, 17, 15]


class Recording:
    """A loss that records each real micro-batch's rows ("row") and delegates to `inner`."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.needs_entropy, self.micros = inner, inner.needs_entropy, []

    def units(self, micro: Any) -> float:
        return self.inner.units(micro)

    def __call__(self, outputs: dict[str, torch.Tensor], micro: Any) -> tuple[torch.Tensor, dict]:
        if micro["response_mask"].sum() > 0:
            self.micros.append(sorted(micro["row"].tolist()))
        return self.inner(outputs, micro)


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    os.environ.setdefault("ROLL_CACHE_DIR", str(tmp_path_factory.mktemp("roll-cache")))
    b = toy_batch(resolve_model_path("builtin:tiny"))
    assert b["attention_mask"].sum(1).tolist() == LENGTHS  # the hand derivations below assume these
    return {**b, "row": torch.arange(len(LENGTHS))}


def _mask(lengths: list[int]) -> torch.Tensor:
    return (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()


def test_budget_cuts_first_fit_decreasing_and_keeps_prompt_groups() -> None:
    lengths = [10, 10, 10, 10, 25, 5]
    # Budget 20, rows alone: 25 (over budget) alone; 10+10 twice; the 5 fits none of those bins: 4 micro-batches.
    assert token_budget_rows(_mask(lengths), 20) == [[0, 1], [2, 3], [4], [5]]
    # Budget 30: 25 | 10+10+10 | 10 ; then 5 joins the 25 (first bin with room).
    assert token_budget_rows(_mask(lengths), 30) == [[0, 1, 2], [3], [4, 5]]
    # Same budget, groups {0,1} {2,3,4} {5}: group {2,3,4} (45) is cut into runs 2+3 (20) and 4 (25); 5 joins 4.
    assert token_budget_rows(_mask(lengths), 30, [[0, 1], [2, 3, 4], [5]]) == [[0, 1], [2, 3], [4, 5]]
    assert token_budget_rows(_mask(lengths), 1) == [[i] for i in range(6)]  # every row over budget: alone
    assert token_budget_rows(_mask(lengths), 10**6) == [list(range(6))]
    assert token_budget_rows(torch.zeros(0, 4, dtype=torch.long), 8) == []
    with pytest.raises(ValueError, match="micro_batch_tokens=-1"):
        HFTrainEngine(resolve_model_path("builtin:tiny"), micro_batch_tokens=-1)


@pytest.mark.parametrize(
    ("packed", "expected"),
    [
        # Rows alone, budget 22: 19 | 17 | 15+7 | 15, then the 3 joins the 19: 4 micro-batches.
        (False, [[0, 2], [1, 3], [4], [5]]),
        # Prompt groups (0,1)=34 and (4,5)=32 exceed 22 and are cut into rows; (2,3)=10 stays whole and fits no
        # bin of 19, 17, 15, 15: 5 micro-batches.
        (True, [[0], [1], [2, 3], [4], [5]]),
    ],
    ids=["padded", "packed"],
)
def test_hf_budget_cut_and_exact_gradients(
    batch: dict[str, torch.Tensor], packed: bool, expected: list[list[int]]
) -> None:
    path = resolve_model_path("builtin:tiny")
    objective = PolicyObjective(agg="token-mean")
    budgeted = HFTrainEngine(path, lr=1e-3, micro_batch_tokens=22, pack_sequences=packed)
    loss = Recording(objective)
    grads = budgeted.compute_gradients(batch, loss)
    assert sorted(loss.micros) == expected and budgeted.micro_batches_run == len(expected)
    assert all(sum(LENGTHS[i] for i in rows) <= 22 or len(rows) == 1 for rows in loss.micros)
    metrics = budgeted.train_step(batch, objective)  # the pass count is reported per train step
    assert metrics["micro_batches"] == len(expected)
    for size in (1, 6):  # one row per micro-batch; every row in one
        ref = HFTrainEngine(path, lr=1e-3, micro_batch_size=size, pack_sequences=packed)
        want = ref.compute_gradients(batch, objective)
        assert ref.micro_batches_run == 6 // size
        assert grads.keys() == want.keys()
        for name, g in want.items():
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.usefixtures("megatron_process_group")
def test_megatron_budget_gradients_and_pipeline_refusal(batch: dict[str, torch.Tensor]) -> None:
    pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")
    from roll_engines.train.megatron import MegatronTrainEngine

    path = resolve_model_path("builtin:tiny")
    with pytest.raises(ValueError, match="micro_batch_tokens > 0 needs pipeline_parallel_size=1"):
        MegatronTrainEngine(path, micro_batch_tokens=22, pipeline_parallel_size=2, dist_backend="gloo")
    objective = PolicyObjective(agg="token-mean")
    common = {"dist_backend": "gloo", "use_distributed_optimizer": False}
    engine = MegatronTrainEngine(path, micro_batch_tokens=22, **common)
    loss = Recording(objective)
    grads = engine.compute_gradients(batch, loss)
    assert sorted(loss.micros) == [[0], [1], [2, 3], [4], [5]]  # packed by default: as hf's packed cut above
    engine.micro_batch_tokens, engine.micro_batch_size = 0, 6
    want = engine.compute_gradients(batch, objective)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_row_micro_batches_keep_a_shuffled_mini_batchs_prompts_together() -> None:
    """Megatron's row micro-batches (`micro_batches` without a budget) when packing: a train step shuffles its rows,
    and micro-batches cut from the shuffled order held one row of each group (packing then computed every prompt
    once per row, as the padded layout does); in prompt order every micro-batch is one group."""
    from roll_core.sequences import pad_left

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    rows = [(k, n) for k in range(3) for n in (1, 2, 3, 4)]  # 3 groups of 4 rows, responses of 1-4 tokens
    shuffled = [rows[i] for i in torch.randperm(12, generator=torch.Generator().manual_seed(0)).tolist()]
    ids, mask = pad_left([prompts[k] for k, _ in shuffled], 0)
    resp = torch.tensor([[20 + k] * n + [0] * (4 - n) for k, n in shuffled])
    resp_mask = (resp > 0).long()
    am = torch.cat([mask, resp_mask], 1)
    mini = {
        "input_ids": torch.cat([ids, resp], 1),
        "attention_mask": am,
        "position_ids": (am.cumsum(1) - 1).clamp_min(0),
        "responses": resp,
        "response_mask": resp_mask,
        "row": torch.arange(12),
    }
    micros = micro_batches(mini, 4, 0, group_prompts=True)
    groups = [sorted({k for k, _ in (shuffled[i] for i in m["row"].tolist())}) for m in micros]
    assert len(groups) == 3 and all(len(g) == 1 for g in groups) and sorted(g[0] for g in groups) == [0, 1, 2]
    assert sorted(i for m in micros for i in m["row"].tolist()) == list(range(12))  # every row once
    # Without packing the cut stays the row order (the scoring passes map outputs back by it).
    assert [m["row"].tolist() for m in micro_batches(mini, 4, 0)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
