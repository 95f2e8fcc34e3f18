"""GRPO against a reward model trained inside the test: the model's score of held-out prompts' responses rises.

A tiny Llama sequence classifier (the builtin tiny tokenizer) learns, by a Bradley-Terry loss on synthetic
preference pairs, that responses holding more digits are better; saved with save_pretrained (safetensors), it is
the run's only reward (`reward_model=hf reward_model.mode=replace`). The tiny random policy (a digit is ~10% of
its samples) learns to say digits within a few steps, which the evaluation on held-out prompts, scored by the
reward model through the collector's evaluation, shows.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
import torch

from roll_core.testing import run_pipeline, tiny_overrides

#: Characters of the synthetic responses besides digits (what else the tiny policy samples).
OTHERS = string.ascii_letters + string.punctuation + " "


def _prompts(rng: random.Random, n: int) -> list[str]:
    """Prompts without digits (a digit in the prompt would tell the reward model nothing about the response)."""
    return [f"Write about {''.join(rng.choices(string.ascii_lowercase, k=5))}" for _ in range(n)]


def _response(rng: random.Random, digits: int) -> str:
    """A response of up to 6 characters holding exactly `digits` digits."""
    chars = rng.choices(OTHERS, k=rng.randint(max(digits, 1), 6) - digits) + rng.choices(string.digits, k=digits)
    rng.shuffle(chars)
    return "".join(chars)


def _train_reward_model(folder: Path, prompts: list[str]) -> tuple[float, float]:
    """Train a tiny sequence classifier on pairs (more digits preferred) with the Bradley-Terry loss
    -log sigmoid(r_chosen - r_rejected) and save it to `folder`. Returns its accuracy on fresh pairs and its scale:
    the mean score of 6-digit responses minus that of digit-free ones."""
    from roll_core.cluster.reward_model import format_row
    from roll_core.models import build_tiny_tokenizer
    from roll_core.testing.reward_models import tiny_classifier_model

    tok = build_tiny_tokenizer()
    rng = random.Random(0)
    model = tiny_classifier_model(tok, layers=1, spread=False)  # seeded (torch.manual_seed(0)), its head as drawn

    def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        return ids, mask

    def scores(digits: list[int]) -> torch.Tensor:
        ids, mask = padded([format_row(tok, "chat", rng.choice(prompts), _response(rng, k)) for k in digits])
        return model(ids, attention_mask=mask).logits[:, 0]

    def pairs(n: int) -> tuple[list[int], list[int]]:
        ranked = [sorted(rng.sample(range(7), 2)) for _ in range(n)]
        return [hi for _, hi in ranked], [lo for lo, _ in ranked]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs slower on several threads of a busy machine
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(60):
            chosen, rejected = pairs(16)
            loss = -torch.nn.functional.logsigmoid(scores(chosen) - scores(rejected)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            chosen, rejected = pairs(256)
            accuracy = float((scores(chosen) > scores(rejected)).float().mean())
            scale = float(scores([6] * 32).mean() - scores([0] * 32).mean())
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(folder)  # safetensors
    tok.save_pretrained(folder)
    return accuracy, scale


def test_grpo_against_a_trained_reward_model_raises_its_score(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "-"}) + "\n" for p in _prompts(random.Random(1), 200)))
    accuracy, scale = _train_reward_model(tmp_path / "rm", _prompts(random.Random(2), 64))
    assert (tmp_path / "rm" / "model.safetensors").is_file()
    assert accuracy > 0.9 and scale > 4.0, f"the reward model did not learn the preference: {accuracy=:.2f} {scale=}"

    steps = 6
    _, history = run_pipeline(
        tiny_overrides(
            data,
            tmp_path / "out",
            "reward_model=hf",
            f"reward_model.path={tmp_path / 'rm'}",
            "reward_model.mode=replace",
            "reward_model.batch_size=32",
            "algo.lr=1e-2",
            f"pipeline.max_steps={steps}",
            f"pipeline.eval_every={steps}",  # step 0 and the last step, on env.eval_size held-out prompts
            "env.eval_size=32",
            "pipeline.eval_size=32",
            "pipeline.save_every=0",
        )
    )
    train = [h for h in history if "reward_model/raw_mean" in h]
    evals = [h["eval/reward"] for h in history if "eval/reward" in h]
    assert len(train) == steps and len(evals) == 2
    # replace, normalize=none: the rows' scores are the reward model's logits as they are.
    for h in train:
        assert h["reward/mean"] == pytest.approx(h["reward_model/raw_mean"], abs=1e-4)
    for h in (h for h in history if "eval/reward" in h):  # the evaluation logs the model's raw scores too
        assert h["eval/reward"] == pytest.approx(h["eval/reward_model/raw_mean"], abs=1e-4)
    raw = [round(h["reward_model/raw_mean"], 2) for h in train]
    before, after = evals
    # A quarter of the way from digit-free responses to all-digit ones (measured: about +12 of a scale of 14).
    assert after - before > 0.25 * scale, (
        f"held-out reward-model score {before:.2f} -> {after:.2f} (scale {scale:.2f}); training batches: {raw}"
    )
    assert sum(raw[-2:]) / 2 > sum(raw[:2]) / 2 + 0.1 * scale, (raw, scale)  # the training batches' score too
