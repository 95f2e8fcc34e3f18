"""On-policy distillation (`pipeline=distill`) with a teacher narrower than the student that still covers the
tokenizer (Qwen2.5-3B's 151936 rows under Qwen2.5-7B's 152064, one 151665-token tokenizer; here 112 rows under 128,
a 99-token tokenizer): accepted before the run, and a sampled padding id beyond the teacher's rows is never sent to
it: that token and the rest of its row are left out of the distillation loss and counted
(distill/beyond_teacher_tokens, distill/unscored_tokens), the other tokens scored exactly. The teacher engine refused
the whole batch there ("outside [0, 112)"), and the config check refused such a teacher outright."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from roll_core.config import load_config
from roll_core.config.build import build
from roll_core.pipelines.collectors import Collected
from roll_core.pipelines.collectors.distill import check_distill
from roll_core.pipelines.metrics import StepLog
from roll_core.protocol import Batch

STUDENT_ROWS, TEACHER_ROWS, TOKENIZER_LEN = 128, 112, 99
BEYOND_KEY, UNSCORED_KEY = "distill/beyond_teacher_tokens", "distill/unscored_tokens"
PAD_ID = 120  # a padding row of the student's: beyond the teacher's 112 rows and the tokenizer's 99 ids


def _save_tokenizer(folder: Path) -> None:
    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    assert len(tok) == TOKENIZER_LEN
    tok.save_pretrained(folder)


def _config_only(folder: Path, vocab: int) -> str:
    from transformers import LlamaConfig

    _save_tokenizer(folder)
    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    LlamaConfig(vocab_size=vocab, **small).save_pretrained(folder)
    return str(folder)


def _cfg(student: str, teacher: str, *extra: str):
    return load_config(
        ["model=tiny", "pipeline=distill", f"model.path={student}", f"distill.teacher={teacher}", *extra]
    )


@pytest.mark.parametrize("teacher_rows", [TEACHER_ROWS, TOKENIZER_LEN])
def test_a_narrower_teacher_covering_the_tokenizer_is_accepted(tmp_path: Path, teacher_rows: int) -> None:
    cfg = _cfg(_config_only(tmp_path / "s", STUDENT_ROWS), _config_only(tmp_path / "t", teacher_rows))
    check_distill(cfg, build(cfg.env))  # was: ConfigError "has 112 output rows ... but the student ... has 128"


class _Teacher:
    """A teacher role in-process: an hf engine scoring the objective's batches (it refuses ids beyond its rows)."""

    def __init__(self, path: str) -> None:
        from roll_engines.train.hf import HFTrainEngine

        self.engine = HFTrainEngine(path, role="reference", name="teacher")
        self.seen: list[torch.Tensor] = []

    def compute_logprobs(self, batch: Batch, temperature: float, topk: int = 0) -> dict:
        self.seen.append(batch["responses"].clone())
        return self.engine.compute_logprobs(batch.tensors(), temperature=temperature, topk=topk)


