"""The `sglang` engine against the InferEngine conformance suite (CUDA only: `nox -s device -- cuda`).

SGLang has no CPU build; on CPU machines these tests skip and only the config composes (tests/configs).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from roll_core.testing.infer_engine import InferEngineTestSuite


@pytest.mark.cuda
class TestSGLangInferEngine(InferEngineTestSuite):
    # FlashInfer kernels need a head size of 64 or more: the wide tiny model has 4 heads of 64.
    model: ClassVar[str] = "builtin:tiny-wide"
    logprob_atol: ClassVar[float] = 2e-3  # GPU kernels in fp32 vs transformers' CPU reference
    supports_truncation: ClassVar[bool] = False
    releases_weights: ClassVar[bool] = True

    @classmethod
    def build_engine(cls, model_path: str, **kwargs: Any):
        pytest.importorskip("sglang", reason="pip install 'roll-engines[sglang]' on a CUDA machine")
        from roll_engines.infer.sglang import SGLangInferEngine

        return SGLangInferEngine(
            # deterministic: SGLang honours per-request seeds only then (the suite checks seeded reproducibility)
            model_path,
            dtype="float32",
            mem_fraction_static=0.3,
            disable_cuda_graph=True,
            deterministic=True,
            **kwargs,
        )


def test_refuses_truncated_sampling_without_starting() -> None:
    from roll_core.interfaces import SamplingParams, UnsupportedSamplingError
    from roll_engines.infer.sglang import SGLangInferEngine

    engine = SGLangInferEngine.__new__(SGLangInferEngine)
    engine.name = "sglang"
    with pytest.raises(UnsupportedSamplingError, match="top-k/top-p"):
        engine.check_sampling(SamplingParams(top_p=0.9))
