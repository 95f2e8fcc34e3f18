"""roll-algos against the reference formulas: verl's `trainer/ppo/core_algos.py` and the papers roll cites.

Every reference below is written here from the formula (python loops over groups, rows and tokens, fp64), not
taken from roll or verl, and probed with ragged masks (left- and right-padded rows, holes, an empty row), groups
whose rewards are all equal, and an eps large enough (0.1) that its placement shows. Where roll deliberately
departs from verl the test pins roll's documented choice and the docstring that states it:
- a group of one gets advantage 0 (verl: GRPO r / (1 + eps), Dr.GRPO and RLOO the raw reward r);
- `seq-mean-token-sum` divides by all B rows, empty ones included (the engines' row units; verl: non-empty rows);
- `seq-mean-token-sum-norm` divides by B * norm_length, Dr.GRPO's 1/G (verl: norm_length alone);
- `ppo`'s dual clip is off unless asked for (verl's `vanilla` always applies c = 3);
- GAE advantages are not whitened here (verl whitens them; roll: `algo.whiten_advantages`);
- `cispo`'s weight floor is 1 - clip_low (as verl; the CISPO paper sets no lower bound).
"""

from __future__ import annotations

import math

import pytest
import torch

from roll_algos import advantages as adv
from roll_algos import losses
from roll_algos.kl import kl_estimate
from roll_algos.losses import aggregate, policy_loss, value_loss

F64 = torch.float64
EPS = 0.1  # large on purpose: (x - m) / (std + eps) and (x - m) / sqrt(var + eps) then differ visibly


def close(a: torch.Tensor, b: torch.Tensor | float, tol: float = 1e-9) -> None:
    torch.testing.assert_close(a.to(F64), torch.as_tensor(b, dtype=F64), atol=tol, rtol=tol)


def ragged_mask() -> torch.Tensor:
    """(6, 7): right-padded rows of lengths 7, 3, 1, a left-padded row, a row with holes, an empty row."""
    m = torch.zeros(6, 7, dtype=F64)
    m[0, :] = 1
    m[1, :3] = 1
    m[2, :1] = 1
    m[3, 4:] = 1
    m[4, [0, 1, 4, 5]] = 1
    return m


def _mean(xs: list[float]) -> float:
    return math.fsum(xs) / len(xs)


def _std(xs: list[float]) -> float:  # unbiased, as torch.std and verl
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


