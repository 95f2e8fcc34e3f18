"""Skinny linear layers for roll's hf engine on CPU: a decode step's few rows as y = (W x^T)^T.

Contract: `use_skinny_linears(model)` gives every plain `torch.nn.Linear` of a float32 CPU model a forward that,
for inputs of at most `MAX_ROWS` rows (a decode step, a batch's tail) outside autograd, computes
`torch.mm(W, x^T)^T` (over zero rows added up to 2, or up to a multiple of 8 above 8 rows, the row counts this
kernel runs fastest at) and returns it contiguous; anything else (prefill, training, other dtypes) is `F.linear`
as before. Same products and sums, so outputs equal `F.linear`'s
up to float reassociation; hooks, weight syncs (which replace or write `weight`) and `requires_grad` are untouched.

Why: PyTorch's CPU `F.linear` (x @ W^T) reaches ~11 GB/s of weight streaming at 2-8 rows on this project's CPUs,
the other operand order ~37 GB/s (a single row, ~17 GB/s either way, runs fastest as two; odd counts above 8
run slower than the next multiple of 8). Measured per layer of SmolLM2-135M, fp32, 2 cores, cold weights (linear
time / this time): 2-3.6x at 2-4 rows, 1.1-1.2x at 16, ~1.05-1.1x at 32, below 1 from 64 rows (hence MAX_ROWS),
and below 1 in bf16 at every row count (hence fp32 only).
The rows of a batch's tail, where most requests have finished, are where decode spends much of its time.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

MAX_ROWS = 32


def _padded(rows: int) -> int:
    """Rows the product is computed for: 2 for one row, else a multiple of 8 above 8 rows (measured: 15, 23, 30 or
    31 rows take longer than 16, 24 or 32)."""
    if rows == 1:
        return 2
    return rows if rows <= 8 else -(-rows // 8) * 8


def skinny_forward(self: torch.nn.Linear, x: Tensor) -> Tensor:
    """nn.Linear.forward: x (..., in) -> (..., out)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 0 < rows <= MAX_ROWS or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
        return torch.nn.functional.linear(x, self.weight, self.bias)
    padded = _padded(rows)
    h = x.reshape(rows, k)
    if padded != rows:  # zero rows, dropped from the result
        h = torch.cat([h, h.new_zeros(padded - rows, k)])
    y = torch.mm(self.weight, h.contiguous().t())[:, :rows].t().contiguous()  # (rows, out)
    if self.bias is not None:
        y = y + self.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def cpu_linears(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> list[torch.nn.Linear]:
    """The plain nn.Linear layers (not subclasses) of `model` whose weight is `dtype` (float32 unless asked) on CPU:
    what a CPU kernel switch (this module's, roll_engines._onednn_linear's) may take over."""
    return [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear
        and m.weight is not None
        and m.weight.device.type == "cpu"
        and m.weight.dtype == dtype
    ]


def use_skinny_linears(model: torch.nn.Module) -> int:
    """Switch the plain nn.Linear layers of a float32 model on CPU; returns how many were switched."""
    linears = cpu_linears(model)
    for module in linears:
        module.forward = functools.partial(skinny_forward, module)  # a partial pickles; a bound method not
    return len(linears)
