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


def test_generated_tokens_without_logprobs_are_an_error_not_zeros() -> None:
    """A result with generated ids but no `output_token_logprobs` fails its request (0.0 would claim probability
    1 and skew every off-policy ratio); the log-probs come with their tokens otherwise; nothing generated is fine."""
    from roll_core.interfaces import Request, SamplingParams
    from roll_engines.infer.sglang import to_request_output

    req = Request("r1", [1, 2, 3], SamplingParams())
    with pytest.raises(ValueError, match="2 generated tokens without their log-probs"):
        to_request_output(req, {"output_ids": [7, 8], "meta_info": {"finish_reason": {"type": "stop"}}}, 0)
    meta = {"output_token_logprobs": [(-0.5, 7, None), (-1.25, 8, None)], "finish_reason": {"type": "length"}}
    out = to_request_output(req, {"output_ids": [7, 8], "meta_info": meta}, 3)
    assert (out.token_ids, out.logprobs, out.weight_version) == ([7, 8], [-0.5, -1.25], 3)
    empty = to_request_output(req, {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}, 0)
    assert empty.token_ids == [] and empty.logprobs == []
