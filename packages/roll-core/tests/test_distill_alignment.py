"""Offline distillation targets line up with the response tokens they score: entry t of a teacher's top-k is its
distribution over response token t. A file whose lists are shifted by one position (logits at the token's own
position, which predict the next token) is refused; top-k of the wrong width from a teacher role is refused
instead of being zero-padded into targets."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from roll_core.errors import ConfigError
from roll_core.pipelines.collectors.distill_offline import OfflineDistillCollector
from roll_core.posttrain.config import DataConfig
from roll_core.posttrain.source import load_rows
from roll_core.testing.chat_templates import family_tokenizer

TOK = family_tokenizer("tiny")
K, ROWS, LEN = 4, 24, 16  # 24 x 15 = 360 positions: more than posttrain.distill.SHIFT_CHECK_TOKENS (256)


def _rows(shift: int, seed: int = 0) -> list[dict]:
    """Token rows whose top-k at response position t holds response token t + shift (0: aligned, 1: the next
    token) among K - 1 other random ids; the last position (nothing after it) holds random ids only."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(ROWS):
        response = torch.randint(3, 98, (LEN,), generator=g).tolist()
        ids = []
        for t in range(LEN):
            target = [response[t + shift]] if t + shift < LEN else []
            others = [x for x in torch.randperm(95, generator=g).add(3).tolist() if x not in target]
            ids.append(target + others[: K - len(target)])
        lps = [[-0.5 - j for j in range(K)] for _ in range(LEN)]
        out.append({"prompt_ids": [5, 6, 7], "response_ids": response, "teacher_topk_ids": ids,
                    "teacher_topk_logprobs": lps})  # fmt: skip
    return out


def _load(tmp_path: Path, rows: list[dict]):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_rows("distill", DataConfig(path=str(path)), TOK, max_prompt_length=64, max_response_length=64)


def test_aligned_top_k_loads_and_a_one_position_shift_is_refused(tmp_path: Path) -> None:
    data = _load(tmp_path, _rows(shift=0))
    assert len(data.train) == ROWS
    b = data.train.batch([0])
    # entry t holds response token t (the student's log-prob of token t is gathered there)
    assert (b["teacher_topk_ids"][0] == b["responses"][0][:, None]).any(-1).all()
    with pytest.raises(ConfigError, match=r"look shifted by one position .* next response token 100% of the time"):
        _load(tmp_path, _rows(shift=1))
    # data the check cannot judge (random ids: neither the token nor the next one) passes
    random_rows = [{**r, "teacher_topk_ids": _rows(shift=0, seed=1)[i]["teacher_topk_ids"]}
                   for i, r in enumerate(_rows(shift=0, seed=2))]  # fmt: skip
    assert len(_load(tmp_path, random_rows).train) == ROWS


def test_lists_for_the_whole_sequence_are_a_teacher_length_skip(tmp_path: Path) -> None:
    """Top-k for prompt + response (one list per sequence position) does not line up with the response: each such
    row is a counted teacher_length skip, and a file of nothing else is an error."""
    rows = _rows(shift=0)
    whole = [{**r, "teacher_topk_ids": r["teacher_topk_ids"][:3] + r["teacher_topk_ids"],
              "teacher_topk_logprobs": r["teacher_topk_logprobs"][:3] + r["teacher_topk_logprobs"]}
             for r in rows]  # fmt: skip
    data = _load(tmp_path, [*rows[:4], *whole[4:]])
    assert len(data.train) == 4 and data.train.skipped == {"teacher_length": ROWS - 4}
    with pytest.raises(ConfigError, match="teacher_length"):
        _load(tmp_path, whole)


class _Teacher:
    """A teacher role whose top-k is `cut` response positions short of the rows' width."""

    def __init__(self, cut: int) -> None:
        self.cut = cut

    def compute_logprobs(self, batch, temperature, topk):
        b, r = batch["responses"].shape
        ids = torch.arange(topk).expand(b, r - self.cut, topk).clone() + 3
        return {"topk_ids": ids, "topk_logprobs": torch.full((b, r - self.cut, topk), -2.0)}


def test_teacher_top_k_of_another_width_is_refused(tmp_path: Path) -> None:
    """The teacher role's (B, R, K) must match the rows' responses: a short width was cached as is and the rest of
    the response trained toward id 0 at log-prob 0 (the batch's zero padding under response_mask 1)."""
    rows = [{"prompt_ids": [5, 6], "response_ids": [7, 8, 9]}, {"prompt_ids": [5], "response_ids": [10, 11, 12]}]
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_rows("sft", DataConfig(path=str(path)), TOK, max_prompt_length=64, max_response_length=64)
    collector = object.__new__(OfflineDistillCollector)
    collector.cfg = SimpleNamespace(distill=SimpleNamespace(topk=2))
    collector.vocab, collector.cache, collector.data = len(TOK), {}, data
    collector.teacher = _Teacher(cut=0)
    batch = collector._batch("train", data.train, [0, 1], None)
    assert batch["teacher_topk_ids"].shape == (2, 3, 2) and collector.cache[("train", 1)][0].shape == (3, 2)
    collector.teacher, collector.cache = _Teacher(cut=1), {}
    with pytest.raises(ValueError, match=r"top-k of shape ids \(2, 2, 2\).*expected \(2, 3, 2\)"):
        collector._batch("train", data.train, [0, 1], None)
