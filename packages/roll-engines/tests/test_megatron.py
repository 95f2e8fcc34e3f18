"""The `megatron` engine (Megatron-Core on CPU over gloo): the TrainEngine conformance suite at TP=PP=1 in this
process; TP=2 and PP=2 against the `hf` engine run on Ray in tests/e2e/test_megatron_ray.py."""

from __future__ import annotations

from typing import Any

import pytest

from roll_core.testing.train_engine import TrainEngineTestSuite

pytest.importorskip("megatron.core", reason="pip install 'roll-engines[megatron]'")


class TestMegatronTrainEngine(TrainEngineTestSuite):
    logprob_atol = 1e-5

    @classmethod
    def build_engine(cls, model_path: str, **kwargs: Any):
        from roll_engines.train.megatron import MegatronTrainEngine

        kwargs.setdefault("micro_batch_size", 4)
        return MegatronTrainEngine(model_path, dist_backend="gloo", use_distributed_optimizer=False, **kwargs)
