"""roll's distillation losses against their published formulas, as test_reference_crosscheck.py does for the RL
estimators: references written here from the formulas (python loops over positions and vocabulary ids, fp64), never
from roll's code, probed with ragged masks, several temperatures, top-k lists that miss the response token, zero
probabilities and a teacher whose padded vocabulary is wider than the student's.

Peers: TRL's GKDTrainer `generalized_jsd_loss` and Agarwal et al. 2024 (GKD) eq. 1,
    JSD(beta) = beta KL(T || M) + (1 - beta) KL(S || M),  M = beta T + (1 - beta) S,
with TRL's special cases beta = 0: KL(T || S) (forward) and beta = 1: KL(S || T) (reverse); both logits divided by
the temperature before the softmax; masked tokens (labels -100) dropped and the sum divided by the unmasked tokens.
roll offers forward and reverse (roll_algos.distill `DISTILL_KL_KINDS`), top-k truncated with a tail bucket or
renormalised over the K ids, and on-policy distillation's sampled-token reverse-KL advantages; not the JSD of
0 < beta < 1 (stated in roll_algos.distill's docstring). The temperature's placement inside the train engines
(log_softmax(logits / T) for the top-k and the gathered ids) is checked against transformers in
test_topk_logprobs.py; here the engine's `_logits` functions get tempered logits, as the engines give them.
Fast, no Ray, no model.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from roll_algos import distill as distill_mod
from roll_algos.distill import DISTILL_KL_KINDS, on_policy_distill_advantages, reverse_kl_per_token, topk_distill_loss
from roll_core.pipelines.collectors.distill_offline import OfflineDistillCollector
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.objectives import distill_offline as offline_obj
from roll_core.pipelines.objectives.distill import DistillObjective
from roll_core.protocol import Batch
from roll_engines.train._logits import response_outputs, topk_of

F64 = torch.float64
INF = math.inf
B, R, V = 5, 6, 8


def close(a: torch.Tensor | float, b: torch.Tensor | float, tol: float = 1e-10) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=tol, rtol=tol)


def ragged_mask() -> torch.Tensor:
    """(5, 6): a full row, a right-padded row, a left-padded row, a row with holes, an empty row."""
    m = torch.zeros(B, R, dtype=F64)
    m[0] = 1
    m[1, :2] = 1
    m[2, 3:] = 1
    m[3, [0, 2, 5]] = 1
    return m


# ---------------------------------------------------------------- references (python floats, from the formulas)
def softmax_ref(logits: list[float], temperature: float) -> list[float]:
    """softmax(logits / temperature); -inf logits get probability 0."""
    z = [x / temperature for x in logits]
    top = max(z)
    e = [0.0 if x == -INF else math.exp(x - top) for x in z]
    s = math.fsum(e)
    return [x / s for x in e]


def kl_ref(p: list[float], q: list[float]) -> float:
    """KL(p || q) = sum_i p_i log(p_i / q_i), 0 log 0 = 0, +inf where q_i = 0 < p_i."""
    terms = []
    for pi, qi in zip(p, q, strict=True):
        if pi == 0.0:
            continue
        if qi == 0.0:
            return INF
        terms.append(pi * (math.log(pi) - math.log(qi)))
    return math.fsum(terms)


def gjsd_ref(teacher: list[float], student: list[float], beta: float) -> float:
    """GKD eq. 1 with TRL's endpoints: beta = 0 forward KL(T || S), beta = 1 reverse KL(S || T)."""
    if beta == 0:
        return kl_ref(teacher, student)
    if beta == 1:
        return kl_ref(student, teacher)
    m = [beta * t + (1 - beta) * s for t, s in zip(teacher, student, strict=True)]
    return beta * kl_ref(teacher, m) + (1 - beta) * kl_ref(student, m)


def buckets(p: list[float], ids: list[int], *, tail: bool) -> list[float]:
    """p on the K ids, plus the mass of every other id (tail), or renormalised over the K ids (no tail)."""
    on = [p[i] for i in ids]
    if not tail:
        s = math.fsum(on)
        return [x / s for x in on]
    return [*on, math.fsum(p[i] for i in range(len(p)) if i not in ids)]