# ---------------------------------------------------------------- outcome advantages
def scores_with_flat_groups(g: int) -> torch.Tensor:
    s = torch.randn(5 * g, generator=torch.Generator().manual_seed(g), dtype=F64)
    s[g : 2 * g] = 0.7  # every sample of prompt 1 scored alike
    s[3 * g : 4 * g] = torch.tensor([1.0, 0.0] * (g // 2), dtype=F64)  # a 0/1 verifier group
    return s


def ref_grpo(scores: list[float], g: int, *, std: bool, eps: float) -> list[float]:
    out = []
    for k in range(0, len(scores), g):
        grp = scores[k : k + g]
        m = _mean(grp)
        out += [(r - m) / (_std(grp) + eps) if std else r - m for r in grp]
    return out


@pytest.mark.parametrize("g", [2, 4, 8])
def test_grpo_dr_grpo_rloo_match_their_formulas(g: int) -> None:
    s = scores_with_flat_groups(g)
    sl = s.tolist()
    close(adv.group_normalized(s, g, eps=EPS), ref_grpo(sl, g, std=True, eps=EPS))
    close(adv.group_normalized(s, g, std_normalize=False), ref_grpo(sl, g, std=False, eps=EPS))
    # reward_normalized's group/group and group/none are GRPO and Dr.GRPO
    close(adv.reward_normalized(s, g, eps=EPS), ref_grpo(sl, g, std=True, eps=EPS))
    close(adv.reward_normalized(s, g, std_type="none"), ref_grpo(sl, g, std=False, eps=EPS))
    # RLOO as verl writes it: r n / (n - 1) - mean n / (n - 1)
    rloo = []
    for k in range(0, len(sl), g):
        grp = sl[k : k + g]
        rloo += [r * g / (g - 1) - _mean(grp) * g / (g - 1) for r in grp]
    close(adv.leave_one_out(s, g), rloo)


def test_a_group_of_one_gets_zero_where_verl_passes_the_reward_through() -> None:
    # Deliberate: verl gives a lone sample r / (1 + eps) (GRPO: mean 0, std 1) or r (Dr.GRPO, RLOO), i.e. the raw
    # reward as its advantage; roll gives 0 (nothing to compare it with), and says so.
    s = torch.tensor([0.3, -2.0, 5.0], dtype=F64)
    for out in (
        adv.group_normalized(s, 1),
        adv.group_normalized(s, 1, std_normalize=False),
        adv.leave_one_out(s, 1),
        adv.reward_normalized(s, 1),
        adv.reward_normalized(s, 1, std_type="none"),
    ):
        close(out, [0.0, 0.0, 0.0])
    assert "group of one" in adv.group_normalized.__doc__.lower()
    assert "group of one" in adv.leave_one_out.__doc__.lower()


@pytest.mark.parametrize("g", [2, 4])
def test_lite_ppo_is_group_mean_over_batch_std_of_the_raw_rewards(g: int) -> None:
    s = scores_with_flat_groups(g)
    sl = s.tolist()
    batch_std = _std(sl)
    want = [v / (batch_std + EPS) for v in ref_grpo(sl, g, std=False, eps=EPS)]
    close(adv.reward_normalized(s, g, mean_type="group", std_type="batch", eps=EPS), want)
    # batch/batch is REINFORCE++'s sequence-level whitening
    m = _mean(sl)
    whitened = [(r - m) / (batch_std + EPS) for r in sl]
    close(adv.reward_normalized(s, g, mean_type="batch", std_type="batch", eps=EPS), whitened)
    close(adv.batch_normalized(s, eps=EPS), whitened)
    # REINFORCE++-baseline on (B,) scores: each sequence once, group mean out, then whitened over the batch
    centred = ref_grpo(sl, g, std=False, eps=EPS)
    cm, cs = _mean(centred), _std(centred)
    close(adv.group_baseline_batch_normalized(s, g, eps=EPS), [(c - cm) / (cs + EPS) for c in centred])


# ---------------------------------------------------------------- token-level returns, whitening, GAE
def ref_masked_whiten(x: list[list[float]], m: list[list[float]], eps: float = 1e-8) -> list[list[float]]:
    vals = [x[b][t] for b in range(len(x)) for t in range(len(x[b])) if m[b][t]]
    mu = _mean(vals)
    var = math.fsum((v - mu) ** 2 for v in vals) / (len(vals) - 1)
    scale = 1 / math.sqrt(var + eps)
    return [[(xv - mu) * scale if mv else 0.0 for xv, mv in zip(xr, mr)] for xr, mr in zip(x, m)]


def ref_returns(r: list[list[float]], m: list[list[float]], gamma: float) -> list[list[float]]:
    """verl's REINFORCE++ returns for rows padded on either side (running sum, reset at each padding token)."""
    out = []
    for rr, mm in zip(r, m):
        run, row = 0.0, [0.0] * len(rr)
        for t in reversed(range(len(rr))):
            run = rr[t] + gamma * run
            row[t] = run if mm[t] else 0.0
            run *= mm[t]
        out.append(row)
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_returns_and_token_whitening_match_verl(gamma: float) -> None:
    mask = ragged_mask()[[0, 1, 2, 3, 5]]  # padded on either side, no holes (verl resets its sum at a hole)
    r = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1), dtype=F64) * mask
    r[mask == 0] = 123.0  # whatever padding holds
    want = ref_returns(r.tolist(), mask.tolist(), gamma)
    got = adv.discounted_returns(r, mask, gamma=gamma)
    close(got, want)
    close(adv.whiten(got, mask), ref_masked_whiten(want, mask.tolist()))


