"""The held-out task accuracy of the post-training pipelines (pipeline=sft, dpo, distill_offline, and the teacher's
at step 0 of pipeline=distill) resumes the rows the engine aborted on its own, as RLVR's evaluation and roll-eval
do (roll_core.pipelines.collectors._resume). They sampled with the bare inference group: a row preempted once under
load (vLLM's preemption, a weight-sync pause) ended "abort" and was scored an engine failure (wrong), so the
accuracy fell with the engine's load, not the model's skill.

The engine is scripted: its batch `generate` aborts problem `cut` after two tokens (once); the request API finishes
the resumed row. The reward grades a complete answer right, a cut one wrong."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.interfaces import Request, RequestOutput, SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.protocol import Batch
from roll_core.testing.echo import EchoProblem, EchoTask

ANSWER = 5  # tokens of a complete answer
TOKEN = 40  # the token the engine answers with
PROBLEMS = [EchoProblem("ok", "question 0"), EchoProblem("cut", "question 1")]


class _PreemptingEngine:
    """Batch `generate`: a complete answer ("stop") for every problem but `cut`, which the engine aborts after 2
    tokens; the request API gives a resumed row the rest of its answer ("stop"). `resumed` counts the requests."""

    def __init__(self) -> None:
        self.resumed = 0

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        ids = [pid for pid in prompts["problem_id"] for _ in range(n)]
        resp = torch.zeros((len(ids), ANSWER), dtype=torch.long)
        mask = torch.zeros((len(ids), ANSWER), dtype=torch.long)
        for i, pid in enumerate(ids):
            k = 2 if pid == "cut" else ANSWER
            resp[i, :k], mask[i, :k] = TOKEN, 1
        finish = ["abort" if pid == "cut" else "stop" for pid in ids]
        tensors = {"responses": resp, "behaviour_logprobs": torch.zeros(resp.shape), "response_mask": mask}
        return Batch({**tensors, "truncated": torch.zeros(len(ids))}, {"finish_reason": finish})

    def submit_request(self, request: Request, route_key: str | None = None) -> Future:
        self.resumed += 1
        rest = [TOKEN] * (ANSWER - 2)
        fut: Future = Future()
        fut.set_result(RequestOutput(request.request_id, request.prompt_ids, rest, [0.0] * len(rest), "stop"))
        return fut


class _Reward:
    """Right (score 1) for a complete answer, wrong for a cut one."""

    def score(self, batch: Batch) -> Batch:
        s = (batch["response_mask"].sum(-1) >= ANSWER).float()
        return Batch({"scores": s, "correct": s, "formatted": torch.ones_like(s)}, {"response_text": [""] * len(s)})


@pytest.fixture(autouse=True)
def no_idle_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_core import idle_aborts

    monkeypatch.setattr(idle_aborts, "IDLE_BACKOFF_S", 0.0)


def _ctx(engine: _PreemptingEngine) -> Any:
    """What the collectors' `evaluate` read of their context (a text model, no held-out rows to score)."""
    cfg = SimpleNamespace(
        model=SimpleNamespace(max_prompt_length=64, chat_template_kwargs={}, path="m"),
        pipeline=SimpleNamespace(seed=0, eval_temperature=None, max_idle_aborts=3),
        distill=SimpleNamespace(teacher_paths=lambda path: {"math": path}),
    )
    return SimpleNamespace(
        cfg=cfg,
        infer=engine,
        tokenizer=build_tiny_tokenizer(),
        task=EchoTask(),
        sampling=SamplingParams(max_new_tokens=16, temperature=1.0),
        train=None,
    )


def _sft(engine: _PreemptingEngine) -> Any:
    from roll_core.pipelines.collectors.sft import SFTCollector

    c = SFTCollector.__new__(SFTCollector)  # the evaluation part only
    c.ctx = _ctx(engine)
    c.cfg, c.held_out, c.eval_problems, c.reward = c.ctx.cfg, None, PROBLEMS, _Reward()
    return c.evaluate


def _dpo(engine: _PreemptingEngine) -> Any:
    from roll_core.pipelines.collectors.dpo import DPOCollector

    c = DPOCollector.__new__(DPOCollector)
    c.ctx = _ctx(engine)
    c.cfg, c.eval_batch, c.eval_set, c.reward = c.ctx.cfg, None, PROBLEMS, _Reward()
    return c.evaluate


def _distill_offline(engine: _PreemptingEngine) -> Any:
    from roll_core.pipelines.collectors.distill_offline import _TaskEval

    e = _TaskEval.__new__(_TaskEval)
    e.ctx, e.problems, e.reward = _ctx(engine), PROBLEMS, _Reward()
    return e


def _distill_teacher(engine: _PreemptingEngine) -> Any:
    """pipeline=distill's teacher evaluation (context distillation, step 0): the teacher's accuracy as eval/accuracy."""
    from roll_core.pipelines.collectors.distill import DistillCollector

    ctx = _ctx(engine)
    c = DistillCollector.__new__(DistillCollector)
    c.ctx, c.template, c.fields = ctx, "Think: {prompt}", ["prompt"]
    c.inner = SimpleNamespace(
        eval_set=PROBLEMS, infer=engine, scoring=_Reward(), sampling=ctx.sampling, eval_temperature=1.0
    )
    return lambda step: {"eval/accuracy": c.evaluate_teacher()["eval/teacher_accuracy"]}


@pytest.mark.parametrize("build", [_sft, _dpo, _distill_offline, _distill_teacher])
def test_a_row_the_engine_preempted_once_is_resumed_not_scored_an_engine_failure(build: Any) -> None:
    """Both answers are right, one after a preemption: accuracy 1 (it was 0.5, the preempted row a failure)."""
    engine = _PreemptingEngine()
    out = build(engine)(1)
    assert out["eval/accuracy"] == pytest.approx(1.0)
    assert engine.resumed == 1  # the cut row, resumed from its two tokens
