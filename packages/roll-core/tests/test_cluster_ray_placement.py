"""How `Cluster` places roles on a Ray instance it starts itself (roll_core.cluster.launch):

- A role whose placement group the instance cannot hold beside the run's other groups (its resources are fixed and
  only this run reserves from them) is a ConfigError at once, naming the keys; it waited
  `cluster.placement_timeout_s` (600 s by default) for nothing.
- Ray workers inherit the driver's environment: torch.distributed launch variables a driver under torchrun or a
  PyTorchJob pod has (RANK=3, WORLD_SIZE=8, MASTER_PORT, torchrun's agent-store switch) reached a rank of one as they
  were (its engine's process group waited for 7 ranks that never come) and the ranks of a group beside the ones it
  exported. A rank of one now sees none, a group of two only its own.
- Reward workers (0.25 CPU each, outside placement groups) beyond what the instance holds waited
  `cluster.placement_timeout_s` too; now they are a ConfigError at once, and later placement groups count them.
- `cluster.resources.GPU` (the schema's example for tests) is handed to Ray as `num_gpus`: as a custom resource
  Ray's `init` refused it with an AssertionError.

One Ray instance for the module (`cluster`, started by the Cluster under test).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from roll_core.cluster.group import WorkerGroup
from roll_core.cluster.worker import INHERITED_LAUNCH_ENV
from roll_core.config.schema import ClusterConfig, HwConfig
from roll_core.errors import ConfigError

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the controller imports the workers as Ray workers do (inherited PYTHONPATH)
from ray_placement_workers import LaunchEnv  # noqa: E402

pytestmark = pytest.mark.ray

#: What a driver started by torchrun (or a PyTorchJob pod) has in its environment.
DRIVER_LAUNCH_ENV = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "3",
    "LOCAL_WORLD_SIZE": "8",
    "MASTER_ADDR": "10.9.9.9",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


class LaunchEnvGroup(WorkerGroup[LaunchEnv]):
    worker_cls = LaunchEnv


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A Cluster on a 2-CPU Ray instance it starts itself, from a driver whose environment has torchrun's variables;
    the environment and the signal handlers `ray.init` replaces are put back at the end."""
    ray = pytest.importorskip("ray")
    from roll_core.cluster.launch import Cluster

    if ray.is_initialized():
        # An instance an earlier module of this process left running (tests/e2e's shared one, which the next
        # module that wants it starts again): this module needs the one its Cluster starts, so it stops
        # that one; it skipped instead, whenever it ran after an e2e module in the same xdist worker.
        ray.shutdown()
    saved = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    os.environ.update(DRIVER_LAUNCH_ENV, RAY_AUTH_MODE="disabled")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), saved.get("PYTHONPATH")) if p)
    cfg = ClusterConfig(
        backend="ray", num_cpus=2, placement="disaggregated", cpus_per_worker=1.0, placement_timeout_s=120
    )
    try:
        c = Cluster(cfg, HwConfig(platform="cpu"))
        yield c
        c.shutdown()
    finally:
        if ray.is_initialized():
            ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_a_rank_of_one_sees_no_inherited_launch_variables_and_a_group_only_its_own(cluster: Any) -> None:
    """The driver's RANK=3 WORLD_SIZE=8 (and torchrun's other variables) reach no worker: a rank of one sees none,
    a group of two its own rendezvous (rank 0's address and reserved port)."""
    single = cluster.group(LaunchEnvGroup, "reference", 1)
    try:
        assert single.call(LaunchEnv.launch_env) == [dict.fromkeys(INHERITED_LAUNCH_ENV)]
    finally:
        single.shutdown()
        cluster._remove_placement_groups(["reference"])
    pair = cluster.group(LaunchEnvGroup, "critic", 2)
    try:
        seen = pair.call(LaunchEnv.launch_env)
        for rank, env in enumerate(seen):
            assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == "0"
            assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] != "29500"
            assert env["LOCAL_WORLD_SIZE"] is None and env["TORCHELASTIC_USE_AGENT_STORE"] is None
    finally:
        pair.shutdown()
        cluster._remove_placement_groups(["critic"])


