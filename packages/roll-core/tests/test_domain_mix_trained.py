"""A multi-domain run with dynamic sampling (algo.drop_uniform_groups): the groups a domain loses to the filter
show in `domain/<d>/trained_share`, the mix the step trains on, beside `domain/<d>/share`, the sampled mix.

Before, the step reported only the sampled mix (the fixed env.counts, every step) while the trained batch could hold
none of a domain whose groups were all solved: the mix changed and nothing said so."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from roll_core.cluster.reward_guard import RewardFailureBudget
from roll_core.data import make_sampler
from roll_core.interfaces import SamplingParams
from roll_core.models import build_tiny_tokenizer
from roll_core.pipelines.collectors.prompts import MAX_IDLE_ABORTS, PromptCollector
from roll_core.pipelines.metrics import StepLog
from roll_core.pipelines.rollout import problem_fields
from roll_core.protocol import Batch

GROUP = 2


@dataclass(frozen=True)
class _Problem:
    id: str
    prompt: str
    answer: str
    domain: str
    metadata: dict[str, Any] = field(default_factory=dict)


class _Task:
    """Domains `solved` (every answer right: groups without reward variance) and `learning` (half right), 8 prompts
    each, 2 of each per batch of 4 (env.counts)."""

    def __init__(self) -> None:
        self.domains = ["solved", "learning"]
        self.problems = [_Problem(f"{d}/{i}", f"{d} {i}", "1", d) for d in self.domains for i in range(8)]

    def train_set(self) -> list[_Problem]:
        return self.problems

    def domain_slices(self) -> dict[str, range]:
        return {"solved": range(0, 8), "learning": range(8, 16)}

    def mixture(self) -> tuple[dict[str, float], dict[str, int]]:
        return {}, {"solved": 2, "learning": 2}


class _Infer:
    """Every row answers 3 tokens."""

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        rows = len(prompts) * n
        out = Batch(
            {
                "responses": torch.full((rows, 3), 7, dtype=torch.long),
                "behaviour_logprobs": torch.full((rows, 3), -0.1),
                "response_mask": torch.ones((rows, 3), dtype=torch.long),
                "truncated": torch.zeros(rows),
            },
            {"finish_reason": ["stop"] * rows},
        )
        out.meta["generate_seconds"] = 1.0
        return out


class _Reward:
    """The `solved` domain's rows score 1; each `learning` group's first row 1, its second 0."""

    def score(self, batch: Batch) -> Batch:
        s = torch.tensor(
            [1.0 if m["domain"] == "solved" else float(i % GROUP == 0) for i, m in enumerate(batch["metadata"])]
        )
        return Batch({"scores": s, "correct": s, "formatted": torch.ones_like(s)}, {"response_text": [""] * len(s)})


def _collector() -> PromptCollector:
    c = PromptCollector.__new__(PromptCollector)
    algo = SimpleNamespace(
        group_size=GROUP,
        drop_uniform_groups=True,
        refill_oversample=1.0,
        refill_max_batches=3.0,
        overlong_buffer=0,
        reward_clip=None,
    )
    model = SimpleNamespace(max_response_length=16, max_prompt_length=64, chat_template_kwargs={})
    pipeline = SimpleNamespace(seed=0, rollout_batch_size=4, max_idle_aborts=MAX_IDLE_ABORTS)
    c.cfg = SimpleNamespace(algo=algo, model=model, pipeline=pipeline)
    c.ctx = SimpleNamespace(samples=lambda step, rows: None)
    c.task = _Task()
    c.tokenizer, c.infer, c.processor = build_tiny_tokenizer(), _Infer(), None
    c.sampling = SamplingParams(max_new_tokens=16)
    c.train_set, c.domains, c.reward_model, c.advantage_scale = c.task.train_set(), c.task.domains, None, None
    c.sampler, c._replay = make_sampler(c.task, batch_size=4, seed=0), []
    c._prompt_batch = lambda problems, counts: Batch(  # type: ignore[method-assign]
        fields={"prompt_ids": [[11, 12]] * len(problems), **problem_fields(problems)}
    )
    c.reward, c.reward_budget, c._step_counters, c._step_failure = _Reward(), RewardFailureBudget(3), {}, None
    return c


def test_the_trained_mix_shows_the_groups_dynamic_sampling_dropped() -> None:
    out = StepLog()
    collected = _collector().next(1, out)
    assert collected is not None
    trained = [m["domain"] for m in collected.batch["metadata"]]
    # The sampled mix is env.counts (2 + 2 prompts); the filter dropped every `solved` group, the refills too.
    assert out["domain/solved/share"] == out["domain/learning/share"] == 0.5
    assert out["data/dropped_groups"] == out["data/sampled_groups"] - len(trained) // GROUP > 0
    assert "solved" not in trained and len(trained) == 4 * GROUP
    assert out["domain/solved/trained_share"] == trained.count("solved") / len(trained) == 0.0
    assert out["domain/learning/trained_share"] == trained.count("learning") / len(trained) == 1.0
