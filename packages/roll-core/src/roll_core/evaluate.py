"""`roll-eval`'s engine: held-out accuracy of a model on a task, with the run config's inference settings.

Single-turn tasks: accuracy and mean reward over the task's eval split. Agentic tasks (env=sokoban, ...): one
episode per held-out environment seed, reporting success rate, mean turns and the invalid-action rate.
"""

from __future__ import annotations

from typing import Any

from roll_core.cluster.launch import Cluster
from roll_core.cluster.roles import InferGroup, RewardGroup
from roll_core.config.build import as_dict, build
from roll_core.config.compose import ConfigError
from roll_core.interfaces import SamplingParams
from roll_core.interfaces.tasks import AgenticTask
from roll_core.models import resolve_model_path
from roll_core.pipelines.rollout import evaluate


def evaluate_model(cfg: Any, samples: int | None = None) -> dict[str, Any]:
    """Evaluate `cfg.model` on `cfg.env`'s held-out split (in-process, no Ray)."""
    from transformers import AutoTokenizer

    cluster = Cluster(type(cfg.cluster)(backend="local"), cfg.hw)
    path = resolve_model_path(cfg.model.path)
    tok_path = cfg.model.tokenizer or path
    task = build(cfg.env)
    agentic = isinstance(task, AgenticTask)
    problems = [] if agentic else task.eval_set()[: samples or cfg.pipeline.eval_size]
    if not agentic and not problems:  # said before a model is loaded
        raise ConfigError(
            f"env={getattr(task, 'name', type(task).__name__)} has no held-out problems to evaluate "
            f"(pipeline.eval_size={cfg.pipeline.eval_size}, --samples={samples}): give the task held-out problems "
            "(env.eval_size, env.eval_path) or raise pipeline.eval_size"
        )
    ie = as_dict(cfg.infer_engine)
    infer = cluster.group(
        InferGroup,
        "actor_infer",
        1,
        engine=ie,
        runtime={
            "model_path": path,
            "dtype": ie.get("dtype") or cfg.model.dtype,
            "seed": cfg.pipeline.seed,
            "max_new_tokens": cfg.model.max_response_length,
            "platform": cluster.platform.name,
            "device": "auto",
        },
    )
    temp = ie["temperature"] if cfg.pipeline.eval_temperature is None else cfg.pipeline.eval_temperature
    params = SamplingParams(
        temperature=temp,
        top_p=ie["top_p"],
        top_k=ie["top_k"],
        stop=tuple(ie["stop"]),
        max_new_tokens=cfg.model.max_response_length,
        seed=cfg.pipeline.seed + 17,
    )
    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    if agentic:
        return _evaluate_agentic(task, infer, tokenizer, params, samples)
    reward = cluster.group(RewardGroup, "reward", 1, env=as_dict(cfg.env), tokenizer_path=tok_path)
    result = evaluate(
        infer,
        reward,
        tokenizer,
        task,
        problems,
        max_prompt_length=cfg.model.max_prompt_length,
        params=params,
    )
    return {**result, "task": getattr(task, "name", type(task).__name__)}


def _evaluate_agentic(task: Any, infer: Any, tokenizer: Any, params: SamplingParams, samples: int | None) -> dict:
    """One episode per held-out seed of an agentic task (the same rollout code as training)."""
    from roll_core.agentic.env_manager import EnvManager
    from roll_core.agentic.rollout import AgenticRollout, task_turns
    from roll_core.pipelines.collectors.episodes import episode_metrics

    seeds = task.eval_seeds()[:samples] if samples else task.eval_seeds()
    envs = EnvManager.for_task(task)
    try:
        turns, limits = task_turns(task, tokenizer)
        rollout = AgenticRollout(infer, envs, turns, tokenizer, limits)
        trajs = rollout.run(seeds, list(range(len(seeds))), params)
        m = episode_metrics(trajs, None, None)
    finally:
        envs.close()
    return {
        "accuracy": m["reward/accuracy"],
        "success_rate": m["reward/accuracy"],
        "reward": m["reward/mean"],
        "mean_turns": m["episode/turns_mean"],
        "invalid_action_rate": m["episode/invalid_action_rate"],
        "tool_calls_mean": m["episode/tool_calls_mean"],
        "n": len(trajs),
        "ends": {k.removeprefix("episode/end_"): v for k, v in m.items() if k.startswith("episode/end_")},
        "task": getattr(task, "name", type(task).__name__),
        "agentic": True,
    }
