"""Role workers of the RLVR pipeline and their typed worker-group wrappers.

Roles: `TrainWorker` serves actor_train, critic and reference (by the engine's `role`), `InferWorker` serves
actor_infer, `RewardWorker` scores responses. Engines are built from their `_target_` configs, so roll-core never
imports an engine package. Each `*Group` class exposes exactly the calls the controller makes, with types, so an
IDE or type checker sees `actor_infer.generate(batch, n=8) -> Batch`.
"""

from __future__ import annotations

from typing import Any

import torch

from roll_core.cluster.group import Handle, WorkerGroup
from roll_core.cluster.worker import Dispatch, Worker, dispatch
from roll_core.config.build import build
from roll_core.protocol import Batch


class TrainWorker(Worker):
    """Hosts a training engine (policy, critic or frozen reference)."""

    def __init__(self, engine: dict[str, Any], runtime: dict[str, Any], **base: Any) -> None:
        super().__init__(**base)
        self.engine = build(engine, **runtime)

    @dispatch(Dispatch.DP)
    def compute_logprobs(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False) -> Batch:
        out = self.engine.compute_logprobs(batch.tensors(), temperature=temperature, with_entropy=with_entropy)
        return Batch(out)

    @dispatch(Dispatch.DP)
    def compute_values(self, batch: Batch) -> Batch:
        return Batch(self.engine.compute_values(batch.tensors()))

    @dispatch(Dispatch.DP)
    def train(
        self, batch: Batch, loss_fn: Any, mini_batches: int, epochs: int, temperature: float, shuffle_seed: int
    ) -> dict[str, float]:
        return self.engine.train_step(
            batch.tensors(),
            loss_fn,
            mini_batches=mini_batches,
            epochs=epochs,
            temperature=temperature,
            shuffle_seed=shuffle_seed + self.rank,
        )

    @dispatch(Dispatch.DP)
    def compute_gradients(self, batch: Batch, loss_fn: Any, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        return self.engine.compute_gradients(batch.tensors(), loss_fn, temperature)

    @dispatch(Dispatch.BROADCAST)
    def get_weights(self) -> dict[str, torch.Tensor] | None:
        weights = self.engine.get_weights()  # collective for sharded engines: every rank must call it
        return weights if self.rank == 0 else None

    @dispatch(Dispatch.BROADCAST)
    def save(self, folder: str, tokenizer_path: str | None = None) -> None:
        self.engine.save(folder, tokenizer_path)

    @dispatch(Dispatch.BROADCAST)
    def load(self, folder: str) -> None:
        self.engine.load(folder)


class InferWorker(Worker):
    """Hosts an inference engine."""

    def __init__(self, engine: dict[str, Any], runtime: dict[str, Any], **base: Any) -> None:
        super().__init__(**base)
        self.engine = build(engine, **runtime)

    @dispatch(Dispatch.DP)
    def generate(
        self, batch: Batch, n: int, temperature: float | None = None, max_new_tokens: int | None = None, seed: int = 0
    ) -> Batch:
        gen = self.engine.generate(
            batch["prompt_ids"], n, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed * 1009 + self.rank
        )
        out = Batch(
            {
                "responses": gen.responses,
                "behaviour_logprobs": gen.logprobs,
                "response_mask": gen.response_mask,
                "truncated": gen.truncated,
            }
        )
        out.meta["generate_seconds"] = gen.seconds
        return out

    @dispatch(Dispatch.BROADCAST)
    def load_weights(self, weights: dict[str, torch.Tensor]) -> int:
        return self.engine.load_weights(weights)


class RewardWorker(Worker):
    """Decodes responses and scores them with the task's reward."""

    def __init__(self, env: dict[str, Any], tokenizer_path: str, **base: Any) -> None:
        super().__init__(**base)
        from transformers import AutoTokenizer

        self.task = build(env)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    @dispatch(Dispatch.DP)
    def score(self, batch: Batch) -> Batch:
        texts = [
            self.tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
            for r, m in zip(batch["responses"], batch["response_mask"])
        ]
        res = self.task.reward.score(texts, batch["answer"])
        out = Batch(
            {
                "scores": torch.tensor(res.scores, dtype=torch.float32),
                "correct": torch.tensor(res.correct, dtype=torch.float32),
                "formatted": torch.tensor(res.formatted, dtype=torch.float32),
            },
            {"response_text": texts},
        )
        out.meta["reward_counters"] = res.counters
        return out


def _sum_counters(parts: list[Batch]) -> dict[str, int]:
    total: dict[str, int] = {}
    for p in parts:
        for k, v in p.meta.get("reward_counters", {}).items():
            total[k] = total.get(k, 0) + v
    return total


class TrainGroup(WorkerGroup[TrainWorker]):
    """actor_train, critic or reference."""

    worker_cls = TrainWorker

    def compute_logprobs(self, batch: Batch, temperature: float = 1.0, with_entropy: bool = False) -> Batch:
        return self.call("compute_logprobs", batch, temperature, with_entropy)

    def compute_values(self, batch: Batch) -> Batch:
        return self.call("compute_values", batch)

    def train(
        self, batch: Batch, loss_fn: Any, *, mini_batches: int, epochs: int, temperature: float, shuffle_seed: int
    ) -> dict[str, float]:
        per_rank: list[dict[str, float]] = self.call(
            "train", batch, loss_fn, mini_batches, epochs, temperature, shuffle_seed
        )
        return {k: sum(d[k] for d in per_rank) / len(per_rank) for k in per_rank[0]}

    def get_weights_handle(self) -> Handle:
        """Weights stay where they are (Ray object store) until an inference group consumes them."""
        return self.submit("get_weights")

    def save(self, folder: str, tokenizer_path: str | None = None) -> None:
        self.call("save", folder, tokenizer_path)

    def load(self, folder: str) -> None:
        self.call("load", folder)


class InferGroup(WorkerGroup[InferWorker]):
    """actor_infer."""

    worker_cls = InferWorker

    def generate(
        self,
        batch: Batch,
        n: int,
        *,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        seed: int = 0,
    ) -> Batch:
        handle = self.submit("generate", batch, n, temperature, max_new_tokens, seed)
        parts = handle.values()
        out = Batch.concat(_pad_responses(parts))
        out.meta["generate_seconds"] = max(p.meta.get("generate_seconds", 0.0) for p in parts)
        return out

    def load_weights(self, weights_handle: Handle) -> int:
        """Load rank 0's weights from a `TrainGroup.get_weights_handle()` into every inference worker."""
        ref = weights_handle.refs[0]
        return int(self.call("load_weights", ref)[0])


class RewardGroup(WorkerGroup[RewardWorker]):
    """reward."""

    worker_cls = RewardWorker

    def score(self, batch: Batch) -> Batch:
        handle = self.submit("score", batch.select("responses", "response_mask", "answer"))
        parts = handle.values()
        out = Batch.concat(parts)
        out.meta["reward_counters"] = _sum_counters(parts)
        return out


def _pad_responses(parts: list[Batch]) -> list[Batch]:
    """Ranks return responses of different lengths R_i: right-pad all to the longest before concatenating."""
    r = max(p["responses"].shape[1] for p in parts)
    out = []
    for p in parts:
        extra = r - p["responses"].shape[1]
        if extra:
            t = p.tensors()
            for k in ("responses", "behaviour_logprobs", "response_mask"):
                t[k] = torch.nn.functional.pad(t[k], (0, extra))
            p = Batch(t, p.fields, p.meta)
        out.append(p)
    return out
