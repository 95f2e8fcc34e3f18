"""SFT loss: hand-computed NLL under each aggregation, metrics, and masked NaN/inf slots that never leak."""

from __future__ import annotations

import math

import pytest
import torch

from roll_algos.sft import sft_loss

NAN, INF = float("nan"), float("inf")
# Valid target log-probs: row 0 -> -1, -2; row 1 -> -0.5. Masked slots hold NaN / inf / garbage.
LOGP = [[-1.0, -2.0, NAN], [-0.5, NAN, INF]]
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def close(a: torch.Tensor, b: float, tol: float = 1e-6) -> None:
    assert abs(a.item() - b) <= tol, (a.item(), b)


def test_token_mean_value_metrics_and_gradient() -> None:
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    loss, m = sft_loss(logp, MASK)
    # nll tokens 1, 2, 0.5 -> token mean 3.5 / 3
    close(loss, 3.5 / 3)
    close(m["nll"], 3.5 / 3)
    close(m["ppl"], math.exp(3.5 / 3))
    close(m["tokens"], 3.0)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    loss.backward()
    # d/dlogp of -(sum of valid logp)/3 is -1/3 on each valid token, exactly 0 (not NaN) on masked ones.
    expected = torch.tensor([[-1 / 3, -1 / 3, 0.0], [-1 / 3, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected)


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        ("seq-mean-token-mean", (1.5 + 0.5) / 2),  # row means 3/2 and 0.5
        ("seq-mean-token-sum", (3.0 + 0.5) / 2),  # row sums 3 and 0.5 over B = 2
        ("seq-mean-token-sum-norm", 3.5 / (2 * 4)),  # total 3.5 over B * norm_length = 2 * 4
    ],
)
def test_other_aggregations(agg: str, expected: float) -> None:
    loss, m = sft_loss(torch.tensor(LOGP, dtype=torch.float64), MASK, agg=agg, norm_length=4)
    close(loss, expected)
    close(m["nll"], 3.5 / 3)  # the metric is the token mean whatever the aggregation


def test_all_masked_is_zero_and_finite() -> None:
    logp = torch.full((2, 3), NAN, requires_grad=True)
    loss, m = sft_loss(logp, torch.zeros(2, 3))
    loss.backward()
    close(loss, 0.0)
    close(m["ppl"], 1.0)
    close(m["tokens"], 0.0)
    assert torch.equal(logp.grad, torch.zeros(2, 3))


def test_bad_input_is_an_error() -> None:
    with pytest.raises(ValueError, match="does not match"):
        sft_loss(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="unknown aggregation"):
        sft_loss(torch.zeros(2, 3), torch.ones(2, 3), agg="mean")


def test_half_precision_metrics_are_fp32() -> None:
    # 3001 bf16 log-probs of -0.3 (exactly -0.30078125 in bf16). The metrics were kept in bf16: `tokens` read 3008
    # (3001 rounded to bf16) and `nll` 904 / 3008 = 0.30053. In fp32, as roll_algos.losses does for half inputs:
    # tokens 3001, nll 0.30078125, ppl exp(0.30078125).
    logp = torch.full((1, 3001), -0.3, dtype=torch.bfloat16)
    loss, m = sft_loss(logp, torch.ones(1, 3001))
    close(m["tokens"], 3001.0)
    assert all(v.dtype == torch.float32 for v in m.values())
    close(m["nll"], 0.30078125)
    close(m["ppl"], math.exp(0.30078125), tol=1e-5)
    close(loss, 0.30078125)
