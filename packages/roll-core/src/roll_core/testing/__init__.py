"""Helpers for tests of roll and of plugins: a tiny learnable task, tiny-model overrides, an in-process runner,
reference computations with plain transformers, and the conformance suites of roll's contracts.

`constant_answer_task(path)` writes a JSONL task whose answer is always 7: a randomly initialised tiny model
learns to end its reply with 7 within a few steps of GRPO or PPO, which makes "reward rises" testable in
seconds on a CPU.

Conformance suites (subclass them in an implementation's tests, as `roll_hw.testing.PlatformTestSuite`):
`roll_core.testing.infer_engine.InferEngineTestSuite`, `roll_core.testing.train_engine.TrainEngineTestSuite`
(critic values and LoRA base log-probs included), `roll_core.testing.tasks.TaskTestSuite` and
`AgenticTaskTestSuite`, `roll_core.testing.envs.EnvTestSuite`, `roll_core.testing.rewards.RewardTestSuite`,
`roll_core.testing.estimators.EstimatorTestSuite`; the losses' suite is roll-algos' own
(`roll_algos.testing.PolicyLossTestSuite`). They import pytest; this module does not. roll's own tests run the
TrainEngine suite over every installed `roll.train_engines` entry point, the Task suite over every `roll.envs`
one and the estimator suite over every `roll.algorithms` one: an entry point's class says how to build a small
test instance with a classmethod hook (`conformance_engine`, `conformance_task`; see those modules) and raises
`CannotRunHere` from it when this machine cannot build one (the suite then skips with that reason).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CannotRunHere(Exception):
    """Raised by a conformance hook (`conformance_engine`, `conformance_task`) when this environment cannot build
    the instance (no sandbox, no device, no distributed setup); the suite skips with the message as the reason.
    A missing optional dependency may raise ImportError instead, with the same effect."""


def fill_missing(node: Any) -> None:
    """Fill a composed config's mandatory values (`???`: model=hf's model.path, env=file's env.path) with
    placeholder paths, in place, so that presets with user-supplied paths can be validated in tests."""
    from omegaconf import DictConfig, OmegaConf

    for key in node:
        if OmegaConf.is_missing(node, key):
            node[key] = f"/placeholder/{key}"
        elif isinstance(node[key], DictConfig):
            fill_missing(node[key])


def constant_answer_task(path: str | Path, rows: int = 200) -> Path:
    """Write `rows` prompts whose answer is 7 to `path` (JSONL) and return the path."""
    path = Path(path)
    path.write_text("".join(json.dumps({"prompt": f"Q{i}: say 7", "answer": "7"}) + "\n" for i in range(rows)))
    return path


def tiny_overrides(data: str | Path, out: str | Path, *extra: str) -> list[str]:
    """Config overrides for a fast learning run of the built-in tiny model on `constant_answer_task` data."""
    return [
        "model=tiny",
        "model.max_response_length=6",
        "env=file",
        f"env.path={data}",
        "env.reward.last_number_weight=1.0",
        "env.eval_size=16",
        "algo.group_size=8",
        "algo.lr=3e-3",
        "pipeline.rollout_batch_size=4",
        "pipeline.max_steps=20",
        "pipeline.eval_every=0",
        "pipeline.progress=false",
        f"pipeline.output_dir={out}",
        "train_engine.micro_batch_size=16",
        *extra,
    ]


def run_pipeline(overrides: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Compose, build and run a pipeline in this process; returns (summary, metrics history)."""
    from roll_core.cli import pipeline_class
    from roll_core.config import load_config
    from roll_core.tracking import Tracker

    cfg = load_config(overrides)
    pipeline = pipeline_class(cfg.pipeline.name)(cfg)
    try:
        summary = pipeline.run()
    finally:
        pipeline.shutdown()
    return summary, Tracker.read_metrics(Path(pipeline.out) / "metrics.jsonl")


def reward_curve(history: list[dict[str, Any]]) -> list[float]:
    """Mean training reward per step (evaluation-only records skipped)."""
    return [h["reward/mean"] for h in history if h["step"] > 0 and "reward/mean" in h]


def reference_greedy(model_path: str, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation and its per-token log-probs (log_softmax of raw logits) computed with plain transformers,
    one full forward per token and no cache: the reference every inference engine is checked against."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    ids, out, logps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            tok = int(logits.argmax())
            out.append(tok)
            logps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
            if tok in eos_ids:
                break
    return out, logps


def teacher_forced_logprobs(model_path: str, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / temperature) of `tokens` after `prompt` under plain transformers (the trainer's view)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
