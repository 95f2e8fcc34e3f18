"""The engine constructor contract (roll_core.interfaces.runtime) for roll-engines' engines: every config schema
extends its roll-core base, every constructor takes every key of its config and of its runtime type and no catch-all
`**kwargs`, and a key an engine does not take fails before anything is loaded. Signatures only: nothing is built."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hydra.utils import get_object

from roll_core import registry
from roll_core.cluster.roles import build_engine, engine_kwargs
from roll_core.config.schema import InferEngineConfig, TrainEngineConfig
from roll_core.interfaces.runtime import INFER_RUNTIME_KEYS, TRAIN_RUNTIME_KEYS, check_engine_kwargs
from roll_engines import config as C

TRAIN = [C.HFTrainEngineConfig, C.FSDP2TrainEngineConfig, C.MegatronTrainEngineConfig]
INFER = [C.HFInferEngineConfig, C.VLLMInferEngineConfig, C.SGLangInferEngineConfig]


def _runtime(keys: frozenset[str]) -> dict[str, Any]:
    """One value per runtime key (the worker removes `platform` before the engine sees the runtime)."""
    return {k: None for k in keys - {"platform"}}


def _own_keys(schema: Any) -> dict[str, Any]:
    keys = engine_kwargs(dataclasses.asdict(schema()))
    return {k: v for k, v in keys.items() if k != "_target_"}


@pytest.mark.parametrize("schema", TRAIN + INFER, ids=lambda s: s.__name__)
def test_every_engine_takes_its_config_and_runtime_keys(schema: Any) -> None:
    train = schema in TRAIN
    assert issubclass(schema, TrainEngineConfig if train else InferEngineConfig)
    target = get_object(schema._target_)
    check_engine_kwargs(target, _own_keys(schema), _runtime(TRAIN_RUNTIME_KEYS if train else INFER_RUNTIME_KEYS))


def test_the_schemas_cover_every_in_tree_engine() -> None:
    names = {s.name for s in TRAIN}, {s.name for s in INFER}
    installed = set(registry.available("roll.train_engines")), set(registry.available("roll.infer_engines"))
    assert names[0] <= installed[0] and names[1] <= installed[1]
    assert {"hf", "fsdp2", "megatron"} == names[0] and {"hf", "vllm", "sglang"} == names[1]


def test_catch_all_and_unknown_keys_are_errors() -> None:
    def swallows(model_path: str, **unused: Any) -> None: ...

    with pytest.raises(TypeError, match=r"takes \*\*kwargs"):
        check_engine_kwargs(swallows, {}, {"model_path": "x"})
    target = get_object(C.HFTrainEngineConfig._target_)
    with pytest.raises(TypeError, match=r"config key\(s\) \['bogus'\]"):
        check_engine_kwargs(target, {"bogus": 1}, {})
    with pytest.raises(TypeError, match=r"runtime key\(s\) \['max_new_tokens'\]"):
        check_engine_kwargs(target, {}, {"max_new_tokens": 8})  # an inference key sent to a trainer


def test_build_engine_refuses_an_unknown_key_before_loading() -> None:
    class _Worker:
        pass

    cfg = {**dataclasses.asdict(C.HFTrainEngineConfig()), "bogus_knob": 3}
    # The model path does not exist: reaching the constructor would fail differently (and slowly).
    with pytest.raises(TypeError, match="HFTrainEngine does not accept the config key"):
        build_engine(_Worker(), cfg, {"model_path": "/nonexistent", "role": "actor", "platform": "cpu"})


def test_a_cpu_train_engine_opens_a_gloo_group_whatever_the_node_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """hw.platform=cpu on a GPU node: fsdp2 and megatron engines on CPU took the node's platform backend (nccl) and
    their first collective on CPU tensors failed; a CPU engine's group is gloo, an accelerator's the platform's."""
    import roll_hw
    from roll_engines.train._settings import backend_for

    class NodeWithGpus:
        dist_backend = "nccl"

    monkeypatch.setattr(roll_hw, "current_platform", NodeWithGpus(), raising=False)
    assert backend_for("cpu") == "gloo" and backend_for(torch.device("cpu")) == "gloo"
    assert backend_for("cuda:0") == "nccl"
