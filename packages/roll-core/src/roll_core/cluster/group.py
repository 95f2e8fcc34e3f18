"""Worker groups over two backends with one code path: `local` (in-process) and `ray` (actors).

`WorkerGroup(cls, world_size, backend, **kwargs)` creates `world_size` instances of a worker class and runs calls
according to each method's declared dispatch mode (see roll_core.cluster.worker). A call names the worker method
itself, never its name as a string: `group.call(TrainWorker.compute_values, batch)`, so a type checker sees the
method and checks its arguments (`Method`: a worker method with the worker's type first). `submit()` returns a
`Handle` (roll_core.cluster.handle) to wait on, so the controller can overlap work; `call()` waits. A call reaches
every rank it names on both backends, whatever another rank raises (an engine's `abort_weight_update` is not skipped
because another engine's failed; the local backend stopped at the first rank that raised); its caller gets a failing
rank's own error (its type kept: Ray's is an instance of it; local: the lowest rank's), noted with the failing
rank(s). The `local` backend executes at submit time in this process (so `breakpoint()` in a worker just works); the
`ray` backend places actors by the resources and placement groups the caller gives. Arguments and results travel by
value on both (the local backend copies tensors, Batches and the containers holding them:
roll_core.cluster.worker.by_value).

Start and shutdown: roll_core.cluster._group_start (a rank that fails to start fails the group's start at once,
every rank already built stopped first).

Faults (Ray only; an in-process call cannot time out or die apart from the controller):
- `call_timeout_s`: a call must finish within this many seconds of its submission, else `CallTimeoutError`
  names the role, method, ranks and timeout.
- A worker that died (`WorkerDiedError` names role, rank and node, and quotes Ray's report of why: killed, the
  OOM killer, a segfault's exit, a constructor's traceback; chained as its cause) or hung past the timeout is,
  in a group whose class is `restartable` and while `max_restarts` allows, killed and re-created with the same
  options (the same placement bundle) and set up again; the group's restart hooks restore its state (an
  inference engine gets the trainer's weights: roll_core.cluster.weight_sync) and the call is rerun on the new
  worker, so its caller sees the result, not the fault. Ranks that answered keep their results, ranks still
  running are waited for, and a `Handle` waits once: asking it again returns the same results (or error), never
  reruns. `restarts` and `timeouts` count the faults. `restarts` counts restart attempts, per rank: one whose new
  worker fails to start (its constructor or set-up raises, or it is not up within `start_timeout_s`) counts
  against `max_restarts` too and fails its call (the next call tries again, within the budget); once the budget
  is spent, a call to the rank fails at once, naming the role, rank, attempts and the last start failure (a worker
  that can never start, a bad config or a missing GPU, would otherwise make every call wait `start_timeout_s` and
  fail, for ever). The hooks run once per restart, in order; calls from other threads to the restarted ranks wait
  until they end. A hook that raises stops the restore: the unrestored new
  workers are killed (the next call restarts them again, within `max_restarts`) and the hook's error is raised,
  noted with the role, ranks, hook and the restart's cause. A hook that fails with a WorkerDiedError because every
  rank it restored died and was restarted (and restored, by the inner restart's hooks) inside it leaves a healthy
  group: it is logged, and the call is rerun.
- One call's parts are sent to all its ranks under the group's submit lock: two
  threads calling the same group (an async run's trainer `train` beside an engine restore's `publish_weights`)
  otherwise interleaved their sends, and since Ray runs one caller's calls on an actor in the order sent, rank 0
  ran [train, publish] and rank 1 [publish, train]: their collectives mismatched (a hang, or wrong results). The
  lock is held only while sending, never while waiting for results or for a restore. A restart's reruns are sent
  under it too, but they reach only the restarted ranks, after calls other threads sent since: a collective whose
  ranks are rerun in part stays unsafe (why sharded trainers are not restartable).
- A method that raised a Ray error of its own (a RayActorError: an actor it called died) is its error, not its
  worker's death: it is raised, noted, and nothing is restarted.
- A method declared `retry=False` is not rerun: the worker is restarted, then `WorkerRestartedError` asks the
  caller to redo the protocol the call belongs to.
- A group that may not restart (sharded trainers: their ranks share torch.distributed groups) fails with the
  error and `death_hint()` appended (the pipeline names the checkpoint to resume from) as soon as a rank's death
  is seen, without waiting for the other ranks: they may be blocked in a collective with the dead one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from roll_core.cluster._group_faults import (  # the errors are imported from here
    CallTimeoutError,
    WorkerDiedError,
    WorkerRestartedError,
    death_summary,
    failed_note,
    hook_name,
    ray_report,
    start_failures_note,
)
from roll_core.cluster._group_start import GroupStart, RayOptions
from roll_core.cluster.handle import Handle
from roll_core.cluster.mesh import Mesh
from roll_core.cluster.ports import free_port, reserve_port  # noqa: F401  (re-exported: old imports work)
from roll_core.cluster.worker import Dispatch, Worker, by_value, dispatch_mode, retryable
from roll_core.protocol import Batch

W = TypeVar("W", bound=Worker)
P = ParamSpec("P")
R = TypeVar("R")
#: A worker method as the controller names it: `TrainWorker.compute_values` (unbound, the worker first).
Method = Callable[Concatenate[W, P], R]
log = logging.getLogger(__name__)


class WorkerGroup(GroupStart, Generic[W]):
    """`world_size` workers of class `cls` on the `local` or `ray` backend."""

    #: The worker class a typed subclass drives (used by roll_core.cluster.launch.Cluster).
    worker_cls: type[Worker] = Worker
    #: Ranks are torch.distributed processes (sharded training): several ranks cannot share one process.
    one_process_per_rank: bool = False
    #: A dead or hung worker may be re-created alone (its state can be restored by the restart hooks).
    restartable: bool = False

    def __init__(
        self,
        cls: type[W],
        world_size: int,
        backend: str = "local",
        *,
        name: str = "",
        ray_options: RayOptions | None = None,
        mesh: Mesh | None = None,
        call_timeout_s: float | None = None,
        max_restarts: int = 0,
        start_timeout_s: float = 600.0,
        **kwargs: Any,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.cls, self.world_size, self.backend, self.name = cls, world_size, backend, name or cls.__name__
        self.call_timeout_s = call_timeout_s or None
        self.max_restarts = max_restarts if self.restartable else 0
        self.start_timeout_s = start_timeout_s  # a restarted worker's start and set-up (an engine loads its model)
        self.restarts = 0  # restart attempts (per rank) so far, whether their new workers started or not
        # Per rank: (restart attempts in a row whose worker failed to start, the last one's error and its words).
        self._start_failures: dict[int, tuple[int, BaseException, str]] = {}
        # Incarnation of each rank (bumped by a restart): a call that fails on a rank another thread has already
        # restarted is rerun there, not restarted twice. Restarts and their hooks run under `restart_lock`
        # (re-entrant: hooks make calls); code that must not interleave with a restore takes it too (weight sync).
        self._incarnation = [0] * world_size
        self.restart_lock = threading.RLock()
        self.timeouts = 0  # calls (per rank) that passed their deadline
        self._restart_hooks: list[Callable[[list[int]], None]] = []
        # While restart hooks restore ranks: (the thread running them, those ranks). Calls from other threads to
        # those ranks wait for the end of the restore (`_actors`); `_state_lock` makes a restart's swap of actors and
        # incarnations atomic for the calls that read them.
        self._restoring: tuple[threading.Thread, frozenset[int]] | None = None
        self._state_lock = threading.Lock()
        # Held while one call's parts are sent to its ranks (module doc), after `_actors` (which may wait for a
        # restore whose hooks call this group) and never while waiting: it nests inside nothing that blocks.
        self._submit_lock = threading.Lock()
        #: Appended to a fatal fault's message (the pipeline names the checkpoint to resume from).
        self.death_hint: Callable[[], str] | None = None
        self.mesh = mesh or Mesh(dp=world_size)
        if self.mesh.world_size != world_size:
            raise ValueError(f"{self.name}: mesh {self.mesh} has {self.mesh.world_size} ranks, the group {world_size}")
        self.nodes: list[str] = ["local"] * world_size  # node id per rank, for error messages
        if backend == "local":
            if world_size > 1 and self.one_process_per_rank:
                raise ValueError(
                    f"{self.name}: world_size={world_size} runs one process per rank (torch.distributed), which the "
                    "local backend cannot give: use cluster=ray, or world_size=1"
                )
            self.workers: list[Any] = self._start_local(cls, world_size, kwargs)
        elif backend == "ray":
            self.workers = self._start_ray(cls, world_size, ray_options or RayOptions(), kwargs)
        else:
            raise ValueError(f"unknown backend {backend!r}: use 'local' or 'ray'")

    # ---- calls --------------------------------------------------------------------------------------------
    def _method_name(self, method: Callable[..., Any]) -> str:
        """The name of a worker method of this group's class (a string or another class's method is an error)."""
        if isinstance(method, str):
            raise TypeError(
                f"{self.name}: pass the worker method ({self.cls.__name__}.{method}), not its name: a type checker "
                "sees a method, not a string"
            )
        name = getattr(method, "__name__", None)
        owner = next((c for c in self.cls.__mro__ if name is not None and vars(c).get(name) is method), None)
        if owner is None:
            raise TypeError(f"{self.name}: {method!r} is not a method of {self.cls.__name__} (or of its bases)")
        return name

    def submit(self, method: Method[W, P, R], *args: P.args, **kwargs: P.kwargs) -> Handle[R]:
        """Start `method` (a method of the group's worker class) according to its dispatch mode; returns a Handle."""
        name = self._method_name(method)
        mode = dispatch_mode(self.cls, name)
        if mode is Dispatch.ONE:
            raise TypeError(f"{self.cls.__name__}.{name} goes to one rank: use submit_to(rank, ...)")
        per_rank_args = self._distribute(mode, args)
        targets = range(1) if mode is Dispatch.RANK0 else range(self.world_size)
        return self._run(name, mode, {r: per_rank_args[r] for r in targets}, kwargs)

    def submit_to(self, rank: int, method: Method[W, P, R], *args: P.args, **kwargs: P.kwargs) -> Handle[R]:
        """Start `method` on one rank only (methods declared `Dispatch.ONE`)."""
        name = self._method_name(method)
        mode = dispatch_mode(self.cls, name)
        if mode is not Dispatch.ONE:
            raise TypeError(f"{self.cls.__name__}.{name} is dispatched as {mode.value}, not to one rank")
        if not 0 <= rank < self.world_size:
            raise IndexError(f"{self.name} has ranks 0..{self.world_size - 1}, not {rank}")
        return self._run(name, mode, {rank: args}, kwargs)

    def _run(self, method: str, mode: Dispatch, args: dict[int, Sequence[Any]], kwargs: dict[str, Any]) -> Handle:
        ranks = list(args)
        keep = None
        if mode is Dispatch.DP and self.mesh.dp != self.world_size:
            keep = [ranks.index(r) for r in self.mesh.output_ranks()]
        if self.backend == "local":
            return Handle(self._call_local(method, args, kwargs), mode, lambda p: p, keep)
        actors, born = self._actors(args)
        with self._submit_lock:  # every rank gets this call in the same place among other threads' calls
            parts = [getattr(actors[r], method).remote(*a, **kwargs) for r, a in args.items()]
        deadline = self._deadline()
        return Handle(parts, mode, lambda p: self._collect(method, args, kwargs, p, deadline, born), keep, remote=True)

    def _actors(self, ranks: Iterable[int]) -> tuple[dict[int, Any], dict[int, int]]:
        """The actors of `ranks` and their incarnations, read together (a restart swaps both). A rank whose restart
        hooks still restore it is waited for, unless this thread runs them (their own calls): a call from another
        thread (a request, a health check) reached the new worker before its state was restored, and an engine
        served its initial weights as the current ones."""
        wanted = list(ranks)
        while True:
            with self._state_lock:
                busy = self._restoring
                if busy is None or busy[0] is threading.current_thread() or busy[1].isdisjoint(wanted):
                    return {r: self.workers[r] for r in wanted}, {r: self._incarnation[r] for r in wanted}
            with self.restart_lock:  # the restoring thread holds it until its hooks end
                pass

    def _call_local(self, method: str, args: dict[int, Sequence[Any]], kwargs: dict[str, Any]) -> list[Any]:
        """Per-rank results of an in-process call (module doc: every rank is called, then the first error raised).
        Each rank gets its own copy of the arguments, and the caller copies of the results, as Ray's serialisation
        gives them (see roll_core.cluster.worker.by_value)."""
        parts: list[Any] = []
        errors: dict[int, Exception] = {}
        for r, a in args.items():
            try:
                parts.append(by_value(getattr(self.workers[r], method)(*by_value(a), **by_value(kwargs))))
            except Exception as exc:  # an interrupt stops at once
                errors[r] = exc
                parts.append(None)
        if errors:
            first, exc = next(iter(errors.items()))
            others = "".join(f"; rank {r}: {type(e).__name__}: {e}" for r, e in errors.items() if r != first)
            note = failed_note(self.name, method, list(errors), len(args))
            exc.add_note(f"{note}; rank {first}'s error raised{others}")
            raise exc
        return parts

    def call_ranks(self, ranks: Sequence[int], method: Method[W, P, R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run a broadcast method on some ranks only (restoring restarted workers); their results in order."""
        name = self._method_name(method)
        mode = dispatch_mode(self.cls, name)
        if mode not in (Dispatch.BROADCAST, Dispatch.RANK0):
            raise TypeError(f"{self.cls.__name__}.{name} is dispatched as {mode.value}; call_ranks runs broadcasts")
        return self._run(name, Dispatch.BROADCAST, {r: args for r in ranks}, kwargs).values()

    # ---- faults (Ray) ---------------------------------------------------------------------------------------
    def _deadline(self) -> float | None:
        return None if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s

    def add_restart_hook(self, hook: Callable[[list[int]], None]) -> None:
        """Call `hook(ranks)` after ranks were restarted, before the failed call is rerun (state restore)."""
        self._restart_hooks.append(hook)

    def _collect(
        self,
        method: str,
        args: dict[int, Sequence[Any]],
        kwargs: dict[str, Any],
        refs: list[Any],
        deadline: float | None,
        born: dict[int, int],
    ) -> list[Any]:
        """Per-rank results of a call; dead or hung ranks are restarted and their part rerun (see module doc)."""
        import ray

        pending = dict(zip(args, refs))
        results: dict[int, Any] = {}
        while pending:
            dead, hung = [], []
            deaths: dict[int, Exception] = {}  # Ray's report of each death (cause, node, pid, exit detail)
            waiting = dict(pending)
            # One answer at a time: a death is seen when it happens. A group that may not restart it fails at once,
            # since its other ranks may be blocked in a collective with the dead one (an NCCL wait can last 30 min).
            while waiting:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _ = ray.wait(list(waiting.values()), num_returns=1, timeout=remaining)
                if not ready:
                    hung = list(waiting)  # past the deadline
                    break
                for r in [r for r, ref in waiting.items() if ref in ready]:
                    try:
                        results[r] = ray.get(waiting.pop(r))
                    except ray.exceptions.RayTaskError as exc:  # the method raised: the first to answer is raised
                        # First: a method that raised a RayActorError of its own (an actor it called died) gets an
                        # instance of both, and was taken for its worker's death (a healthy worker restarted).
                        exc.add_note(failed_note(self.name, method, [r], len(args)))
                        raise
                    except ray.exceptions.RayActorError as exc:
                        dead.append(r)
                        deaths[r] = exc
                if dead and self.restarts + len(dead) > self.max_restarts:
                    break
            if not dead and not hung:
                break
            self._recover(method, dead, hung, born, deaths)
            rerun = dead + hung
            actors, reborn = self._actors(rerun)
            born = {**born, **reborn}
            deadline = self._deadline()
            # Ranks not yet answered when a death stopped the wait (one another caller's restart had repaired) are
            # still running: wait for them too, with the reruns.
            pending = {r: ref for r, ref in waiting.items() if r not in rerun}
            with self._submit_lock:  # the reruns too: they may be a collective over several ranks
                pending.update({r: getattr(actors[r], method).remote(*args[r], **kwargs) for r in rerun})
        return [results[r] for r in args]

    def _recover(
        self,
        method: str,
        dead: list[int],
        hung: list[int],
        born: dict[int, int],
        deaths: dict[int, Exception] | None = None,
    ) -> None:
        """Restart dead and hung ranks if this group may, else raise the error that names them (and Ray's report
        of the death: `deaths`). Ranks that another thread restarted since the call was submitted (`born`: their
        incarnation then) are only rerun."""
        failed = dead + hung
        with self.restart_lock:
            self.timeouts += len(hung)
            dead = [r for r in dead if self._incarnation[r] == born.get(r, 0)]
            hung = [r for r in hung if self._incarnation[r] == born.get(r, 0)]
            if dead or hung:
                self._restart_or_raise(method, dead, hung, deaths or {})
        if not retryable(self.cls, method):
            raise WorkerRestartedError(f"{self.name}: rank(s) {failed} restarted; {method}() must be redone", failed)

    def _restart_or_raise(self, method: str, dead: list[int], hung: list[int], deaths: dict[int, Exception]) -> None:
        failed = dead + hung
        allowed = self.restarts + len(failed) <= self.max_restarts
        if not allowed:
            budget = (
                f"; {self.restarts} restart(s) already, cluster.max_restarts={self.max_restarts}"
                if self.restartable
                else ""
            )
            hint = f". {self.death_hint()}" if self.death_hint is not None else ""
            # A rank whose last restart failed to start is dead because it was killed then: its start failure says why.
            unstarted, start_error = start_failures_note(self._start_failures, failed)
            if dead:
                where = ", ".join(f"rank {r} on node {self.nodes[r]}" for r in dead)
                # Why it died (OOM killer, segfault, a failed constructor's traceback) is in Ray's report alone.
                cause = start_error or next((deaths[r] for r in dead if r in deaths), None)
                report = f"\nRay's report: {ray_report(cause)}" if cause is not None and not unstarted else ""
                raise WorkerDiedError(
                    f"{self.name} {where} died during {method}(){budget}{unstarted}{hint}{report}"
                ) from cause
            raise CallTimeoutError(
                f"{self.name}.{method}() did not return within {self.call_timeout_s}s on rank(s) "
                f"{', '.join(map(str, hung))} (cluster.call_timeout_s, or cluster.call_timeouts.{self.name})"
                f"{budget}{unstarted}{hint}"
            )
        reason = ", ".join(
            [f"rank {r} died during {method}(){death_summary(deaths.get(r))}" for r in dead]
            + [f"rank {r} hung in {method}() past {self.call_timeout_s}s" for r in hung]
        )
        self.restart(failed, reason)

    def restart(self, ranks: list[int], reason: str = "requested") -> None:
        """Kill and re-create `ranks` with their original options, set them up, then run the restart hooks. It spends
        the faults' `max_restarts` budget: past it (or on a group that may not restart) it raises, restarting none."""
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"{self.name}: restart needs distinct ranks in [0, {self.world_size}), got {ranks}")
        with self.restart_lock:
            if self.restarts + len(ranks) > self.max_restarts or self.backend != "ray":
                raise RuntimeError(
                    f"{self.name}: cannot restart rank(s) {ranks} ({reason}): {self.restarts} restart(s) already, "
                    f"cluster.max_restarts={self.max_restarts} (restartable={self.restartable}, backend={self.backend})"
                )
            self._restart(ranks, reason)

    def _restart(self, ranks: list[int], reason: str) -> None:
        import ray

        # Counted before the start: an attempt whose worker never comes up spends the budget too (module doc).
        self.restarts += len(ranks)
        log.warning(
            "%s: %s; restarting rank(s) %s (%d of cluster.max_restarts=%d used)",
            self.name,
            reason,
            ranks,
            self.restarts,
            self.max_restarts,
        )
        dead = {r: self.workers[r] for r in ranks}
        for r in ranks:
            try:
                ray.kill(self.workers[r], no_restart=True)  # a hung worker must free its bundle for its successor
            except Exception:
                pass  # already gone
        fresh: dict[int, Any] = {}
        wait = self.start_timeout_s
        try:
            for r in ranks:
                fresh[r] = self._spawn(r)
            nodes = ray.get([a.node_id.remote() for a in fresh.values()], timeout=wait)
            ray.get([a.setup.remote(*self._endpoint) for a in fresh.values()], timeout=wait)
        except BaseException as exc:
            # A successor that did not come up is killed: alive (its set-up raised) or waiting to be placed, it
            # would hold or take the bundle for nothing.
            for a in fresh.values():
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass
            if not isinstance(exc, ray.exceptions.RayError):
                raise
            timed_out = isinstance(exc, ray.exceptions.GetTimeoutError)
            why = type(exc).__name__ if timed_out else ray_report(exc)
            for r in ranks:
                tries = self._start_failures.get(r, (0,))[0] + 1
                self._start_failures[r] = (tries, exc, f"not up within {wait}s ({why})" if timed_out else why)
            raise WorkerDiedError(
                f"{self.name}: rank(s) {ranks} could not be restarted within {wait}s ({why}); "
                f"the cluster has {ray.available_resources()} free; {self.restarts} of "
                f"cluster.max_restarts={self.max_restarts} restart(s) used. The restart was for: {reason}"
            ) from exc
        with self._state_lock:
            for (r, actor), node in zip(fresh.items(), nodes):
                self.workers[r], self.nodes[r] = actor, str(node)
                self._incarnation[r] += 1
                self._start_failures.pop(r, None)
            outer = self._restoring  # a restart inside a hook (the restored rank died again) keeps the outer's ranks
            self._restoring = (threading.current_thread(), frozenset(ranks) | (outer[1] if outer else frozenset()))
        try:
            self._restore(ranks, reason, fresh, dead)
        finally:
            with self._state_lock:
                self._restoring = outer

    def _restore(self, ranks: list[int], reason: str, fresh: dict[int, Any], dead: dict[int, Any]) -> None:
        """Run the restart hooks once each, in order. A hook that raises stops the restore: the new workers it
        left unrestored are killed (kept, they served calls with a fresh state: an engine's initial weights, not the
        trainer's) and their ranks get back their `dead` actors, so the next call restarts them and the hooks run
        again, within cluster.max_restarts; the hook's error is raised, noted with the role, ranks, hook and the
        restart's cause. A hook that failed because every rank died again and was restarted inside it (whose hooks
        restored them) ends the restore: the group is healthy (a WeightSync restore's receive fails then)."""
        import ray

        for hook in self._restart_hooks:
            try:
                hook(list(ranks))
            except BaseException as exc:
                # A successor a restart inside the hook replaced is that restart's (its hooks restored it).
                with self._state_lock:
                    stale = [r for r, a in fresh.items() if self.workers[r] is a]
                    if not stale and isinstance(exc, WorkerDiedError):
                        log.warning("%s: rank(s) %s restored by a restart inside %s", self.name, ranks, hook_name(hook))
                        return
                    # Ray's kill is asynchronous (a call sent now could still run on the successor); the dead actor
                    # fails every call at once: its death is long known.
                    for r in stale:
                        self.workers[r] = dead[r]
                for r in stale:
                    try:
                        ray.kill(fresh[r], no_restart=True)
                    except Exception:
                        pass  # already gone
                exc.add_note(
                    f"{self.name}: rank(s) {ranks} were restarted ({reason}), but the restart hook {hook_name(hook)} "
                    f"failed to restore them; the unrestored new worker(s) of rank(s) {stale} were stopped (the next "
                    f"call restarts them: {self.restarts} of cluster.max_restarts={self.max_restarts} used)"
                )
                raise

    def check_health(self, timeout: float = 30.0) -> list[int]:
        """Ping every rank and restart those that died (restartable groups); returns the restarted ranks. A rank
        busy past `timeout` counts as alive (long calls are the call timeout's business)."""
        if self.backend != "ray":
            return []
        import ray

        # The incarnations the pings reach: a rank another thread restarts meanwhile is not restarted twice.
        actors, born = self._actors(range(self.world_size))
        refs = [actors[r].ping.remote() for r in range(self.world_size)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        ready_set, dead, deaths = set(ready), [], {}
        for r, ref in enumerate(refs):
            if ref in ready_set:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    dead.append(r)
                    deaths[r] = exc
        if dead:
            self._recover("ping", dead, [], {r: born[r] for r in dead}, deaths)
        return dead

    def call(self, method: Method[W, P, R], *args: P.args, **kwargs: P.kwargs) -> Any:
        """`submit(...).result()`: per the dispatch mode, rank 0's `R` (RANK0), the concatenated Batch (DP) or the
        list of per-rank results (BROADCAST, DP of other types)."""
        return self.submit(method, *args, **kwargs).result()

    def _distribute(self, mode: Dispatch, args: Sequence[Any]) -> list[Sequence[Any]]:
        if mode is not Dispatch.DP:
            return [args] * self.world_size
        if not args or not isinstance(args[0], Batch):
            got = type(args[0]).__name__ if args else "no argument"
            raise TypeError(f"a DP call needs a Batch as its first argument, got {got}")
        # Split by data-parallel rank only: the TP x PP ranks of one replica get the same rows.
        parts = args[0].split(self.mesh.dp)
        return [(parts[self.mesh.dp_rank(r)], *args[1:]) for r in range(self.world_size)]
