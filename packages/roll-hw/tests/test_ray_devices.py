"""roll_hw.ray_devices: a Ray worker's local device from the ids Ray assigned, narrowed by Ray or under NOSET."""

from __future__ import annotations

import re

import pytest

from roll_hw.cpu import CpuPlatform
from roll_hw.cuda import CudaPlatform
from roll_hw.npu import NpuPlatform
from roll_hw.ray_devices import describe, local_device, local_rank, noset_narrowing, ray_noset
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


@pytest.mark.parametrize(
    ("visible", "ray_id", "sees"),
    [
        ("0,1,-1,2", "2", "0,1"),  # CUDA stops at -1: Ray counted 4 GPUs, the worker has 2 (cuda:3 was its device)
        ("0,1,-1,2", "-1", "0,1"),
        ("4,4,5", "5", "no device"),  # a repeated entry hides every device
        ("GPU-aa,GPU-bb,7", "7", "GPU-aa,GPU-bb"),  # a UUID list ends at an entry that is no UUID
        ("1,x,2", "2", "1"),
    ],
)
def test_under_noset_an_entry_cuda_does_not_read_is_not_a_device(visible: str, ray_id: str, sees: str) -> None:
    """Ray splits the node's CUDA_VISIBLE_DEVICES at every comma; CUDA reads it up to the first entry that names no
    device, and a repeat hides all. An id past the cut was given its place in the full list: a device index this
    worker does not have. It is an error that says how CUDA reads the variable; entries before the cut still count."""
    env = {NOSET: "1", "CUDA_VISIBLE_DEVICES": visible}
    read_as = rf"CUDA_VISIBLE_DEVICES='{visible}', which cuda reads as {sees} \("
    with pytest.raises(ValueError, match=read_as + "it stops at .*where the node's raylet starts"):
        local_device(CudaPlatform, [ray_id], env)
    with pytest.raises(ValueError, match=read_as + rf".*without (.*, )?{re.escape(ray_id)} \(.*raylet starts"):
        noset_narrowing(CudaPlatform, [visible.split(",")[0], ray_id], env)
    if sees != "no device":
        assert local_device(CudaPlatform, [sees.split(",")[-1]], env).index == sees.count(",")
    hip = {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": visible}
    with pytest.raises(ValueError, match=r"which rocm reads as"):  # ROCm's runtime (and torch there) read it alike
        local_device(RocmPlatform, [ray_id], hip)
    # Spaces around entries and "1gpu" (strtoul's reading: device 1) name devices, as before.
    assert local_device(CudaPlatform, ["2"], {NOSET: "1", "CUDA_VISIBLE_DEVICES": "0, 1gpu, 2"}).index == 2


def test_under_noset_a_multi_device_worker_is_narrowed_to_its_ids_as_ray_would() -> None:
    """A TP=2 engine worker on GPUs 2 and 3: its engine's processes count devices from 0, so unnarrowed they took
    GPUs 0 and 1, other workers'. It gets CUDA_VISIBLE_DEVICES=2,3 (what Ray sets without NOSET), or the entries
    of the node's own list; once narrowed there is nothing more to set, and its device is local 0."""
    assert noset_narrowing(CudaPlatform, ["2", "3"], {NOSET: "1"}) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    node = {NOSET: "1", "CUDA_VISIBLE_DEVICES": "4,6,7"}
    assert noset_narrowing(CudaPlatform, ["6", "7"], node) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    uuids = {NOSET: "1", "CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb,GPU-cc"}
    assert noset_narrowing(CudaPlatform, ["GPU-cc", "GPU-aa"], uuids) == {"CUDA_VISIBLE_DEVICES": "GPU-cc,GPU-aa"}
    narrowed = {NOSET: "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert noset_narrowing(CudaPlatform, [2, 3], narrowed) == {}
    dev = local_device(CudaPlatform, ["2", "3"], narrowed)
    assert (dev.index, dev.noset) == (0, True)
    assert describe(CudaPlatform, dev) == (
        f"uses cuda:0: Ray's GPU 2 (of 2, 3), {NOSET}=1: Ray left CUDA_VISIBLE_DEVICES to roll, narrowed to this "
        "worker's 2 devices (CUDA_VISIBLE_DEVICES=2,3: its engine's processes count them from 0)"
    )
    # One device keeps the node's numbering (CUDA IPC between colocated workers); without NOSET Ray narrowed.
    assert noset_narrowing(CudaPlatform, ["3"], {NOSET: "1"}) == {}
    assert noset_narrowing(CudaPlatform, ["2", "3"], {"CUDA_VISIBLE_DEVICES": "2,3"}) == {}
    assert noset_narrowing(CpuPlatform, ["2", "3"], {NOSET: "1"}) == {}
    hip = {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1"}
    assert noset_narrowing(RocmPlatform, ["0", "1"], hip) == {"HIP_VISIBLE_DEVICES": "0,1"}
    npu = {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "true"}
    assert noset_narrowing(NpuPlatform, ["4", "5"], npu) == {"ASCEND_RT_VISIBLE_DEVICES": "4,5"}


def test_narrowing_to_a_device_this_worker_cannot_see_is_an_error() -> None:
    with pytest.raises(
        ValueError, match=r"assigned GPU 1, 3 but this worker sees CUDA_VISIBLE_DEVICES='0,1', without 3"
    ):
        noset_narrowing(CudaPlatform, ["1", "3"], {NOSET: "1", "CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError, match=r"GPU GPU-aa, GPU-bb, not indices, and CUDA_VISIBLE_DEVICES is unset"):
        noset_narrowing(CudaPlatform, ["GPU-aa", "GPU-bb"], {NOSET: "1"})


@pytest.mark.parametrize(
    ("env", "ids", "rank"),
    [
        ({NOSET: "1"}, ["3"], 3),  # every GPU visible: Ray's GPU 3 is cuda:3, LOCAL_RANK=0 put it on cuda:0
        ({NOSET: "1", "CUDA_VISIBLE_DEVICES": "4,6,7"}, ["7"], 2),
        ({"CUDA_VISIBLE_DEVICES": "3"}, ["3"], 0),  # narrowed by Ray: its GPU is cuda:0
        ({NOSET: "1"}, ["2", "3"], 0),  # several devices: narrowed by roll (before or after), the first is cuda:0
        ({NOSET: "1", "CUDA_VISIBLE_DEVICES": "2,3"}, ["2", "3"], 0),
        ({NOSET: "1"}, [], 0),  # reserved no GPU
    ],
)
def test_local_rank_is_the_local_device_index(env: dict[str, str], ids: list[str], rank: int) -> None:
    platforms = (CudaPlatform, RocmPlatform, NpuPlatform)
    assert local_rank(platforms, {"GPU": ids, "NPU": [], "TPU": []}, env) == rank


def test_local_rank_follows_the_switch_that_is_on() -> None:
    platforms = (CudaPlatform, RocmPlatform, NpuPlatform)
    hip = {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0,1,2,3"}
    assert local_rank(platforms, {"GPU": ["2"]}, hip) == 2
    npu = {"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}
    assert local_rank(platforms, {"GPU": [], "NPU": ["5"]}, npu) == 5
    assert local_rank(platforms, {"NPU": ["5"]}, {NOSET: "1"}) == 0  # the CUDA switch leaves NPUs to Ray
    both = {NOSET: "1", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(
        ValueError,
        match=r"switches of cuda, rocm are all on \(RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1, "
        r"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1\) and give this worker different device indices "
        r"\({'cuda': 3, 'rocm': 1}\), and which platform it runs is not known",
    ):
        local_rank(platforms, {"GPU": ["3"]}, both)


def test_local_rank_follows_the_switch_of_the_platform_in_use() -> None:
    """A node image with Ray's CUDA and HIP switches both on: an AMD node started with HIP_VISIBLE_DEVICES=2,3 was
    refused (CUDA's switch, CUDA_VISIBLE_DEVICES unset, read GPU 3 as device 3), though only HIP numbers its GPUs."""
    platforms = (CudaPlatform, RocmPlatform, NpuPlatform)
    both = {NOSET: "1", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "2,3"}
    assert local_rank(platforms, {"GPU": ["3"]}, both, in_use=RocmPlatform) == 1
    assert local_rank(platforms, {"GPU": ["3"]}, both, in_use=CudaPlatform) == 3  # an NVIDIA node, same image
    # The HIP switch alone on an NVIDIA node: Ray narrowed CUDA_VISIBLE_DEVICES to GPU 3, which is cuda:0.
    hip_only = {"RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "3"}
    assert local_rank(platforms, {"GPU": ["3"]}, hip_only, in_use=CudaPlatform) == 0
    assert local_rank(platforms, {"GPU": ["3"]}, both, in_use=CpuPlatform) == 0  # no Ray switch of its own
    # Switches that agree need no platform: nothing to refuse.
    agree = {**both, "CUDA_VISIBLE_DEVICES": "2,3"}
    assert local_rank(platforms, {"GPU": ["3"]}, agree) == 1
    with pytest.raises(ValueError, match=r"assigned GPU 5 but this worker sees HIP_VISIBLE_DEVICES='2,3'"):
        local_rank(platforms, {"GPU": ["5"]}, both, in_use=RocmPlatform)  # the platform's own errors stay