def test_reinforce_pp_baseline_composition_matches_verl_at_gamma_one() -> None:
    # verl: (score - group mean) on every token, whitened over the tokens. roll-core: the group mean subtracted
    # from the outcome on the last token, reward-to-go (gamma 1), whitened over the tokens: the same numbers.
    mask = ragged_mask()[[0, 1, 2, 3]]
    s = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=F64)
    base = s - adv.group_normalized(s, 2, std_normalize=False)
    last = torch.zeros_like(mask)
    last[0, 6], last[1, 2], last[2, 0], last[3, 6] = 1, 1, 1, 1
    got = adv.whiten(adv.discounted_returns((s - base)[:, None] * last, mask, gamma=1.0), mask)
    centred = ref_grpo(s.tolist(), 2, std=False, eps=0.0)
    tiled = [[c] * mask.shape[1] for c in centred]
    close(got, ref_masked_whiten(tiled, mask.tolist()))


def ref_gae(r, v, m, gamma, lam):  # verl's recursion, skipping masked steps
    out = []
    for rr, vv, mm in zip(r, v, m):
        nxt, last, row = 0.0, 0.0, [0.0] * len(rr)
        for t in reversed(range(len(rr))):
            cur = rr[t] + gamma * nxt - vv[t] + gamma * lam * last
            if mm[t]:
                nxt, last, row[t] = vv[t], cur, cur
        out.append(row)
    return out


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_verl_before_its_whitening(gamma: float, lam: float) -> None:
    mask = ragged_mask()
    gen = torch.Generator().manual_seed(2)
    r = torch.randn(mask.shape, generator=gen, dtype=F64)
    v = torch.randn(mask.shape, generator=gen, dtype=F64)
    r[mask == 0], v[mask == 0] = 50.0, -50.0
    want = ref_gae(r.tolist(), v.tolist(), mask.tolist(), gamma, lam)
    a, ret = adv.gae(r, v, mask, gamma=gamma, lam=lam)
    close(a, want)
    close(ret, torch.tensor(want, dtype=F64) + v * mask)
    # verl then whitens the advantages; roll leaves that to algo.whiten_advantages (whiten = verl's masked_whiten)
    close(adv.whiten(a, mask), ref_masked_whiten(want, mask.tolist()))


# ---------------------------------------------------------------- KL estimators
def test_kl_estimators_match_verl_kl_penalty() -> None:
    x = torch.tensor([-30.0, -12.0, -3.0, -0.5, -1e-4, 0.0, 1e-4, 0.5, 3.0, 25.0], dtype=F64)  # logp - ref_logp
    ref = torch.full_like(x, -2.0)
    logp = ref + x
    for kind, f in {
        "k1": lambda d: d,
        "k2": lambda d: 0.5 * d * d,
        "mse": lambda d: 0.5 * d * d,
        "abs": abs,
        # verl: k = clamp(ref - logp, +-20); clamp(e^k - k - 1, -10, 10)
        "k3": lambda d: min(max(math.exp(min(max(-d, -20), 20)) - min(max(-d, -20), 20) - 1, -10), 10),
        "low_var_kl": lambda d: min(max(math.exp(min(max(-d, -20), 20)) - min(max(-d, -20), 20) - 1, -10), 10),
    }.items():
        close(kl_estimate(logp, ref, kind), [f(d) for d in x.tolist()], tol=1e-12)


# ---------------------------------------------------------------- aggregation
def ref_agg(lm: list[list[float]], m: list[list[float]], mode: str, norm: int) -> float:
    rows = [[x for x, k in zip(lr, mr) if k] for lr, mr in zip(lm, m)]
    if mode == "token-mean":
        return math.fsum(x for r in rows for x in r) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return _mean([_mean(r) for r in rows if r])
    if mode == "seq-mean-token-sum":  # roll: every row of the batch counts (verl: rows with a token)
        return math.fsum(math.fsum(r) for r in rows) / len(rows)
    return math.fsum(math.fsum(r) for r in rows) / (len(rows) * norm)  # Dr.GRPO: 1/G, then 1/MAX_TOKENS


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_aggregation_matches_its_formula(mode: str) -> None:
    mask = ragged_mask()
    lm = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    lm[mask == 0] = float("nan")
    close(aggregate(lm, mask, mode, norm_length=16), ref_agg(lm.tolist(), mask.tolist(), mode, 16))
    # Without an empty row verl's seq-mean-token-sum (over rows with a token) is the same number.
    close(aggregate(lm[:5], mask[:5], mode, norm_length=16), ref_agg(lm[:5].tolist(), mask[:5].tolist(), mode, 16))


