"""Engines on an accelerator (run by `nox -s device -- cuda|rocm|npu`; skipped on CPU machines)."""

from __future__ import annotations

import pytest
import torch

from roll_core.models import resolve_model_path
from roll_core.pipelines.objectives import PolicyObjective
from roll_core.protocol import build_sequences, pad_left


def _engines(device: str, dtype: str):
    from roll_engines.infer.hf import HFInferEngine
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path("builtin:tiny")
    infer = HFInferEngine(path, device=device, dtype=dtype, max_new_tokens=8)
    train = HFTrainEngine(path, device=device, dtype=dtype, lr=1e-3)
    return infer, train


def _check(device: str) -> None:
    infer, train = _engines(device, "float32")
    ids = [infer.tokenizer("What is 1+1?")["input_ids"]]
    gen = infer.generate(ids, infer.defaults.replace(seed=0), n=4)
    p_ids, p_mask = pad_left(ids * 4, infer.pad_id)
    batch = build_sequences(p_ids, p_mask, gen.responses, gen.response_mask)
    batch.update(
        responses=gen.responses, response_mask=gen.response_mask, advantages=torch.ones(4, 1) * gen.response_mask
    )
    logp = train.compute_logprobs(batch)["logprobs"]
    torch.testing.assert_close(logp * gen.response_mask, gen.logprobs, atol=1e-3, rtol=1e-3)
    metrics = train.train_step(batch, PolicyObjective())
    assert metrics["grad_norm"] > 0
    assert infer.load_weights(train.get_weights()) > 0


@pytest.mark.cuda
def test_hf_engines_on_cuda() -> None:
    _check("cuda")


@pytest.mark.rocm
def test_hf_engines_on_rocm() -> None:
    _check("cuda")  # torch addresses ROCm devices as "cuda"


@pytest.mark.npu
def test_hf_engines_on_npu() -> None:
    _check("npu")
