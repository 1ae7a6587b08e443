"""Rotary position embedding: ff.apply_rotary, custom op, autograd, backend wiring.

One call, top to bottom:
  ff.apply_rotary (checks, below) / ff.RotaryEmbedding (modules/positional.py)
    -> torch.ops.fastformer.rotary (or the eager Function, see ops/_common.py)
    -> backends.select(Call("rotary", ...))
    -> _C.rotary (cpu: csrc/cpu/rotary.cpp) | triton_kernels/rotary.py | reference/rotary.py

The math is in reference/rotary.py. Nothing is saved for the backward but the tables: the
rotation is orthogonal, so dx is the same kernel run on dy with the opposite angle (conj).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks, _ext, backends
from ..reference import rotary as ref
from ._common import needs_grad, rowwise, via_custom_op


def _call(x: Tensor, interleaved: bool) -> backends.Call:
    features = set()
    if interleaved:
        features.add("interleaved")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        features.add("last_dim_strided")
    return backends.Call("rotary", x.device.type, x.dtype, frozenset(features), head_dim=x.shape[-1])


# ---- backend implementations ----------------------------------------------------------------
class _CompiledImpl:
    @staticmethod
    def run(x, cos, sin, interleaved, conj):
        return _ext.C.rotary(x, cos, sin, interleaved, conj)


class _TritonImpl:
    @staticmethod
    def run(x, cos, sin, interleaved, conj):
        import triton

        from ..triton_kernels import rotary as tk
        B, H, L, D = x.shape
        out = x.new_empty((B, L, H, D)).transpose(1, 2)
        rows = B * H * L
        if rows == 0 or D == 0:
            return out
        cfg = tk.config(D)
        tk.rotary_kernel[(triton.cdiv(rows, cfg["BLOCK_ROWS"]),)](
            x, x.stride(0), x.stride(1), x.stride(2), out, out.stride(0), out.stride(1),
            out.stride(2), cos, sin, rows, H, L, D, cos.shape[1],
            INTERLEAVED=interleaved, CONJ=conj, **cfg)
        return out


class _ReferenceImpl:
    run = staticmethod(ref.rotary)


backends.register_impl("rotary", "reference", _ReferenceImpl)
backends.register_impl("rotary", "triton", _TritonImpl)
if _ext.C is not None and hasattr(_ext.C, "rotary"):
    backends.register_impl("rotary", "cpu", _CompiledImpl)


def _run(x, cos, sin, interleaved, conj, backend=None):
    chosen = backends.select(_call(x, interleaved), backend)
    return chosen, chosen.impls["rotary"].run(x, cos, sin, interleaved, conj)


# ---- custom op (torch.compile / export route) ---------------------------------------------------
@torch.library.custom_op("fastformer::rotary", mutates_args=())
def rotary_op(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, conj: bool) -> Tensor:
    return _run(x, cos, sin, interleaved, conj)[1]


@rotary_op.register_fake
def _(x, cos, sin, interleaved, conj):
    B, H, L, D = x.shape
    return x.new_empty((B, L, H, D)).transpose(1, 2)


def _setup_context(ctx, inputs, output):
    _, cos, sin, interleaved, conj = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved, ctx.conj = interleaved, conj


def _op_backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return rotary_op(rowwise(dy), cos, sin, ctx.interleaved, not ctx.conj), None, None, None, None


rotary_op.register_autograd(_op_backward, setup_context=_setup_context)


class _RotaryFunction(torch.autograd.Function):
    """Eager route: same implementations as the custom op, fewer dispatcher round trips."""

    @staticmethod
    def forward(ctx, x, cos, sin, interleaved, conj):
        backend, out = _run(x, cos, sin, interleaved, conj)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved, ctx.conj, ctx.backend = interleaved, conj, backend
        ctx.dispatch = backends.last_dispatch()
        return out

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        backends.record(ctx.dispatch)  # the forward's backend runs the backward
        dx = ctx.backend.impls["rotary"].run(rowwise(dy), cos, sin, ctx.interleaved, not ctx.conj)
        return dx, None, None, None, None


# ---- public API ---------------------------------------------------------------------------
def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotary position embedding of ``x`` in one pass (RoPE; math in fastformer/reference/rotary.py).

    Args:
        x: (B, H, L, D) float16/bfloat16/float32/float64, any strides with a contiguous last
            dim (e.g. the heads viewed out of a fused QKV projection; nothing is copied).
        cos, sin: (L, R/2) tables of the angles of positions 0..L-1 of ``x``'s rows, R <= D
            even; float32 (float64 for float64 ``x``). Channels R..D-1 pass through unchanged.
            ``ff.RotaryEmbedding`` builds them. They are constants: no gradient reaches them.
        interleaved: rotate pairs (2i, 2i+1) (GPT-J, RoFormer) instead of (i, i + R/2)
            (GPT-NeoX, Llama: the "rotate_half" form, the default).

    Returns:
        (B, H, L, D) in x's dtype (stored as (B, L, H, D)), computed in fp32 and rounded once.
    """
    fn = "apply_rotary"
    _checks.tensor(fn, "x", x, dims=(4,))
    _checks.flag(fn, "interleaved", interleaved)
    acc = ref.acc_dtype(x.dtype)
    for name, t in (("cos", cos), ("sin", sin)):
        _checks.tensor(fn, name, t, dims=(2,), dtypes=(acc,))
    _checks.same_device(fn, "x", x, cos=cos, sin=sin)
    _checks.shape(fn, "sin", sin, tuple(cos.shape), " (the shape of `cos`)")
    L, D = x.shape[2], x.shape[3]
    if cos.shape[0] != L or not 0 < 2 * cos.shape[1] <= D:
        raise ValueError(f"{fn}: `cos` and `sin` must be (L, R/2) = ({L}, R/2) with 0 < R <= "
                         f"D = {D} (x is (B, H, L, D) = {tuple(x.shape)}); got "
                         f"{tuple(cos.shape)}")
    # The tables are (L, R/2), small next to x: copied only if a caller passes strided views.
    cos, sin = cos.contiguous(), sin.contiguous()
    if via_custom_op(x, cos, sin):
        return rotary_op(x, cos, sin, interleaved, False)
    if needs_grad(x):
        return _RotaryFunction.apply(x, cos, sin, interleaved, False)
    return _run(x, cos, sin, interleaved, False)[1]


__all__ = ["apply_rotary"]
