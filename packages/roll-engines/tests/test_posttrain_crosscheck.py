"""roll's post-training losses against the formulas of TRL (the peer users compare against): `DPOTrainer`
(trl/trainer/dpo_trainer.py, `_compute_loss` of TRL 1.x and `dpo_loss` of TRL <= 0.28), `CPOTrainer`'s
`loss_type="simpo"` (trl/experimental/cpo) and the token-mean SFT loss.

As packages/roll-algos/tests/test_reference_crosscheck.py does for verl, every reference below is written here from
the formula (python floats, fp64, one pair or one token at a time), never imported from TRL or from roll.

DPO (`roll_algos.preference`, and the `dpo` objective's metrics and row weights): loss, rewards/chosen,
rewards/rejected, rewards/margins, rewards/accuracies and the gradient on random pairs, at 1e-9 in fp64 (the
objective sums log-probs in fp32: 1e-5 there). Where roll departs from TRL the test pins roll's documented choice
and the docstring that states it:
- `sigmoid` with label_smoothing eps is conservative DPO, TRL <= 0.28's `sigmoid`; TRL >= 0.29's `sigmoid` ignores
  label_smoothing, and TRL's `robust` (an unbiased loss, divided by 1 - 2 eps) is not offered;
- `ipo`'s rewards are length-averaged, as TRL <= 0.28 reported them; TRL >= 0.29 reports beta (pi - ref) of the
  summed log-probs, so its rewards, margins and accuracies differ for ipo (the loss is the same).

SFT (`SFTLoss`, the default `token-mean`): the sum over micro-batches (rows, token budgets) and data-parallel ranks
of each micro-batch's loss scaled as the engines scale it has the gradient of sum(token NLL) / (trained tokens of
the whole mini-batch), rows holding 0 to 11 trained tokens; and the hf engine's accumulated gradient on the tiny
model equals that loss's gradient through plain transformers at 1e-5. A mean of per-micro-batch means (the classic
gradient-accumulation bug) is caught by the same comparisons.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from roll_algos import preference
from roll_algos.preference import preference_loss, preference_row_weights
from roll_core.config.posttrain import DPOConfig
from roll_core.pipelines.losses import agg_units
from roll_core.pipelines.objectives import dpo as dpo_objective
from roll_core.pipelines.objectives.dpo import DPOObjective
from roll_core.pipelines.objectives.sft import SFTLoss
from roll_core.sequences import build_sequences, pad_left
from roll_engines.train._micro import token_budget_rows
from roll_engines.train.hf import HFTrainEngine

F64 = torch.float64
TOL = 1e-9


# ======================================================================== DPO: the TRL formulas, one pair at a time
def logsig(x: float) -> float:
    """log sigma(x), stable on both sides."""
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x: float) -> float:
    return math.exp(logsig(x))


def trl_pair(v: str, beta: float, eps: float, gamma: float, p: tuple, trl: str = "0.28") -> tuple[float, ...]:
    """(loss, reward_chosen, reward_rejected, dloss/dpi_chosen, dloss/dpi_rejected) of one pair under TRL's
    `loss_type=v` (simpo: CPOTrainer). p = (pi_c, pi_r, ref_c, ref_r, len_c, len_r): summed log-probs, lengths.
    `trl` picks the version where TRL changed: "0.28" (dpo_loss) or "1.x" (_compute_loss)."""
    pc, pr, rc, rr, lc, lr = p
    if v in ("sigmoid", "hinge", "robust"):
        h = (pc - rc) - (pr - rr)  # logits = pi_logratios - ref_logratios
        if v == "sigmoid":  # TRL <= 0.28: -(1-eps) logsigmoid(beta h) - eps logsigmoid(-beta h); 1.x: eps unused
            e = eps if trl == "0.28" else 0.0
            loss = -(1 - e) * logsig(beta * h) - e * logsig(-beta * h)
            dh = -beta * ((1 - e) * sig(-beta * h) - e * sig(beta * h))
        elif v == "hinge":  # relu(1 - beta h)
            loss = max(0.0, 1 - beta * h)
            dh = -beta if 1 - beta * h > 0 else 0.0
        else:  # robust: (-(1-eps) logsigmoid(beta h) + eps logsigmoid(-beta h)) / (1 - 2 eps)
            loss = (-(1 - eps) * logsig(beta * h) + eps * logsig(-beta * h)) / (1 - 2 * eps)
            dh = -beta * ((1 - eps) * sig(-beta * h) + eps * sig(beta * h)) / (1 - 2 * eps)
        return loss, beta * (pc - rc), beta * (pr - rr), dh, -dh
    if v == "ipo":  # ((pi_c - ref_c)/|y_c| - (pi_r - ref_r)/|y_r| - 1/(2 beta))^2
        h = (pc - rc) / lc - (pr - rr) / lr
        loss = (h - 1 / (2 * beta)) ** 2
        dh = 2 * (h - 1 / (2 * beta))
        if trl == "0.28":  # concatenated_forward divided both models' logps by the length before the rewards
            rew = beta * (pc / lc - rc / lc), beta * (pr / lr - rr / lr)
        else:  # 1.x: rewards of the summed log-ratios
            rew = beta * (pc - rc), beta * (pr - rr)
        return loss, *rew, dh / lc, -dh / lr
    assert v == "simpo"  # CPOTrainer: average_log_prob; logits = avg_c - avg_r - gamma / beta
    z = pc / lc - pr / lr - gamma / beta
    loss = -(1 - eps) * logsig(beta * z) - eps * logsig(-beta * z)
    dz = -beta * ((1 - eps) * sig(-beta * z) - eps * sig(beta * z))
    return loss, beta * pc / lc, beta * pr / lr, dz / lc, -dz / lr


def trl_batch(v: str, beta: float, eps: float, gamma: float, pairs: list[tuple], trl: str = "0.28") -> dict:
    """TRL's logged metrics and mean loss over `pairs`, and the gradient of the mean loss (dL/dpi_c, dL/dpi_r)."""
    rows = [trl_pair(v, beta, eps, gamma, p, trl) for p in pairs]
    n = len(rows)
    return {
        "loss": math.fsum(r[0] for r in rows) / n,
        "rewards_chosen": math.fsum(r[1] for r in rows) / n,
        "rewards_rejected": math.fsum(r[2] for r in rows) / n,
        "reward_margin": math.fsum(r[1] - r[2] for r in rows) / n,  # mean(chosen_rewards - rejected_rewards)
        "reward_accuracy": sum(r[1] > r[2] for r in rows) / n,  # mean(chosen_rewards > rejected_rewards)
        "w_chosen": [r[3] / n for r in rows],
        "w_rejected": [r[4] / n for r in rows],
    }


