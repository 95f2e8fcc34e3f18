"""`roll-eval`'s engine: held-out accuracy of a model on a task, with the run config's inference settings."""

from __future__ import annotations

from typing import Any

from roll_core.cluster.launch import Cluster
from roll_core.cluster.roles import InferGroup, RewardGroup
from roll_core.config.build import as_dict, build
from roll_core.interfaces import SamplingParams
from roll_core.models import resolve_model_path
from roll_core.pipelines.rollout import evaluate


def evaluate_model(cfg: Any, samples: int | None = None) -> dict[str, Any]:
    """Evaluate `cfg.model` on `cfg.env`'s held-out split (in-process, no Ray)."""
    from transformers import AutoTokenizer

    cluster = Cluster(type(cfg.cluster)(backend="local"), cfg.hw)
    path = resolve_model_path(cfg.model.path)
    tok_path = cfg.model.tokenizer or path
    task = build(cfg.env)
    problems = task.eval_set()[: samples or cfg.pipeline.eval_size]
    ie = as_dict(cfg.infer_engine)
    infer = cluster.group(
        InferGroup,
        "actor_infer",
        1,
        engine=ie,
        runtime={
            "model_path": path,
            "dtype": cfg.model.dtype,
            "seed": cfg.pipeline.seed,
            "max_new_tokens": cfg.model.max_response_length,
            "platform": cluster.platform.name,
            "device": "auto",
        },
    )
    reward = cluster.group(RewardGroup, "reward", 1, env=as_dict(cfg.env), tokenizer_path=tok_path)
    temp = ie["temperature"] if cfg.pipeline.eval_temperature is None else cfg.pipeline.eval_temperature
    params = SamplingParams(
        temperature=temp,
        top_p=ie["top_p"],
        top_k=ie["top_k"],
        stop=tuple(ie["stop"]),
        max_new_tokens=cfg.model.max_response_length,
        seed=cfg.pipeline.seed + 17,
    )
    result = evaluate(
        infer,
        reward,
        AutoTokenizer.from_pretrained(tok_path),
        task,
        problems,
        max_prompt_length=cfg.model.max_prompt_length,
        params=params,
    )
    return {**result, "task": getattr(task, "name", type(task).__name__)}
