"""The reward model scores what its model would score alone, and only where it is used: a model without a pad token
of its own reads each row's last token (an EOS that is also the tokenizer's pad included), and pipelines whose
collectors never build the reward model refuse `reward_model=hf` instead of ignoring it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from roll_core.config import load_config
from roll_core.errors import ConfigError
from roll_core.testing.reward_models import tiny_classifier


def _classifier_without_pad(folder: Path) -> str:
    """A seeded tiny Llama sequence classifier whose config has no pad token, with the builtin tiny tokenizer whose
    pad is its EOS (`</s>`): the layout of reward models trained reading every input's last token."""
    from roll_core.models import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.pad_token = tok.eos_token
    return tiny_classifier(folder, tok, pad=False)


def test_rows_ending_in_eos_are_scored_at_the_eos_when_the_model_has_no_pad_token(tmp_path: Path) -> None:
    """The worker gave the model the tokenizer's pad (= EOS) for batching, and transformers' pooling then skipped
    every row's final EOS: each row was scored at the token before it, not as the model scores the row alone."""
    from transformers import AutoModelForSequenceClassification

    from roll_core.cluster.reward_model import RewardModelWorker, check_reward_model

    path = check_reward_model(_classifier_without_pad(tmp_path / "rm"))
    worker = RewardModelWorker(path, template="{prompt} {response}</s>", batch_size=2, platform="cpu")
    prompts, responses = ["What is 2+2?", "hi", "Name a colour"], ["4", "hello there", "red"]
    rows, _ = worker.tokenize(prompts, responses)
    eos = worker.tokenizer.eos_token_id
    assert all(r[-1] == eos for r in rows)
    got = worker.forward(rows)

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    assert model.config.pad_token_id is None
    with torch.no_grad():
        want = torch.tensor([float(model(torch.tensor([r])).logits[0, 0]) for r in rows])
        before_eos = torch.tensor([float(model(torch.tensor([r[:-1]])).logits[0, 0]) for r in rows])
    assert (want - before_eos).abs().min() > 0.1  # the two readings differ clearly
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Batches without such a row still pad with the tokenizer's pad.
    plain = worker.forward([r[:-1] for r in rows])
    torch.testing.assert_close(plain, before_eos, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pipeline", ["agentic", "agent"])
def test_episode_pipelines_refuse_a_reward_model_they_never_build(pipeline: str) -> None:
    """The episode and agent collectors never build the reward model: `reward_model=hf` was accepted and its scores
    never reached the run's rewards."""
    from roll_core.pipelines.collectors.episodes import refuse_prompt_only_settings

    cfg = load_config([f"pipeline={pipeline}", "reward_model=hf", "reward_model.path=/unused/rm"])
    want = rf"reward_model=hf: .* not to pipeline={pipeline}'s episodes.*reward_model=none"
    with pytest.raises(ConfigError, match=want):
        refuse_prompt_only_settings(cfg)
    refuse_prompt_only_settings(load_config([f"pipeline={pipeline}"]))  # without one: accepted


@pytest.mark.parametrize("pipeline", ["sft", "dpo", "distill_offline"])
def test_file_row_pipelines_refuse_a_reward_model_they_never_build(pipeline: str, tmp_path: Path) -> None:
    """The sft, dpo and offline distillation collectors train on the responses of their files and never build the
    reward model: `reward_model=hf` passed their checks and its scores silently never reached anything."""
    import json

    from roll_core import registry

    pairs = pipeline == "dpo"
    rows = tmp_path / "rows.jsonl"
    row = {"prompt": "Q", "chosen": "7", "rejected": "8"} if pairs else {"prompt": "Q", "completion": "7"}
    rows.write_text("".join(json.dumps(row) + "\n" for _ in range(4)))
    base = [f"pipeline={pipeline}", "model=tiny", f"data.path={rows}", "pipeline.eval_every=0"]
    if pipeline == "distill_offline":
        base.append("distill.teacher=builtin:tiny")  # rows without a stored top-k: the teacher scores them
    factory = registry.load("roll.collectors", pipeline)
    want = rf"reward_model=hf with pipeline={pipeline}: .*never builds the reward model.*set reward_model=none"
    with pytest.raises(ConfigError, match=want):
        factory.check(load_config([*base, "reward_model=hf", "reward_model.path=/unused/rm"]), None)
    factory.check(load_config(base), None)  # the same run without a reward model: accepted