def random_pairs(n: int, seed: int) -> list[tuple]:
    """Pairs of summed log-probs (pi_c, pi_r, ref_c, ref_r) and lengths 1..30, the policy near the reference (the
    margins take both signs, the hinge both sides of its kink), the last pair a tie."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lc, lr = rng.randint(1, 30), rng.randint(1, 30)
        rc, rr = -rng.uniform(0.2, 2.0) * lc, -rng.uniform(0.2, 2.0) * lr
        out.append((rc + rng.gauss(0, 3), rr + rng.gauss(0, 3), rc, rr, lc, lr))
    out[-1] = (-3.0, -3.0, -2.0, -2.0, 3, 3)  # a tie (margin exactly 0 in every variant): not an accurate pair
    return out


CASES = [  # (variant, beta, label_smoothing, simpo_gamma)
    ("sigmoid", 0.1, 0.0, 0.0),
    ("sigmoid", 0.5, 0.2, 0.0),
    ("hinge", 0.1, 0.0, 0.0),
    ("hinge", 1.0, 0.0, 0.0),
    ("ipo", 0.1, 0.0, 0.0),
    ("ipo", 2.0, 0.0, 0.0),
    ("simpo", 2.0, 0.0, 0.5),
    ("simpo", 2.5, 0.1, 1.4),
]


def roll_call(fn, v: str, beta: float, eps: float, gamma: float, pairs: list[tuple]):
    t = [torch.tensor([p[k] for p in pairs], dtype=F64) for k in range(6)]
    ref = (None, None) if v == "simpo" else (t[2], t[3])
    return fn(
        t[0],
        t[1],
        *ref,
        variant=v,
        beta=beta,
        label_smoothing=eps,
        simpo_gamma=gamma,
        chosen_len=t[4],
        rejected_len=t[5],
    )


@pytest.mark.parametrize(("v", "beta", "eps", "gamma"), CASES)
def test_preference_losses_metrics_and_gradients_are_trls(v: str, beta: float, eps: float, gamma: float) -> None:
    pairs = random_pairs(64, seed=CASES.index((v, beta, eps, gamma)))
    want = trl_batch(v, beta, eps, gamma, pairs)
    assert 0 < want["reward_accuracy"] < 1  # both signs of the margin are probed
    loss, m = roll_call(preference_loss, v, beta, eps, gamma, pairs)
    assert loss.dtype == F64
    per_pair = [trl_pair(v, beta, eps, gamma, p)[0] for p in pairs]
    torch.testing.assert_close(loss, torch.tensor(per_pair, dtype=F64), atol=TOL, rtol=TOL)
    for k in ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"):
        assert abs(float(m[k]) - want[k]) <= TOL * max(1.0, abs(want[k])), (k, float(m[k]), want[k])
    w_c, w_r, _, _ = roll_call(preference_row_weights, v, beta, eps, gamma, pairs)
    torch.testing.assert_close(w_c, torch.tensor(want["w_chosen"], dtype=F64), atol=TOL, rtol=TOL)
    torch.testing.assert_close(w_r, torch.tensor(want["w_rejected"], dtype=F64), atol=TOL, rtol=TOL)


def test_label_smoothing_is_cdpo_as_trl_028_not_robust_nor_trl_1x() -> None:
    # Deliberate: roll's sigmoid with eps is conservative DPO, TRL <= 0.28's `sigmoid`; TRL 1.x's `sigmoid` ignores
    # label_smoothing (it reads it for `robust` and `exo_pair` only) and TRL's `robust` is a different loss.
    pairs = random_pairs(32, seed=5)
    loss, _ = roll_call(preference_loss, "sigmoid", 0.3, 0.2, 0.0, pairs)
    got = float(loss.mean())
    assert abs(got - trl_batch("sigmoid", 0.3, 0.2, 0.0, pairs)["loss"]) <= TOL
    assert abs(got - trl_batch("sigmoid", 0.3, 0.2, 0.0, pairs, trl="1.x")["loss"]) > 1e-3
    assert abs(got - trl_batch("robust", 0.3, 0.2, 0.0, pairs)["loss"]) > 1e-3
    assert "robust" not in preference.PREFERENCE_VARIANTS
    doc = " ".join(preference.__doc__.split())
    assert "TRL <= 0.28" in doc and "robust" in doc


def test_ipo_rewards_are_length_averaged_as_trl_028() -> None:
    # Deliberate: ipo compares length-averaged log-ratios; roll reports those (beta (pi - ref) / |y|), as TRL <= 0.28
    # did; TRL 1.x reports the summed log-ratios. One pair where the two disagree on the accuracy: chosen +2 nats over
    # 40 tokens, rejected +1 nat over 4 tokens (summed margin > 0, averaged < 0).
    pairs = [(-20.0, -7.0, -22.0, -8.0, 40, 4)]
    _, m = roll_call(preference_loss, "ipo", 0.1, 0.0, 0.0, pairs)
    old, new = trl_batch("ipo", 0.1, 0.0, 0.0, pairs), trl_batch("ipo", 0.1, 0.0, 0.0, pairs, trl="1.x")
    assert old["loss"] == new["loss"] and abs(float(m["loss"]) - old["loss"]) <= TOL
    for k in ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"):
        assert abs(float(m[k]) - old[k]) <= TOL, k
    assert float(m["reward_accuracy"]) == 0.0 and new["reward_accuracy"] == 1.0
    doc = " ".join(preference.__doc__.split())
    assert "TRL >= 0.29" in doc and "ipo" in doc


# ---------------------------------------------------------------- the dpo objective's metrics and row weights
def interleaved(pairs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token log-probs (2n, R) fp32, response_mask (2n, R) with holes and padding, reference sums (2n,))."""
    g = torch.Generator().manual_seed(seed)
    r = 12
    lengths = torch.randint(1, r + 1, (2 * pairs,), generator=g)
    mask = (torch.arange(r)[None] < lengths[:, None]).long()
    holes = (torch.rand(mask.shape, generator=g) < 0.2) & (torch.arange(r)[None] > 0)
    mask = mask * (~holes).long()  # masked context inside a response (the first token stays trained)
    logp = -torch.rand(mask.shape, generator=g) * 3
    logp = torch.where(mask.bool(), logp, torch.full_like(logp, float("nan")))  # never read where masked
    seq = torch.where(mask.bool(), logp.double(), 0.0).sum(-1)
    ref = (seq + torch.randn(2 * pairs, generator=g, dtype=F64)).float()
    return logp, mask, ref


