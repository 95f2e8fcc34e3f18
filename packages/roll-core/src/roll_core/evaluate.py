"""`roll-eval`'s engine: held-out metrics of a model with the run config's inference settings, through the same
collector evaluation a training run logs (`Collector.evaluate`).

Single-turn tasks: accuracy and mean reward over the task's eval split. Agentic tasks (env=sokoban, ...): one
episode per held-out environment seed, reporting success rate, mean turns and the invalid-action rate. Runs in
this process (no Ray), one inference worker.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from roll_core import registry
from roll_core.cluster.launch import Cluster
from roll_core.cluster.roles import InferGroup
from roll_core.config.build import as_dict, build
from roll_core.config.compose import ConfigError
from roll_core.interfaces.tasks import AgenticTask
from roll_core.models import resolve_model_path
from roll_core.pipelines.collectors import CollectorContext
from roll_core.pipelines.wiring import sampling_params


def evaluate_model(cfg: Any, samples: int | None = None) -> dict[str, Any]:
    """Evaluate `cfg.model` on `cfg.env`'s held-out split; `samples` caps the held-out problems (or seeds)."""
    from transformers import AutoTokenizer

    task = build(cfg.env)
    agentic = isinstance(task, AgenticTask)
    name = "agentic" if agentic and cfg.pipeline.name == "rlvr" else cfg.pipeline.name  # roll-eval M env=sokoban
    if not agentic and not task.eval_set()[: samples or cfg.pipeline.eval_size]:  # said before a model is loaded
        raise ConfigError(
            f"env={getattr(task, 'name', type(task).__name__)} has no held-out problems to evaluate "
            f"(pipeline.eval_size={cfg.pipeline.eval_size}, --samples={samples}): give the task held-out problems "
            "(env.eval_size, env.eval_path) or raise pipeline.eval_size"
        )
    pipe = dataclasses.replace(
        cfg.pipeline, name=name, eval_every=1, eval_size=samples or cfg.pipeline.eval_size, async_ratio=0
    )
    cfg = dataclasses.replace(cfg, pipeline=pipe)
    factory = registry.load("roll.collectors", name)
    factory.check(cfg, task)
    cluster = Cluster(type(cfg.cluster)(backend="local"), cfg.hw)
    path = resolve_model_path(cfg.model.path)
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
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or path)
    collector = factory(CollectorContext(cfg, cluster, infer, sampling_params(cfg), tokenizer, task, path))
    try:
        if agentic and samples:
            collector.eval_seeds = collector.eval_seeds[:samples]  # type: ignore[attr-defined]
        m = collector.evaluate(0)
    finally:
        collector.close()
        cluster.shutdown()
    out: dict[str, Any] = {
        "accuracy": m["eval/accuracy"],
        "reward": m["eval/reward"],
        "n": int(m["eval/n"]),
        "task": getattr(task, "name", type(task).__name__),
    }
    if agentic:
        out.update(
            success_rate=m["eval/success_rate"],
            mean_turns=m["eval/mean_turns"],
            invalid_action_rate=m["eval/invalid_action_rate"],
            tool_calls_mean=m["eval/tool_calls_mean"],
            ends={k.removeprefix("eval/end_"): v for k, v in m.items() if k.startswith("eval/end_")},
            agentic=True,
        )
    return out
