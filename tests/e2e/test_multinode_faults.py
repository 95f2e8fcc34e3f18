"""Node loss on a simulated multi-node Ray cluster (ray.cluster_utils.Cluster: a CPU-only head and two nodes with
one GPU each; a fake-GPU platform asks Ray for "GPU" while computing on the CPU). A restartable role placed in a
placement-group bundle on a node that is removed is re-created where Ray re-places the bundle (the other node),
and the call that failed is rerun there."""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import pytest

from roll_core.cluster.group import WorkerGroup
from roll_core.cluster.launch import Cluster
from roll_core.cluster.worker import Worker
from roll_core.config.schema import ClusterConfig, HwConfig
from roll_hw.cpu import CpuPlatform

pytestmark = [pytest.mark.ray, pytest.mark.slow]


class FakeGpuPlatform(CpuPlatform):
    name: ClassVar[str] = "fakegpu"
    ray_resource: ClassVar[str | None] = "GPU"
    visible_devices_env: ClassVar[str | None] = "CUDA_VISIBLE_DEVICES"


class RestartableGroup(WorkerGroup[Worker]):
    worker_cls = Worker
    restartable = True


@pytest.fixture(scope="module")
def two_nodes():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster as RayCluster

    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Declare a lost node dead within ~2 s instead of ~30 s (the GCS health check).
    fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_timeout_ms": 500}
    cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 2, "_system_config": fast})
    nodes = {name: cluster.add_node(num_cpus=2, num_gpus=1, resources={name: 1}) for name in ("a", "b")}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": {"ROLL_CACHE_DIR": os.environ["ROLL_CACHE_DIR"]}})
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


def _wait_until_dead(node_id: str, timeout: float = 60.0) -> None:
    """Until the GCS declares the node dead (its workers may still answer for a moment after the raylet died)."""
    import ray

    deadline = time.monotonic() + timeout
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, f"node {node_id} still alive after {timeout}s"
        time.sleep(0.2)


def test_role_on_a_lost_node_is_restarted_on_another_and_the_call_rerun(two_nodes: Any) -> None:
    cluster, nodes = two_nodes
    roll = Cluster(
        ClusterConfig(backend="ray", placement="disaggregated", cpus_per_worker=0.5), HwConfig(), FakeGpuPlatform
    )
    try:
        opts = roll._placement("actor_infer", 1)
        group = RestartableGroup(Worker, 1, "ray", name="actor_infer", ray_options=opts, max_restarts=1)
        roll.groups.append(group)
        before = group.nodes[0]
        lost = next(n for n in nodes.values() if n.node_id == before)
        cluster.remove_node(lost, allow_graceful=False)
        _wait_until_dead(lost.node_id)
        rank, _, _ = group.call(Worker.ping)[0]  # the worker died with its node: restarted elsewhere, ping rerun
        assert rank == 0 and group.restarts == 1
        assert group.nodes[0] != before and group.nodes[0] in {n.node_id for n in nodes.values()}
        assert roll.fault_metrics()["faults/restarts_actor_infer"] == 1
    finally:
        roll.shutdown()