@pytest.mark.parametrize(("v", "beta", "eps", "gamma"), CASES)
@pytest.mark.parametrize("sft_weight", [0.0, 0.7])
def test_dpo_objective_metrics_and_weights_are_trls(v: str, beta: float, eps: float, gamma: float, sft_weight: float):
    """The objective on interleaved rows (chosen at even rows) against TRL's loss + rpo_alpha x NLL (TRL <= 0.28's
    rpo_alpha, 1.x's loss_type=[..., "sft"]; CPO's cpo_alpha for simpo), NLL the token mean of the chosen
    completions' cross-entropy: metrics, and row weights w with sum_rows w x sum_t logp_t having its gradient."""
    n = 6
    logp, mask, ref = interleaved(n, seed=int(beta * 10) + len(v))
    obj = DPOObjective.__new__(DPOObjective)  # row_weights reads only the dpo config
    obj.dpo = DPOConfig(loss=v, beta=beta, label_smoothing=eps, simpo_gamma=gamma or 0.5, sft_weight=sft_weight)
    weights, m = obj.row_weights({"response_mask": mask}, logp, None if v == "simpo" else ref)
    tok = [[float(x) for x, k in zip(row, mrow, strict=True) if k] for row, mrow in zip(logp, mask, strict=True)]
    sums, lens, refs = [math.fsum(t) for t in tok], [len(t) for t in tok], [float(x) for x in ref]
    pairs = [(sums[i], sums[i + 1], refs[i], refs[i + 1], lens[i], lens[i + 1]) for i in range(0, 2 * n, 2)]
    want = trl_batch(v, beta, eps, gamma or 0.5, pairs)
    chosen_tokens = sum(lens[0::2])
    nll = -math.fsum(x for t in tok[0::2] for x in t) / chosen_tokens
    want.update(
        preference_loss=want["loss"],
        nll=nll,
        loss=want["loss"] + sft_weight * nll,
        chosen_logp=math.fsum(sums[0::2]) / n,
        rejected_logp=math.fsum(sums[1::2]) / n,
    )
    for k in ("loss", "preference_loss", "nll", "rewards_chosen", "rewards_rejected", "reward_margin", "chosen_logp"):
        assert abs(m[k] - want[k]) <= 1e-5 * max(1.0, abs(want[k])), (k, m[k], want[k])
    assert abs(m["reward_accuracy"] - want["reward_accuracy"]) <= 1e-7  # a count / n, rounded to fp32
    # d(loss)/d(logp of a token) of row i: its pair's weight, plus -rpo_alpha / T_c on each chosen token
    row_w = [w for pair in zip(want["w_chosen"], want["w_rejected"], strict=True) for w in pair]
    row_w = [w - (sft_weight / chosen_tokens if i % 2 == 0 else 0.0) for i, w in enumerate(row_w)]
    torch.testing.assert_close(weights.double(), torch.tensor(row_w, dtype=F64), atol=1e-6, rtol=1e-5)
    assert dpo_objective.WEIGHT_KEY == "dpo_weight"


