"""roll_hw.ray_devices: a Ray worker's local device from the ids Ray assigned, narrowed by Ray or under NOSET."""

from __future__ import annotations

import pytest

from roll_hw.cpu import CpuPlatform
from roll_hw.cuda import CudaPlatform
from roll_hw.npu import NpuPlatform
from roll_hw.ray_devices import describe, local_device, ray_noset
from roll_hw.rocm import RocmPlatform

NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def test_the_noset_names_are_rays() -> None:
    """The switch names Ray 2.60 reads (ray/_private/accelerators/{nvidia_gpu,amd_gpu,npu}.py); checked against
    the installed Ray where it is there."""
    assert CudaPlatform.ray_noset_env == NOSET
    assert RocmPlatform.ray_noset_env == "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"
    assert NpuPlatform.ray_noset_env == "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"
    assert CpuPlatform.ray_noset_env is None
    accel = pytest.importorskip("ray._private.accelerators")
    assert accel.nvidia_gpu.NOSET_CUDA_VISIBLE_DEVICES_ENV_VAR == CudaPlatform.ray_noset_env
    assert accel.amd_gpu.NOSET_HIP_VISIBLE_DEVICES_ENV_VAR == RocmPlatform.ray_noset_env
    assert accel.npu.NOSET_ASCEND_RT_VISIBLE_DEVICES_ENV_VAR == NpuPlatform.ray_noset_env
    assert accel.amd_gpu.HIP_VISIBLE_DEVICES_ENV_VAR == RocmPlatform.visible_devices_env


@pytest.mark.parametrize(("value", "on"), [("1", True), ("true", True), ("TRUE", True), ("0", False), ("", False)])
def test_the_switch_is_read_as_ray_reads_it(value: str, on: bool) -> None:
    assert ray_noset(CudaPlatform, {NOSET: value}) is on
    assert ray_noset(CudaPlatform, {}) is False
    assert ray_noset(CpuPlatform, {NOSET: "1"}) is False  # no Ray switch for the CPU


@pytest.mark.parametrize("ray_id", ["0", "1", "3"])
def test_narrowed_by_ray_the_assigned_gpu_is_local_device_0(ray_id: str) -> None:
    dev = local_device(CudaPlatform, [ray_id], {"CUDA_VISIBLE_DEVICES": ray_id})
    assert (dev.index, dev.ray_ids, dev.noset) == (0, (ray_id,), False)
    assert describe(CudaPlatform, dev) == (
        f"uses cuda:0: Ray's GPU {ray_id}, narrowed by Ray (CUDA_VISIBLE_DEVICES={ray_id})"
    )


@pytest.mark.parametrize("ray_id", [0, 1, 3])
def test_under_noset_the_assigned_gpu_id_is_the_local_index(ray_id: int) -> None:
    """Every GPU of the node is visible: Ray's GPU 3 is cuda:3, not cuda:0 (every worker of the node was there)."""
    dev = local_device(CudaPlatform, [ray_id], {NOSET: "1"})
    assert (dev.index, dev.ray_ids, dev.noset) == (ray_id, (str(ray_id),), True)
    line = describe(CudaPlatform, dev)
    assert line.startswith(f"uses cuda:{ray_id}: Ray's GPU {ray_id}, {NOSET}=1: Ray left CUDA_VISIBLE_DEVICES unset")


def test_under_noset_an_id_counts_in_the_nodes_own_visible_list() -> None:
    """A node started with CUDA_VISIBLE_DEVICES=4,6,7: Ray's ids are those entries, the worker inherits the list,
    and torch numbers them 0, 1, 2."""
    env = {NOSET: "1", "CUDA_VISIBLE_DEVICES": "4,6,7"}
    assert [local_device(CudaPlatform, [i], env).index for i in ("4", "6", "7")] == [0, 1, 2]
    uuid = {NOSET: "1", "CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}
    assert local_device(CudaPlatform, ["GPU-bb"], uuid).index == 1


def test_a_multi_device_worker_uses_its_first_assigned_device() -> None:
    dev = local_device(CudaPlatform, ["2", "3"], {NOSET: "1"})
    assert dev.index == 2 and "Ray's GPU 2 (of 2, 3)" in describe(CudaPlatform, dev)
    assert local_device(CudaPlatform, ["2", "3"], {"CUDA_VISIBLE_DEVICES": "2,3"}).index == 0


def test_rocm_and_npu_follow_their_own_switch_and_variable() -> None:
    rocm = {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0,1,2,3"}
    assert local_device(RocmPlatform, ["2"], rocm).index == 2
    assert local_device(RocmPlatform, ["2"], {NOSET: "1"}).index == 0  # the CUDA switch does not stop Ray on ROCm
    npu = {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "true"}
    assert local_device(NpuPlatform, ["5"], npu).index == 5


def test_a_device_this_worker_cannot_see_is_an_error_not_device_0() -> None:
    with pytest.raises(ValueError, match=r"assigned GPU 3 but this worker sees CUDA_VISIBLE_DEVICES='0,1'"):
        local_device(CudaPlatform, ["3"], {NOSET: "1", "CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError, match=r"sees CUDA_VISIBLE_DEVICES=''"):
        local_device(CudaPlatform, ["0"], {NOSET: "1", "CUDA_VISIBLE_DEVICES": ""})
    with pytest.raises(ValueError, match=r"'GPU-aa', not an index, and CUDA_VISIBLE_DEVICES is unset"):
        local_device(CudaPlatform, ["GPU-aa"], {NOSET: "1"})
    with pytest.raises(ValueError, match="reserved no device"):
        local_device(CudaPlatform, [], {NOSET: "1"})
