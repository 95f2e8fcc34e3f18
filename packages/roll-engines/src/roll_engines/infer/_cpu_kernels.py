"""The CPU kernels of the `hf` inference engine (roll_engines.infer.hf) and of bench/bench_rollout.py's ceiling.

Contract: `use_cpu_kernels(model)` switches a CPU inference model's forwards in place to the fastest kernels this
CPU has (module docstring of roll_engines.infer.hf, "on CPU"); the numbers it computes are those of the model's own
forwards up to float reassociation. Weights change only at syncs, whose end drops the blocked copies
(roll_engines._onednn_linear.drop_packed).
"""

from __future__ import annotations

import torch

from roll_engines._onednn_linear import SKINNY_ROWS, use_onednn_linears, use_packed_bf16_linears
from roll_engines.infer._decode_attention import use_decode_attention
from roll_engines.infer._skinny_linear import use_skinny_linears
from roll_hw.cpu import cpu_bf16_instructions, fp32_linear_library


def use_cpu_kernels(model: torch.nn.Module, *, vision: bool = False) -> None:
    """Give a CPU inference model the engine's kernels (bench/bench_rollout.py's ceiling uses the same).

    fp32 linears through oneDNN where MKL is the slower library (roll_engines._onednn_linear), a decode step's last
    few rows (memory-bound) through the skinny operand order (roll_engines.infer._skinny_linear); weights change
    only at syncs, so oneDNN's blocked copies of them (1.23x on the quickstart rollout). bf16 where the CPU computes
    it natively: products on prepacked weights as well (1.7-2.4x per product). bf16/fp16 decode steps without a
    mask: grouped query heads as rows of their key/value head (roll_engines.infer._decode_attention; 1.35-1.7x on
    the bf16 quickstart rollout).
    """
    onednn = fp32_linear_library() == "onednn"
    if not (onednn and use_onednn_linears(model, skinny_rows=SKINNY_ROWS, prepack=True)):
        use_skinny_linears(model)
    if model.dtype == torch.bfloat16 and cpu_bf16_instructions() is not None:
        use_packed_bf16_linears(model)
    if model.dtype in (torch.bfloat16, torch.float16) and not vision:
        use_decode_attention(model)
