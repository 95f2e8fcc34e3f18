"""Stand-ins for tests of held-out evaluation (roll-eval's `roll_core.evaluate.sample_rows` and `summarize`, a
training run's `roll_core.pipelines.rollout.evaluate`), with the echo task (roll_core.testing.echo).

- `StopEngine(token, length)`: an inference engine that answers every prompt with `length` copies of `token`,
  finished "stop".
- `eval_collector(...)`: what `sample_rows` (and the prompts collector's `evaluate`) read of a collector.
- `sample_records(samples)`: one problem's sample records, as `sample_rows` writes them, from (extracted answer,
  correct, failed) triples: what `summarize` and `breakdown` read.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from roll_core.interfaces import SamplingParams
from roll_core.protocol import Batch

__all__ = ["StopEngine", "eval_collector", "sample_records"]


class StopEngine:
    """Every prompt answered with `length` tokens `token`, finished ("stop")."""

    def __init__(self, token: int, length: int = 3) -> None:
        self.token, self.length = token, length

    def generate(self, prompts: Batch, params: SamplingParams, n: int) -> Batch:
        """`n` samples of each prompt, every one the same answer."""
        rows = len(prompts) * n
        resp = torch.full((rows, self.length), self.token, dtype=torch.long)
        tensors = {
            "responses": resp,
            "behaviour_logprobs": torch.zeros(resp.shape),
            "response_mask": torch.ones_like(resp),
        }
        return Batch({**tensors, "truncated": torch.zeros(rows)}, {"finish_reason": ["stop"] * rows})


def eval_collector(
    tokenizer: Any,
    problems: list[Any],
    infer: Any,
    scoring: Any,
    sampling: SamplingParams,
    max_prompt_length: int,
    **extra: Any,
) -> SimpleNamespace:
    """A collector as evaluation reads it: its config (model.max_prompt_length, no chat-template arguments, seed 0,
    3 idle aborts), `tokenizer` (no processor), `problems` as its eval set, the engine `infer`, `sampling` at
    evaluation temperature 1, `scoring`; `extra` further attributes."""
    return SimpleNamespace(
        cfg=SimpleNamespace(
            model=SimpleNamespace(max_prompt_length=max_prompt_length, chat_template_kwargs={}),
            pipeline=SimpleNamespace(seed=0, max_idle_aborts=3),
        ),
        tokenizer=tokenizer,
        processor=None,
        eval_set=problems,
        infer=infer,
        sampling=sampling,
        eval_temperature=1.0,
        scoring=scoring,
        **extra,
    )


def sample_records(samples: list[tuple[str | None, float, str | None]]) -> list[dict[str, Any]]:
    """One problem's (index 0) records from (extracted, correct, failed): its reward is `correct`, formatted,
    one token long, finished "stop"."""
    return [
        {
            "index": 0,
            "sample": j,
            "extracted": e,
            "correct": c,
            "reward": c,
            "formatted": 1.0,
            "length": 1,
            "finish_reason": "stop",
            "failed": f,
        }
        for j, (e, c, f) in enumerate(samples)
    ]
