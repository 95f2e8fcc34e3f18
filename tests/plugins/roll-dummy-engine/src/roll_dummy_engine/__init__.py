"""An out-of-tree inference engine: transformers without a KV cache, one request at a time.

It exists to prove that a package outside roll can add an engine and its config: it depends only on roll-core's
contract (`roll_core.interfaces.InferEngine`), registers the class under `roll.infer_engines` and its schema under
`roll.configs` (so `infer_engine=recompute` composes without a YAML file in roll's conf/), and passes the
InferEngine conformance suite. Every token recomputes the whole sequence: correct, simple and slow.

The schema and `register_configs` live here and import no torch: every `roll-train` (its `--help` too) calls each
`roll.configs` entry point to compose a config. The engine is in `roll_dummy_engine.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from roll_core.config.schema import InferEngineConfig


@dataclass
class RecomputeInferEngineConfig(InferEngineConfig):
    """infer_engine=recompute: a cache-free transformers sampler (a plugin example)."""

    _target_: str = "roll_dummy_engine.engine.RecomputeInferEngine"
    name: str = "recompute"


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="infer_engine", name="recompute", node=RecomputeInferEngineConfig)


def __getattr__(name: str) -> Any:
    if name == "RecomputeInferEngine":  # the engine imports torch: loaded on first use
        from roll_dummy_engine.engine import RecomputeInferEngine

        return RecomputeInferEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
