"""DPO's logged `dpo/nll` is the token mean over all the step's chosen trained tokens (roll_core.pipelines.objectives
.dpo), not the pair-weighted mean of each mini-batch's own token mean (which weighs a token of a short mini-batch
more), and `dpo/loss` is dpo/preference_loss + sft_weight x dpo/nll; the row weights the actor trains on (the exact
gradient) are unchanged: each chosen row's carries -sft_weight / its own mini-batch's chosen tokens."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_algos.preference import preference_row_weights
from roll_core.config.posttrain import DPOConfig
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives.dpo import WEIGHT_KEY, DPOObjective, pair_arguments, summed
from roll_core.protocol import Batch

SFT = 0.5
CHOSEN_LENGTHS = (1, 6)  # the two mini-batches (one pair each) hold 1 and 6 chosen tokens
R = 6


def _logp(responses: torch.Tensor) -> torch.Tensor:
    """The fake policy's token log-probs: a function of the token alone (any row order gives the same)."""
    return -0.1 * responses.float() - 0.05


class _Actor:
    """compute_logprobs from `_logp`; train records the mini-batches it is given."""

    def __init__(self) -> None:
        self.trained: list[Batch] = []

    def compute_logprobs(self, batch: Batch, temperature: float, **_: Any) -> dict[str, torch.Tensor]:
        return {"logprobs": _logp(batch["responses"])}

    def train(self, mini: Batch, loss_fn: Any, **_: Any) -> dict[str, float]:
        self.trained.append(mini)
        return {"optimizer_steps": 1.0}


def _batch() -> Batch:
    """Two pairs (chosen at even rows): chosen responses of CHOSEN_LENGTHS tokens, rejected ones of 2."""
    lengths = [CHOSEN_LENGTHS[0], 2, CHOSEN_LENGTHS[1], 2]
    mask = (torch.arange(R)[None] < torch.tensor(lengths)[:, None]).long()
    responses = (torch.arange(4 * R).reshape(4, R) % 17 + 3) * mask
    return Batch(
        {
            "responses": responses,
            "response_mask": mask,
            "is_chosen": torch.tensor([True, False, True, False]),
            "row_id": torch.arange(4),
        }
    )


def test_dpo_nll_is_the_steps_token_mean() -> None:
    actor = _Actor()
    cfg = SimpleNamespace(
        dpo=DPOConfig(loss="simpo", sft_weight=SFT),  # simpo: no reference to fake
        pipeline=SimpleNamespace(seed=0),
        algo=SimpleNamespace(ppo_epochs=1),
    )
    roles = SimpleNamespace(actor_train=actor, reference=None, reference_is_base=False, mini_batches=2)
    obj = DPOObjective(cfg, roles)
    batch = _batch()
    out = StepLog()
    obj.update(1, Collected(batch, batch["is_chosen"].float()), out)

    mask = batch["response_mask"]
    seq = summed(_logp(batch["responses"]), mask)
    want_nll = -float(seq[0::2].sum()) / float(mask[0::2].sum())  # 7 chosen tokens of the step together
    per_mini = [-float(seq[i]) / float(mask[i].sum()) for i in (0, 2)]
    assert abs(sum(per_mini) / 2 - want_nll) > 0.05  # the old metric (pair mean of token means) differs
    assert out["dpo/nll"] == pytest.approx(want_nll, rel=1e-6)
    assert out["dpo/loss"] == pytest.approx(out["dpo/preference_loss"] + SFT * want_nll, rel=1e-6)

    # The gradient is untouched: each mini-batch's row weights are the preference loss's plus, on its chosen row,
    # -sft_weight / that mini-batch's chosen tokens.
    assert len(actor.trained) == 2
    for mini in actor.trained:
        m_mask = mini["response_mask"]
        m_seq = summed(_logp(mini["responses"]), m_mask)
        w_c, w_r, _, _ = preference_row_weights(**pair_arguments(cfg.dpo, m_seq, None, m_mask.sum(-1).float()))
        want = torch.stack([w_c - SFT / float(m_mask[0::2].sum()), w_r], dim=1).flatten().float()
        torch.testing.assert_close(mini[WEIGHT_KEY], want)
