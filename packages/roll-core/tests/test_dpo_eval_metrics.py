"""The DPO collector's held-out pair metrics (roll_core.pipelines.collectors.dpo) are the training objective's: with
dpo.sft_weight > 0 (RPO) eval/dpo_loss is the preference loss + sft_weight x the chosen rows' token-mean NLL, as
dpo/loss is; it left the NLL term out."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from roll_core.config.posttrain import DPOConfig
from roll_core.pipelines.collectors.dpo import DPOCollector
from roll_core.protocol import Batch


@pytest.mark.parametrize("sft_weight", [0.0, 0.7])
def test_eval_dpo_loss_carries_the_objectives_nll_term(sft_weight: float) -> None:
    # Two pairs (chosen at even rows); responses of 2, 1, 3, 2 tokens; per-token log-probs of the policy.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    logp = torch.tensor([[-0.5, -0.5, 9], [-2.0, 9, 9], [-0.2, -0.2, -0.2], [-1.0, -1.0, 9]]) * mask
    ref = torch.tensor([-1.5, -1.5, -1.0, -1.5])  # the reference's summed log-probs
    c = DPOCollector.__new__(DPOCollector)  # the evaluation part only
    c.cfg = SimpleNamespace(dpo=DPOConfig(loss="sigmoid", beta=0.5, sft_weight=sft_weight))
    c.eval_batch, c.eval_ref = Batch({"response_mask": mask}), ref
    c.ctx = SimpleNamespace(train=SimpleNamespace(compute_logprobs=lambda batch, t: {"logprobs": logp}))
    out = c._pair_eval()
    # By hand: chosen sums -1.0 and -0.6, rejected -2.0 and -2.0; margins 0.5 * ((-1 + 1.5) - (-2 + 1.5)) = 0.5 and
    # 0.5 * ((-0.6 + 1.0) - (-2 + 1.5)) = 0.45; NLL = 1.6 / 5 chosen tokens = 0.32.
    pref = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(-0.45))) / 2
    assert out["eval/dpo_preference_loss"] == pytest.approx(pref, abs=1e-6)
    assert out["eval/dpo_nll"] == pytest.approx(0.32, abs=1e-6)
    assert out["eval/dpo_loss"] == pytest.approx(pref + sft_weight * 0.32, abs=1e-6)
    assert out["eval/dpo_pairs"] == 2.0 and out["eval/dpo_accuracy"] == 1.0