def test_token_sum_modes_state_their_divisors() -> None:
    doc = losses.__doc__
    assert "mean over all B sequences of sum_t L*m" in doc and "sum(L*m) / (B * norm_length)" in doc


# ---------------------------------------------------------------- policy losses
def policy_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = ragged_mask()
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=gen, dtype=F64) * 3
    logp = old + torch.randn(mask.shape, generator=gen, dtype=F64) * 0.4  # ratios on both sides of both clips
    a = torch.randn(mask.shape, generator=gen, dtype=F64)
    logp[mask == 0], old[mask == 0], a[mask == 0] = float("nan"), float("inf"), float("nan")
    return logp, old, a, mask


def check_against(variant: str, ref_token_loss, seed: int, **kw) -> None:
    """roll's loss and gradient equal `ref_token_loss(logp, old, A)` (B, T) aggregated by token-mean and by
    seq-mean-token-mean (with ref_agg's formula), on leaf copies of logp."""
    logp, old, a, mask = policy_inputs(seed)
    for agg in ("token-mean", "seq-mean-token-mean"):
        mine = logp.clone().requires_grad_(True)
        got, _ = policy_loss(mine, old, a, mask, variant=variant, agg=agg, **kw)
        got.backward()
        theirs = torch.where(mask.bool(), logp, 0.0).requires_grad_(True)
        per_token = ref_token_loss(theirs, torch.where(mask.bool(), old, 0.0), torch.where(mask.bool(), a, 0.0))
        valid = mask.bool()
        if agg == "token-mean":
            want = per_token[valid].sum() / valid.sum()
        else:
            rows = [per_token[b][valid[b]].mean() for b in range(mask.shape[0]) if valid[b].any()]
            want = torch.stack(rows).mean()
        want.backward()
        close(got.detach(), want.detach())
        close(mine.grad, torch.where(valid, theirs.grad, 0.0))


def ppo_ref(lo: float, hi: float, c: float | None):
    def f(logp, old, a):  # verl's compute_policy_loss_vanilla
        r = torch.exp(torch.clamp(logp - old, -20, 20))
        l1 = torch.maximum(-a * r, -a * torch.clamp(r, 1 - lo, 1 + hi))
        return l1 if c is None else torch.where(a < 0, torch.minimum(-a * c, l1), l1)

    return f


@pytest.mark.parametrize("seed", [0, 1])
def test_ppo_clip_higher_and_dual_clip_match_verl(seed: int) -> None:
    check_against("ppo", ppo_ref(0.2, 0.2, None), seed)
    check_against("ppo", ppo_ref(0.2, 0.28, None), seed, clip_high=0.28)  # DAPO clip-higher
    check_against("ppo", ppo_ref(0.2, 0.28, 3.0), seed, clip_high=0.28, dual_clip=3.0)  # verl's default c = 3
    check_against("ppo", ppo_ref(0.1, 0.3, 1.5), seed, clip_low=0.1, clip_high=0.3, dual_clip=1.5)


def gspo_ref(lo: float, hi: float):
    def f(logp, old, a):  # GSPO-token (arXiv 2507.18071 eq. 13), as verl
        m = ragged_mask()
        s = ((logp - old) * m).sum(-1) / m.sum(-1).clamp(min=1)  # log s_i = mean_t log r_t, unclamped per token
        ratio = torch.exp(s.detach()[:, None] + logp - logp.detach())
        return torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - lo, 1 + hi))

    return f


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_the_sequence_ratio_of_the_paper(seed: int) -> None:
    check_against("gspo", gspo_ref(3e-4, 4e-4), seed, clip_low=3e-4, clip_high=4e-4)  # the paper's ranges
    check_against("gspo", gspo_ref(0.2, 0.28), seed, clip_high=0.28)


