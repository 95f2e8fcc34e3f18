"""Scale-out on a simulated multi-node Ray cluster (ray.cluster_utils.Cluster: 3 nodes on this machine).

Nodes: a head with CPUs only, and two workers `a` and `b`, each declaring 2 GPUs and 2 units of the dummy
platform's `DUMMY` device resource. A fake-GPU platform (the CPU with Ray resource "GPU") lets placement be
checked without accelerators: Ray itself assigns GPU ids and sets CUDA_VISIBLE_DEVICES; for DUMMY, roll sets
DUMMY_VISIBLE_DEVICES from each bundle's place on its node.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import ClassVar

import pytest

from roll_core.cluster.group import WorkerGroup
from roll_core.cluster.launch import DEVICE_ROLES, Cluster
from roll_core.cluster.worker import Worker
from roll_core.config.schema import ClusterConfig, HwConfig
from roll_core.testing import run_pipeline, tiny_overrides
from roll_hw.cpu import CpuPlatform

pytestmark = [pytest.mark.ray, pytest.mark.slow]


class FakeGpuPlatform(CpuPlatform):
    """Computes on the CPU but asks Ray for "GPU" resources like the CUDA platform."""

    name: ClassVar[str] = "fakegpu"
    ray_resource: ClassVar[str | None] = "GPU"
    visible_devices_env: ClassVar[str | None] = "CUDA_VISIBLE_DEVICES"


@pytest.fixture(scope="module")
def nodes():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster as RayCluster

    if ray.is_initialized():
        ray.shutdown()
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    ids = {}
    for name in ("a", "b"):
        node = cluster.add_node(num_cpus=2, num_gpus=2, resources={name: 1, "DUMMY": 2})
        ids[name] = node.node_id
    cluster.wait_for_nodes()
    # The dummy platform is active in the workers only: the driver (head) never needs the workers' devices.
    env = {"ROLL_CACHE_DIR": os.environ["ROLL_CACHE_DIR"], "ROLL_DUMMY_PLATFORM": "1"}
    ray.init(address=cluster.address, runtime_env={"env_vars": env})
    yield ids
    ray.shutdown()
    cluster.shutdown()


def _groups(
    placement: str, strategy: str, sizes: dict[str, int], devices: dict[str, int] | None = None
) -> tuple[Cluster, dict[str, list[dict]]]:
    cluster = Cluster(
        ClusterConfig(backend="ray", placement=placement, strategy=strategy, cpus_per_worker=0.5),
        HwConfig(),
        platform=FakeGpuPlatform,
    )
    out = {}
    for role, n in sizes.items():
        opts = cluster._placement(role, n, (devices or {}).get(role, 1))
        group = WorkerGroup(Worker, n, "ray", name=role, ray_options=opts)
        cluster.groups.append(group)
        out[role] = group.call(Worker.node_info)
    return cluster, out


def test_disaggregated_roles_land_on_separate_nodes_with_their_own_gpus(nodes: dict[str, str]) -> None:
    cluster, info = _groups("disaggregated", "STRICT_PACK", {"actor_train": 2, "actor_infer": 2})
    try:
        train_nodes = {w["node_id"] for w in info["actor_train"]}
        infer_nodes = {w["node_id"] for w in info["actor_infer"]}
        assert len(train_nodes) == 1 and len(infer_nodes) == 1 and train_nodes != infer_nodes
        assert train_nodes | infer_nodes == set(nodes.values())  # the GPU nodes, never the head
        for role in info.values():
            assert sorted(w["CUDA_VISIBLE_DEVICES"] for w in role) == ["0", "1"]  # one GPU each, distinct
            assert all(w["resources"].get("GPU") == 1.0 for w in role)
    finally:
        cluster.shutdown()


def test_tensor_parallel_engine_workers_get_whole_device_bundles(nodes: dict[str, str]) -> None:
    """Two inference workers of tensor_parallel_size=2: each holds both GPUs of one node (its own bundle)."""
    cluster, info = _groups("disaggregated", "SPREAD", {"actor_infer": 2}, devices={"actor_infer": 2})
    try:
        infer = info["actor_infer"]
        assert {w["node_id"] for w in infer} == set(nodes.values())  # one TP group per 2-GPU node
        for w in infer:
            assert w["resources"].get("GPU") == 2.0
            assert sorted(w["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"]
    finally:
        cluster.shutdown()
    with pytest.raises(ValueError, match=r"use cluster\.placement=disaggregated"):
        _groups("colocated", "PACK", {"actor_infer": 1}, devices={"actor_infer": 2})


def test_under_ray_noset_each_worker_uses_the_gpu_ray_assigned(nodes: dict[str, str]) -> None:
    """RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 in the workers: Ray does not narrow CUDA_VISIBLE_DEVICES, and
    each worker's device (as the CUDA platform resolves it there) is its own GPU, not GPU 0 of the node."""
    cluster = Cluster(
        ClusterConfig(backend="ray", placement="disaggregated", strategy="STRICT_PACK", cpus_per_worker=0.5),
        HwConfig(),
        platform=FakeGpuPlatform,
    )
    try:
        opts = cluster._placement("actor_train", 2)
        opts.env = [{"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}] * 2
        group = WorkerGroup(Worker, 2, "ray", name="actor_train", ray_options=opts)
        cluster.groups.append(group)
        info = group.call(Worker.node_info, "cuda")
        assert len({w["node_id"] for w in info}) == 1 and all("CUDA_VISIBLE_DEVICES" not in w for w in info)
        assert sorted((w["device"]["index"], w["device"]["ray_ids"], w["device"]["noset"]) for w in info) == [
            (0, ("0",), True),
            (1, ("1",), True),
        ]
    finally:
        cluster.shutdown()


def test_colocated_roles_share_bundles_that_span_nodes(nodes: dict[str, str]) -> None:
    cluster, info = _groups("colocated", "PACK", {"actor_train": 4, "actor_infer": 4})
    try:
        train, infer = info["actor_train"], info["actor_infer"]
        assert {w["node_id"] for w in train} == set(nodes.values())  # 4 one-GPU bundles over two 2-GPU nodes
        for t, i in zip(train, infer):  # rank r of every role time-shares bundle r: same node, same GPU
            assert (t["node_id"], t["CUDA_VISIBLE_DEVICES"]) == (i["node_id"], i["CUDA_VISIBLE_DEVICES"])
            # Each device role (actor_train, actor_infer, reference, critic, reward_model) takes a fifth of a GPU.
            assert t["resources"]["GPU"] == pytest.approx(1 / len(DEVICE_ROLES)) == pytest.approx(0.2)
    finally:
        cluster.shutdown()


def test_tiny_rlvr_run_across_simulated_nodes(
    nodes: dict[str, str],
    seven_task: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """FSDP2 over 2 ranks on nodes a and b (never the driver's), driven from a head where the dummy platform is not
    available: every worker resolves its own platform and device, and rank 0 chooses the rendezvous on its node.
    Before training, both trainer nodes read the driver's marker in the run folder (the shared filesystem check:
    every simulated node shares this machine's disk, so it passes) and the marker is removed."""
    pytest.importorskip("roll_dummy_platform")
    monkeypatch.delenv("ROLL_DUMMY_PLATFORM", raising=False)  # the driver cannot use the workers' devices
    caplog.set_level(logging.INFO, logger="roll_core.cluster.shared_fs")
    summary, history = run_pipeline(
        tiny_overrides(
            seven_task,
            tmp_path,
            "cluster=ray",
            "cluster.placement=disaggregated",
            "cluster.strategy=STRICT_SPREAD",
            "hw.platform=dummy",
            "train_engine=fsdp2",
            "train_engine.world_size=2",
            "pipeline.max_steps=3",
            "pipeline.eval_every=3",
        )
    )
    assert [h["step"] for h in history] == [0, 1, 2, 3] and summary["final_eval_accuracy"] is not None
    placement = json.loads((tmp_path / "placement.json").read_text())
    train = placement["actor_train"]
    assert {w["node_id"] for w in train} == set(nodes.values())  # one rank on each worker node, none on the head
    host, port, chosen_by = train[0]["rendezvous"]
    assert chosen_by == train[0]["pid"] and train[1]["rendezvous"] == [host, port, chosen_by]
    devices = [(w["node_id"], w["DUMMY_VISIBLE_DEVICES"]) for r in ("actor_train", "actor_infer") for w in placement[r]]
    assert {node for node, _ in devices} <= set(nodes.values())  # DUMMY devices live on a and b, not the head
    assert len(set(devices)) == 3 and {d for _, d in devices} <= {"0", "1"}  # each worker its own device
    checked = [r.getMessage() for r in caplog.records if r.getMessage().startswith("shared run folder checked")]
    assert len(checked) == 1 and "and 2 other node(s)" in checked[0]
    assert all(f"node {n} (" in checked[0] for n in nodes.values())  # the trainer's nodes a and b, not the head
    assert not list(tmp_path.glob(".roll-shared-fs-*"))