class _Actor:
    """The actor's train group: records the batch it is asked to train on."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []

    def train(self, batch: Batch, objective: Any, **kwargs: Any) -> dict[str, float]:
        self.batches.append(batch)
        return {}


def test_a_padding_id_beyond_the_teacher_is_left_unscored_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from roll_core.interfaces.inference import SamplingParams
    from roll_core.pipelines.objectives.distill import DistillObjective
    from roll_core.pipelines.wiring import Roles

    pytest.importorskip("roll_engines.train.hf")
    student = _config_only(tmp_path / "student", STUDENT_ROWS)
    teacher_dir = tmp_path / "teacher"
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=TEACHER_ROWS, **small)).eval()
    model.save_pretrained(teacher_dir)
    _save_tokenizer(teacher_dir)
    cfg = _cfg(student, str(teacher_dir), "distill.coef=0.5")
    check_distill(cfg, build(cfg.env))

    teacher, actor = _Teacher(str(teacher_dir)), _Actor()
    roles = Roles(actor_train=actor, actor_infer=None, reference=None, critic=None, reference_is_base=False,  # type: ignore[arg-type]
                  sampling=SamplingParams(temperature=1.0), mini_batches=1, teachers={"default": teacher})  # fmt: skip
    objective = DistillObjective(cfg, roles, trajectories=False)

    prompts = torch.tensor([[3, 4, 5], [3, 4, 6], [3, 4, 7]])
    responses = torch.tensor([[20, 30, 40, 50], [21, PAD_ID, 31, 41], [22, 32, 42, 0]])
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float32)
    b, p = prompts.shape
    input_ids = torch.cat([prompts, responses], 1)
    attention_mask = torch.cat([torch.ones(b, p, dtype=torch.long), response_mask.long()], 1)
    student_logp = -torch.rand(b, 4, generator=torch.Generator().manual_seed(1)) - 0.5
    batch = Batch(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp_min(0),
            "responses": responses,
            "response_mask": response_mask,
            "behaviour_logprobs": student_logp,
        },
        {"metadata": [{}] * b},
    )
    out = StepLog()
    with caplog.at_level(logging.WARNING):
        objective.update(0, Collected(batch, torch.zeros(b)), out)  # was: ValueError "... outside [0, 112)"

    assert objective.teacher_rows == {"default": TEACHER_ROWS}
    # the teacher never saw the padding id: a placeholder there and after it
    assert int(teacher.seen[0].max()) < TEACHER_ROWS and teacher.seen[0][1].tolist() == [21, 0, 0, 0]
    assert out[BEYOND_KEY] == 1.0 and out[UNSCORED_KEY] == 3.0
    assert sum(BEYOND_KEY in r.getMessage() for r in caplog.records) == 1
    scored = response_mask.clone()
    scored[1, 1:] = 0.0
    trained = actor.batches[0]
    assert torch.equal(trained["response_mask"], scored)  # out of the loss: the actor trains on the scored tokens
    assert torch.equal(batch["response_mask"], response_mask)  # the batch's own mask is the response's

    # the scored tokens' teacher log-probs are the teacher model's own, at the true prefix
    with torch.no_grad():
        ok = responses.masked_fill(responses >= TEACHER_ROWS, 0)  # the unscored positions' values are never read
        logits = model(input_ids=torch.cat([prompts, ok], 1), attention_mask=attention_mask).logits.float()
    want = torch.log_softmax(logits[:, p - 1 : -1], -1).gather(-1, responses.clamp_max(TEACHER_ROWS - 1)[..., None])
    want = want[..., 0] * scored
    torch.testing.assert_close(batch["teacher_logprobs"], want, atol=1e-5, rtol=0)
    adv = trained["advantages"]
    torch.testing.assert_close(adv, -0.5 * (student_logp - want) * scored, atol=1e-5, rtol=0)
    assert bool((adv[1, 1:] == 0).all())
    n = float(scored.sum())
    assert out["distill/teacher_logp"] == pytest.approx(float(want.sum()) / n, abs=1e-5)
    assert out["distill/reverse_kl"] == pytest.approx(float(((student_logp - want) * scored).sum()) / n, abs=1e-5)
    assert out["distill/default/reverse_kl"] == pytest.approx(out["distill/reverse_kl"], abs=1e-6)
    assert out["perf/response_tokens"] == float(response_mask.sum())

    # a second step: counted again, not warned again
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        out2 = StepLog()
        objective.update(1, Collected(batch, torch.zeros(b)), out2)
    assert out2[UNSCORED_KEY] == 3.0 and not any(BEYOND_KEY in r.getMessage() for r in caplog.records)


def test_unscored_tokens_follow_each_rows_teachers_width() -> None:
    """A row scored by a wide teacher keeps every token; a narrow teacher's row loses its first beyond id and what
    follows, and only response tokens count (a padding position's id is never read)."""
    from roll_core.pipelines.objectives.distill import beyond_teacher

    responses = torch.tensor([[5, 9, 3, 2], [5, 9, 3, 2], [1, 2, 3, 11]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    widths = torch.tensor([100, 8, 8])
    beyond, unscored = beyond_teacher(responses, mask, widths)
    assert beyond.tolist() == [[False] * 4, [False, True, False, False], [False] * 4]
    assert unscored.tolist() == [[False] * 4, [False, True, True, True], [False] * 4]
