"""Releasing a vLLM engine (at `shutdown`, or when it is dropped without one), and the in-process engines of one
process, which share its parallel groups.

vLLM (0.32) keeps its parallel groups and torch.distributed process-wide. An engine whose core runs in this process
(`InprocClient`: the CPU default, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) with its worker here too (`UniProcExecutor`,
TP=1) sets them up, or joins the ones another such engine set up; the in-process core's `shutdown` always tears
them down (`cleanup_dist_env_and_memory`), under every other engine of the process that uses them: that engine's
next step failed with vLLM's "pipeline model parallel group is not initialized". Roll cannot make the groups
per engine. It warns when a second in-process engine is built while another lives (`join`), and when one shuts
down it marks the others that use the groups (`Release`): their calls then fail with an error naming the cause.

Contract:
- Every engine gets a `Release` (`join`, right after vLLM is built): vLLM's engine client, the engine's name and
  layout, never the engine itself. Running it shuts the client down once; `release` (shutdown, a failed `__init__`)
  runs it at most once, and so does the engine's finalizer when an engine dropped without `shutdown` is collected.
  The finalizer does not run at interpreter exit (vLLM's own finalizers shut its client down then, and a daemon
  driver thread may still be inside a step).
- The driver thread (`drive`) holds its engine only during a turn (`turn`: one step or one batch of jobs), never
  while it waits for a job: a dropped engine becomes unreachable, its finalizer shuts vLLM down, fails what it
  still held (requests of a sync that never finished), removes its LoRA adapter folders and ends the thread.
- `collect_dropped`, before an engine builds vLLM: an engine dropped but not yet collected (in a reference cycle)
  still holds vLLM and, in-process, the groups; it is collected then, not later under the new engine.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import weakref
from concurrent.futures import Future, InvalidStateError
from typing import Any

log = logging.getLogger("roll_engines.infer.vllm")

#: The `Release` of every engine not yet released (shut down or collected).
_LIVE: set[Release] = set()
# Re-entrant, and every reader iterates a snapshot: a dropped engine's finalizer (`_collected`) runs inside the cyclic
# garbage collector, on whichever thread an allocation triggered it, possibly one holding this lock (a plain lock hung).
_LOCK = threading.RLock()

#: How long `collect_dropped` waits for an engine's turn in progress (a step, a batch of jobs) to end.
TURN_WAIT_S = 10.0

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


class Release:
    """What shuts one engine's vLLM down: its engine client, name and layout, and weakly the engine (to mark it when
    another engine takes the groups). Its finalizer holds it: it never references the engine strongly."""

    def __init__(self, owner: Any) -> None:
        self.name: str = owner.name
        self.client: Any = owner.engine.engine_core
        self.inproc, self.uses_groups = _layout(owner.engine)
        self.owner = weakref.ref(owner)
        #: Held by the driver thread while it holds the engine (a turn); `collect_dropped` waits for it.
        self.turn = threading.Lock()
        self.jobs: queue.Queue | None = None  # the driver's (`start_driver`): woken when the engine is collected
        self.pending: Any = None  # the engine's RequestTable and deferred list: failed when it is collected
        self.deferred: list[tuple[Any, Future]] | None = None
        self.adapters: Any = None  # its AdapterSync (LoRA adapter folders in /dev/shm): closed when it is collected
        self.shutdowns = 0  # times vLLM's engine client was shut down (0 or 1)

    def __call__(self) -> None:
        """Shut the client down now (idempotent); in-process, mark every other live engine that uses the groups."""
        with _LOCK:
            client, self.client = self.client, None
            _LIVE.discard(self)
            others = [r.owner() for r in tuple(_LIVE) if r.uses_groups] if self.inproc else []
        if client is None:
            return
        for other in others:
            if other is not None and other._groups_lost is None:
                other._groups_lost = (
                    f"{other.name}: vLLM's process-wide parallel groups, which this engine shares, were torn down "
                    f"when another vLLM engine of this process ({self.name}) shut down; this engine cannot run "
                    f"any more (shut it down). To run several engines in one process, {WORKAROUND}"
                )
        try:
            client.shutdown()  # InprocClient or SyncMPClient
            self.shutdowns += 1
        except Exception:
            log.warning("%s: vLLM's engine shutdown failed", self.name, exc_info=True)


def _collected(release: Release) -> None:
    """The finalizer of an engine dropped without `shutdown` (no turn of its driver runs: it held the engine)."""
    try:
        log.warning("%s: the vLLM engine was dropped without shutdown(); shutting vLLM down", release.name)
        release()
        futures = [fut for _, fut in release.deferred or ()]
        futures += [state.future for state in (release.pending.states() if release.pending is not None else ())]
        while release.jobs is not None and not release.jobs.empty():  # queued requests (a control job holds it)
            job = release.jobs.get_nowait()
            if job is not None:
                futures.append(job[2])
        _fail(futures, release.name)
        if release.adapters is not None:
            release.adapters.close()
        if release.jobs is not None:
            release.jobs.put(None)  # wakes the driver, which finds its engine gone and ends
    except Exception:  # a finalizer's error is printed, never raised: log it with its cause instead
        log.warning("%s: releasing a dropped vLLM engine failed", release.name, exc_info=True)


def _fail(futures: list[Future], name: str) -> None:
    """Fail the unresolved `futures` of the engine `name`, dropped without `shutdown`."""
    for fut in futures:
        try:
            fut.set_exception(RuntimeError(f"{name} engine was dropped without shutdown()"))
        except InvalidStateError:  # resolved already
            pass


def join(owner: Any) -> None:
    """Record `owner` (a VLLMInferEngine whose `engine` was just built): its `Release` and the finalizer that runs it
    when `owner` is collected unreleased; warn when it shares this process's parallel groups with another live
    in-process engine."""
    release = Release(owner)
    owner._vllm_release = release
    finalizer = weakref.finalize(owner, _collected, release)
    finalizer.atexit = False
    owner._vllm_finalizer = finalizer
    with _LOCK:
        others = [r for r in tuple(_LIVE) if r.inproc and (release.uses_groups or r.uses_groups)]
        _LIVE.add(release)
    if release.inproc and others:
        log.warning(
            "%s: another vLLM engine of this process (%s) also runs its engine core here: vLLM keeps its parallel "
            "groups process-wide, so shutting either down tears them down under the other, whose next call then "
            "fails. To run several engines in one process, %s",
            owner.name,
            ", ".join(r.name for r in others),
            WORKAROUND,
        )


def collect_dropped() -> None:
    """Before an engine builds vLLM: collect engines dropped without `shutdown` (their finalizers shut their vLLM
    down), so that none is collected later, under the new engine. Waits (`TURN_WAIT_S` at most) for each live
    engine's driver turn in progress, since a driver holds its engine during a turn."""
    with _LOCK:
        releases = tuple(_LIVE)
    if not releases:
        return
    held = [r.turn for r in releases if r.turn.acquire(timeout=TURN_WAIT_S)]
    try:
        gc.collect()
    finally:
        for lock in held:
            lock.release()


