"""How `Cluster` starts, joins and stops Ray (roll_core.cluster.launch), with Ray's entry points replaced: no
instance is started.

- A failure in the constructor after this run started Ray (hw.platform=auto on a CPU head of a GPU cluster) left
  that Ray running: the caller never got the Cluster whose shutdown stops it, and the next run in the process
  joined it. Now it is stopped before the error leaves; a Ray found running is left alone.
- `cluster.num_cpus`, `cluster.resources` and `cluster.ray_token_auth` size a Ray instance roll starts: with
  `cluster.address` or a Ray already running they were ignored without a word. Now a ConfigError names the key.
- `shutdown` stopped at the first group whose shutdown raised: the other groups, every placement group and Ray
  stayed. Now every step runs and the first error is raised after.
- A pipeline whose build stopped inside ray.init (a stop signal while Ray starts: StoppedWhileBuilding) left the
  started Ray running: the Cluster never existed, so neither it nor the pipeline's shutdown knew of it. Now it is
  stopped. A build failing after the Cluster exists shuts down the Cluster's Ray too.
- `cluster.ray_token_auth=false` set RAY_AUTH_MODE=disabled for good: every later Ray the process started (a sweep's
  next job) ran without token authentication. Now the variable is put back once ray.init returns (or raises).
"""

from __future__ import annotations

import importlib
import os
import signal
from types import SimpleNamespace
from typing import Any

import pytest

from roll_core.cluster.launch import Cluster
from roll_core.config.schema import ClusterConfig, HwConfig
from roll_core.errors import ConfigError
from roll_core.pipelines.loop import Pipeline
from roll_core.pipelines.run_control import StoppedWhileBuilding

