"""Offline distillation rows: an SFT row (prompt/completion text or ids, or messages) plus the teacher's top-k.

`teacher_topk_ids` and `teacher_topk_logprobs` hold one list of K per response token (every position of the
response region, masked context tokens of a multi-turn row included), the teacher's log-probabilities of its K
most likely next tokens there. A row is a counted skip unless: both lists have one entry per response token; every
entry has the same K (and the same K as the file's first good row: batches are (B, R, K)); ids are integers in the
student tokenizer's vocabulary (`len(tokenizer)`; the offline distillation collector refuses, naming the row, an id
the model's `vocab_size` lacks), distinct within a position; log-probs are <= 1e-6 (log-softmax rounding may land a
hair above 0), never NaN or +inf, and -inf (probability 0: the loss counts 0 log 0 = 0, roll_algos.distill) only
beside a listed token of positive probability; each position's top-k mass sum(exp) is in (0, 1 + 1e-4]. (A
reverse KL to a teacher probability of 0 is infinite: the offline distillation collector refuses such rows with
distill.kind=reverse, naming the row.) A row carrying a `tokenizer`
fingerprint that differs from the student tokenizer's is an error naming both: the teacher's ids would index another
vocabulary (the fingerprint roll wrote before it became version-independent is accepted too when it matches).
They are kept as (R, K) int32 / float32 tensors in `TokenRow.aligned`, cut with the response when it is truncated.

Alignment: entry t is the teacher's distribution over response token t itself, i.e. computed from the logits at
the position before it (logits[P - 1 + t] of the prompt + response sequence, P prompt tokens), exactly what the
student's log-probs at response token t are. A list for the whole sequence, or one more or one fewer position, is
a `teacher_length` skip (a file of nothing else is an error). The off-by-one that keeps the length (the logits at
the response positions, logits[P + t], which predict token t + 1) is caught on the first `SHIFT_CHECK_TOKENS`
response positions read: a ConfigError when the teacher's top-k holds the next response token at least half the
time and the token itself at most a quarter as often (correctly aligned top-k lists hold the token itself far more
often than the next one; data it cannot judge, e.g. random ids, passes).
"""

from __future__ import annotations

from typing import Any

import torch

from roll_core.errors import ConfigError
from roll_core.posttrain.row_values import need
from roll_core.posttrain.rows import RawRow, SkipRow
from roll_core.posttrain.tokenize import SFTTokenizer, TokenRow, legacy_tokenizer_fingerprint, tokenizer_fingerprint

TEACHER_IDS = "teacher_topk_ids"
TEACHER_LOGPROBS = "teacher_topk_logprobs"
LOGPROB_TOLERANCE = 1e-6
MASS_TOLERANCE = 1e-4
#: Response positions (from the first rows read) on which the top-k lists are checked for a one-position shift.
SHIFT_CHECK_TOKENS = 256


