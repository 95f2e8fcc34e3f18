"""The base of the workers that host an engine, and how engines are built on them.

Engine config keys in `WORKER_KEYS` configure the worker and its placement, not the engine, and are not passed
to the engine's constructor (`engine_kwargs`). `build_engine` checks the engine's keys against its constructor
before anything is loaded, then builds it with the run's values (roll_core.interfaces.runtime).

Engines are built on the process's main thread. A Ray actor that serves several calls at once (`max_concurrency`,
the request API) runs its methods on pool threads, but its constructor on the main thread; engines that install
signal handlers or start event loops (SGLang before 0.5.10 calls `signal.signal`, which raises off the main
thread) are therefore built in the inference worker's `__init__`. Training engines need the rendezvous first and
are built in `setup`, on the main thread too (their actors serve one call at a time). `engine_thread()` reports it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from roll_core.cluster.worker import Dispatch, Worker, dispatch
from roll_core.config.build import build
from roll_core.devices import resolve_device
from roll_core.interfaces.runtime import (
    InferEngineRuntime,
    TrainEngineRuntime,
    check_engine_kwargs,
    supported_runtime,
)

log = logging.getLogger(__name__)

#: Engine-config keys read by workers, placement and weight sync (never passed to an engine's constructor).
# `dtype` of an inference engine reaches it through the runtime keys (resolved on its node, default model.dtype).
WORKER_KEYS = (
    "world_size",
    "sync_transport",
    "sync_bucket_mb",
    "sync_timeout_s",
    "sleep_level",
    "python",
    "max_concurrency",
    "dtype",
    "structured",  # a sampling setting (SamplingParams.structured), not the engine's
    "lora_sync",  # the engine gets the adapter rank it serves (runtime `lora_rank`) instead
)


def engine_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """The engine's own keys of an engine config (worker keys removed)."""
    return {k: v for k, v in cfg.items() if k not in WORKER_KEYS}


class EngineWorker(Worker):
    """A worker hosting one engine built by `build_engine` (training or inference)."""

    @dispatch(Dispatch.BROADCAST)
    def engine_thread(self) -> tuple[str, bool]:
        """(name of the thread the engine was built on, whether it is the main thread)."""
        return self.engine_thread_name


def build_engine(worker: Worker, cfg: dict[str, Any], runtime: TrainEngineRuntime | InferEngineRuntime) -> Any:
    """Build an engine from its config and the run's values (roll_core.interfaces.runtime) on this worker,
    recording the thread it was built on (`engine_thread`). A key the engine's constructor does not take is a
    TypeError naming it, raised before anything is loaded."""
    from hydra.utils import get_object

    resolved = resolve_device(dict(runtime))
    own = engine_kwargs(cfg)
    if own.get("param_dtype") == "bfloat16" and resolved.get("dtype") == "float32":
        # Pure bf16 asked (model.dtype bfloat16/auto) on a platform that computes in fp32 (no fast bf16): the
        # master weights follow, as the compute dtype did (the engine refuses masters narrower than compute).
        log.warning("train_engine.param_dtype bfloat16 -> float32: the compute dtype resolved to float32 here")
        own["param_dtype"] = "float32"
    target = get_object(own["_target_"])
    resolved = supported_runtime(target, resolved)  # an optional key the engine does not take: logged, not passed
    check_engine_kwargs(target, {k: v for k, v in own.items() if k != "_target_"}, resolved)
    engine = build(own, **resolved)
    worker.engine_dtype = str(getattr(engine, "dtype", None) or resolved.get("dtype") or "").removeprefix("torch.")
    current = threading.current_thread()
    worker.engine_thread_name = (current.name, current is threading.main_thread())
    return engine
