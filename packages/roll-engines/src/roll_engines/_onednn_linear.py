"""fp32 linear layers through oneDNN on CPUs where torch's MKL matmul leaves half the machine idle.

Contract: `use_onednn_linears(model)` gives every plain `torch.nn.Linear` of a float32 CPU model a forward that
computes y = x W^T + b with oneDNN's fp32 inner product (`torch.ops.mkldnn._linear_pointwise`, weights as they are:
nothing is repacked or copied, so weight syncs that write or replace `weight` need nothing), forward and backward
(`OneDNNLinear`: dX = dY W and dW = dY^T X through the same kernel, dW through MKL where dY is larger than
`TRANSPOSE_LIMIT`, db = dY summed; no second derivative: `create_graph` through it raises). Anything it does not
cover takes `F.linear` as before: other dtypes or devices, autocast, tensor subclasses (FSDP2's DTensor outside
forward), a non-contiguous weight or bias, an empty or 1-D input, `torch.backends.mkldnn.enabled = False`, or a
torch without the op. `skinny_rows=k` sends no-grad inputs of at most k rows (a decode step's last rows,
memory-bound) to the infer engine's skinny product instead; `prepack=True` runs the other no-grad products on
blocked copies of the weights, packed again after a weight is written or replaced. Outputs equal `F.linear`'s up to
float reassociation (relative ~1e-6). A switched model pickles and runs where it is unpickled.

Why: torch's CPU fp32 matmul is MKL's, which runs its AVX2 kernels on AMD CPUs. Measured on an AMD EPYC (Zen 4
family, avx512f, 2 cores), fp32, GFLOP/s MKL -> oneDNN: 2048^3 209 -> 483; a training micro-batch's shapes
(2048 rows, SmolLM2-135M) forward 213 -> 451, dX 212 -> 415, dW 209 -> 305 (with transposed copies; passing
W^T and X^T as views is 1.2-1.3x faster again at 1200 rows); a
decode step's 32 rows, all 30 layers: 52 -> 31 ms. Where MKL is the better library (Intel) roll_hw.cpu
`fp32_linear_library()` says "mkl" and nothing is switched.

bf16 inference: `use_packed_bf16_linears(model)` gives the plain nn.Linear layers of a bf16 CPU model a forward
that runs no-grad products on the prepacked weights as well (torch's own bf16 CPU matmul is oneDNN's too, on the
weights as they are): measured on AVX512-BF16 (an AMD EPYC, Zen 5), SmolLM2 shapes with weights from memory,
41-99 us per product at 1-32 rows against torch's 97-173 (1.7-2.4x); outputs equal to `F.linear`'s for the
contiguous inputs compared (a strided input may differ by one bf16 rounding).
Anything needing a gradient, or outside the same cover in bf16, takes `F.linear`.

oneDNN caches what it builds per product shape; engine processes cap those caches (roll_hw.cpu
`bound_onednn_caches`), since every micro-batch and prefill brings new shapes.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from roll_engines.infer import _skinny_linear as _skinny
from roll_engines.infer._skinny_linear import cpu_linears

_FWD = None  # torch.ops.mkldnn._linear_pointwise, looked up once

#: Rows up to which the infer engine's no-grad products take the skinny operand order instead (memory-bound:
#: the 30 layers of SmolLM2-135M at 2 rows 14.0 ms skinny vs 19.4 oneDNN, 4 rows 14.6 vs 18.4, 8 rows 28.2 vs 20.5).
SKINNY_ROWS = 4

#: Largest output gradient (elements) whose dW goes through oneDNN (64 MiB in fp32); above it dW is MKL's, which
#: reads dY transposed in place where oneDNN's call copies it. Measured at 1200 x 49152 (SmolLM2's vocabulary): dW
#: 308 ms oneDNN vs 348 MKL, a small gain for a dY-sized copy; at the layers' shapes oneDNN is 1.8x.
TRANSPOSE_LIMIT = 1 << 24

#: Largest total of linear weights (fp32, or bf16 for `use_packed_bf16_linears`) an inference model gets prepacked
#: copies of (the copies double that memory).
#: Measured (SmolLM2-135M, 0.54 GB): the quickstart rollout 1.23x with packed weights, paired, with EOS and without.
PREPACK_MAX_BYTES = 2 << 30


def onednn_linear_op() -> Callable[..., Tensor] | None:
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


def _op() -> Callable[..., Tensor]:
    # _FWD is filled by use_onednn_linears; a switched model unpickled in a fresh process looks it up here.
    return _FWD or onednn_linear_op()


class OneDNNLinear(torch.autograd.Function):
    """y = x w^T + b with oneDNN on both passes. x (..., in), w (out, in), b (out,) or None -> y (..., out)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        # Only what the asked-for gradients read: dX needs W, dW needs X (a frozen LoRA base keeps no X).
        ctx.save_for_backward(x if w.requires_grad else None, w if x.requires_grad else None)
        ctx.has_bias = b is not None
        return _op()(x, w, b, "none", [], "")

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward's products have no derivative: refuse, never 0
    def backward(ctx, gy: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        op = _op()
        gy2 = gy.reshape(-1, gy.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            # dY (m, out) @ W (out, in): the kernel's weight operand is W^T, read as a view (a laid-out copy of it
            # first: 1.2-1.3x slower).
            gx = op(gy2, w.t(), None, "none", [], "").reshape(*gy.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if gy2.numel() > TRANSPOSE_LIMIT:
                # A vocabulary-wide dY (a micro-batch of 4096 tokens x 49152 words: 800 MB): torch's `_linear_pointwise`
                # lays the kernel's first operand out contiguously, a dY-sized copy; MKL reads dY^T in place, ~1.1x
                # slower at this shape.
                gw = torch.mm(gy2.t(), x2)
            else:
                # dY^T (out, m) @ X (m, in): dY^T is laid out by torch (contiguous), X^T is read as a view.
                gw = op(gy2.t(), x2.t(), None, "none", [], "")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy2.sum(0)
        return gx, gw, gb


def _plain(t: Tensor, dtype: torch.dtype) -> bool:
    return type(t) in (torch.nn.Parameter, Tensor) and t.dtype == dtype and t.device.type == "cpu"


def _covered(x: Tensor, w: Tensor, b: Tensor | None, dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN computes this product: plain contiguous `dtype` CPU weight and bias (the kernel reads them as
    dense), a plain `dtype` CPU input of 2+ dimensions and some rows, no autocast, oneDNN enabled."""
    return (
        x.dim() >= 2
        and x.numel() > 0
        and type(x) is Tensor
        and _plain(x, dtype)
        and _plain(w, dtype)
        and w.is_contiguous()
        and (b is None or (_plain(b, dtype) and b.is_contiguous()))
        and not torch.is_autocast_enabled("cpu")
        and torch.backends.mkldnn.enabled
    )


#: A module's weight laid out in oneDNN's blocked format for no-grad products, with the (data_ptr, _version) of
#: the weight it was packed from: a weight written in place (a sync's `copy_`) or replaced is packed anew at its
#: next use. Kept outside the module (not in its state, not pickled); an entry goes with its module.
_PACKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[int, int], Tensor]] = weakref.WeakKeyDictionary()


def _packed(module: torch.nn.Module, w: Tensor) -> Tensor:
    key = (w.data_ptr(), w._version)
    hit = _PACKED.get(module)
    if hit is None or hit[0] != key:
        # The stale copy goes first, both its references (this local and the dict's): never two copies at once.
        hit = None
        _PACKED.pop(module, None)
        hit = _PACKED[module] = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), None))
    return hit[1]


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the prepacked copies of `model`'s layers (a second copy of each packed weight)."""
    return sum(hit[1].numel() * hit[1].element_size() for m in model.modules() if (hit := _PACKED.get(m)) is not None)


def drop_packed(model: torch.nn.Module) -> None:
    """Free the prepacked copies of `model`'s layers (an engine asleep at level 2: its weights are gone too); the
    next product packs its weight anew."""
    for m in model.modules():
        _PACKED.pop(m, None)


def onednn_forward(self: torch.nn.Linear, x: Tensor, skinny_rows: int = 0, prepack: bool = False) -> Tensor:
    """nn.Linear.forward: x (..., in) -> (..., out), through oneDNN where `_covered`, else `F.linear`."""
    w, b = self.weight, self.bias
    op = _op()
    if op is None or not _covered(x, w, b):
        return torch.nn.functional.linear(x, w, b)
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
    if grad:
        return OneDNNLinear.apply(x, w, b)
    if skinny_rows and x.numel() // x.shape[-1] <= skinny_rows:
        return _skinny.skinny_forward(self, x)
    return op(x, _packed(self, w) if prepack else w, b, "none", [], "")


def use_onednn_linears(model: torch.nn.Module, skinny_rows: int = 0, prepack: bool = False) -> int:
    """Switch the plain nn.Linear layers of a model whose weights are fp32 on CPU to `onednn_forward`; returns how
    many were switched (0 where this torch has no oneDNN inner product). `prepack=True` (an inference engine's
    weights, which change only at syncs) runs no-grad products on a blocked copy of each weight (`_PACKED`), if the
    switched weights total at most `PREPACK_MAX_BYTES`."""
    if onednn_linear_op() is None:
        return 0
    linears = cpu_linears(model)
    prepack = prepack and sum(m.weight.numel() * 4 for m in linears) <= PREPACK_MAX_BYTES
    for module in linears:
        # a partial pickles; a bound method does not
        module.forward = functools.partial(onednn_forward, module, skinny_rows=skinny_rows, prepack=prepack)
    return len(linears)


def packed_bf16_forward(self: torch.nn.Linear, x: Tensor) -> Tensor:
    """nn.Linear.forward of a bf16 inference layer: x (..., in) -> (..., out) on the prepacked weight where no
    gradient is asked and `_covered` in bf16, else `F.linear`."""
    w, b = self.weight, self.bias
    op = _op()
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad))
    if op is None or grad or not _covered(x, w, b, torch.bfloat16):
        return torch.nn.functional.linear(x, w, b)
    return op(x, _packed(self, w), b, "none", [], "")


def use_packed_bf16_linears(model: torch.nn.Module) -> int:
    """Switch the plain nn.Linear layers of a model whose weights are bf16 on CPU to `packed_bf16_forward` (an
    inference engine's: the packed copies are renewed after a weight changes, as in fp32); returns how many were
    switched (0 where this torch has no oneDNN inner product, or the weights exceed `PREPACK_MAX_BYTES`). Call it
    only where the CPU computes bf16 natively (roll_hw.cpu.cpu_bf16_instructions())."""
    linears = cpu_linears(model, torch.bfloat16)
    if onednn_linear_op() is None or sum(m.weight.numel() * 2 for m in linears) > PREPACK_MAX_BYTES:
        return 0
    for module in linears:
        module.forward = functools.partial(packed_bf16_forward, module)  # a partial pickles; a bound method not
    return len(linears)