ray = pytest.importorskip("ray")


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Ray's init/shutdown/is_initialized recorded; `running` says whether Ray runs in the process; the driver
    resolves to the CPU platform and the cluster offers 8 GPUs (so hw.platform=auto is refused)."""
    from roll_hw.cpu import CpuPlatform

    state: dict[str, Any] = {"running": False, "inits": [], "shutdowns": 0}

    def init(**kwargs: Any) -> None:
        state["inits"].append(kwargs)
        state["running"] = True

    def shutdown() -> None:
        state["shutdowns"] += 1
        state["running"] = False

    monkeypatch.setattr(ray, "is_initialized", lambda: state["running"])
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 8.0})
    monkeypatch.setattr("roll_hw.resolve_platform", lambda name=None: CpuPlatform)
    # No Ray answers at cluster.address here: the fake init stands for one that does.
    monkeypatch.setattr("roll_core.cluster.ray_address.unreachable", lambda address, timeout_s=5.0: "")
    return state


AUTO_ON_GPU_CLUSTER = r"hw\.platform=auto found no accelerator on this driver"


def test_a_failure_after_starting_ray_stops_it(fake_ray: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=AUTO_ON_GPU_CLUSTER):
        Cluster(ClusterConfig(backend="ray", num_cpus=2), HwConfig(platform="auto"))
    assert len(fake_ray["inits"]) == 1 and fake_ray["inits"][0]["address"] == "local"
    assert fake_ray["shutdowns"] == 1 and not fake_ray["running"]


def test_a_failure_after_joining_by_address_disconnects(fake_ray: dict[str, Any]) -> None:
    """The driver's connection is this run's (its shutdown() would close it too); the cluster itself lives on."""
    with pytest.raises(ConfigError, match=AUTO_ON_GPU_CLUSTER):
        Cluster(ClusterConfig(backend="ray", address="auto"), HwConfig(platform="auto"))
    assert [i["address"] for i in fake_ray["inits"]] == ["auto"]
    assert fake_ray["shutdowns"] == 1


def test_a_failure_on_a_ray_already_running_leaves_it_running(fake_ray: dict[str, Any]) -> None:
    fake_ray["running"] = True
    with pytest.raises(ConfigError, match=AUTO_ON_GPU_CLUSTER):
        Cluster(ClusterConfig(backend="ray"), HwConfig(platform="auto"))
    assert fake_ray["inits"] == [] and fake_ray["shutdowns"] == 0 and fake_ray["running"]


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("num_cpus", 2, r"cluster\.num_cpus=2"),
        ("resources", {"accel": 1.0}, r"cluster\.resources=\{'accel': 1\.0\}"),
        ("ray_token_auth", False, r"cluster\.ray_token_auth=False"),
    ],
)
@pytest.mark.parametrize("how", ["address", "running"])
def test_instance_settings_on_a_joined_ray_are_config_errors(
    fake_ray: dict[str, Any], key: str, value: Any, shown: str, how: str
) -> None:
    address = "auto" if how == "address" else None
    fake_ray["running"] = how == "running"
    why = r"cluster\.address=auto joins a running Ray" if how == "address" else "Ray already runs in this process"
    cfg = ClusterConfig(backend="ray", address=address, **{key: value})
    with pytest.raises(ConfigError, match=rf"{shown} sizes or secures a Ray instance roll starts, but {why}"):
        Cluster(cfg, HwConfig(platform="cpu"))
    assert fake_ray["inits"] == [] and fake_ray["shutdowns"] == 0


def test_defaults_join_and_settings_size_a_new_instance(fake_ray: dict[str, Any]) -> None:
    joined = Cluster(ClusterConfig(backend="ray", address="auto"), HwConfig(platform="cpu"))
    assert [i["address"] for i in fake_ray["inits"]] == ["auto"] and joined._started_ray
    Cluster(ClusterConfig(backend="ray"), HwConfig(platform="cpu"))  # already running: joined, nothing to refuse
    assert len(fake_ray["inits"]) == 1
    fake_ray["running"] = False
    Cluster(ClusterConfig(backend="ray", num_cpus=3, resources={"accel": 1.0}), HwConfig(platform="cpu"))
    assert fake_ray["inits"][1]["num_cpus"] == 3 and fake_ray["inits"][1]["resources"] == {"accel": 1.0}


class _Group:
    def __init__(self, name: str, fails: bool, log: list[str]) -> None:
        self.name, self.fails, self.log = name, fails, log

    def shutdown(self) -> None:
        self.log.append(self.name)
        if self.fails:
            raise RuntimeError(f"{self.name} would not stop")


def test_shutdown_does_every_step_and_raises_the_first_error(fake_ray: dict[str, Any], monkeypatch) -> None:
    ray_pg = importlib.import_module("ray.util.placement_group")
    removed: list[str] = []
    monkeypatch.setattr(ray_pg, "remove_placement_group", removed.append)
    stopped: list[str] = []
    c = Cluster.__new__(Cluster)
    c.groups = [_Group(name, name != "ok", stopped) for name in ("actor_train", "actor_infer", "ok")]
    c._pgs = {"actor_train": ("pg-train", 1, None), "actor_infer": ("pg-infer", 1, None)}
    c._started_ray, fake_ray["running"] = True, True
    with pytest.raises(RuntimeError, match="actor_train would not stop"):
        c.shutdown()
    assert stopped == ["actor_train", "actor_infer", "ok"]
    assert removed == ["pg-train", "pg-infer"] and c._pgs == {} and c.groups == []
    assert fake_ray["shutdowns"] == 1 and not c._started_ray
    c.shutdown()  # nothing left: a second shutdown (the pipeline's close after an error) does nothing
    assert fake_ray["shutdowns"] == 1


def _stopped_inside_init(state: dict[str, Any]) -> Any:
    """A ray.init that started Ray's processes (not yet connected: `is_initialized()` still False) when a stop signal
    arrived, as BuildStop raises it where the build is."""

    def init(**kwargs: Any) -> None:
        state["inits"].append(kwargs)
        raise StoppedWhileBuilding(signal.SIGINT)

    return init


@pytest.mark.parametrize("address", [None, "auto"])
def test_a_stop_inside_ray_init_stops_what_it_started(
    fake_ray: dict[str, Any], monkeypatch: pytest.MonkeyPatch, address: str | None
) -> None:
    monkeypatch.setattr(ray, "init", _stopped_inside_init(fake_ray))
    with pytest.raises(StoppedWhileBuilding):
        Cluster(ClusterConfig(backend="ray", address=address), HwConfig(platform="cpu"))
    assert len(fake_ray["inits"]) == 1 and fake_ray["shutdowns"] == 1


def test_a_refused_setting_before_ray_init_stops_nothing(
    fake_ray: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("roll_core.cluster.ray_address.unreachable", lambda address, timeout_s=5.0: "refused")
    with pytest.raises(ConfigError, match=r"cluster\.address=10\.0\.0\.1:6379: no Ray cluster to join: refused"):
        Cluster(ClusterConfig(backend="ray", address="10.0.0.1:6379"), HwConfig(platform="cpu"))
    assert fake_ray["inits"] == [] and fake_ray["shutdowns"] == 0


@pytest.mark.parametrize("where", ["inside ray.init", "after the cluster"])
def test_a_pipeline_whose_build_fails_stops_its_ray(
    fake_ray: dict[str, Any], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The pipeline's build fails (a stop signal while Ray starts; a ConfigError after the cluster exists, as a
    later check or a model that does not load raises): the Ray it started is stopped before the error goes on, the
    run folder's lock released after it; the next job of the process finds no Ray."""
    order: list[str] = []
    if where == "inside ray.init":
        monkeypatch.setattr(ray, "init", _stopped_inside_init(fake_ray))
    real_shutdown = ray.shutdown
    monkeypatch.setattr(ray, "shutdown", lambda: (order.append("ray"), real_shutdown()))

    def build(self: Pipeline, cfg: Any, output_dir: Any) -> None:
        self.run_lock = SimpleNamespace(release=lambda: order.append("lock"))
        self.cluster = Cluster(ClusterConfig(backend="ray"), HwConfig(platform="cpu"))
        raise ConfigError("model.path: no such model")

    monkeypatch.setattr(Pipeline, "_build", build)
    with pytest.raises((StoppedWhileBuilding, ConfigError)):
        Pipeline(SimpleNamespace())  # type: ignore[arg-type]
    assert order == ["ray", "lock"] and fake_ray["shutdowns"] == 1 and not fake_ray["running"]


