"""Evaluation of a run with a reward model, and the reward model's head precision.

- Evaluation normalises the reward model's scores by the training statistics, not by the evaluated batch's own:
  with `normalize=batch` each eval batch was standardised against itself, so `eval/reward` was exactly 0 (replace)
  for a bad policy and a good one alike. Its raw scores are logged (`eval/reward_model/raw_mean`, `raw_std`).
- A bf16/fp16 reward model computes its `score` head in float32: its logits are not rounded to a bf16 step.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.reward_model import RewardModelScoring
from roll_core.protocol import Batch
from roll_core.testing.reward_models import FixedScorer, reward_model_config, scoring_rows

TRAIN = [0.0, 1.0, 2.0, 3.0]  # the training batch's raw scores: mean 1.5, population variance 1.25
BAD, GOOD = [0.0, 0.0, 0.5, 0.5], [3.0, 3.0, 2.5, 2.5]


@pytest.mark.parametrize("normalize", ["batch", "running"])
@pytest.mark.parametrize("mode", ["replace", "add"])
def test_eval_reward_tells_a_good_policy_from_a_bad_one(normalize: str, mode: str) -> None:
    """After one training batch, a bad policy's eval batch and a good one's (same task reward) get different
    eval rewards, each its raw scores z-scored by the training statistics; the raw means are logged. With
    normalize=batch both were exactly the task reward (each eval batch standardised against itself)."""
    weight = 0.5 if mode == "add" else 1.0
    scoring = RewardModelScoring(
        reward_model_config(normalize=normalize, mode=mode, weight=weight), FixedScorer(TRAIN, BAD, GOOD)
    )
    batch, scored = scoring_rows([1.0, 0.0, 1.0, 0.0])
    scoring.apply(batch, scored, StepLog())
    assert scoring.stats.count == 4
    rewards, logged = [], []
    for raw in (BAD, GOOD):
        batch, scored = scoring_rows([1.0, 0.0, 1.0, 0.0])
        scoring.apply(batch, scored, None)  # evaluation's call (the collector's _Scoring)
        z = [(x - 1.5) / (1.25 + 1e-6) ** 0.5 for x in raw]
        want = z if mode == "replace" else [t + 0.5 * v for t, v in zip([1, 0, 1, 0], z)]
        assert scored["scores"].tolist() == pytest.approx(want, abs=1e-5)
        rewards.append(float(scored["scores"].mean()))
        logged.append(scoring.take_eval_metrics())
    assert scoring.stats.count == 4  # evaluation never updates the training statistics
    assert rewards[1] - rewards[0] > 1.0
    assert [m["eval/reward_model/raw_mean"] for m in logged] == pytest.approx([0.25, 2.75])
    assert logged[0]["eval/reward_model/raw_std"] == pytest.approx(0.25)
    assert logged[0]["eval/reward_model/running_mean"] == pytest.approx(1.5)
    assert scoring.take_eval_metrics() == {}  # taken once


def test_batch_mode_training_rows_stay_standardised_by_their_own_batch() -> None:
    """normalize=batch still standardises each training batch by itself (the running statistics it now keeps are
    evaluation's reference only), and logs them."""
    scoring = RewardModelScoring(reward_model_config(normalize="batch"), FixedScorer([10.0, 20.0], [0.0, 2.0]))
    for raw in ([10.0, 20.0], [0.0, 2.0]):
        batch, scored = scoring_rows([0.0, 0.0])
        out = StepLog()
        scoring.apply(batch, scored, out)
        assert scored["scores"].tolist() == pytest.approx([-1.0, 1.0], abs=1e-5)
        assert out["reward_model/raw_mean"] == pytest.approx(sum(raw) / 2)
    assert scoring.stats.count == 4 and out["reward_model/running_mean"] == pytest.approx(8.0)


def test_a_step0_evaluation_without_training_statistics_uses_its_own() -> None:
    scoring = RewardModelScoring(reward_model_config(normalize="batch"), FixedScorer([1.0, 3.0]))
    batch, scored = scoring_rows([0.0, 0.0])
    scoring.apply(batch, scored, None)
    assert scored["scores"].tolist() == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert scoring.stats.count == 0


def test_the_prompts_collectors_eval_log_carries_the_raw_reward_model_scores(monkeypatch) -> None:
    """PromptCollector.evaluate: the reward model scores through the collector's _Scoring, and eval/reward of a
    bad and a good policy differ; eval/reward_model/raw_mean is in the eval log (evaluation wrote no reward-model
    metric before)."""
    from roll_core.pipelines.collectors import prompts
    from roll_core.pipelines.collectors.prompts import PromptCollector, _Scoring

    class Task:
        def score(self, batch: Batch) -> Batch:
            n = len(batch)
            return Batch({"scores": torch.zeros(n), "correct": torch.zeros(n)}, {"response_text": ["r"] * n})

    def evaluate(infer: Any, reward: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:  # the held-out loop
        scored = reward.score(Batch(fields={"prompt_text": ["p"] * 4}))
        return {"accuracy": 0.0, "accuracy_stderr": None, "reward": float(scored["scores"].mean()), "n": 4}

    monkeypatch.setattr(prompts, "evaluate", evaluate)
    rm = RewardModelScoring(reward_model_config(normalize="batch"), FixedScorer(TRAIN, BAD, GOOD))
    batch, scored = scoring_rows([0.0] * 4)
    rm.apply(batch, scored, StepLog())  # one training batch
    c = PromptCollector.__new__(PromptCollector)
    c.cfg = SimpleNamespace(
        model=SimpleNamespace(max_prompt_length=64, chat_template_kwargs={}),
        pipeline=SimpleNamespace(seed=0, max_idle_aborts=3, eval_temperature=0.0),
    )
    c.infer, c.tokenizer, c.task, c.eval_set, c.processor = None, SimpleNamespace(pad_token_id=0), None, [], None
    c.sampling = SimpleNamespace(replace=lambda **kw: None)
    c.reward_model, c.scoring = rm, _Scoring(Task(), rm)  # type: ignore[arg-type]
    bad, good = c.evaluate(1), c.evaluate(2)
    assert bad["eval/reward"] == pytest.approx((0.25 - 1.5) / 1.25**0.5, abs=1e-5)
    assert good["eval/reward"] == pytest.approx((2.75 - 1.5) / 1.25**0.5, abs=1e-5)
    assert (bad["eval/reward_model/raw_mean"], good["eval/reward_model/raw_mean"]) == pytest.approx((0.25, 2.75))


def _tiny_classifier(dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    return model.to(dtype).eval()


def _head_reference(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's logits at the last token, the float32 product of the head's input hidden state there and its
    weight): what a float32 head gives on the same hidden states."""
    seen: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda m, a, out: seen.append(out.detach()))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, 0]
    finally:
        hook.remove()
    want = seen[0][:, -1].float() @ model.score.weight.detach().float()[0]
    return logits, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_head_runs_in_float32(dtype: torch.dtype) -> None:
    """The head of a bf16/fp16 classifier gives float32 logits equal to a float32 head on the same hidden states
    (they were rounded to a half-precision step: one bf16 step is 1/64 at a score of 3, enough to tie close
    responses of a group); a float32 model is left as it is."""
    from roll_core.cluster.reward_model import fp32_score_head

    ids = torch.randint(1, 64, (6, 9), generator=torch.Generator().manual_seed(1))
    model = _tiny_classifier(dtype)
    logits, want = _head_reference(model, ids)
    assert logits.dtype == dtype and (logits.float() - want).abs().max() > 1e-3  # the half head's rounding
    assert fp32_score_head(model)
    logits, want = _head_reference(model, ids)
    assert logits.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == dtype  # the body stays
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    assert not fp32_score_head(_tiny_classifier(torch.float32))


def test_the_worker_scores_a_bf16_model_with_a_float32_head(tmp_path: Path, monkeypatch) -> None:
    """A reward_model.dtype=bfloat16 worker (forced on this CPU, whose platform would run float32): its scores are
    the float32 head's on the bf16 hidden states, not bf16-rounded logits."""
    import roll_core.devices
    from roll_core.cluster.reward_model import RewardModelWorker
    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = _tiny_classifier(torch.float32)
    model.resize_token_embeddings(len(tok))
    model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    monkeypatch.setattr(roll_core.devices, "resolve_device", lambda rt: {**rt, "device": "cpu", "dtype": "bfloat16"})
    worker = RewardModelWorker(str(tmp_path), template="{prompt} {response}", batch_size=1)
    assert worker.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert worker.model.score.weight.dtype == torch.float32
    rows, _ = worker.tokenize([f"question {i}" for i in range(6)], [f"answer {i * 7}" for i in range(6)])
    got = worker.forward(rows)
    want = torch.stack([_head_reference(worker.model, torch.tensor([r]))[1][0] for r in rows])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
