"""Offline distillation rows whose teacher top-k holds a -inf log-prob (probability 0 among the listed tokens) are
kept (roll_core.posttrain.distill) and train with a finite loss: the forward KL counts 0 log 0 = 0
(roll_algos.distill._xlogy_kl). NaN and +inf are still counted `teacher_nonfinite` skips and a position whose every
entry is -inf (top-k mass 0) a `teacher_mass` skip; with distill.kind=reverse (KL(student || teacher), infinite at a
teacher probability of 0) such a row at a loss token is a ConfigError naming it (collectors.distill_offline)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from roll_core.errors import ConfigError
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.collectors.distill_offline import check_stored_ids
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.distill_offline import OfflineDistillObjective
from roll_core.testing.posttrain_rows import load, write_jsonl

INF = float("inf")
ZERO_PROB = [[-0.2, -1.8, -INF]] * 3  # the third listed token has probability 0


def _row(lps: list, mask: tuple = (1, 1, 1)) -> dict:
    return {
        "prompt_ids": [5, 6],
        "response_ids": [7, 8, 9],
        "response_mask": list(mask),
        "teacher_topk_ids": [[7, 4, 5], [8, 4, 5], [9, 4, 5]],
        "teacher_topk_logprobs": lps,
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import os

    from roll_core.models import resolve_model_path

    old = os.environ.get("ROLL_CACHE_DIR")
    os.environ["ROLL_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield resolve_model_path("builtin:tiny")
    if old is None:
        os.environ.pop("ROLL_CACHE_DIR", None)
    else:
        os.environ["ROLL_CACHE_DIR"] = old


def _tok(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_a_zero_probability_is_kept_nan_and_plus_inf_are_not(tiny: str, tmp_path: Path) -> None:
    rows = [
        _row(ZERO_PROB),
        _row([[-0.2, -1.8, math.nan]] * 3),
        _row([[-0.2, -1.8, INF]] * 3),
        _row([[-0.3, -2.0, -3.0], [-INF, -INF, -INF], [-0.3, -2.0, -3.0]]),  # top-k mass 0 at position 1
    ]
    src = load("distill", _tok(tiny), path=write_jsonl(tmp_path / "d.jsonl", rows)).train
    assert src.skipped == {"teacher_nonfinite": 2, "teacher_mass": 1}
    assert len(src) == 1
    lps = src.batch([0])["teacher_topk_logprobs"]
    assert lps.shape == (1, 3, 3) and bool((lps[0, :, 2] == -INF).all()) and bool(torch.isfinite(lps[0, :, :2]).all())


@pytest.mark.parametrize("tail", [True, False])
def test_a_zero_probability_row_trains_with_a_finite_loss(tiny: str, tmp_path: Path, tail: bool) -> None:
    from roll_engines.train.hf import HFTrainEngine

    src = load("distill", _tok(tiny), path=write_jsonl(tmp_path / "d.jsonl", [_row(ZERO_PROB)] * 2)).train
    assert len(src) == 2
    batch = src.batch([0, 1])
    engine = HFTrainEngine(tiny, lr=1e-2)
    before = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    cfg = SimpleNamespace(distill=SimpleNamespace(kind="forward", tail=tail), pipeline=SimpleNamespace(seed=0))
    # The role's `train` is its engines' train_step on the batch's tensors.
    actor = SimpleNamespace(train=lambda b, loss_fn, **kw: engine.train_step(dict(b.td.items()), loss_fn, **kw))
    objective = OfflineDistillObjective(cfg, SimpleNamespace(actor_train=actor, mini_batches=1))
    out = StepLog()
    objective.update(1, Collected(batch, torch.zeros(len(batch))), out)
    assert math.isfinite(out["distill/loss"]) and out["distill/loss"] > 0
    assert math.isfinite(out["distill/kl"]) and out["distill/teacher_topk_mass"] < 1
    assert out["actor/optimizer_steps"] == 1.0 and out["actor/nonfinite_steps"] == 0.0
    after = dict(engine.model.named_parameters())
    assert all(bool(torch.isfinite(p).all()) for p in after.values())
    assert any(not torch.equal(before[k], p.detach()) for k, p in after.items())  # the step moved the weights


def test_reverse_kl_refuses_a_zero_probability_at_a_loss_token(tiny: str, tmp_path: Path) -> None:
    tok = _tok(tiny)
    src = load("distill", tok, path=write_jsonl(tmp_path / "d.jsonl", [_row(ZERO_PROB)])).train
    check_stored_ids(src, len(tok), "tiny", kind="forward")  # the forward KL counts it 0
    with pytest.raises(ConfigError, match=r"d\.jsonl.*-inf.*position 0.*distill\.kind=forward"):
        check_stored_ids(src, len(tok), "tiny", kind="reverse")
    # Only at a masked context token: no loss term there, accepted.
    masked = [[-0.3, -2.0, -3.0], [-0.2, -1.8, -INF], [-0.3, -2.0, -3.0]]
    src = load("distill", tok, path=write_jsonl(tmp_path / "m.jsonl", [_row(masked, (1, 0, 1))])).train
    check_stored_ids(src, len(tok), "tiny", kind="reverse")