def trl_generalized_jsd(s_logits: torch.Tensor, t_logits: torch.Tensor, labels: torch.Tensor, beta: float, temp: float):
    """TRL's `generalized_jsd_loss` (trl/experimental/gkd/gkd_trainer.py), re-typed from its formula: F.kl_div with
    log targets, batchmean over labels != -100."""
    s = F.log_softmax(s_logits / temp, dim=-1)
    t = F.log_softmax(t_logits / temp, dim=-1)
    if beta == 0:
        jsd = F.kl_div(s, t, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(t, s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=s.dtype)
        mix = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(mix, t, reduction="none", log_target=True) + (1 - b) * F.kl_div(
            mix, s, reduction="none", log_target=True
        )
    mask = labels != -100
    return jsd[mask].sum() / mask.sum()


def logits(seed: int, v: int = V, scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(B, R, v, generator=torch.Generator().manual_seed(seed), dtype=F64)


def roll_student_teacher(s_logits: torch.Tensor, t_logits: torch.Tensor, k: int, temp: float):
    """What the pipeline hands the loss: the teacher's top-k of log_softmax(t / T) (a scoring pass) and the
    student's log_softmax(s / T) gathered at those ids (a training pass), through the engines' own functions."""
    tz = t_logits / temp
    top = topk_of(tz, torch.logsumexp(tz, -1), k)
    resp = torch.zeros(s_logits.shape[:2], dtype=torch.long)
    student = response_outputs(s_logits / temp, resp, gather_ids=top["topk_ids"])["gathered_logprobs"]
    return student, top["topk_logprobs"], top["topk_ids"]


# ---------------------------------------------------------------- full vocabulary: TRL's beta = 0 and beta = 1
@pytest.mark.parametrize("temp", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("kind", DISTILL_KL_KINDS)
def test_full_vocabulary_kl_is_trl_gkd_beta_0_forward_and_beta_1_reverse(kind: str, temp: float) -> None:
    s_logits, t_logits, mask = logits(1), logits(2), ragged_mask()
    student, teacher, _ = roll_student_teacher(s_logits, t_logits, V, temp)
    student.requires_grad_(True)
    loss, kl, _ = topk_distill_loss(student, teacher, mask, kind=kind)
    beta = 0 if kind == "forward" else 1
    want = [
        [gjsd_ref(softmax_ref(t_logits[b, t].tolist(), temp), softmax_ref(s_logits[b, t].tolist(), temp), beta)
         * float(mask[b, t]) for t in range(R)]
        for b in range(B)
    ]  # fmt: skip
    close(kl, want)
    n = int(mask.sum())
    close(loss, math.fsum(x for row in want for x in row) / n)  # token mean over the unmasked tokens
    # TRL's own formula (batchmean over labels != -100) gives the same loss, and its beta = 0.5 is neither side
    labels = torch.where(mask.bool(), 0, -100)
    close(loss, trl_generalized_jsd(s_logits, t_logits, labels, beta, temp))
    mid = trl_generalized_jsd(s_logits, t_logits, labels, 0.5, temp)
    close(mid, math.fsum(
        gjsd_ref(softmax_ref(t_logits[b, t].tolist(), temp), softmax_ref(s_logits[b, t].tolist(), temp), 0.5)
        for b in range(B) for t in range(R) if mask[b, t]
    ) / n)  # fmt: skip
    assert abs(float(mid) - loss.item()) > 1e-3
    # the temperature is applied to both sides: tempering the teacher alone is another number
    if temp != 1.0:
        one_sided = [
            gjsd_ref(softmax_ref(t_logits[b, t].tolist(), temp), softmax_ref(s_logits[b, t].tolist(), 1.0), beta)
            for b in range(B) for t in range(R) if mask[b, t]
        ]  # fmt: skip
        assert abs(math.fsum(one_sided) / n - loss.item()) > 1e-3
    loss.backward()
    assert torch.isfinite(student.grad).all()


def test_the_docstring_states_the_peer_conventions_and_what_is_not_offered() -> None:
    doc = " ".join(distill_mod.__doc__.split())
    assert DISTILL_KL_KINDS == ("forward", "reverse")
    assert "`forward` is its beta = 0 and `reverse` its beta = 1" in doc
    assert "0 < beta < 1" in doc and "is not offered" in doc
    assert "no bound of the full KL" in doc
    assert "beta = 1, reverse KL" in doc  # on-policy distillation is GKD's reverse KL
    assert offline_obj.TEMPERATURE == 1.0  # offline: the models' plain distributions, both sides


# ---------------------------------------------------------------- top-k truncation
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("kind", DISTILL_KL_KINDS)
def test_topk_kl_is_the_bucketed_or_renormalised_kl_and_the_response_token_may_miss(kind: str, tail: bool) -> None:
    k, temp = 3, 0.8
    s_logits, t_logits, mask = logits(3), logits(4), ragged_mask()
    student, teacher, ids = roll_student_teacher(s_logits, t_logits, k, temp)
    # at (0, 1) the student puts most of its mass on an id outside the teacher's top-k (the response token of
    # teacher-forced rows, or the student's own sample): it counts in the student's tail, or (no tail) nowhere
    miss = next(i for i in range(V) if i not in ids[0, 1].tolist())
    s_logits[0, 1, miss] = 12.0
    student, teacher, ids = roll_student_teacher(s_logits, t_logits, k, temp)
    # masked positions hold garbage, which never reaches the loss or the gradient
    hole = ~mask.bool()
    student = torch.where(hole[..., None], torch.nan, student).requires_grad_(True)
    teacher = torch.where(hole[..., None], -torch.inf, teacher)
    loss, kl, metrics = topk_distill_loss(student, teacher, mask, kind=kind, tail=tail)
    want, t_mass, s_mass = [], [], []
    for b in range(B):
        row = []
        for t in range(R):
            if not mask[b, t]:
                row.append(0.0)
                continue
            p_t, p_s = softmax_ref(t_logits[b, t].tolist(), temp), softmax_ref(s_logits[b, t].tolist(), temp)
            top = ids[b, t].tolist()
            bt, bs = buckets(p_t, top, tail=tail), buckets(p_s, top, tail=tail)
            row.append(kl_ref(bt, bs) if kind == "forward" else kl_ref(bs, bt))
            t_mass.append(math.fsum(p_t[i] for i in top))
            s_mass.append(math.fsum(p_s[i] for i in top))
            if tail:  # merging ids never increases a KL: a lower bound of the full KL
                full = kl_ref(p_t, p_s) if kind == "forward" else kl_ref(p_s, p_t)
                assert row[-1] <= full + 1e-12
        want.append(row)
    close(kl, want)
    close(loss, math.fsum(x for r in want for x in r) / float(mask.sum()))
    close(metrics["teacher_topk_mass"], math.fsum(t_mass) / len(t_mass))
    close(metrics["student_topk_mass"], math.fsum(s_mass) / len(s_mass))
    assert s_mass[1] < 0.01  # (0, 1): the student's mass sits outside the teacher's top-k
    loss.backward()
    assert torch.isfinite(student.grad).all() and not student.grad[hole].any()


def test_the_renormalised_kl_can_exceed_the_full_kl() -> None:
    # p = (0.45, 0.05, 0.5), q = (0.05, 0.45, 0.5), K = {0, 1}: full KL 0.4 log 9, conditional KL 0.8 log 9
    p, q = [0.45, 0.05, 0.5], [0.05, 0.45, 0.5]
    lp = torch.tensor([[[math.log(0.45), math.log(0.05)]]], dtype=F64)
    lq = torch.tensor([[[math.log(0.05), math.log(0.45)]]], dtype=F64)
    one = torch.ones(1, 1, dtype=F64)
    _, renorm, _ = topk_distill_loss(lq, lp, one, kind="forward", tail=False)
    _, bucketed, _ = topk_distill_loss(lq, lp, one, kind="forward", tail=True)
    close(renorm[0, 0], 0.8 * math.log(9))
    close(bucketed[0, 0], kl_ref(p, q))  # the tails match: K = {0, 1} plus one bucket is the whole vocabulary here
    assert float(renorm) > kl_ref(p, q)


# ---------------------------------------------------------------- zero probabilities
def test_a_zero_probability_adds_nothing_on_the_left_and_infinity_on_the_right() -> None:
    # teacher p = (0.7, 0.3, 0) on its top-3 (an id it gives probability 0), student q = (0.2, 0.3, 0.5)
    p, q = [0.7, 0.3, 0.0], [0.2, 0.3, 0.5]
    lp = torch.tensor([[[math.log(0.7), math.log(0.3), -INF]]], dtype=F64)
    lq = torch.tensor([[[math.log(0.2), math.log(0.3), math.log(0.5)]]], dtype=F64, requires_grad=True)
    one = torch.ones(1, 1, dtype=F64)
    for tail in (True, False):
        loss, _, _ = topk_distill_loss(lq, lp, one, kind="forward", tail=tail)  # 0 log 0 = 0
        close(loss, kl_ref(p, q) if tail else kl_ref(p, buckets(q, [0, 1, 2], tail=False)))
        (grad,) = torch.autograd.grad(loss, lq)
        assert torch.isfinite(grad).all()
        # reverse with the zero on the student's side: the student gives an id probability 0
        loss, _, _ = topk_distill_loss(lp.clone().requires_grad_(True), lq.detach(), one, kind="reverse", tail=tail)
        close(loss, kl_ref(p, q) if tail else kl_ref(p, buckets(q, [0, 1, 2], tail=False)))
    # the teacher gives probability 0 to an id the student puts mass on: reverse KL is +inf (not NaN)
    loss, _, _ = topk_distill_loss(lq, lp, one, kind="reverse")
    assert loss.item() == INF and kl_ref(q, p) == INF
    loss, _, _ = topk_distill_loss(lp, lq.detach(), one, kind="forward")
    assert loss.item() == INF


# ---------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", DISTILL_KL_KINDS)
def test_fp32_and_bf16_inputs_match_the_fp64_reference(kind: str, dtype: torch.dtype) -> None:
    k, temp = 4, 0.7
    s64, t64, mask = logits(5), logits(6), ragged_mask()
    # a bf16 model's logits reach the log-softmax in fp32 (the engines' logits.float()): compare with the fp64
    # reference of the rounded logits
    s_in, t_in = s64.to(dtype).float(), t64.to(dtype).float()
    student, teacher, ids = roll_student_teacher(s_in, t_in, k, temp)
    _, kl, _ = topk_distill_loss(student, teacher, mask.float(), kind=kind)
    assert kl.dtype == torch.float32
    student64, teacher64, ids64 = roll_student_teacher(s_in.double(), t_in.double(), k, temp)
    assert torch.equal(ids, ids64)
    _, want, _ = topk_distill_loss(student64, teacher64, mask, kind=kind)
    close(kl, want, tol=2e-5)
    # log-probs handed over in bf16 are upcast before the tails (1 - mass) are formed
    _, kl16, _ = topk_distill_loss(student64.to(dtype), teacher64.to(dtype), mask.to(dtype), kind=kind)
    assert kl16.dtype == torch.float32
    _, want16, _ = topk_distill_loss(student64.to(dtype).double(), teacher64.to(dtype).double(), mask, kind=kind)
    close(kl16, want16, tol=2e-5)
    # on-policy: the sampled-token estimate in fp32 is the fp64 one
    s_tok, t_tok = student64[..., 0], teacher64[..., 0]
    close(reverse_kl_per_token(s_tok.float(), t_tok.float(), mask), (s_tok - t_tok) * mask, tol=1e-5)


# ---------------------------------------------------------------- on-policy distillation
@pytest.mark.parametrize("temp", [1.0, 0.6])
def test_on_policy_advantages_are_an_unbiased_gkd_reverse_kl_gradient(temp: float) -> None:
    # At one context, weight every vocabulary id y by pi_S(y) (the exact expectation over the student's samples):
    # E[k1] is KL(S || T) (GKD / TRL beta = 1) and E[A grad log pi_S] is -grad KL(S || T).
    g = torch.Generator().manual_seed(7)
    z = (2 * torch.randn(V, generator=g, dtype=F64)).requires_grad_(True)
    zt = 2 * torch.randn(V, generator=g, dtype=F64)
    log_s, log_t = torch.log_softmax(z / temp, -1), torch.log_softmax(zt / temp, -1)
    one = torch.ones(1, V, dtype=F64)
    k1 = reverse_kl_per_token(log_s.detach()[None], log_t[None], one)[0]
    p_s = softmax_ref(z.tolist(), temp)
    want = gjsd_ref(softmax_ref(zt.tolist(), temp), p_s, 1)
    close(math.fsum(p * float(x) for p, x in zip(p_s, k1, strict=True)), want)
    adv = on_policy_distill_advantages(log_s.detach()[None], log_t[None], one, coef=1.0)[0]
    (pg,) = torch.autograd.grad((log_s.exp().detach() * adv * log_s).sum(), z, retain_graph=True)
    kl = (log_s.exp() * (log_s - log_t)).sum()
    (direct,) = torch.autograd.grad(kl, z)
    close(pg, -direct)


def _teacher_batch(student_ids: torch.Tensor, mask: torch.Tensor) -> Batch:
    b, r = student_ids.shape
    prompts = torch.ones(b, 2, dtype=torch.long)
    return Batch(
        {
            "input_ids": torch.cat([prompts, student_ids], 1),
            "attention_mask": torch.cat([torch.ones(b, 2, dtype=torch.long), mask.long()], 1),
            "position_ids": torch.arange(2 + r).expand(b, -1),
            "responses": student_ids,
            "response_mask": mask.float(),
        },
        {"metadata": [{}] * b},
    )


class _ScoringTeacher:
    """A teacher role: log_softmax(logits / T) over its own (padded) vocabulary at the response tokens; garbage
    (`junk`) at masked positions, as a constrained or padded position may give."""

    def __init__(self, logits: torch.Tensor, junk: float = math.nan) -> None:
        self.logits, self.junk, self.temperatures = logits, junk, []

    def compute_logprobs(self, batch: Batch, temperature: float, topk: int = 0) -> dict[str, torch.Tensor]:
        self.temperatures.append(temperature)
        z = self.logits / temperature
        if topk:
            return topk_of(z, torch.logsumexp(z, -1), topk)
        lp = torch.log_softmax(z, -1).gather(-1, batch["responses"][..., None])[..., 0]
        return {"logprobs": torch.where(batch["response_mask"].bool(), lp, self.junk)}


def _on_policy(teacher: _ScoringTeacher, temp: float) -> SimpleNamespace:
    return SimpleNamespace(roles=SimpleNamespace(teachers={"default": teacher}), temperature=temp)


@pytest.mark.parametrize("padding", [-INF, -3.0])
def test_on_policy_teacher_log_probs_with_a_wider_padded_vocabulary(padding: float) -> None:
    # teacher vocabulary 10 (ids 8, 9 padding), student 8: ids align one to one, each side normalised over its own
    # logits, so finite padding logits hold part of the teacher's mass and -inf ones none
    temp, mask = 0.7, ragged_mask()
    t_logits = torch.cat([logits(8), torch.full((B, R, 2), padding, dtype=F64)], -1)
    s_logits = logits(9)
    ids = torch.randint(0, V, (B, R), generator=torch.Generator().manual_seed(10))
    student = torch.log_softmax(s_logits / temp, -1).gather(-1, ids[..., None])[..., 0]
    for junk in (math.nan, -INF):  # what a teacher gives at masked positions never reaches the result
        role = _ScoringTeacher(t_logits, junk)
        out = StepLog()
        got = DistillObjective.teacher_logprobs(_on_policy(role, temp), _teacher_batch(ids, mask), student, out)
        assert role.temperatures == [temp]  # the rollout temperature, as the student's
        want = [
            [math.log(softmax_ref(t_logits[b, t].tolist(), temp)[int(ids[b, t])]) if mask[b, t] else 0.0
             for t in range(R)]
            for b in range(B)
        ]  # fmt: skip
        close(got, want, tol=1e-6)  # the objective keeps teacher log-probs in fp32 (the mask's dtype)
        if padding == -INF:  # the padded teacher is the unpadded one
            close(got, torch.log_softmax(t_logits[..., :V] / temp, -1).gather(-1, ids[..., None])[..., 0] * mask, 1e-6)
        k1 = [float(student[b, t]) - want[b][t] for b in range(B) for t in range(R) if mask[b, t]]
        close(out["distill/default/reverse_kl"], math.fsum(k1) / len(k1), tol=1e-6)
        adv = on_policy_distill_advantages(student, got, mask)
        close(adv, -(student - torch.tensor(want, dtype=F64)) * mask, tol=1e-6)


def test_on_policy_teacher_zero_probability_on_a_sampled_token_is_an_error() -> None:
    mask = ragged_mask()
    t_logits = logits(11)
    ids = torch.zeros(B, R, dtype=torch.long)
    t_logits[3, 2, 0] = -INF  # row 3, response position 2 (unmasked): the teacher rules the sampled token out
    role = _ScoringTeacher(t_logits)
    where = r"teacher default gives log-prob -inf .* row 3 at response position 2"
    with pytest.raises(FloatingPointError, match=where):
        DistillObjective.teacher_logprobs(_on_policy(role, 1.0), _teacher_batch(ids, mask), ids.double(), StepLog())


# ---------------------------------------------------------------- offline: a teacher with a wider padded vocabulary
def _offline(teacher: _ScoringTeacher, k: int) -> tuple[OfflineDistillCollector, SimpleNamespace]:
    col = object.__new__(OfflineDistillCollector)
    col.cfg = SimpleNamespace(distill=SimpleNamespace(topk=k))
    col.teacher, col.vocab, col.cache = teacher, V, {}
    mask = torch.ones(B, R)
    ids = torch.zeros(B, R, dtype=torch.long)
    rows = _teacher_batch(ids, mask)
    rows["prompts"] = torch.ones(B, 2, dtype=torch.long)
    rows = Batch(rows.td, {"where": [f"rows.jsonl:{i + 1}" for i in range(B)]})
    source = SimpleNamespace(batch=lambda todo: rows, items=[SimpleNamespace(response_ids=[0] * R)] * B)
    return col, source


def test_offline_teacher_padding_ids_are_refused_or_absorbed_by_the_tail() -> None:
    k, mask = 3, torch.ones(B, R, dtype=F64)
    real, s_logits = logits(12), logits(13)
    # padding logits above every real one: the teacher's top-k names ids the student has no logit for
    high = _ScoringTeacher(torch.cat([real, torch.full((B, R, 2), 50.0, dtype=F64)], -1))
    col, source = _offline(high, k)
    with pytest.raises(ValueError, match=r"token id 9 .* rows.jsonl:1, outside the student's vocabulary of 8"):
        col._score("train", source, list(range(B)))
    # -inf or low finite padding: the top-k ids are the student's; the teacher's log-probs are normalised over its
    # own 10 logits, so finite padding mass is in the teacher's tail bucket
    for padding in (-INF, -6.0):
        t_logits = torch.cat([real, torch.full((B, R, 2), padding, dtype=F64)], -1)
        col, source = _offline(_ScoringTeacher(t_logits), k)
        col._score("train", source, list(range(B)))
        assert col.teacher.temperatures == [offline_obj.TEMPERATURE]
        t_ids = torch.stack([col.cache[("train", i)][0] for i in range(B)]).long()
        t_lps = torch.stack([col.cache[("train", i)][1] for i in range(B)])
        student = response_outputs(s_logits, torch.zeros(B, R, dtype=torch.long), gather_ids=t_ids)
        _, kl, _ = topk_distill_loss(student["gathered_logprobs"], t_lps.double(), mask, kind="forward")
        want = []
        for b in range(B):
            for t in range(R):
                p_t, p_s = softmax_ref(t_logits[b, t].tolist(), 1.0), softmax_ref(s_logits[b, t].tolist(), 1.0)
                top = t_ids[b, t].tolist()
                want.append(kl_ref(buckets(p_t, top, tail=True), buckets(p_s, top, tail=True)))
        close(kl.flatten(), want, tol=1e-6)  # the cache holds fp32 log-probs
