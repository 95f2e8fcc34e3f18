"""Distillation between models of one tokenizer whose vocabularies are padded differently (config vocab_size
beyond the tokenizer's length, e.g. Qwen2.5-1.5B's 151936 rows and Qwen2.5-7B's 152064 over one 151665-token
tokenizer).

On-policy (`pipeline=distill`): a teacher whose rows do not cover the tokenizer has no log-prob for real tokens the
student can sample; that is refused before any model loads, naming both widths and the tokenizer's length. A teacher
as wide or wider passes, and so does a narrower one covering the tokenizer (test_distill_narrow_teacher: its missing
padding ids are left unscored). Only the configs and tokenizers are written: the check reads nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from roll_core.config import load_config
from roll_core.config.build import build
from roll_core.errors import ConfigError
from roll_core.pipelines.collectors.distill import check_distill


def _model(folder: Path, vocab: int) -> str:
    """A folder holding the builtin tiny tokenizer (99 ids) and a Llama config of `vocab` output rows."""
    from transformers import LlamaConfig

    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.save_pretrained(folder)
    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    LlamaConfig(vocab_size=vocab, **small).save_pretrained(folder)
    return str(folder)


def _cfg(student: str, teacher: str):
    return load_config(["model=tiny", "pipeline=distill", f"model.path={student}", f"distill.teacher={teacher}"])


def test_a_teacher_lacking_real_token_ids_is_refused_naming_both_widths(tmp_path: Path) -> None:
    student = _model(tmp_path / "student", 128)
    teacher = _model(tmp_path / "teacher", 96)  # ids 96..98 are the tokenizer's
    cfg = _cfg(student, teacher)
    want = r"(?s)teacher default .* has 96 output rows .* has 128 .*produces 99 ids.*\[96, 99\)"
    with pytest.raises(ConfigError, match=want):
        check_distill(cfg, build(cfg.env))


@pytest.mark.parametrize("teacher_rows", [128, 160])
def test_a_teacher_as_wide_or_wider_passes(tmp_path: Path, teacher_rows: int) -> None:
    student = _model(tmp_path / "student", 128)
    teacher = _model(tmp_path / "teacher", teacher_rows)
    cfg = _cfg(student, teacher)
    check_distill(cfg, build(cfg.env))


class _Teacher:
    """A teacher role in-process: an hf engine scoring the collector's batches."""

    def __init__(self, path: str) -> None:
        from roll_engines.train.hf import HFTrainEngine

        self.engine = HFTrainEngine(path, role="reference", name="teacher")

    def compute_logprobs(self, batch, temperature: float, topk: int = 0) -> dict:
        return self.engine.compute_logprobs(batch.tensors(), temperature=temperature, topk=topk)


def test_a_wider_teachers_top_k_is_its_top_k_among_the_students_ids(tmp_path: Path) -> None:
    """Offline distillation with distill.teacher: the teacher (160 rows) ranks its padding rows 128..159, which the
    student (128 rows) lacks, among its top-k (scaled up here so that they do at every position). Asked for K, that
    stopped the run ("outside the student's vocabulary"); the targets are the teacher's K most likely ids below 128,
    with log-probs normalised over all 160 rows (transformers' log_softmax, the padding rows' mass left to the tail)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from roll_core.models import build_tiny_tokenizer
    from roll_core.pipelines.collectors import CollectorContext
    from roll_core.pipelines.collectors.distill_offline import TEMPERATURE, OfflineDistillCollector

    pytest.importorskip("roll_engines.train.hf")
    tok = build_tiny_tokenizer()
    student = _model(tmp_path / "student", 128)
    teacher = tmp_path / "teacher"
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=160, tie_word_embeddings=False, **small))
    with torch.no_grad():
        model.lm_head.weight[128:] *= 50.0  # the padding rows hold most of the mass
    model.save_pretrained(teacher)
    tok.save_pretrained(teacher)
    rows = [dict(prompt_ids=[3, 4, 5], response_ids=[20 + i, 30, 40 + i]) for i in range(4)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    k = 5
    cfg = load_config(
        [
            "model=tiny",
            "pipeline=distill_offline",
            f"model.path={student}",
            f"distill.teacher={teacher}",
            f"distill.topk={k}",
            f"data.path={data}",
            f"pipeline.output_dir={tmp_path / 'run'}",
            "data.eval_size=0",
            "pipeline.eval_every=0",
        ]
    )
    ctx = CollectorContext(cfg, None, None, None, tok, None, student, teachers={"default": _Teacher(str(teacher))})
    collector = OfflineDistillCollector(ctx)
    batch = collector._batch("train", collector.data.train, list(range(4)), None)
    ids, lps = batch["teacher_topk_ids"], batch["teacher_topk_logprobs"]
    assert ids.shape[-1] == k
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    r = batch["responses"].shape[1]
    full = torch.log_softmax(logits[:, -r - 1 : -1] / TEMPERATURE, dim=-1)  # (B, R, 160)
    assert float(full[..., 128:].exp().sum(-1)[mask].min()) > 0.5  # the padding rows do rank first
    want_lps, want_ids = full[..., :128].topk(k, dim=-1)
    assert torch.equal(ids[mask], want_ids[mask])
    torch.testing.assert_close(lps[mask], want_lps[mask], atol=1e-5, rtol=0)
