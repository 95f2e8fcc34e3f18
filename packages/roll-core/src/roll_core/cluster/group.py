"""Worker groups over two backends with one code path: `local` (in-process) and `ray` (actors).

`WorkerGroup(cls, world_size, backend, **kwargs)` creates `world_size` instances of a worker class and runs
calls according to each method's declared dispatch mode (see roll_core.cluster.worker). `submit()` returns a
`Handle` to wait on, so the controller can overlap work; `call()` waits. The `local` backend executes at submit
time in this process (so `breakpoint()` in a worker just works); the `ray` backend places actors by the
resources and placement groups the caller gives.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from roll_core.cluster.mesh import Mesh
from roll_core.cluster.worker import Dispatch, Worker, dispatch_mode
from roll_core.protocol import Batch

W = TypeVar("W", bound=Worker)


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on this host (bound on `host`) for a torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class RayOptions:
    """How to place one group's actors on Ray."""

    num_cpus: float = 0.5
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    # (placement group, bundle index per rank); None lets Ray schedule freely.
    placement: tuple[Any, list[int]] | None = None
    env: list[dict[str, str]] | None = None  # per-rank environment variables (e.g. visible devices)
    # Python executable of another virtual environment for these actors (Ray runtime_env `py_executable`): an
    # engine with conflicting pins (vLLM's transformers pin) runs in its own venv while other roles do not.
    python: str | None = None
    # Calls one actor may serve at once (threads): request-level engines serve many blocking requests.
    max_concurrency: int = 1


class WorkerDiedError(RuntimeError):
    """A worker process died during a call; the message names role, rank and node."""


class Handle:
    """A pending group call; `result()` waits and assembles per the dispatch mode."""

    def __init__(
        self,
        parts: list[Any],
        mode: Dispatch,
        resolve: Callable[[list[Any]], list[Any]],
        keep: list[int] | None = None,
    ) -> None:
        self._parts, self._mode, self._resolve = parts, mode, resolve
        self._keep = keep  # DP calls on a mesh: the parts that carry results (one per replica, in DP order)

    @property
    def refs(self) -> list[Any]:
        """Raw per-rank results or Ray object refs (to pass results on without a round trip)."""
        return self._parts

    def values(self) -> list[Any]:
        """Per-rank results, waiting for every rank; a DP call on a mesh returns one result per replica."""
        values = self._resolve(self._parts)
        return values if self._keep is None else [values[i] for i in self._keep]

    def result(self) -> Any:
        values = self.values()
        if self._mode in (Dispatch.RANK0, Dispatch.ONE):
            return values[0]
        if self._mode is Dispatch.DP and values and all(isinstance(v, Batch) for v in values):
            return Batch.concat(values)
        return values