# ======================================================================== SFT: token-mean over the whole mini-batch
LENGTHS = [1, 11, 3, 0, 7, 2, 9]  # trained tokens per row (one row trains none)


def sft_rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(token log-probs (B, R) fp64 with grad, response_mask (B, R) with a hole in row 1)."""
    r = max(LENGTHS) + 1
    mask = (torch.arange(r)[None] < torch.tensor(LENGTHS)[:, None]).long()
    mask[1, 4] = 0  # masked context inside a response
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(mask.shape, generator=g, dtype=F64) * 4).requires_grad_(True)
    return logp, mask


def reference_sft(logp: torch.Tensor, mask: torch.Tensor) -> tuple[float, list[list[float]]]:
    """sum of token NLLs / trained tokens (TRL's token-mean), and its gradient d/dlogp: -1/T on trained tokens."""
    cells = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    total, values = len(cells), logp.detach().tolist()
    loss = math.fsum(-values[b][t] for b, t in cells) / total
    grad = [[-1.0 / total if mask[b, t] else 0.0 for t in range(mask.shape[1])] for b in range(mask.shape[0])]
    return loss, grad


def accumulated(logp: torch.Tensor, mask: torch.Tensor, ranks: list[list[list[int]]], loss_fn) -> torch.Tensor:
    """The engines' accumulation: `ranks` holds each rank's micro-batches (row lists); a micro-batch's loss is scaled
    by units(micro) / U x D (U: units over every rank's micro-batches, D ranks) and the ranks' gradients averaged."""
    micros = [[{"response_mask": mask[rows]} for rows in rank] for rank in ranks]
    total = sum(loss_fn.units(m) for rank in micros for m in rank)
    d = len(ranks)
    out = logp.new_zeros(())
    for rank_rows, rank_micros in zip(ranks, micros, strict=True):
        for rows, micro in zip(rank_rows, rank_micros, strict=True):
            loss, _ = loss_fn({"logprobs": logp[rows]}, micro)
            out = out + loss * (loss_fn.units(micro) / total * d) / d
    return out


class MeanOfMicroMeans(SFTLoss):
    """The classic bug: every micro-batch weighs the same (its token mean), whatever its number of tokens."""

    def units(self, micro) -> float:
        return 1.0


def splits(mask: torch.Tensor) -> dict[str, list[list[list[int]]]]:
    b = mask.shape[0]
    attend = mask.clone()
    attend[1, 4] = 1  # the hole is attended
    return {
        "whole": [[list(range(b))]],
        "rows of 1": [[[i] for i in range(b)]],
        "rows of 3": [[list(range(i, min(i + 3, b))) for i in range(0, b, 3)]],
        "12-token budget": [token_budget_rows(attend, 12)],
        "two ranks, rows of 2": [[[0, 1], [2, 3]], [[4, 5], [6]]],
        "two ranks, unequal": [[[1]], [[0, 2], [3, 4, 5, 6]]],
    }


def test_sft_token_mean_is_exact_under_any_micro_batch_split_and_ranks() -> None:
    logp, mask = sft_rows()
    want_loss, want_grad = reference_sft(logp, mask)
    for what, ranks in splits(mask).items():
        got = accumulated(logp, mask, ranks, SFTLoss())
        (grad,) = torch.autograd.grad(got, logp)
        assert abs(got.item() - want_loss) <= TOL, what
        torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=F64), atol=TOL, rtol=TOL, msg=what)
    assert agg_units(mask, "token-mean") == sum(LENGTHS) - 1


