"""The `hf` and `fsdp2` training engines pass the TrainEngine conformance suite (fsdp2 as one rank in-process)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from roll_core.cluster.group import free_port
from roll_core.testing.train_engine import TrainEngineTestSuite
from roll_engines.train.fsdp2 import FSDP2TrainEngine
from roll_engines.train.hf import HFTrainEngine


class TestHFTrainEngine(TrainEngineTestSuite):
    @classmethod
    def build_engine(cls, model_path: str, **kwargs: Any) -> HFTrainEngine:
        return HFTrainEngine(model_path, **kwargs)


class TestFSDP2TrainEngine(TrainEngineTestSuite):
    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def process_group(cls):
        import torch.distributed as dist

        env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        yield
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    @classmethod
    def build_engine(cls, model_path: str, **kwargs: Any) -> FSDP2TrainEngine:
        return FSDP2TrainEngine(model_path, dist_backend="gloo", **kwargs)