def test_a_placement_the_instance_cannot_hold_is_a_config_error_at_once(cluster: Any) -> None:
    """2 CPUs: 3 ranks of 1 CPU never fit, nor 1 beside a role holding 2; the error comes at once, names the keys,
    and leaves no placement group behind (a fitting role is placed after it)."""
    import ray
    from ray.util.placement_group import placement_group_table

    t0 = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=r"placement of actor_train \(3 x \{'CPU': 1\.0\}\) needs 3 CPU \(it holds 2\) .*"
        r"train_engine\.world_size.*cluster\.num_cpus",
    ):
        cluster.group(LaunchEnvGroup, "actor_train", 3)
    held = cluster.group(LaunchEnvGroup, "actor_infer", 2)
    try:
        with pytest.raises(ConfigError, match=r"needs 3 CPU \(it holds 2\) with the placement groups of actor_infer"):
            cluster.group(LaunchEnvGroup, "critic", 1)
        assert time.monotonic() - t0 < 60, "waited for a placement that never comes"
        assert list(cluster._pgs) == ["actor_infer"]
        live = [g for g, t in placement_group_table().items() if t["state"] != "REMOVED"]
        assert live == [cluster._pgs["actor_infer"][0].id.hex()]
    finally:
        held.shutdown()
        cluster._remove_placement_groups(["actor_infer"])
    assert ray.is_initialized()


def test_reward_workers_beyond_the_instance_are_a_config_error_at_once(cluster: Any) -> None:
    """Reward workers take 0.25 CPU each outside placement groups: 9 of them on 2 CPUs, or 5 beside a 1-CPU bundle,
    never start (they waited cluster.placement_timeout_s, then failed as workers that did not start); they are a
    ConfigError at once naming pipeline.reward_workers, and a placement group made after them counts them."""
    t0 = time.monotonic()
    with pytest.raises(
        ConfigError,
        match=r"placement of reward \(9 x \{'CPU': 0\.25\}\) needs 2\.25 CPU \(it holds 2\) .*"
        r"Lower pipeline\.reward_workers or cluster\.cpus_per_worker",
    ):
        cluster.group(LaunchEnvGroup, "reward", 9)
    held = cluster.group(LaunchEnvGroup, "actor_infer", 1)
    try:
        with pytest.raises(
            ConfigError, match=r"needs 2\.25 CPU \(it holds 2\) with the placement groups of actor_infer"
        ):
            cluster.group(LaunchEnvGroup, "reward", 5)
        reward = cluster.group(LaunchEnvGroup, "reward", 1)
        try:
            with pytest.raises(
                ConfigError,
                match=r"placement of critic .* needs 2\.25 CPU \(it holds 2\) with the placement groups of "
                r"actor_infer and the workers of reward",
            ):
                cluster.group(LaunchEnvGroup, "critic", 1)
        finally:
            reward.shutdown()
        assert time.monotonic() - t0 < 60, "waited for workers that never start"
        assert list(cluster._pgs) == ["actor_infer"]
    finally:
        held.shutdown()
        cluster._remove_placement_groups(["actor_infer"])


def test_cluster_resources_gpu_is_handed_to_ray_as_its_gpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked by Ray's own parameter validation (what `ray.init` runs first), without starting an instance."""
    ray = pytest.importorskip("ray")
    from ray._private.parameter import RayParams

    from roll_core.cluster.launch import Cluster

    seen: dict[str, Any] = {}

    def init(**kwargs: Any) -> None:
        seen.update(kwargs)
        RayParams(num_cpus=kwargs["num_cpus"], num_gpus=kwargs.get("num_gpus"), resources=kwargs.get("resources"))

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    Cluster(ClusterConfig(backend="ray", num_cpus=2, resources={"GPU": 2, "accel": 1}), HwConfig(platform="cpu"))
    assert seen["num_gpus"] == 2 and seen["resources"] == {"accel": 1}
    with pytest.raises(ValueError, match=r"cluster\.resources\.CPU: Ray counts CPU itself.*cluster\.num_cpus"):
        Cluster(ClusterConfig(backend="ray", resources={"CPU": 4}), HwConfig(platform="cpu"))
    with pytest.raises(ValueError, match=r"cluster\.resources\.GPU=1\.5: a Ray instance holds a whole number"):
        Cluster(ClusterConfig(backend="ray", resources={"GPU": 1.5}), HwConfig(platform="cpu"))