def test_a_mean_of_micro_batch_means_is_caught() -> None:
    logp, mask = sft_rows()
    _, want_grad = reference_sft(logp, mask)
    for what, ranks in splits(mask).items():
        if what == "whole":
            continue
        got = accumulated(logp, mask, ranks, MeanOfMicroMeans())
        (grad,) = torch.autograd.grad(got, logp)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=F64), atol=TOL, rtol=TOL, msg=what)


# ---------------------------------------------------------------- the hf engine, end to end on the tiny model
GRAD_TOL = 1e-5
ENGINE_LENGTHS = [1, 11, 3, 0, 7, 2]


class _SimulatedRank(HFTrainEngine):
    """One of two data-parallel ranks: its all-reduce adds the other rank's [units, tokens]."""

    other = (0.0, 0.0)

    @property
    def dp_size(self) -> int:
        return 2

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t + torch.tensor(self.other, dtype=t.dtype)


@pytest.fixture(scope="module")
def sft_batch(tiny: str) -> dict[str, torch.Tensor]:
    """Rows after prompts of 1-4 tokens with 0 to 11 trained tokens; row 1's response has a masked (attended) hole."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 99, (1 + i % 4,), generator=g).tolist() for i in range(len(ENGINE_LENGTHS))]
    attend = (torch.arange(12)[None] < torch.tensor([max(n, 1) for n in ENGINE_LENGTHS])[:, None]).long()
    responses = torch.randint(3, 99, attend.shape, generator=g) * attend
    p_ids, p_mask = pad_left(prompts, 0)
    out = build_sequences(p_ids, p_mask, responses, attend)
    mask = attend.clone()
    mask[3] = 0  # the empty row attends one token, trains none
    mask[1, 4] = 0
    out.update(responses=responses, response_mask=mask)
    return out


@pytest.fixture(scope="module")
def reference_grads(tiny: str, sft_batch: dict) -> dict[str, torch.Tensor]:
    """sum of the trained tokens' NLL / their count, through plain transformers (each row on its own, unpadded)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    mask = sft_batch["response_mask"]
    total = int(mask.sum())
    r = mask.shape[1]
    for b in range(len(mask)):
        am = sft_batch["attention_mask"][b].bool()
        ids = sft_batch["input_ids"][b][am]
        resp_len = int(am[-r:].sum())
        logits = model(ids[None]).logits[0]
        logp = torch.log_softmax(logits[-resp_len - 1 : -1].float(), -1).gather(-1, ids[-resp_len:, None])[:, 0]
        nll = -(logp * mask[b, :resp_len]).sum() / total
        nll.backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for k, g in want.items():
        torch.testing.assert_close(got[k], g, atol=GRAD_TOL, rtol=GRAD_TOL, msg=f"{what}: {k}")