def start_driver(owner: Any, name: str) -> threading.Thread:
    """Start `owner`'s driver thread (`drive`), which holds it weakly."""
    release: Release = owner._vllm_release
    release.jobs, release.pending, release.deferred = owner._jobs, owner._pending, owner._deferred
    release.adapters = owner._adapters
    args = (weakref.ref(owner), release, owner._jobs)
    thread = threading.Thread(target=drive, args=args, name=name, daemon=True)
    thread.start()
    return thread


def drive(ref: weakref.ref, release: Release, jobs: queue.Queue) -> None:
    """The driver loop: each turn (`owner._drive_turn(job)`, under `release.turn`) takes the engine from `ref` and
    drops it before the loop waits for the next job. Ends when the engine stopped (`_drive_turn` returned None) or
    is gone (a job it took then fails)."""
    job = None
    while True:
        with release.turn:
            engine = ref()
            if engine is None:
                if job is not None:  # taken as the engine was collected: its finalizer drained the others
                    _fail([job[2]], release.name)
                return
            wait = engine._drive_turn(job)
            del engine
            job = None  # its payload may hold the engine: not kept through the wait
        if wait is None:
            return
        job = jobs.get() if wait else None


def release(owner: Any) -> None:
    """Shut `owner`'s vLLM engine down now and drop it (idempotent). vLLM tears its process-global state down
    (in-process the parallel groups and torch.distributed, `cleanup_dist_env_and_memory`) when its engine client is
    collected (a weakref finalizer): an `LLM` still referenced at shutdown (a caller's variable, a kept traceback,
    an `__init__` that failed after building it) was collected later, under the process's next engine, whose next
    step then failed ("pipeline model parallel group is not initialized"). The client's `shutdown` detaches that
    finalizer; detaching `owner`'s own finalizer makes its later collection change nothing."""
    engine = owner.__dict__.pop("engine", None)
    owner.__dict__.pop("llm", None)
    finalizer = owner.__dict__.pop("_vllm_finalizer", None)
    done: Release | None = owner.__dict__.get("_vllm_release")
    if finalizer is not None:
        if finalizer.detach() is not None and done is not None:
            done()
    elif engine is not None:  # `join` never ran (it failed): the client alone
        try:
            engine.engine_core.shutdown()
        except Exception:
            log.warning("%s: vLLM's engine shutdown failed", owner.name, exc_info=True)


def named(owner: Any, exc: BaseException) -> BaseException:
    """`exc` of a vLLM call, or, where `owner` lost its parallel groups (`Release`), the error saying so."""
    if owner._groups_lost is None:
        return exc
    error = RuntimeError(owner._groups_lost)
    error.__cause__ = exc
    return error
