"""How a worker group's workers start and stop (roll_core.cluster.group, whose `WorkerGroup` has `GroupStart` as a
base class and re-exports `RayOptions`: import it from there).

Start: a rank whose constructor or set-up fails (or that is not placed within `start_timeout_s`) fails the group's
start at once, without waiting for the other ranks (they may wait in a rendezvous with it); every rank already
built is stopped first (Ray: killed, freeing its CPUs, devices and bundle; local: torn down). A constructor's
failure is a `WorkerDiedError` naming the rank and quoting Ray's report (the traceback); a set-up's is the
worker's own error (its type kept), with a note naming the rank.

Contract: `_start_local` and `_start_ray` return the group's started workers (every rank built and set up) or raise,
leaving no rank of the group running; `_start_ray` also keeps what a restart needs (`_spawn`'s actor class, kwargs and
per-rank options, the rendezvous `_endpoint`) and sets `nodes`. `shutdown()` stops every worker (Ray: killed; local:
torn down, a failed teardown logged and the others still torn down) and leaves the group without workers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from roll_core.cluster._group_faults import wait_all

# The group's logger: these messages keep the name they had in roll_core.cluster.group.
log = logging.getLogger("roll_core.cluster.group")


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


class GroupStart:
    """The start and shutdown methods of `WorkerGroup` (the module docstring). They use the group's `name`,
    `world_size`, `backend`, `nodes`, `start_timeout_s` and `workers`."""

    def _start_local(self, cls: type, world_size: int, kwargs: dict[str, Any]) -> list[Any]:
        """Build and set up the ranks in this process; if one fails, those built are torn down (their engines'
        threads and memory) before its error is raised."""
        workers: list[Any] = []
        try:
            for r in range(world_size):
                workers.append(cls(rank=r, world_size=world_size, **kwargs))
            endpoint = workers[0].rendezvous_endpoint()
            for w in workers:
                w.setup(*endpoint, export_env=False)
        except BaseException:
            for w in workers:
                try:
                    w.teardown()
                except Exception:  # the error that stopped the start is the one to raise
                    log.exception("%s rank %d: teardown after a failed start failed", self.name, w.rank)
            raise
        return workers

    def _start_ray(self, cls: type, world_size: int, opts: RayOptions, kwargs: dict[str, Any]) -> list[Any]:
        """Create the actors, wait for them to be placed and built, then set them up. A rank that fails (its
        constructor or its set-up raises, or it is not placed in time) fails the start at once, without waiting for
        the other ranks (they may wait in a rendezvous with it), and every actor of the group is killed first: the
        ranks already built would otherwise keep their CPUs, devices and placement bundles, and a rerun in the same
        Ray session would wait for them forever."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote_cls = ray.remote(cls)
        self._remote_cls, self._actor_kwargs, self._actor_options = remote_cls, kwargs, []
        actors: list[Any] = []
        try:
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
                self._actor_options.append(options)
                actors.append(self._spawn(r))
            # Bounded: an actor Ray cannot place (its bundle's share used up) would otherwise be waited for forever.
            nodes = wait_all(self.name, self.nodes, [a.node_id.remote() for a in actors], "start", self.start_timeout_s)
            self.nodes = [str(n) for n in nodes]
            # Phase two: rank 0 (wherever it landed) picks the rendezvous on its own node; then every rank sets up.
            endpoint = ray.get(actors[0].rendezvous_endpoint.remote())
            self._endpoint = endpoint  # a restarted rank sets up with the same rendezvous
            self.workers = actors
            # Unbounded: the set-up loads models.
            wait_all(self.name, self.nodes, [a.setup.remote(*endpoint) for a in actors], "set up", None)
        except BaseException:
            for a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:
                    pass  # already gone
            self.workers = []
            raise
        return actors

    def _spawn(self, rank: int) -> Any:
        """A new actor for `rank`, with the options (resources, placement bundle, environment) of the first."""
        return self._remote_cls.options(**self._actor_options[rank]).remote(
            rank=rank, world_size=self.world_size, **self._actor_kwargs
        )

    def shutdown(self) -> None:
        """Stop the actors (ray), or tear down and drop the instances (local: engine threads would outlive them)."""
        if self.backend == "ray":
            import ray

            for a in self.workers:
                ray.kill(a)
        else:
            for w in self.workers:
                try:
                    w.teardown()
                except Exception:  # a failed run's engine may be broken: release the others regardless
                    log.exception("%s rank %d: teardown failed", self.name, w.rank)
        self.workers = []