def _rank_grads(tiny: str, batch: dict, loss_fn, **kwargs) -> dict[str, torch.Tensor]:
    parts = [{k: v[rows] for k, v in batch.items()} for rows in ([1], [0, 2, 3, 4, 5])]
    counts = [(loss_fn.units(p), float(p["response_mask"].sum())) for p in parts]
    out: dict[str, torch.Tensor] = {}
    for i, part in enumerate(parts):
        engine = _SimulatedRank(tiny, lr=0.0, **kwargs)
        engine.other = counts[1 - i]
        for k, g in engine.compute_gradients(part, loss_fn).items():
            out[k] = out.get(k, 0) + g / 2  # the ranks' gradients averaged (FSDP / DDP)
    return out


CUTS = {
    "whole, padded": dict(micro_batch_size=6, pack_sequences=False),
    "rows of 1, padded": dict(micro_batch_size=1, pack_sequences=False),
    "rows of 2, packed": dict(micro_batch_size=2),
    "14-token budget, packed": dict(micro_batch_tokens=14),
    "14-token budget, padded": dict(micro_batch_tokens=14, pack_sequences=False),
}


def test_hf_engine_sft_gradient_is_the_whole_batchs_token_mean(tiny: str, sft_batch: dict, reference_grads: dict):
    for what, kwargs in CUTS.items():
        engine = HFTrainEngine(tiny, lr=0.0, **kwargs)
        _same(engine.compute_gradients(sft_batch, SFTLoss()), reference_grads, what)
        assert engine.micro_batches_run > 1 or what.startswith("whole")
    _same(_rank_grads(tiny, sft_batch, SFTLoss(), micro_batch_size=1), reference_grads, "two ranks")


def test_hf_engine_catches_a_mean_of_micro_batch_means(tiny: str, sft_batch: dict, reference_grads: dict) -> None:
    whole = HFTrainEngine(tiny, lr=0.0, micro_batch_size=6).compute_gradients(sft_batch, MeanOfMicroMeans())
    _same(whole, reference_grads, "one micro-batch: the bug is invisible")
    for what in ("rows of 1, padded", "14-token budget, packed"):
        got = HFTrainEngine(tiny, lr=0.0, **CUTS[what]).compute_gradients(sft_batch, MeanOfMicroMeans())
        with pytest.raises(AssertionError):
            _same(got, reference_grads, what)


def test_hf_engine_sft_loss_metric_is_the_batch_token_mean(tiny: str, sft_batch: dict) -> None:
    """SFTObjective's sft/loss: the ratio of the engine-averaged per-micro-batch NLL sums and token counts."""
    from roll_core.pipelines.objectives.sft import _NLL_SUM, _TOKENS

    engine = HFTrainEngine(tiny, role="reference", pack_sequences=False)
    logp = engine.compute_logprobs(sft_batch)["logprobs"].double()
    mask = sft_batch["response_mask"]
    want = float(-(logp * mask).sum() / mask.sum())
    got = HFTrainEngine(tiny, lr=0.0, micro_batch_tokens=14).train_step(sft_batch, SFTLoss())
    assert abs(got[_NLL_SUM] / got[_TOKENS] - want) <= 1e-5 * want