class WorkerGroup(Generic[W]):
    """`world_size` workers of class `cls` on the `local` or `ray` backend."""

    #: The worker class a typed subclass drives (used by roll_core.cluster.launch.Cluster).
    worker_cls: type[Worker] = Worker
    #: Ranks are torch.distributed processes (sharded training): several ranks cannot share one process.
    one_process_per_rank: bool = False

    def __init__(
        self,
        cls: type[W],
        world_size: int,
        backend: str = "local",
        *,
        name: str = "",
        ray_options: RayOptions | None = None,
        mesh: Mesh | None = None,
        **kwargs: Any,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.cls, self.world_size, self.backend, self.name = cls, world_size, backend, name or cls.__name__
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
            self.workers: list[Any] = [cls(rank=r, world_size=world_size, **kwargs) for r in range(world_size)]
            endpoint = self.workers[0].rendezvous_endpoint()
            for w in self.workers:
                w.setup(*endpoint, export_env=False)
        elif backend == "ray":
            self.workers = self._start_ray(cls, world_size, ray_options or RayOptions(), kwargs)
        else:
            raise ValueError(f"unknown backend {backend!r}: use 'local' or 'ray'")

    def _start_ray(self, cls: type, world_size: int, opts: RayOptions, kwargs: dict[str, Any]) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote_cls = ray.remote(cls)
        actors = []
        for r in range(world_size):
            options: dict[str, Any] = {
                "num_cpus": opts.num_cpus,
                "num_gpus": opts.num_gpus,
                "resources": dict(opts.resources),
            }
            if opts.placement is not None:
                pg, bundles = opts.placement
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundles[r]
                )
            runtime_env: dict[str, Any] = {}
            if opts.env and opts.env[r]:
                runtime_env["env_vars"] = dict(opts.env[r])
            if opts.python:
                runtime_env["py_executable"] = opts.python
            if runtime_env:
                options["runtime_env"] = runtime_env
            if opts.max_concurrency > 1:
                options["max_concurrency"] = opts.max_concurrency
            actors.append(remote_cls.options(**options).remote(rank=r, world_size=world_size, **kwargs))
        try:
            self.nodes = [str(n) for n in ray.get([a.node_id.remote() for a in actors])]
        except ray.exceptions.RayActorError as exc:
            raise WorkerDiedError(f"{self.name}: a worker failed to start: {exc}") from exc
        # Phase two: rank 0 (wherever it landed) picks the rendezvous on its own node; then every rank sets up.
        endpoint = ray.get(actors[0].rendezvous_endpoint.remote())
        self.workers = actors
        self._get([a.setup.remote(*endpoint) for a in actors], list(range(world_size)), "setup")
        return actors

    # ---- calls --------------------------------------------------------------------------------------------
    def submit(self, method: str, *args: Any, **kwargs: Any) -> Handle:
        """Start `method` on the group according to its dispatch mode; returns a Handle."""
        mode = dispatch_mode(self.cls, method)
        if mode is Dispatch.ONE:
            raise TypeError(f"{self.cls.__name__}.{method} goes to one rank: use submit_to(rank, ...)")
        per_rank_args = self._distribute(mode, args)
        targets = range(1) if mode is Dispatch.RANK0 else range(self.world_size)
        return self._run(method, mode, {r: per_rank_args[r] for r in targets}, kwargs)

    def submit_to(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Handle:
        """Start `method` on one rank only (methods declared `Dispatch.ONE`)."""
        mode = dispatch_mode(self.cls, method)
        if mode is not Dispatch.ONE:
            raise TypeError(f"{self.cls.__name__}.{method} is dispatched as {mode.value}, not to one rank")
        if not 0 <= rank < self.world_size:
            raise IndexError(f"{self.name} has ranks 0..{self.world_size - 1}, not {rank}")
        return self._run(method, mode, {rank: args}, kwargs)

    def _run(self, method: str, mode: Dispatch, args: dict[int, Sequence[Any]], kwargs: dict[str, Any]) -> Handle:
        ranks = list(args)
        keep = None
        if mode is Dispatch.DP and self.mesh.dp != self.world_size:
            keep = [ranks.index(r) for r in self.mesh.output_ranks()]
        if self.backend == "local":
            parts = [getattr(self.workers[r], method)(*a, **kwargs) for r, a in args.items()]
            return Handle(parts, mode, lambda p: p, keep)
        parts = [getattr(self.workers[r], method).remote(*a, **kwargs) for r, a in args.items()]
        return Handle(parts, mode, lambda p: self._get(p, ranks, method), keep)

    def _get(self, refs: list[Any], ranks: list[int], method: str) -> list[Any]:
        """ray.get that names the role, rank and node of a worker that died."""
        import ray

        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as exc:
            dead = []
            for r, ref in zip(ranks, refs):
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError:
                    dead.append(f"rank {r} on node {self.nodes[r]}")
                except Exception:
                    pass
            where = ", ".join(dead) or "a rank"
            raise WorkerDiedError(f"{self.name} {where} died during {method}(): {type(exc).__name__}") from exc

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`submit(...).result()`."""
        return self.submit(method, *args, **kwargs).result()

    def _distribute(self, mode: Dispatch, args: Sequence[Any]) -> list[Sequence[Any]]:
        if mode is not Dispatch.DP:
            return [args] * self.world_size
        if not args or not isinstance(args[0], Batch):
            raise TypeError(f"a DP call needs a Batch as its first argument, got {type(args[0]).__name__}")
        # Split by data-parallel rank only: the TP x PP ranks of one replica get the same rows.
        parts = args[0].split(self.mesh.dp)
        return [(parts[self.mesh.dp_rank(r)], *args[1:]) for r in range(self.world_size)]

    def shutdown(self) -> None:
        """Stop the actors (ray) or drop the instances (local)."""
        if self.backend == "ray":
            import ray

            for a in self.workers:
                ray.kill(a)
        self.workers = []
