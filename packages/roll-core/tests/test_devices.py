"""roll_core.devices.resolve_device: the platform a role's engine runs on, decided on its worker."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

import roll_hw
from roll_core.devices import resolve_device
from roll_hw.cpu import CpuPlatform
from roll_hw.npu import NpuPlatform


def test_the_engines_current_platform_is_the_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines ask roll_hw.current_platform (their distributed backend, memory); it was a fresh auto-detection, not
    the run's hw.platform, so an active plugin (or a broken one) decided for a run that named cpu."""
    roll_hw.set_current_platform(NpuPlatform)  # what detection would have said (a plugin platform, say)
    try:
        out = resolve_device({"platform": "cpu", "device": "auto", "dtype": "float32", "role": "actor"})
        assert out["device"] == "cpu" and roll_hw.current_platform is CpuPlatform
    finally:
        roll_hw.set_current_platform(None)


def test_a_platform_whose_probe_raises_names_itself_and_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from roll_hw import detect

    class Raising(CpuPlatform):
        @classmethod
        def is_available(cls) -> bool:
            raise OSError("libacme_driver.so: cannot open shared object file")

    real = detect.get_platform_class
    monkeypatch.setattr(detect, "get_platform_class", lambda name: Raising if name == "acme" else real(name))
    with pytest.raises(RuntimeError, match=r"^\S+: platform 'acme' \(requested\).*raised OSError: libacme_driver"):
        resolve_device({"platform": "acme", "device": "auto"})


class _FakeRay:
    """What resolve_device asks of ray in a worker: initialised, the actor id, the accelerator ids it reserved (as
    Ray 2.60 answers: {"GPU": []} for an actor with num_gpus=0, which sees the node's GPUs all the same)."""

    def __init__(self, actor_id: str | None, gpus: list[str]) -> None:
        context = SimpleNamespace(
            get_actor_id=lambda: actor_id, get_accelerator_ids=lambda: {"GPU": gpus, "NPU": [], "TPU": []}
        )
        self.is_initialized = lambda: True
        self.get_runtime_context = lambda: context


@pytest.fixture
def gpu_node_detected(monkeypatch: pytest.MonkeyPatch):
    """Detection finds the node's GPUs (CUDA); `ray` is what the test installs in sys.modules."""
    import sys

    from roll_hw.cuda import CudaPlatform

    def install(ray: _FakeRay | None) -> type:
        monkeypatch.setattr(
            roll_hw, "resolve_platform", lambda name=None: CpuPlatform if name == "cpu" else CudaPlatform
        )
        monkeypatch.setitem(sys.modules, "ray", ray)
        return CudaPlatform

    yield install
    roll_hw.set_current_platform(None)


def test_a_ray_worker_that_reserved_no_gpu_does_not_take_the_nodes_gpu(
    gpu_node_detected, caplog: pytest.LogCaptureFixture
) -> None:
    """A reward worker's judge engine (platform auto) in a Ray actor with num_gpus=0: Ray 2.60 leaves the node's
    CUDA_VISIBLE_DEVICES there (verified: an actor with num_gpus=0 saw '0,1'), so detection found CUDA and the
    engine took cuda:0, a GPU Ray gave to another worker. It runs on the CPU now, and says so."""
    import logging

    gpu_node_detected(_FakeRay("actor-1", []))
    with caplog.at_level(logging.WARNING, logger="roll_core.devices"):
        out = resolve_device({"platform": "auto", "device": "auto", "dtype": "float32", "role": "judge"})
    assert out["device"] == "cpu" and roll_hw.current_platform is CpuPlatform
    auto = resolve_device({"platform": "auto", "device": "auto", "dtype": "auto", "role": "judge"})["dtype"]
    assert auto == ("bfloat16" if CpuPlatform.supports_bf16() else "float32")  # the CPU's rule, not the GPU's
    assert "role judge: this Ray worker reserved no GPU" in caplog.text
    with pytest.raises(RuntimeError, match=r"role judge: platform cuda in a Ray worker that reserved no GPU"):
        resolve_device({"platform": "cuda", "device": "auto", "dtype": "float32", "role": "judge"})


@pytest.mark.parametrize("ray", [_FakeRay("actor-1", ["3"]), _FakeRay(None, []), None], ids=["gpu", "driver", "none"])
def test_a_worker_with_its_gpu_or_a_driver_keeps_the_accelerator(gpu_node_detected, ray) -> None:
    """An actor given a GPU (Ray sets CUDA_VISIBLE_DEVICES to it: cuda is that GPU), the driver (cluster=local), a
    process without Ray: the detected platform stands."""
    cuda = gpu_node_detected(ray)
    out = resolve_device({"platform": "auto", "device": "auto", "dtype": "float32", "role": "actor"})
    assert out["device"] == "cuda" and roll_hw.current_platform is cuda