class DistillParser:
    """Distillation rows of one SFT form to TokenRows whose `aligned` holds the teacher's top-k lists."""

    def __init__(self, sft: SFTTokenizer) -> None:
        self.sft = sft
        self.k: int | None = None  # set by the first good row
        self.fingerprint = tokenizer_fingerprint(sft.tokenizer)
        self._legacy: str | None = None  # computed at the first row stamped with another fingerprint
        # [positions, top-k holds token t, top-k holds token t + 1] until the shift check has run (then None)
        self._shift: list[int] | None = [0, 0, 0]

    def parse(self, raw: RawRow, form: str) -> TokenRow:
        cfg = self.sft.cfg
        teacher_tok = raw.row.get(cfg.tokenizer_key)
        if teacher_tok is not None and teacher_tok != self.fingerprint and teacher_tok != self.legacy:
            raise ConfigError(
                f"{raw.where}: the teacher's tokenizer {teacher_tok} is not the student's {self.fingerprint} "
                f"(column {cfg.tokenizer_key!r}; roll_core.posttrain.tokenize.tokenizer_fingerprint of the teacher's "
                "tokenizer): distill with a teacher that shares the student's tokenizer"
            )
        row = self.sft.tokens(raw.row, form)
        row.where = raw.where
        ids = need(raw.row, cfg.teacher_ids_key)
        lps = need(raw.row, cfg.teacher_logprobs_key)
        ids_t, lps_t = self.check(ids, lps, len(row.response_ids))
        self.check_shift(row.response_ids, ids_t, raw.where)
        # compact tensors, not Python lists: a file of long responses with K=20 would otherwise take gigabytes
        row.aligned = {TEACHER_IDS: ids_t.to(torch.int32), TEACHER_LOGPROBS: lps_t.to(torch.float32)}
        row = self.sft.limit(row)
        if self.k is None:
            self.k = int(ids_t.shape[1])
        return row

    @property
    def legacy(self) -> str:
        """The student's fingerprint as roll computed it before it hashed a version-independent form: files
        stamped with it (under the same library versions) name the same tokenizer."""
        if self._legacy is None:
            self._legacy = legacy_tokenizer_fingerprint(self.sft.tokenizer)
        return self._legacy

    def check_shift(self, response_ids: list[int], ids_t: torch.Tensor, where: str) -> None:
        """Count how often position t's top-k holds response token t and token t + 1; once SHIFT_CHECK_TOKENS
        positions are counted, a ConfigError when the lists look shifted by one (see the module docstring)."""
        if self._shift is None or len(response_ids) < 2:
            return
        resp = torch.tensor(response_ids, dtype=torch.long)
        head = ids_t[:-1]
        self._shift[0] += len(resp) - 1
        self._shift[1] += int((head == resp[:-1, None]).any(-1).sum())
        self._shift[2] += int((head == resp[1:, None]).any(-1).sum())
        positions, own, nxt = self._shift
        if positions < SHIFT_CHECK_TOKENS:
            return
        self._shift = None
        if nxt >= 0.5 * positions and 4 * own <= nxt:
            raise ConfigError(
                f"the teacher's top-k lists look shifted by one position (checked up to {where}): over the first "
                f"{positions} response positions they hold the next response token {nxt / positions:.0%} of the time "
                f"and the token itself {own / positions:.0%}. Entry t must be the teacher's distribution over "
                "response token t, from the logits at the position before it (logits[P - 1 + t] of prompt + "
                "response), not the logits at the token's own position"
            )

    def check(self, ids: Any, lps: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(R, K) long ids and float64 log-probs, validated (see the module doc), or a SkipRow."""
        cfg = self.sft.cfg
        for value, key in ((ids, cfg.teacher_ids_key), (lps, cfg.teacher_logprobs_key)):
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, (list, tuple)) for v in value):
                raise SkipRow("wrong_type", f"{key!r} must be a list (one per response token) of lists of K")
            if len(value) != n:
                raise SkipRow("teacher_length", f"{key!r} has {len(value)} positions, the response has {n} tokens")
        ks = {len(v) for v in ids} | {len(v) for v in lps}
        if len(ks) != 1 or 0 in ks:
            raise SkipRow("teacher_k", f"top-k lists of unequal or zero length {sorted(ks)}")
        k = ks.pop()
        if self.k is not None and k != self.k:
            raise SkipRow("teacher_k", f"K={k} differs from the file's K={self.k}")
        if not all(isinstance(x, int) and not isinstance(x, bool) for v in ids for x in v):
            raise SkipRow("wrong_type", f"{cfg.teacher_ids_key!r} must hold integer token ids")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for v in lps for x in v):
            raise SkipRow("wrong_type", f"{cfg.teacher_logprobs_key!r} must hold numbers")
        ids_t = torch.tensor(ids, dtype=torch.long).reshape(n, k)
        lps_t = torch.tensor(lps, dtype=torch.float64).reshape(n, k)
        vocab = self.sft.vocab
        if n and (ids_t.min() < 0 or ids_t.max() >= vocab):
            raise SkipRow("bad_token_id", f"teacher ids outside the student's vocabulary [0, {vocab})")
        if n and k > 1 and (ids_t.sort(dim=1).values.diff(dim=1) == 0).any():
            raise SkipRow("teacher_duplicate_ids", "a position lists one token id twice")
        if bool((torch.isnan(lps_t) | (lps_t == float("inf"))).any()):
            raise SkipRow("teacher_nonfinite", "a teacher log-prob is NaN or +inf")
        if n and lps_t.max() > LOGPROB_TOLERANCE:
            raise SkipRow("teacher_positive_logprob", f"a teacher log-prob is {lps_t.max().item():.3g} > 0")
        mass = lps_t.exp().sum(dim=1)
        if n and bool((lps_t == float("-inf")).all(dim=1).any()):  # -inf is probability 0: allowed, not everywhere
            pos = int((lps_t == float("-inf")).all(dim=1).nonzero()[0])
            raise SkipRow("teacher_mass", f"every top-k log-prob is -inf (top-k mass 0) at response position {pos}")
        if n and mass.max() > 1 + MASS_TOLERANCE:
            pos = int(mass.argmax())
            raise SkipRow("teacher_mass", f"top-k mass {mass[pos].item():.6f} > 1 at response position {pos}")
        return ids_t, lps_t


def teacher_tensors(rows: list[TokenRow], width: int, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """(B, R, K) `teacher_topk_ids` (long) and `teacher_topk_logprobs` (float32), aligned with `responses` of
    width R; 0 wherever `mask` (B, R) is 0 (context and padding)."""
    k = max((int(r.aligned[TEACHER_IDS].shape[1]) for r in rows if TEACHER_IDS in r.aligned), default=1)
    ids = torch.zeros((len(rows), width, k), dtype=torch.long)
    lps = torch.zeros((len(rows), width, k), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = len(r.response_ids)
        if n:
            ids[i, :n] = r.aligned[TEACHER_IDS]
            lps[i, :n] = r.aligned[TEACHER_LOGPROBS]
    keep = mask.bool()[:, :, None]
    return {TEACHER_IDS: torch.where(keep, ids, 0), TEACHER_LOGPROBS: torch.where(keep, lps, 0.0)}
