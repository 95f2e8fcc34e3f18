"""roll_core.devices.resolve_device: the platform a role's engine runs on, decided on its worker."""

from __future__ import annotations

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
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
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
