"""Fused residual-add + LayerNorm / RMSNorm: public functions, launchers, custom ops, autograd.

One call, top to bottom:
  ff.add_layer_norm / ff.layer_norm / ff.rms_norm      (checks, below)
    -> torch.ops.fastformer.add_norm_fwd (or the eager Function, see ops/_common.py)
    -> backends.select(Call("add_norm", ...))
    -> _C.add_norm_fwd (cpu, cuda) | _triton_fwd (triton_kernels/norm.py) | reference/norm.py

Saved for the backward: mean and rstd (fp32; fp64 for fp64 inputs) and the tensors z is
recomputed from: ``residual_out`` when it was returned (the pre-norm residual stream the caller
keeps anyway), else ``x`` and ``residual``. The backward returns one tensor dz for both dx and
dresidual.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _checks, _ext, backends
from ..reference import norm as ref
from ._common import needs_grad, rowwise, via_custom_op

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def _uniform_row_stride(t: Tensor) -> Optional[int]:
    """Stride between consecutive rows of t viewed as (-1, t.shape[-1]), or None if the leading
    dims cannot be walked with one stride (e.g. a transposed view)."""
    stride = None
    expected = None
    for size, st in reversed(list(zip(t.shape[:-1], t.stride()[:-1]))):
        if size == 1:
            continue
        if stride is None:
            stride, expected = st, st * size
        elif st != expected:
            return None
        else:
            expected = st * size
    return t.shape[-1] if stride is None else stride


def _features(x: Tensor, residual, weight, bias, rms, return_residual) -> frozenset:
    f = set()
    if residual is not None:
        f.add("residual")
    if weight is not None:
        f.add("weight")
    if bias is not None:
        f.add("bias")
    if rms:
        f.add("rms")
    if return_residual:
        f.add("return_residual")
    for t in (x, residual):
        if t is None or t.is_contiguous():
            continue
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            f.add("last_dim_strided")
        elif _uniform_row_stride(t) is None:
            f.add("rows_strided")
    return frozenset(f)


_call_cache: dict = {}


def _call(x, residual, weight, bias, rms, return_residual) -> backends.Call:
    """The Call for select(); contiguous inputs hit a cache (building one costs ~15 us)."""
    contiguous = x.is_contiguous() and (residual is None or residual.is_contiguous())
    if contiguous:
        key = (x.device.type, x.dtype, x.shape[-1], residual is None, weight is None,
               bias is None, rms, return_residual)
        call = _call_cache.get(key)
        if call is not None:
            return call
    call = backends.Call("add_norm", x.device.type, x.dtype,
                         _features(x, residual, weight, bias, rms, return_residual),
                         hidden=x.shape[-1])
    if contiguous and len(_call_cache) < 4096:
        _call_cache[key] = call
    return call


# ---- backend implementations ----------------------------------------------------------------
class _CompiledImpl:
    """cpu and cuda: fastformer._C (it dispatches on the tensors' device)."""

    @staticmethod
    def fwd(x, residual, weight, bias, eps, rms, return_residual):
        return tuple(_ext.C.add_norm_fwd(x, residual, weight, bias, eps, rms, return_residual))

    @staticmethod
    def bwd(dy, dres_out, z_a, z_b, weight, mean, rstd, rms, need_dw, need_db, param_dtype):
        return tuple(_ext.C.add_norm_bwd(rowwise(dy), None if dres_out is None else rowwise(dres_out),
                                         z_a, z_b, weight, mean, rstd, rms, need_dw, need_db,
                                         _DTYPE_CODE[param_dtype]))


class _TritonImpl:
    """Launchers of triton_kernels/norm.py."""

    @staticmethod
    def fwd(x, residual, weight, bias, eps, rms, return_residual):
        from ..triton_kernels import norm as tk
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        store_res = return_residual and residual is not None
        res_out = torch.empty_like(y) if store_res else x.new_empty((0,))
        stats = dict(dtype=torch.float32, device=x.device)
        mean = torch.empty(0 if rms else rows, **stats)
        rstd = torch.empty(rows, **stats)
        if rows:
            cfg = tk.fwd_config(hidden)
            grid = (triton_cdiv(rows, cfg["BLOCK_ROWS"]),)
            tk.add_norm_fwd_kernel[grid](
                x, _uniform_row_stride(x),
                residual if residual is not None else x,
                _uniform_row_stride(residual) if residual is not None else 0,
                weight if weight is not None else x, bias if bias is not None else x,
                y, res_out if store_res else y, rstd if rms else mean, rstd,
                rows, hidden, eps,
                HAS_RESIDUAL=residual is not None, STORE_RESIDUAL=store_res,
                HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, RMS=rms, **cfg)
        return y, res_out, mean, rstd

    @staticmethod
    def bwd(dy, dres_out, z_a, z_b, weight, mean, rstd, rms, need_dw, need_db, param_dtype):
        from ..triton_kernels import norm as tk
        hidden = z_a.shape[-1]
        rows = z_a.numel() // hidden
        dz = torch.empty(z_a.shape, dtype=z_a.dtype, device=z_a.device)

        def with_stride(t):  # gradients may arrive with any layout; make rows uniform
            if t is None:
                return z_a, 0
            t = rowwise(t)
            stride = _uniform_row_stride(t)
            return (t, stride) if stride is not None else (t.contiguous(), hidden)

        sm_count = (torch.cuda.get_device_properties(z_a.device).multi_processor_count
                    if z_a.is_cuda else 1)
        cfg = tk.bwd_config(hidden, rows, sm_count)
        programs = cfg.pop("programs")
        rows_per_program = cfg.pop("rows_per_program")
        part = dict(dtype=torch.float32, device=z_a.device)
        dw_part = torch.empty((programs, hidden) if need_dw else (0,), **part)
        db_part = torch.empty((programs, hidden) if need_db else (0,), **part)
        if rows:
            (dy_t, dy_s), (dr_t, dr_s) = with_stride(dy), with_stride(dres_out)
            (za_t, za_s), (zb_t, zb_s) = with_stride(z_a), with_stride(z_b)
            tk.add_norm_bwd_kernel[(programs,)](
                dy_t, dy_s, dr_t, dr_s, za_t, za_s, zb_t, zb_s,
                weight if weight is not None else z_a, rstd if rms else mean, rstd, dz,
                dw_part if need_dw else rstd, db_part if need_db else rstd,
                rows, hidden, rows_per_program,
                HAS_DRES=dres_out is not None, HAS_ZB=z_b is not None,
                HAS_WEIGHT=weight is not None, RMS=rms, NEED_DW=need_dw, NEED_DB=need_db, **cfg)
        elif need_dw or need_db:
            dw_part.zero_()
            db_part.zero_()
        empty = z_a.new_empty((0,), dtype=param_dtype)
        dw = dw_part.sum(0, dtype=torch.float64).to(param_dtype) if need_dw else empty
        db = db_part.sum(0, dtype=torch.float64).to(param_dtype) if need_db else empty
        return dz, dw, db


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class _ReferenceImpl:
    fwd = staticmethod(ref.add_norm_fwd)
    bwd = staticmethod(ref.add_norm_bwd)


backends.register_impl("add_norm", "cpu", _CompiledImpl)
backends.register_impl("add_norm", "cuda", _CompiledImpl)
backends.register_impl("add_norm", "triton", _TritonImpl)
backends.register_impl("add_norm", "reference", _ReferenceImpl)


def _fwd_impl(x, residual, weight, bias, eps, rms, return_residual, backend=None):
    chosen = backends.select(_call(x, residual, weight, bias, rms, return_residual), backend)
    return chosen, chosen.impls["add_norm"].fwd(x, residual, weight, bias, eps, rms,
                                                return_residual)


def _bwd_impl(dy, dres_out, z_a, z_b, weight, mean, rstd, rms, need_dw, need_db, param_dtype):
    chosen = backends.select(_call(z_a, z_b, weight, None, rms, False))
    return chosen.impls["add_norm"].bwd(dy, dres_out, z_a, z_b, weight, mean, rstd, rms,
                                        need_dw, need_db, param_dtype)


# ---- custom ops (torch.compile / export route) ----------------------------------------------
@torch.library.custom_op("fastformer::add_norm_fwd", mutates_args=())
def add_norm_fwd_op(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
                    bias: Optional[Tensor], eps: float, rms: bool,
                    return_residual: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(_fwd_impl(x, residual, weight, bias, eps, rms, return_residual)[1])


@add_norm_fwd_op.register_fake
def _(x, residual, weight, bias, eps, rms, return_residual):
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    stat = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.new_empty(x.shape)
    res_out = x.new_empty(x.shape) if (return_residual and residual is not None) else x.new_empty((0,))
    mean = x.new_empty((0,) if rms else (rows,), dtype=stat)
    return y, res_out, mean, x.new_empty((rows,), dtype=stat)


@torch.library.custom_op("fastformer::add_norm_bwd", mutates_args=())
def add_norm_bwd_op(dy: Tensor, dresidual_out: Optional[Tensor], z_a: Tensor, z_b: Optional[Tensor],
                    weight: Optional[Tensor], mean: Tensor, rstd: Tensor, rms: bool,
                    need_dweight: bool, need_dbias: bool,
                    param_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(_bwd_impl(dy, dresidual_out, z_a, z_b, weight, mean, rstd, rms, need_dweight,
                           need_dbias, param_dtype))


@add_norm_bwd_op.register_fake
def _(dy, dresidual_out, z_a, z_b, weight, mean, rstd, rms, need_dweight, need_dbias, param_dtype):
    hidden = z_a.shape[-1]
    dw = z_a.new_empty((hidden,) if need_dweight else (0,), dtype=param_dtype)
    db = z_a.new_empty((hidden,) if need_dbias else (0,), dtype=param_dtype)
    return z_a.new_empty(z_a.shape), dw, db


def _save(ctx, x, residual, weight, bias, rms, return_residual, res_out, mean, rstd, backend):
    if residual is not None and return_residual:
        z_a, z_b = res_out, None
    else:
        z_a, z_b = x, residual
    ctx.save_for_backward(z_a, z_b, weight, mean, rstd)
    ctx.rms = rms
    ctx.has_residual = residual is not None
    ctx.has_bias = bias is not None
    ctx.return_residual = bool(return_residual and residual is not None)
    params = weight if weight is not None else bias
    ctx.param_dtype = params.dtype if params is not None else x.dtype
    ctx.backend = backend


def _grads(ctx, dy, dres_out, bwd):
    z_a, z_b, weight, mean, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_dw = weight is not None and need[2]
    need_db = ctx.has_bias and need[3]
    if dres_out is not None and (not ctx.return_residual or dres_out.numel() == 0):
        dres_out = None
    dz, dw, db = bwd(dy, dres_out, z_a, z_b, weight, mean, rstd, ctx.rms, need_dw, need_db,
                     ctx.param_dtype)
    return (dz, dz if ctx.has_residual else None, dw if need_dw else None,
            db if need_db else None, None, None, None)


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, rms, return_residual = inputs
    _, res_out, mean, rstd = output
    _save(ctx, x, residual, weight, bias, rms, return_residual, res_out, mean, rstd, None)


def _op_backward(ctx, dy, dres_out, _dmean, _drstd):
    return _grads(ctx, dy, dres_out, add_norm_bwd_op)


add_norm_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


class _AddNormFunction(torch.autograd.Function):
    """Eager route of the Python-launched backends (reference, Triton): same implementations
    as the custom ops, fewer dispatcher round trips. `backend` is the one _add_norm selected."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms, return_residual, backend):
        y, res_out, mean, rstd = backend.impls["add_norm"].fwd(x, residual, weight, bias, eps,
                                                              rms, return_residual)
        _save(ctx, x, residual, weight, bias, rms, return_residual, res_out, mean, rstd, backend)
        ctx.dispatch = backends.last_dispatch()
        ctx.mark_non_differentiable(mean, rstd)
        return y, res_out

    @staticmethod
    def backward(ctx, dy, dres_out):
        # The forward's backend runs the backward (it was selected, and validated, for the
        # same tensors); no second selection.
        backends.record(ctx.dispatch)
        return _grads(ctx, dy, dres_out, ctx.backend.impls["add_norm"].bwd) + (None,)


# ---- public API ---------------------------------------------------------------------------
_FLOAT = frozenset(_checks.FLOAT_DTYPES)


def _valid_param(p, x, hidden) -> bool:
    return p is None or (isinstance(p, Tensor) and p.dim() == 1 and p.shape[0] == hidden
                         and (p.dtype is x.dtype or p.dtype is torch.float32)
                         and p.device == x.device)


def _check(fn, x, residual, weight, bias, eps):
    # Fast path: a valid call costs a few attribute reads; the detailed checks below run only
    # to name what is wrong.
    if (isinstance(x, Tensor) and x.dtype in _FLOAT and x.dim() >= 1 and x.shape[-1] >= 1
            and (residual is None or (isinstance(residual, Tensor) and residual.shape == x.shape
                                      and residual.dtype is x.dtype
                                      and residual.device == x.device))
            and _valid_param(weight, x, x.shape[-1]) and _valid_param(bias, x, x.shape[-1])
            and (weight is None or bias is None or weight.dtype is bias.dtype)
            and type(eps) is float and eps >= 0.0):
        return eps
    _checks.tensor(fn, "x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{fn}: `x` must have at least one dimension with a non-zero last "
                         f"(normalized) size, got shape {tuple(x.shape)}")
    hidden = x.shape[-1]
    _checks.tensor(fn, "residual", residual, optional=True)
    _checks.tensor(fn, "weight", weight, optional=True)
    _checks.tensor(fn, "bias", bias, optional=True)
    _checks.same_device(fn, "x", x, residual=residual, weight=weight, bias=bias)
    if residual is not None:
        _checks.shape(fn, "residual", residual, tuple(x.shape), " (the shape of `x`)")
        _checks.same_dtype(fn, "x", x, residual=residual)
    for name, p in (("weight", weight), ("bias", bias)):
        _checks.shape(fn, name, p, (hidden,), " (the last dim of `x`)")
        _checks.param_dtype(fn, name, p, x)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        _checks.same_dtype(fn, "weight", weight, bias=bias)
    return _checks.number(fn, "eps", eps, lo=0.0)


def _add_norm(x, residual, weight, bias, eps, rms, return_residual):
    if via_custom_op(x, residual, weight, bias):
        y, res_out, _, _ = add_norm_fwd_op(x, residual, weight, bias, eps, rms, return_residual)
    elif needs_grad(x, residual, weight, bias):
        chosen = backends.select(_call(x, residual, weight, bias, rms, return_residual))
        if chosen.impls["add_norm"] is _CompiledImpl:
            # The same kernels behind a C++ autograd node (csrc/bindings.cpp): no Python in
            # the forward's bookkeeping or the backward (~0.1-0.2 ms per step on small rows).
            y, res_out = _ext.C.add_norm_autograd(x, residual, weight, bias, eps, rms,
                                                  return_residual)
        else:
            y, res_out = _AddNormFunction.apply(x, residual, weight, bias, eps, rms,
                                                return_residual, chosen)
    else:
        _, (y, res_out, _, _) = _fwd_impl(x, residual, weight, bias, eps, rms, return_residual)
    if not return_residual:
        return y
    return y, (res_out if residual is not None else x)


def add_layer_norm(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
                   bias: Optional[Tensor], eps: float = 1e-5, *, return_residual: bool = False):
    """``y = LayerNorm(x + residual)`` over the last dimension, in one pass over memory.

    Args:
        x: (..., hidden) float16/bfloat16/float32/float64; any leading dims and strides as long
            as the last dim is contiguous (otherwise the reference path runs; see
            ``ff.last_dispatch()``).
        residual: same shape and dtype as ``x``, or None (plain LayerNorm).
        weight, bias: (hidden,) in x's dtype or float32, or None.
        eps: added to the variance (>= 0).
        return_residual: also return ``x + residual`` (rounded to x's dtype, exactly as eager
            ``x + residual``), the residual stream of a pre-norm block.

    Returns:
        ``y``, or ``(y, x + residual)`` when ``return_residual``. Statistics are computed in
        fp32 (fp64 for fp64 inputs); the backward saves only mean and rstd.
    """
    fn = "add_layer_norm"
    eps = _check(fn, x, residual, weight, bias, eps)
    _checks.flag(fn, "return_residual", return_residual)
    return _add_norm(x, residual, weight, bias, eps, False, return_residual)


def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5):
    """``torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)``, fused kernels."""
    eps = _check("layer_norm", x, None, weight, bias, eps)
    return _add_norm(x, None, weight, bias, eps, False, False)


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float = 1e-6, *,
             residual: Optional[Tensor] = None, return_residual: bool = False):
    """``y = (x + residual) / sqrt(mean((x + residual)^2) + eps) * weight`` over the last dim.

    Same conventions as :func:`add_layer_norm` (residual optional, ``return_residual`` returns
    the residual stream). Note the default eps 1e-6 (as in most RMSNorm models); torch's
    ``F.rms_norm`` defaults to ``torch.finfo(dtype).eps``.
    """
    fn = "rms_norm"
    if eps is None:
        eps = torch.finfo(x.dtype).eps if isinstance(x, Tensor) and x.is_floating_point() else 1e-6
    eps = _check(fn, x, residual, weight, None, eps)
    _checks.flag(fn, "return_residual", return_residual)
    return _add_norm(x, residual, weight, None, eps, True, return_residual)


__all__ = ["add_layer_norm", "layer_norm", "rms_norm"]