@pytest.mark.parametrize("before", [None, "token", "disabled"])
@pytest.mark.parametrize("fails", [False, True])
def test_token_auth_off_sets_ray_auth_mode_for_the_start_only(
    fake_ray: dict[str, Any], monkeypatch: pytest.MonkeyPatch, before: str | None, fails: bool
) -> None:
    """Ray reads RAY_AUTH_MODE while it starts (its processes inherit it; the driver caches it in its RayConfig and
    keeps talking to the instance without it): the variable is the caller's again after ray.init, also when it
    raised."""
    if before is None:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", before)
    seen: list[str | None] = []

    def init(**kwargs: Any) -> None:
        seen.append(os.environ.get("RAY_AUTH_MODE"))
        fake_ray["running"] = True
        if fails and len(seen) == 1:
            raise RuntimeError("the raylet did not start")

    monkeypatch.setattr(ray, "init", init)
    if fails:
        with pytest.raises(RuntimeError, match="raylet"):
            Cluster(ClusterConfig(backend="ray", ray_token_auth=False), HwConfig(platform="cpu"))
        assert fake_ray["shutdowns"] == 1
    else:
        Cluster(ClusterConfig(backend="ray", ray_token_auth=False), HwConfig(platform="cpu"))
    assert seen == ["disabled"] and os.environ.get("RAY_AUTH_MODE") == before
    fake_ray["running"] = False
    Cluster(ClusterConfig(backend="ray"), HwConfig(platform="cpu"))  # the next run asks for token auth: untouched
    assert seen[1] == before and os.environ.get("RAY_AUTH_MODE") == before


def test_a_new_instance_declares_the_cpus_this_process_may_use(
    fake_ray: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without cluster.num_cpus, a Ray instance roll starts declared the host's cores (os.cpu_count), not a
    CPU-limited pod's: now the usable CPUs (affinity, cgroup quota), at least 4, as ${roll_logical_cpus:} says."""
    import roll_hw.cpu

    fake_ray["running"] = False
    monkeypatch.setattr(roll_hw.cpu, "usable_cpu_count", lambda: (os.cpu_count() or 1) + 5)
    Cluster(ClusterConfig(backend="ray"), HwConfig(platform="cpu"))
    assert fake_ray["inits"][-1]["num_cpus"] == (os.cpu_count() or 1) + 5