@pytest.mark.parametrize("ray_id", ["1", "3"])
def test_under_noset_a_worker_uses_the_gpu_ray_assigned_not_gpu_0(
    gpu_node_detected, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, ray_id: str
) -> None:
    """RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 (CUDA IPC between workers, vLLM/verl set-ups): Ray leaves
    CUDA_VISIBLE_DEVICES unset, every worker sees every GPU of the node, and bare "cuda" was cuda:0 for all of them.
    The device is now the one Ray assigned, made current (bare "cuda" in the engines), and the log says why."""
    import logging

    cuda = gpu_node_detected(_FakeRay("actor-1", [ray_id]))
    current: list[int] = []
    monkeypatch.setattr(cuda, "set_device", classmethod(lambda cls, index: current.append(index)))
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    _restored_after(monkeypatch, ("CUDA_VISIBLE_DEVICES",))
    with caplog.at_level(logging.INFO, logger="roll_core.devices"):
        out = resolve_device({"platform": "auto", "device": "auto", "dtype": "float32", "role": "actor_train"})
    assert out["device"] == f"cuda:{ray_id}" and current == [int(ray_id)]
    assert f"role actor_train: this Ray worker uses cuda:{ray_id}: Ray's GPU {ray_id}, " in caplog.text
    assert "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1: Ray left CUDA_VISIBLE_DEVICES unset" in caplog.text
    # An explicit index is the user's; a node whose CUDA_VISIBLE_DEVICES hides the GPU is an error, not cuda:0.
    assert resolve_device({"platform": "auto", "device": "cuda:0", "role": "a"})["device"] == "cuda:0"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(ValueError, match=rf"assigned GPU {ray_id} but this worker sees CUDA_VISIBLE_DEVICES='7'"):
        resolve_device({"platform": "auto", "device": "auto", "role": "a"})