def test_gspo_sequence_ratio_is_the_mean_of_the_true_token_log_ratios() -> None:
    # Row of two tokens, log r = 25 and -21: s = exp((25 - 21) / 2) = e^2 = 7.389. With A = -1 the unclipped
    # branch is the larger: loss = -A s = 7.389, gradient s / 2 per token (token-mean over 2). Clamping each token
    # to +-20 before the mean read s as exp(0) = 1: loss 1 (inside the clip range) and gradient 1/2.
    logp = torch.tensor([[-1.0, -30.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-26.0, -9.0]], dtype=F64)
    loss, m = policy_loss(logp, old, torch.tensor([-1.0], dtype=F64), torch.ones(1, 2), variant="gspo")
    loss.backward()
    close(loss.detach(), math.exp(2.0))
    close(logp.grad, [[math.exp(2.0) / 2, math.exp(2.0) / 2]])
    close(m["ratio_mean"], math.exp(2.0))
    # A row's mean beyond +-20 is bounded there (exp stays finite in fp32), as ppo's per-token ratio is.
    one = torch.ones(1, 1)
    loss, _ = policy_loss(0 * one, -45 * one, torch.tensor([-1.0]), one, variant="gspo")
    close(loss, math.exp(20.0), tol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_family_matches_its_formulas(seed: int) -> None:
    def ratio(logp, old):
        return torch.exp(torch.clamp(logp - old, -20, 20)).detach()

    # CISPO (MiniMax-M1; verl's cispo): -sg(clip(r, 1 - clip_low, 1 + clip_high)) A logp
    check_against("cispo", lambda lp, o, a: -torch.clamp(ratio(lp, o), 0.8, 1.28) * a * lp, seed, clip_high=0.28)
    check_against("tis", lambda lp, o, a: -torch.clamp(ratio(lp, o), max=1.5) * a * lp, seed, ratio_cap=1.5)
    check_against("vanilla", lambda lp, o, a: -a * lp, seed)

    # TOPR (Le Roux et al.): positive rows -A logp, others -sg(clip(r, 0, 1)) A logp; positive = mean A > 0 by default
    def topr(lp, o, a):
        m = ragged_mask()
        pos = ((a * m).sum(-1) / m.sum(-1).clamp(min=1)) > 0
        return torch.where(pos[:, None], -a * lp, -torch.clamp(ratio(lp, o), 0, 1) * a * lp)

    check_against("topr", topr, seed)


def test_cispo_documents_its_weight_floor() -> None:
    doc = losses.cispo_loss.__doc__
    assert "1-clip_low" in doc and "no lower bound" in doc


def test_value_loss_matches_verl_clipped_form() -> None:
    mask = ragged_mask()
    gen = torch.Generator().manual_seed(4)
    v, old, ret = (torch.randn(mask.shape, generator=gen, dtype=F64) for _ in range(3))
    for clip in (None, 0.2, 0.5):
        for agg in ("token-mean", "seq-mean-token-mean"):
            mine = v.clone().requires_grad_(True)
            got, met = value_loss(mine, old, ret, mask, clip=clip, agg=agg)
            got.backward()
            theirs = v.clone().requires_grad_(True)
            e1 = (theirs - ret) ** 2
            e2 = (torch.clamp(theirs, old - clip, old + clip) - ret) ** 2 if clip is not None else e1
            per_token = torch.maximum(e1, e2)
            want = 0.5 * torch.tensor(ref_agg(per_token.tolist(), mask.tolist(), agg, 1), dtype=F64)
            close(got.detach(), want)
            # gradient of verl's loss through the same aggregation
            w = mask / mask.sum() if agg == "token-mean" else mask / (mask.sum(-1, keepdim=True).clamp(min=1) * 5)
            (0.5 * per_token * w).sum().backward()
            close(mine.grad, theirs.grad)
            close(met["vf_clipfrac"], ((e2 > e1).to(F64) * mask).sum() / mask.sum())


def test_overlong_penalty_is_dapos_soft_punishment() -> None:
    lmax, cache = 20, 8
    lengths = torch.arange(0, 26)

    def dapo(n: int) -> float:
        if n <= lmax - cache:
            return 0.0
        return (lmax - cache - n) / cache if n <= lmax else -1.0

    close(losses.overlong_penalty(lengths, max_length=lmax, buffer=cache), [dapo(n) for n in lengths.tolist()], 1e-6)
