"""Cluster set-up for a run: platform, backend (local or Ray), and placement of each role's workers.

Placement from `cluster.placement`:
- `colocated`: the device roles (actor_train, actor_infer, reference, critic) share one placement group of as many
  bundles as the first of them has ranks (actor_train's; actor_infer's where nothing trains: a later role with more
  is refused, by roll_core.pipelines.wiring before any role starts); rank r of every role sits on bundle r and
  takes a fractional device share, so the roles time-share the same devices.
- `disaggregated`: each device role gets its own placement group and whole devices.
A role's own `placement` (reward_model.placement) may choose `disaggregated` in a colocated cluster, not
`colocated` in a disaggregated one (the trainer's devices are its own there: a ConfigError).
On a Ray instance the run starts itself (fixed resources, reserved by this run alone) a placement group that does
not fit beside the run's others is a ConfigError at once, not a wait of `cluster.placement_timeout_s`; its
`cluster.resources.GPU` is Ray's GPU count (`num_gpus`). Reward workers need no device and are scheduled freely with
a small CPU share (on an instance the run started, more than its CPUs hold is a ConfigError at once too). A
`cluster.address` where no Ray answers is a ConfigError before `ray.init`, which would retry it without end
(roll_core.cluster.ray_address). On the CPU platform the bundles
hold CPU only. Ray itself sets the visible-devices variable of GPU/NPU workers for the devices it assigns.
`cluster.num_cpus`, `cluster.resources` and `cluster.ray_token_auth` apply to a Ray instance the run starts: set
(not default) with `cluster.address` or a Ray already running in the process they are a ConfigError;
`ray_token_auth=false` sets RAY_AUTH_MODE=disabled for the start only (the variable is put back after ray.init). A
failure after the run started (or joined) Ray or inside its ray.init, before the Cluster exists, stops (disconnects)
it; `shutdown` does every step and raises the first error after.
A local Ray instance that a run starts listens on loopback only (`loopback_only`) and its processes run out of the
driver's process group (`own_session`): a SIGTERM to the group stops the run gracefully, not Ray under it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from roll_core.cluster.group import RayOptions, WorkerGroup
from roll_core.cluster.worker import Worker
from roll_core.config.schema import ClusterConfig, HwConfig, logical_cpus
from roll_core.errors import ConfigError
from roll_hw import Platform

log = logging.getLogger(__name__)
G = TypeVar("G", bound=WorkerGroup)
DEVICE_ROLES = ("actor_train", "actor_infer", "reference", "critic", "reward_model")
#: The keys that size the roles scheduled outside placement groups (named when they cannot fit).
FREE_ROLE_KEYS = {"reward": "pipeline.reward_workers", "env": "env.num_workers"}


def is_device_role(role: str) -> bool:
    """A role whose workers hold a model on the devices: the DEVICE_ROLES, distillation teachers (`teacher_*`,
    which take the reference policy's share when colocated: a distillation run has no reference) and AsyPPO's
    further critics (`critic_1`, ...: algo.num_critics)."""
    return role in DEVICE_ROLES or role.startswith(("teacher_", "critic_"))


# Ray sets the visible-devices variable itself for these resources (its accelerator managers); for any other
# device resource (out-of-tree platforms) roll sets the platform's variable from the bundle's place on its node,
# always: Ray has no NOSET switch for custom resources. Under Ray's own NOSET switches (GPU, NPU) each worker finds
# its device from the ids Ray assigned (roll_hw.ray_devices).
RAY_MANAGED_RESOURCES = ("GPU", "NPU")


def resolve_python(value: str | None, engine: str) -> str | None:
    """The Python executable a role's actors run with: None (this environment), a path, or `auto`.

    `auto`: this environment if it can import the engine's package (`engine`), else the engine's venv that
    `nox -s <engine>_venv` builds at `<repo>/.venvs/<engine>` (or `$ROLL_VENVS_DIR/<engine>`).
    """
    import importlib.util
    from pathlib import Path

    if value is None:
        return None
    if value != "auto":
        path = Path(value).expanduser().absolute()  # not resolve(): a venv's python is a symlink to the base one
        if not path.is_file():
            raise ConfigError(f"infer_engine.python={value!r}: no such executable ({path})")
        return str(path)
    if importlib.util.find_spec(engine) is not None:
        return None
    from roll_core.config.compose import find_conf_dir

    roots = [Path(os.environ["ROLL_VENVS_DIR"])] if os.environ.get("ROLL_VENVS_DIR") else []
    roots.append(find_conf_dir().parent / ".venvs")
    for root in roots:
        candidate = root / engine / "bin" / "python"
        if candidate.is_file():
            return str(candidate)
    raise ConfigError(
        f"infer_engine={engine}: {engine} is not importable in this environment and no venv was found at "
        f"{roots[-1] / engine}: build it with `nox -s {engine}_venv`, or set infer_engine.python to its python"
    )


@contextmanager
def loopback_only() -> Iterator[None]:
    """While a new local Ray instance starts: every server it opens listens on 127.0.0.1 only.

    `ray.init(_node_ip_address="127.0.0.1")` is not enough on Linux: Ray replaces a loopback address by the
    machine's routable one, and its GCS, raylet and workers listen on every interface unless their node address
    is exactly 127.0.0.1. Ray's single-machine mode (its default on macOS and Windows,
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) keeps loopback. The processes it starts inherit the variable; the
    driver read Ray's constant at import, so it is set there for the call too, and both are put back after, so
    a later `ray.init(address=...)` in this process behaves as Ray's default.
    """
    from ray._private import ray_constants

    var = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    old_env, old_const = os.environ.get(var), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[var] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_const
        if old_env is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old_env


@contextmanager
def own_session() -> Iterator[None]:
    """While a new local Ray instance starts: the processes it starts (GCS, raylet, agents; the workers the raylet
    starts inherit it) run in a session of their own, out of the driver's process group.

    `kill -TERM -<pgid>` (schedulers, `timeout`, `docker stop`) and a terminal's Ctrl-C signal the whole process
    group (Ray blocks SIGINT in the processes it starts, not SIGTERM): in it, Ray's GCS and raylet died while the
    driver finished its step, the checkpoint relied on luck (any call needing them failed), and the shutdown hung 60 s
    on the dead GCS before Ray ended the process (exit 1, the run folder's lock kept). Ray does the same on Windows
    (CREATE_NEW_PROCESS_GROUP) when the kernel ties its processes to the driver's life; on Linux that tie is
    PR_SET_PDEATHSIG, which a new session keeps: they still die with the driver, and `ray.shutdown()` stops them by
    pid. Without it (macOS), Ray's reaper kills the driver's process group at exit, so its processes must stay in it:
    nothing changes there.
    """
    from ray._private import services, utils

    base = getattr(services, "ConsolePopen", None)
    if sys.platform == "win32" or not utils.detect_fate_sharing_support():
        yield
        return
    if base is None:  # Ray changed how it starts its processes
        log.warning("Ray's processes share the driver's process group: a SIGTERM to the group reaches them")
        yield
        return

    class SessionPopen(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    services.ConsolePopen = SessionPopen
    try:
        yield
    finally:
        services.ConsolePopen = base


class Cluster:
    """Creates worker groups for roles on the configured backend."""

    def __init__(self, cfg: ClusterConfig, hw: HwConfig, platform: type[Platform] | None = None) -> None:
        from roll_hw import get_platform_class, resolve_platform

        self.cfg = cfg
        if platform is not None:
            self.platform = platform
        elif hw.platform != "auto" and cfg.backend == "ray":
            # Workers check the platform where they run: the driver may be a CPU-only head of a GPU cluster.
            self.platform = get_platform_class(hw.platform)
        else:
            self.platform = resolve_platform(None if hw.platform == "auto" else hw.platform)
        self.groups: list[WorkerGroup] = []
        #: Set by the pipeline: its CheckpointManager, so that a fatal fault names the checkpoint to resume from.
        self.checkpoints: Any = None
        self._fault_totals: dict[str, int] = {}  # counts already reported by fault_metrics()
        self._pgs: dict[str, Any] = {}
        self._node_devices: dict[str, int] = {}  # node id -> device bundles placed there by this run
        self._free_groups: list[tuple[WorkerGroup, float]] = []  # groups outside placement groups, CPUs per worker
        self._started_ray = False
        if cfg.backend == "ray":
            try:
                self._init_ray()
                if hw.platform == "auto" and platform is None:
                    self._check_auto_platform()
            except BaseException:
                # No Cluster is returned, so no shutdown() (the pipeline's included) will stop the Ray this run
                # started: the next run in this process (a sweep's job, a test) would join it, with this run's sizes,
                # its own ignored. A failure inside ray.init counts (a stop signal while the build waits for it).
                self._stop_own_ray()
                raise

    def _check_auto_platform(self) -> None:
        """hw.platform=auto is probed on the driver: a CPU-only head of an accelerator cluster would run every
        worker on CPU, silently. Such a cluster (Ray resources the driver's platform does not use) is an error
        that names the setting instead."""
        import ray

        if self.platform.ray_resource is not None:
            return
        offered = {k: int(v) for k, v in ray.cluster_resources().items() if k in ("GPU", "NPU") and v > 0}
        if offered:
            what = ", ".join(f"{n} {k}" for k, n in offered.items())
            raise ConfigError(
                f"hw.platform=auto found no accelerator on this driver ({self.platform.name}), but the Ray cluster "
                f"offers {what}: name the workers' platform (hw.platform=cuda, rocm or npu), or hw.platform=cpu to "
                "run on CPUs"
            )

    def _init_ray(self) -> None:
        from roll_core.errors import RAY

        ray = RAY.load()

        joined = (
            "Ray already runs in this process"
            if ray.is_initialized()
            else f"cluster.address={self.cfg.address} joins a running Ray"
            if self.cfg.address
            else ""
        )
        if joined:
            self._refuse_instance_keys(joined)
        if ray.is_initialized():
            return
        kwargs: dict[str, Any] = {
            "namespace": self.cfg.namespace,
            "include_dashboard": False,
            "log_to_driver": True,
            "ignore_reinit_error": True,
        }
        # Ours from the call on: ray.init interrupted (a stop signal, StoppedWhileBuilding) or failing after it started
        # its processes or connected leaves them running, and ray.shutdown() is what stops them (a no-op otherwise).
        if self.cfg.address:
            from roll_core.cluster.ray_address import unreachable

            # ray.init retries an address where no Ray answers without end (roll_core.cluster.ray_address).
            why = unreachable(self.cfg.address)
            if why:
                raise ConfigError(
                    f"cluster.address={self.cfg.address}: no Ray cluster to join: {why}. Start one there "
                    "(`ray start --head`), correct the address, or leave cluster.address null to start a Ray instance "
                    "for this run"
                )
            self._started_ray = True
            ray.init(address=self.cfg.address, **kwargs)
            return
        # A new local instance (even if a `ray start` cluster runs here: cluster.address=auto joins that one).
        # Declare enough logical CPUs for every role's fractional share; torch threads are set per worker,
        # independently of Ray's CPU accounting.
        kwargs["num_cpus"] = self.cfg.num_cpus or logical_cpus()  # = ${roll_logical_cpus:} (a pod's CPUs)
        resources = dict(self.cfg.resources)
        # Ray takes GPUs as a count of its own (`num_gpus`), never among custom resources: +cluster.resources.GPU=2
        # (the schema's example, for tests on a CPU machine) failed in ray.init with an AssertionError. A fractional
        # count and Ray's own keys (CPU, memory) are refused by ClusterConfig.
        if "GPU" in resources:
            kwargs["num_gpus"] = int(resources.pop("GPU"))
        if resources:
            kwargs["resources"] = resources
        # Ray's token authentication (on by default for a new local instance since Ray 2.5x) stays on unless the
        # user turns it off: cluster.ray_token_auth=false or RAY_AUTH_MODE=disabled in the environment (tests do
        # that for their private instances). Ray reads the variable while it starts (its processes inherit it, the
        # driver caches it in its RayConfig): it is put back after, or every later Ray this process started (a
        # sweep's next job) ran without token authentication, whatever that job asked for.
        auth_before = os.environ.get("RAY_AUTH_MODE")
        if not self.cfg.ray_token_auth:
            os.environ["RAY_AUTH_MODE"] = "disabled"
        self._started_ray = True
        try:
            with loopback_only(), own_session():
                ray.init(address="local", _node_ip_address="127.0.0.1", **kwargs)
        finally:
            if not self.cfg.ray_token_auth:
                if auth_before is None:
                    os.environ.pop("RAY_AUTH_MODE", None)
                else:
                    os.environ["RAY_AUTH_MODE"] = auth_before

    def _refuse_instance_keys(self, joined: str) -> None:
        """`cluster.num_cpus`, `cluster.resources` and `cluster.ray_token_auth` size and secure a Ray instance roll
        starts: on a Ray this run joins they were ignored without a word (the run believed it had set them). A value
        other than the default is a ConfigError naming the key."""
        set_keys = [
            f"cluster.{k}={v}"
            for k, v, default in (
                ("num_cpus", self.cfg.num_cpus, None),
                ("resources", dict(self.cfg.resources), {}),
                ("ray_token_auth", self.cfg.ray_token_auth, True),
            )
            if v != default
        ]
        if set_keys:
            raise ConfigError(
                f"{set_keys[0]} sizes or secures a Ray instance roll starts, but {joined}: it would be ignored. "
                "Drop it and set it where that Ray starts (`ray start --num-cpus/--resources`, a sweep's "
                "hydra.launcher.ray.init.*), or leave cluster.address null and start no Ray before the run"
            )

    def _stop_own_ray(self) -> None:
        """Stop (or, joined, disconnect from) the Ray this run's `_init_ray` connected; never one it found running."""
        if not self._started_ray:
            return
        import ray

        self._started_ray = False
        try:
            ray.shutdown()
        except Exception as exc:  # the error being handled matters more
            log.warning("Ray could not be shut down: %s", exc)

    def _placement(
        self, role: str, world_size: int, devices_per_worker: int = 1, placement: str | None = None
    ) -> RayOptions:
        """Ray options placing `world_size` workers of `role`, each on `devices_per_worker` devices of one bundle
        (an engine worker spanning N devices for tensor parallelism gets one bundle of N)."""
        from ray.util.placement_group import placement_group

        dev = float(devices_per_worker) if self.platform.ray_resource else 0.0
        key = self.platform.ray_resource
        colocated = (placement or self.cfg.placement) == "colocated"
        if colocated and self.cfg.placement != "colocated":
            # The trainer holds whole devices of its own here: a "shared" group would be new devices, reserved whole
            # for this role's fraction (the rest idle) or never placed on a cluster the other roles fill.
            raise ConfigError(
                f"{role}.placement=colocated time-shares the trainer's devices, but cluster.placement="
                f"{self.cfg.placement} gives each role whole devices of its own: use {role}.placement=disaggregated "
                "(or null, which follows cluster.placement), or cluster.placement=colocated"
            )
        if colocated and devices_per_worker > 1:
            raise ConfigError(
                f"{role} spans {devices_per_worker} devices per worker (tensor parallel), but colocated placement "
                "gives every rank one device bundle: use cluster.placement=disaggregated"
            )
        pg_name = "shared" if colocated else role
        if pg_name not in self._pgs:
            # Ray refuses a bundle of zeros: cpus_per_worker=0 leaves CPU out where a device resource is reserved.
            bundle: dict[str, float] = {"CPU": self.cfg.cpus_per_worker} if self.cfg.cpus_per_worker > 0 else {}
            if dev and key:
                bundle[key] = dev
            if not bundle:
                raise ConfigError(
                    f"{role}: cluster.cpus_per_worker=0 on a cluster without device resources reserves nothing for "
                    "its workers: set cluster.cpus_per_worker > 0"
                )
            pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=self.cfg.strategy)
            self._wait_ready(pg, role, bundle, world_size)
            self._pgs[pg_name] = (pg, world_size, self._bundle_envs(pg, world_size) if dev else None)
        pg, size, envs = self._pgs[pg_name]
        if world_size > size:
            raise ConfigError(
                f"role {role} has world_size={world_size} but the colocated group has {size} bundles; "
                "give every device role the same world_size or use cluster.placement=disaggregated"
            )
        # Colocated roles split each bundle: a job reserves one worker's share per rank, not one per role.
        share = (1.0 / len(DEVICE_ROLES)) if colocated else 1.0
        opts = RayOptions(
            num_cpus=self.cfg.cpus_per_worker * share,
            placement=(pg, list(range(world_size))),
            env=envs[:world_size] if envs else None,
        )
        if dev and key == "GPU":
            opts.num_gpus = dev * share
        elif dev and key:
            opts.resources = {key: dev * share}
        return opts

    def _bundle_envs(self, pg: Any, n: int) -> list[dict[str, str]] | None:
        """Per-bundle visible-devices variables for device resources Ray does not manage itself.

        A bundle's device index counts the device bundles this run has placed on that node so far: the run is
        assumed to own the devices of the nodes it lands on (two runs sharing a node would collide).
        """
        if self.platform.ray_resource in RAY_MANAGED_RESOURCES or not self.platform.visible_devices_env:
            return None
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(pg)
        nodes = table["bundles_to_node_id"]
        envs = []
        for i in range(n):
            count = int(table["bundles"][i].get(self.platform.ray_resource, 1))
            used = self._node_devices.get(nodes[i], 0)
            envs.append(self.platform.visible_devices_for(list(range(used, used + count))))
            self._node_devices[nodes[i]] = used + count
        return envs

    def placement_report(self) -> dict[str, list[dict[str, Any]]]:
        """Role -> per-rank facts (node id, pid, assigned resources, visible-devices variables)."""
        return {g.name: g.call(Worker.node_info) for g in self.groups}

    def _beyond_own_instance(self, bundle: dict[str, float], n: int) -> str:
        """What `n` bundles of `bundle`, beside this run's placement groups and freely scheduled workers (reward,
        env), need beyond the totals of a Ray instance this run started here ("8 CPU (it holds 4)"; "" when they
        fit, or on a joined cluster, which may grow or free resources).
        Such an instance is fixed and nothing but this run reserves from it: what does not fit never will."""
        if not self._started_ray or self.cfg.address:
            return ""
        import ray

        need: dict[str, float] = {k: v * n for k, v in bundle.items()}
        for pg, *_ in self._pgs.values():
            for spec in pg.bundle_specs:
                for k, v in spec.items():
                    need[k] = need.get(k, 0.0) + v
        for g, cpus in self._free_groups:  # a group shut down holds nothing (its workers are gone)
            need["CPU"] = need.get("CPU", 0.0) + cpus * len(g.workers)
        total = ray.cluster_resources()
        over = [(k, v, total.get(k, 0.0)) for k, v in need.items() if v > total.get(k, 0.0) + 1e-9]
        return ", ".join(f"{v:g} {k} (it holds {t:g})" for k, v, t in over)

    def _refuse_beyond_own_instance(self, role: str, bundle: dict[str, float], n: int, what: str) -> None:
        """ConfigError when `n` workers of `bundle` cannot fit the Ray instance this run started (they would wait
        cluster.placement_timeout_s for nothing); `what` names the keys that size them."""
        short = self._beyond_own_instance(bundle, n)
        if not short:
            return
        free = [g.name for g, cpus in self._free_groups if g.workers and cpus]
        workers = f" and the workers of {', '.join(free)}" if free else ""
        raise ConfigError(
            f"placement of {role} ({n} x {bundle}) needs {short} with the placement groups of "
            f"{', '.join(self._pgs) or 'no other role'}{workers}: more than the Ray instance this run started "
            f"holds, so it would wait cluster.placement_timeout_s={self.cfg.placement_timeout_s:g}s for nothing. "
            f"Lower {what} or cluster.cpus_per_worker, give the instance more (cluster.num_cpus, "
            "+cluster.resources.<name>)" + (", or use cluster.placement=colocated" if is_device_role(role) else "")
        )

    def _wait_ready(self, pg: Any, role: str, bundle: dict[str, float], n: int) -> None:
        """Wait for a placement group; a cluster that cannot host it gets an error saying what was asked."""
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import remove_placement_group

        try:
            self._refuse_beyond_own_instance(
                role, bundle, n, "the roles' world_size (train_engine.world_size, infer_engine.world_size)"
            )
        except ConfigError:
            remove_placement_group(pg)
            raise
        try:
            ray.get(pg.ready(), timeout=self.cfg.placement_timeout_s)
        except GetTimeoutError as exc:
            remove_placement_group(pg)
            raise RuntimeError(
                f"placement of {role} ({n} x {bundle}, strategy {self.cfg.strategy}) not ready after "
                f"{self.cfg.placement_timeout_s}s; the cluster has {ray.available_resources()} free of "
                f"{ray.cluster_resources()}. Lower cluster.cpus_per_worker, add nodes, or lower cluster.max_concurrent"
            ) from exc

    def group(
        self,
        group_cls: type[G],
        role: str,
        world_size: int,
        *,
        devices_per_worker: int = 1,
        python: str | None = None,
        max_concurrency: int = 1,
        placement: str | None = None,
        **kwargs: Any,
    ) -> G:
        """A worker group for `role` on this cluster's backend.

        `python` runs the role's actors in another virtual environment (Ray only); `max_concurrency` lets one
        actor serve several calls at once (request-level engines); `devices_per_worker` > 1 gives each worker a
        bundle of that many devices (tensor parallel engines); `placement` (colocated | disaggregated) is a role's own
        choice over `cluster.placement` (reward_model.placement).
        """
        if self.cfg.backend == "local":
            if python:
                raise ConfigError(
                    f"{role} asks for its own Python environment ({python}); roles run in separate environments "
                    "only as Ray actors: use cluster=ray"
                )
            group = group_cls(group_cls.worker_cls, world_size, "local", name=role, **kwargs)
        else:
            pgs_before, devices_before = dict(self._pgs), dict(self._node_devices)
            try:
                if is_device_role(role):
                    opts = self._placement(role, world_size, devices_per_worker, placement)
                else:
                    opts = RayOptions(num_cpus=min(self.cfg.cpus_per_worker, 0.25))
                    # Not in a placement group, yet as bounded: more than the instance holds never starts.
                    keys = FREE_ROLE_KEYS.get(role, f"the number of {role} workers")
                    self._refuse_beyond_own_instance(role, {"CPU": opts.num_cpus}, world_size, keys)
                opts.python, opts.max_concurrency = python, max_concurrency
                group = group_cls(
                    group_cls.worker_cls,
                    world_size,
                    "ray",
                    name=role,
                    ray_options=opts,
                    call_timeout_s=self.cfg.timeout_for(role),
                    max_restarts=self.cfg.max_restarts,
                    start_timeout_s=self.cfg.placement_timeout_s,
                    **kwargs,
                )
            except BaseException:
                # The group killed its actors; the placement group made for it alone goes too (its bundles would
                # stay reserved in a Ray session that outlives this run: a notebook, a joined cluster).
                self._remove_placement_groups([n for n in self._pgs if n not in pgs_before])
                self._node_devices = devices_before
                raise
        group.death_hint = self.resume_hint
        self.groups.append(group)
        if self.cfg.backend == "ray" and not is_device_role(role):
            self._free_groups.append((group, min(self.cfg.cpus_per_worker, 0.25)))
        return group

    def resume_hint(self) -> str:
        """How to continue after a fault roll cannot repair: the latest checkpoint and the overrides to resume."""
        if self.checkpoints is None:
            return "The run cannot continue"
        latest = self.checkpoints.latest()
        if latest is None:
            return (
                f"The run cannot continue and no checkpoint was saved yet under {self.checkpoints.root} "
                "(pipeline.save_every=N saves every N steps)"
            )
        return f"The run cannot continue; resume from the checkpoint {latest}: pipeline.resume_from={latest}"

    def fault_metrics(self) -> dict[str, float]:
        """Faults since the previous call: `faults/restarts` (workers re-created), `faults/timeouts` (calls past
        their deadline), and `faults/restarts_<role>` for each role that restarted."""
        out = {"faults/restarts": 0.0, "faults/timeouts": 0.0}
        for g in self.groups:
            for kind in ("restarts", "timeouts"):
                key = f"{g.name}/{kind}"
                now = getattr(g, kind, 0)
                delta = now - self._fault_totals.get(key, 0)
                self._fault_totals[key] = now
                out[f"faults/{kind}"] += delta
                if delta and kind == "restarts":
                    out[f"faults/restarts_{g.name}"] = float(delta)
        return out

    def dead_workers(self, timeout_s: float = 10.0) -> list[str]:
        """`role rank N` of every worker whose Ray actor died; [] on the local backend. Used after an error to tell
        a fault (a dead process) from a bug, which a restart would only repeat. A worker still busy with a call
        past `timeout_s` counts as alive."""
        if self.cfg.backend != "ray":
            return []
        import ray

        probes = [
            (f"{g.name} rank {r}", w.__ray_ready__.remote()) for g in self.groups for r, w in enumerate(g.workers)
        ]
        deadline, dead = time.monotonic() + timeout_s, []
        for name, ref in probes:
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.RayActorError:
                dead.append(name)
            except ray.exceptions.GetTimeoutError:
                pass
        return dead

    def _remove_placement_groups(self, names: list[str]) -> None:
        if not names:
            return
        from ray.util.placement_group import remove_placement_group

        for name in names:
            pg, *_ = self._pgs.pop(name)
            try:
                remove_placement_group(pg)
            except Exception as exc:  # best effort: the error being handled (or the shutdown) matters more
                log.warning("placement group of %s could not be removed: %s", name, exc)

    def shutdown(self) -> None:
        """Stop every group, remove the placement groups, then stop the Ray this run started, each step whatever
        the ones before raised: a group whose shutdown failed left the others' actors, every placement group and
        Ray running for the next run in this process. The first error is raised at the end, the others logged."""
        errors: list[BaseException] = []
        groups, self.groups, self._free_groups = self.groups, [], []
        for g in groups:
            try:
                g.shutdown()
            except Exception as exc:
                log.error("shutdown of %s failed: %s", g.name, exc)
                errors.append(exc)
        self._remove_placement_groups(list(self._pgs))  # logs its own errors
        if self._started_ray:  # a Ray instance this run started is this run's to stop
            import ray

            self._started_ray = False
            try:
                ray.shutdown()
            except Exception as exc:
                log.error("Ray shutdown failed: %s", exc)
                errors.append(exc)
        if errors:
            raise errors[0]