def test_narrowed_by_ray_the_device_stays_cuda_and_the_log_names_the_gpu(
    gpu_node_detected, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    gpu_node_detected(_FakeRay("actor-1", ["3"]))
    monkeypatch.delenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with caplog.at_level(logging.INFO, logger="roll_core.devices"):
        out = resolve_device({"platform": "auto", "device": "auto", "dtype": "float32", "role": "critic"})
    assert out["device"] == "cuda"  # cuda:0 of this process is Ray's GPU 3
    assert "role critic: this Ray worker uses cuda:0: Ray's GPU 3, narrowed by Ray (CUDA_VISIBLE_DEVICES=3)" in (
        caplog.text
    )


_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _restored_after(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> None:
    """Unset `names` for the test and put them back as they were after it, including what Worker.setup exports
    (`delenv` of an unset variable records nothing: a RANK=1 left behind made a later test's process-group
    rendezvous wait for a rank 0 that never came)."""
    for var in names:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)


@pytest.mark.parametrize(
    ("env", "ids", "local_rank"),
    [
        ({"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, ["3"], "3"),
        ({"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "4,6,7"}, ["6"], "1"),
        ({"CUDA_VISIBLE_DEVICES": "3"}, ["3"], "0"),
        ({"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, ["2", "3"], "0"),
    ],
    ids=["noset", "noset-node-list", "narrowed-by-ray", "noset-two-gpus"],
)
def test_a_ray_worker_exports_its_device_index_as_local_rank(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], ids: list[str], local_rank: str
) -> None:
    """Worker.setup exported LOCAL_RANK=0 always: under NOSET every worker sees the node's GPUs, and a library that
    makes cuda:LOCAL_RANK current (DeepSpeed, accelerate) put every worker of the node on GPU 0. It is the index of
    the GPU Ray assigned now; 0 where Ray narrowed, or for a multi-GPU worker, which roll narrows to its GPUs."""
    import sys

    from roll_core.cluster.worker import Worker

    _restored_after(monkeypatch, (*_DIST_VARS, "CUDA_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"))
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setitem(sys.modules, "ray", _FakeRay("actor-1", ids))
    Worker(rank=1, world_size=2).setup("127.0.0.1", 29500)
    assert {v: os.environ[v] for v in _DIST_VARS} == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": local_rank,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }


def test_local_rank_on_a_node_with_two_ray_switches_follows_the_platform_in_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An AMD node started with HIP_VISIBLE_DEVICES=2,3 from an image that sets Ray's CUDA and HIP switches: Worker.
    setup refused it (CUDA's switch, CUDA_VISIBLE_DEVICES unset, read Ray's GPU 3 as device 3; HIP's as device 1)
    though only HIP numbers the GPUs there. Detection (ROCm, faked: no AMD GPU here) decides: LOCAL_RANK=1."""
    import sys

    from roll_core.cluster.worker import Worker
    from roll_core.devices import ray_local_rank
    from roll_hw.rocm import RocmPlatform

    switches = ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES")
    _restored_after(monkeypatch, (*_DIST_VARS, "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", *switches))
    for var in switches:
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2,3")
    monkeypatch.setitem(sys.modules, "ray", _FakeRay("actor-1", ["3"]))
    monkeypatch.setattr(roll_hw, "resolve_platform", lambda name=None: RocmPlatform)
    Worker(rank=1, world_size=2).setup("127.0.0.1", 29500)
    assert os.environ["LOCAL_RANK"] == "1"

    # Detection that fails leaves a real ambiguity: refused, saying why the platform is not known.
    def broken(name: str | None = None) -> type:
        raise RuntimeError("acme plugin failed to import")

    monkeypatch.setattr(roll_hw, "resolve_platform", broken)
    with pytest.raises(
        ValueError, match=r"give this worker different device indices .*detecting the platform here failed: Runt"
    ):
        ray_local_rank()


def test_outside_ray_local_rank_stays_0(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from roll_core.cluster.worker import Worker

    _restored_after(monkeypatch, _DIST_VARS)
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setitem(sys.modules, "ray", None)
    Worker(rank=1, world_size=2).setup("127.0.0.1", 29500)
    assert os.environ["LOCAL_RANK"] == "0"


@pytest.fixture
def two_gpu_noset_worker(gpu_node_detected, monkeypatch: pytest.MonkeyPatch):
    """A TP=2 engine worker Ray assigned GPUs 2 and 3 under NOSET (CUDA_VISIBLE_DEVICES unset: the node's 4 GPUs
    visible); the CUDA platform counts what CUDA_VISIBLE_DEVICES shows, as torch does before CUDA starts."""
    cuda = gpu_node_detected(_FakeRay("actor-1", ["2", "3"]))
    current: list[int] = []
    monkeypatch.setattr(cuda, "set_device", classmethod(lambda cls, index: current.append(index)))
    monkeypatch.setattr(
        cuda, "device_count", classmethod(lambda cls: len(os.environ.get("CUDA_VISIBLE_DEVICES", "0,1,2,3").split(",")))
    )
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "1")
    _restored_after(monkeypatch, ("CUDA_VISIBLE_DEVICES",))  # the narrowing sets it in this process
    return cuda, current


def test_under_noset_a_multi_gpu_worker_is_narrowed_to_its_gpus_before_its_engine_starts(
    two_gpu_noset_worker, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM at TP=2 spawns one worker process per GPU, counting from cuda:0: under NOSET (nothing narrowed) they ran
    on GPUs 0 and 1 of the node, other workers', while roll used GPU 2. The worker narrows CUDA_VISIBLE_DEVICES to
    its GPUs, as Ray would have, before the engine starts: its processes inherit it, and cuda:0 is GPU 2."""
    import logging

    _, current = two_gpu_noset_worker
    with caplog.at_level(logging.INFO, logger="roll_core.devices"):
        out = resolve_device({"platform": "auto", "device": "auto", "dtype": "float32", "role": "actor_infer"})
    assert (os.environ.get("CUDA_VISIBLE_DEVICES"), out["device"], current) == ("2,3", "cuda:0", [0])
    from roll_core.devices import ray_local_rank

    assert ray_local_rank() == 0
    assert (
        "role actor_infer: this Ray worker spans GPUs 2, 3 under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1: "
        "CUDA_VISIBLE_DEVICES=2,3 set for it and its engine's processes"
    ) in caplog.text
    assert "uses cuda:0: Ray's GPU 2 (of 2, 3), " in caplog.text
    # A second engine on the worker (a reward model): already narrowed, nothing changes.
    assert resolve_device({"platform": "auto", "device": "auto", "role": "rm"})["device"] == "cuda:0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_worker_whose_cuda_already_started_is_refused_not_half_narrowed(
    two_gpu_noset_worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA reads CUDA_VISIBLE_DEVICES once: narrowed after it started, this process would keep the node's numbering
    and its engine's processes the worker's (a CUDA IPC handle for GPU 2 would open GPU 2 of 2 there)."""
    import torch

    cuda, _ = two_gpu_noset_worker
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"must narrow CUDA_VISIBLE_DEVICES to 2,3 .* cuda is already initialised"):
        resolve_device({"platform": "auto", "device": "auto", "role": "actor_infer"})
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cuda, "device_count", classmethod(lambda cls: 4))  # the runtime fixed its count before
    with pytest.raises(RuntimeError, match=r"narrowed CUDA_VISIBLE_DEVICES to 2,3, but cuda then counted 4 devices"):
        resolve_device({"platform": "auto", "device": "auto", "role": "actor_infer"})
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
