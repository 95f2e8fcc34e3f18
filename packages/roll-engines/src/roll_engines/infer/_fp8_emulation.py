"""Emulated FP8 rollout for the `hf` engine: the numerics of vLLM's online FP8 quantization, on any device.

vLLM's `quantization=fp8` (online, dynamic) stores every linear layer's weight in float8_e4m3fn with one scale per
tensor and quantizes each linear layer's input the same way at run time (W8A8, per-tensor dynamic scales); the
embeddings, norms and LM head stay in the model's dtype. Its log-probs then differ from a bf16/fp32 trainer's by
far more than a bf16 rollout's do, which is what the off-policy corrections are for. vLLM's FP8 kernels need a
CUDA GPU; this module reproduces the rounding (not the speed) in the `hf` engine so that the gap, and what each
correction does with it, can be measured on a CPU (`infer_engine.emulate_fp8=true`).

Contract:
- `fp8_round(t)` is `t` rounded through float8_e4m3fn with the scale amax(|t|) / 448 (e4m3's largest finite
  value), returned in t's dtype: each value keeps 3 mantissa bits relative to that scale.
- `FP8Emulation(model)` selects the model's `nn.Linear` layers except the output embedding (LM head), rounds their
  weights now and at every `round_weights()` (the engine calls it after each weight sync: the trainer sends full
  precision, the engine holds rounded copies, as vLLM re-quantizes at each reload), and rounds each such layer's
  input per call (a forward pre-hook). Computation itself stays in the engine's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

#: The largest finite float8_e4m3fn value: a per-tensor scale maps amax(|t|) onto it.
E4M3_MAX = 448.0


def fp8_round(t: Tensor) -> Tensor:
    """`t` (any shape) rounded through float8_e4m3fn with one per-tensor scale amax(|t|)/448, in t's dtype."""
    scale = t.detach().abs().amax().float().clamp(min=1e-12) / E4M3_MAX
    return ((t.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(t.dtype)


class FP8Emulation:
    """Per-tensor FP8 rounding of a model's linear layers (weights and inputs), the LM head excepted."""

    def __init__(self, model: nn.Module) -> None:
        experts = [n for n, p in model.named_parameters() if ".experts." in n and p.dim() == 3]
        if experts:  # vLLM quantizes the routed experts and not the router; these hooks see nn.Linear layers only
            raise ValueError(
                f"infer_engine.emulate_fp8: {type(model).__name__} is a mixture of experts, whose fused expert weights "
                f"({experts[0]}, ...) this emulation does not round as vLLM's FP8 does: it would understate the gap; "
                "use a dense model"
            )
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.layers = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
        if not self.layers:
            raise ValueError(f"infer_engine.emulate_fp8: {type(model).__name__} has no linear layers to quantize")
        for layer in self.layers:
            layer.register_forward_pre_hook(_round_input)
        self.round_weights()

    @torch.no_grad()
    def round_weights(self) -> None:
        """Round every selected weight in place (after a load or a weight sync)."""
        for layer in self.layers:
            if layer.weight.numel():  # a sleeping engine's parameters are empty
                layer.weight.copy_(fp8_round(layer.weight))


def _round_input(module: nn.Module, args: tuple) -> tuple:
    return (fp8_round(args[0]), *args[1:])
