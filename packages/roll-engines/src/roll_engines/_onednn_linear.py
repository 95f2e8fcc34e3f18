"""fp32 linear layers through oneDNN on CPUs where torch's MKL matmul leaves half the machine idle.

Contract: `use_onednn_linears(model)` gives every plain `torch.nn.Linear` of a float32 CPU model a forward that
computes y = x W^T + b with oneDNN's fp32 inner product (`torch.ops.mkldnn._linear_pointwise`, weights as they are:
nothing is repacked or copied, so weight syncs that write or replace `weight` need nothing), forward and backward
(`OneDNNLinear`: dX = dY W, dW = dY^T X, db = sum dY, each through the same kernel, dW through MKL where dY is
larger than `TRANSPOSE_LIMIT`). Anything it does not cover
takes `F.linear` as before: other dtypes or devices, autocast, tensor subclasses (FSDP2's DTensor), a
non-contiguous weight, an empty or 1-D input, or a torch without the op. `skinny_rows=k` sends no-grad inputs of at
most k rows (a decode step's last rows, memory-bound) to the infer engine's skinny product instead. Outputs equal
`F.linear`'s up to float reassociation (relative ~1e-6).

Why: torch's CPU fp32 matmul is MKL's, which runs its AVX2 kernels on AMD CPUs. Measured on an AMD EPYC (Zen 4
family, avx512f, 2 cores), fp32, GFLOP/s MKL -> oneDNN: 2048^3 209 -> 483; a training micro-batch's shapes
(2048 rows, SmolLM2-135M) forward 213 -> 451, dX 212 -> 415, dW 209 -> 305 (with transposed copies; the
kernel takes the transposed views themselves, 1.2-1.3x faster again at 1200 rows); a
decode step's 32 rows, all 30 layers: 52 -> 31 ms. Where MKL is the better library (Intel) roll_hw.cpu
`fp32_linear_library()` says "mkl" and nothing is switched.

oneDNN caches what it builds per product shape; engine processes cap those caches (roll_hw.cpu
`bound_onednn_caches`), since every micro-batch and prefill brings new shapes.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_FWD = None  # torch.ops.mkldnn._linear_pointwise, looked up once

#: Rows up to which the infer engine's no-grad products take the skinny operand order instead (memory-bound:
#: the 30 layers of SmolLM2-135M at 2 rows 14.0 ms skinny vs 19.4 oneDNN, 4 rows 14.6 vs 18.4, 8 rows 28.2 vs 20.5).
SKINNY_ROWS = 4

#: Largest output gradient (elements) whose dW goes through oneDNN (64 MiB in fp32); above it dW is MKL's, which
#: reads the transposed operand in place. Measured at 1200 x 49152 (SmolLM2's vocabulary): dW 308 ms oneDNN vs 348
#: MKL, a small gain for a possible gradient-sized temporary; at the layers' shapes oneDNN is 1.8x.
TRANSPOSE_LIMIT = 1 << 24


def onednn_linear_op():
    """oneDNN's fp32 inner product `(x, w, b, "none", [], "") -> x w^T + b`, or None where this torch lacks it."""
    global _FWD
    if _FWD is None:
        try:
            op = torch.ops.mkldnn._linear_pointwise
            if not torch.backends.mkldnn.is_available():
                raise RuntimeError("torch was built without oneDNN")
            _FWD = op
        except (AttributeError, RuntimeError):
            _FWD = False
    return _FWD or None


def _mm(a: Tensor, b_t: Tensor) -> Tensor:
    """a (m, k) @ b_t (n, k)^T -> (m, n) through oneDNN."""
    return _FWD(a, b_t, None, "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """y = x w^T + b with oneDNN on both passes. x (..., in), w (out, in), b (out,) or None -> y (..., out)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _FWD(x, w, b, "none", [], "")

    @staticmethod
    def backward(ctx, gy: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            # dY (m, out) @ W (out, in); oneDNN reads the transposed view as it is (copying it first: 1.2-1.3x slower)
            gx = _mm(gy2, w.t()).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if gy2.numel() > TRANSPOSE_LIMIT:
                # A vocabulary-wide dY (a micro-batch of 4096 tokens x 49152 words: 800 MB): MKL reads it transposed
                # in place, where oneDNN may lay out a copy, for ~1.1x at this shape.
                gw = torch.mm(gy2.t(), x2)
            else:
                gw = _mm(gy2.t(), x2.t())  # dY^T (out, m) @ X (m, in), transposed views as they are
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy2.sum(0)
        return gx, gw, gb


def _covered(x: Tensor, w: Tensor) -> bool:
    """Whether oneDNN computes this product: plain fp32 CPU tensors, a contiguous weight, a non-empty 2-D+ input."""
    return (
        x.dim() >= 2
        and x.numel() > 0
        and type(w) in (torch.nn.Parameter, Tensor)
        and type(x) is Tensor
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and x.device.type == "cpu"
        and w.is_contiguous()
        and not torch.is_autocast_enabled("cpu")
    )


def onednn_forward(self: torch.nn.Linear, x: Tensor, skinny_rows: int = 0) -> Tensor:
    """nn.Linear.forward: x (..., in) -> (..., out), through oneDNN where `_covered`, else `F.linear`."""
    w, b = self.weight, self.bias
    if not _covered(x, w):
        return torch.nn.functional.linear(x, w, b)
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
    if grad:
        return OneDNNLinear.apply(x, w, b)
    if skinny_rows and x.numel() // x.shape[-1] <= skinny_rows:
        from roll_engines.infer._skinny_linear import skinny_forward

        return skinny_forward(self, x)
    return _FWD(x, w, b, "none", [], "")


def use_onednn_linears(model: torch.nn.Module, skinny_rows: int = 0) -> int:
    """Switch the plain nn.Linear layers of a model whose weights are fp32 on CPU to `onednn_forward`; returns how
    many were switched (0 where this torch has no oneDNN inner product)."""
    if onednn_linear_op() is None:
        return 0
    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if type(module) is torch.nn.Linear and w is not None and w.device.type == "cpu" and w.dtype == torch.float32:
            # a partial pickles; a bound method does not
            module.forward = functools.partial(onednn_forward, module, skinny_rows=skinny_rows)
            n += 1
    return n
