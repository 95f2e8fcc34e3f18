"""Releasing a vLLM engine, and the in-process engines of one process, which share its parallel groups.

vLLM (0.32) keeps its parallel groups and torch.distributed process-wide. An engine whose core runs in this process
(`InprocClient`: the CPU default, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) with its worker here too (`UniProcExecutor`,
TP=1) sets them up, or joins the ones another such engine set up; the in-process core's `shutdown` always tears
them down (`cleanup_dist_env_and_memory`), under every other engine of the process that uses them: that engine's
next step failed with vLLM's "pipeline model parallel group is not initialized". Roll cannot make the groups
per engine. It warns when a second in-process engine is built while another lives (`join`), and when one shuts
down it marks the others that use the groups (`leave`): their calls then fail with an error naming the cause.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

log = logging.getLogger("roll_engines.infer.vllm")

#: Live engines whose core runs in this process (`join` .. `leave`); weak: one collected unreleased just goes.
_LIVE: weakref.WeakSet = weakref.WeakSet()
_LOCK = threading.Lock()

WORKAROUND = (
    "run each engine's core in a process of its own (VLLM_ENABLE_V1_MULTIPROCESSING=1) or each engine in its own "
    "process"
)


def _layout(engine: Any) -> tuple[bool, bool]:
    """(core in this process, model worker in this process: uses the process's groups) of vLLM's `LLMEngine`."""
    # By class name, not import: where these classes live moves between vLLM versions.
    client = engine.engine_core
    if type(client).__name__ != "InprocClient":
        return False, False
    executor = type(getattr(client.engine_core, "model_executor", None))
    return True, any(c.__name__ == "UniProcExecutor" for c in executor.__mro__)


def join(owner: Any) -> None:
    """Record `owner` (a VLLMInferEngine whose `engine` was just built); warn when it shares this process's parallel
    groups with another live in-process engine."""
    owner._inproc, owner._uses_groups = _layout(owner.engine)
    if not owner._inproc:
        return
    with _LOCK:
        others = [e for e in _LIVE if e is not owner and (owner._uses_groups or e._uses_groups)]
        _LIVE.add(owner)
    if others:
        log.warning(
            "%s: another vLLM engine of this process (%s) also runs its engine core here: vLLM keeps its parallel "
            "groups process-wide, so shutting either down tears them down under the other, whose next call then "
            "fails. To run several engines in one process, %s",
            owner.name,
            ", ".join(e.name for e in others),
            WORKAROUND,
        )


def leave(owner: Any) -> None:
    """`owner`'s in-process core is shutting down and takes the process's parallel groups with it: every other live
    in-process engine that uses them is marked (`named`)."""
    with _LOCK:
        if owner not in _LIVE:
            return
        _LIVE.discard(owner)
        for other in _LIVE:
            if other._uses_groups and other._groups_lost is None:
                other._groups_lost = (
                    f"{other.name}: vLLM's process-wide parallel groups, which this engine shares, were torn down "
                    f"when another vLLM engine of this process ({owner.name}) shut down; this engine cannot run "
                    f"any more (shut it down). To run several engines in one process, {WORKAROUND}"
                )


def named(owner: Any, exc: BaseException) -> BaseException:
    """`exc` of a vLLM call, or, where `owner` lost its parallel groups (`leave`), the error saying so."""
    if owner._groups_lost is None:
        return exc
    error = RuntimeError(owner._groups_lost)
    error.__cause__ = exc
    return error


def release(owner: Any) -> None:
    """Shut `owner`'s vLLM engine down now and drop it (idempotent). vLLM tears its process-global state down
    (in-process the parallel groups and torch.distributed, `cleanup_dist_env_and_memory`) when its engine client is
    collected (a weakref finalizer): an `LLM` still referenced at shutdown (a caller's variable, a kept traceback,
    an `__init__` that failed after building it) was collected later, under the process's next engine, whose next
    step then failed ("pipeline model parallel group is not initialized"). The client's `shutdown` detaches that
    finalizer."""
    engine = owner.__dict__.pop("engine", None)
    owner.__dict__.pop("llm", None)
    if engine is None:
        return
    leave(owner)
    try:
        engine.engine_core.shutdown()  # InprocClient or SyncMPClient
    except Exception:
        log.warning("%s: vLLM's engine shutdown failed", owner.name, exc_info=True)
