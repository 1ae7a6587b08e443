"""Fused residual-add + LayerNorm / RMSNorm: public functions, op definition, backends.

One call, top to bottom:
  ff.add_layer_norm / ff.layer_norm / ff.rms_norm      checks (below), NormOptions
    -> ADD_NORM((x, residual, weight, bias), o)       ops/_opdef.py (eager Function, the C++
                                                      autograd node of the cpu backend, or the
                                                      custom ops fastformer::add_norm_fwd/_bwd)
    -> backends.select(Call("add_norm", ...))          the first Impl below that takes it
    -> _C.add_norm_fwd (cpu: csrc/cpu/norm.cpp) | _C.cuda_add_norm_fwd (csrc/cuda/norm.cu)
       | triton_kernels/norm.py | reference/norm.py

Saved for the backward: mean and rstd (fp32; fp64 for fp64 inputs) and the tensors z is
recomputed from: ``residual_out`` when it was returned (the pre-norm residual stream the caller
keeps anyway), else ``x`` and ``residual``. The backward returns one tensor dz for both dx and
dresidual.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _checks, backends
from ..backends import Impl
from ..reference import norm as ref
from ._opdef import OpDef, Options, compiled, options, rowwise

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


def _features(x: Tensor, residual) -> frozenset:
    f = set()
    for t in (x, residual):
        if t is None or t.is_contiguous():
            continue
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            f.add("last_dim_strided")
        elif _uniform_row_stride(t) is None:
            f.add("rows_strided")
    return frozenset(f)


@options
class NormOptions(Options):
    """The options of one add+norm call (csrc/options.h mirrors the fields)."""

    eps: float = 1e-5
    rms: bool = False                # RMSNorm: no mean subtraction, no bias
    return_residual: bool = False    # also return x + residual (the pre-norm residual stream)


_call_cache: dict = {}


def _call(inputs, o: NormOptions) -> backends.Call:
    """The Call for select(); contiguous inputs hit a cache (building one costs ~15 us)."""
    x, residual, weight, bias = inputs
    contiguous = x.is_contiguous() and (residual is None or residual.is_contiguous())
    if contiguous:
        key = (x.device.type, x.dtype, x.shape[-1], residual is None, weight is None,
               bias is None, o.rms, o.return_residual)
        call = _call_cache.get(key)
        if call is not None:
            return call
    present = {name for name, t in zip(("residual", "weight", "bias"), inputs[1:]) if t is not None}
    call = backends.Call("add_norm", x.device.type, x.dtype, o.set_fields(),
                         _features(x, residual) | present, hidden=x.shape[-1])
    if contiguous and len(_call_cache) < 4096:
        _call_cache[key] = call
    return call


def _save(inputs, o: NormOptions, outputs):
    """z = x + residual is recomputed from what the caller keeps anyway: the returned residual
    stream, else x and residual. The bias only tells the gradients' dtype."""
    x, residual, weight, bias = inputs
    _, res_out, mean, rstd = outputs
    if residual is not None and o.return_residual:
        return res_out, None, weight, bias, mean, rstd
    return x, residual, weight, bias, mean, rstd


def _stats_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _fake_fwd(x, residual, weight, bias, o):
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    y = x.new_empty(x.shape)
    res_out = x.new_empty(x.shape) if (o.return_residual and residual is not None) else x.new_empty((0,))
    mean = x.new_empty((0,) if o.rms else (rows,), dtype=_stats_dtype(x))
    return y, res_out, mean, x.new_empty((rows,), dtype=_stats_dtype(x))


def _grad_plan(saved, needs):
    """(need d weight, need d bias, the dtype of the parameter gradients)."""
    z_a, _, weight, bias = saved[:4]
    params = weight if weight is not None else bias
    return (weight is not None and needs[2], bias is not None and needs[3],
            params.dtype if params is not None else z_a.dtype)


def _fake_bwd(grads, saved, o, needs):
    z_a = saved[0]
    need_dw, need_db, param_dtype = _grad_plan(saved, needs)
    hidden = z_a.shape[-1]
    dw = z_a.new_empty((hidden,) if need_dw else (0,), dtype=param_dtype)
    db = z_a.new_empty((hidden,) if need_db else (0,), dtype=param_dtype)
    return z_a.new_empty(z_a.shape), None, dw, db


def _dres_out(grads, o: NormOptions):
    """The gradient of the returned residual stream, None when it was not returned."""
    dres = grads[1] if len(grads) > 1 else None
    if dres is None or not o.return_residual or dres.numel() == 0:
        return None
    return dres


# d residual is d x (one tensor, dz).
ADD_NORM = OpDef("add_norm", inputs=("x", "residual?", "weight?", "bias?"), options=NormOptions,
                 outputs=("y", "residual_out", "mean", "rstd"), visible=2, save=_save,
                 fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, call=_call, grad_aliases={1: 0})

_NORM_FEATURES = frozenset({"residual", "weight", "bias"})
_NORM_OPTIONS = frozenset({"eps", "rms", "return_residual"})


# ---- implementations ------------------------------------------------------------------------
class _Compiled(Impl):
    """cpu and cuda: fastformer._C (csrc/cpu/norm.cpp, csrc/cuda/norm.cu); fwd is the _C
    function itself, bwd_kernel the backward's."""

    options = _NORM_OPTIONS

    def bwd(self, grads, saved, o, needs):
        z_a, z_b, weight, _, mean, rstd = saved
        need_dw, need_db, param_dtype = _grad_plan(saved, needs)
        dz, dw, db = self.bwd_kernel(
            rowwise(grads[0]), rowwise(_dres_out(grads, o)), z_a, z_b, weight, mean, rstd,
            o.rms, need_dw, need_db, _DTYPE_CODE[param_dtype])
        return dz, None, dw, db


@ADD_NORM.implementation
class _Cuda(_Compiled):
    backend = "cuda"
    dtypes = backends.GPU_FLOAT
    features = _NORM_FEATURES
    fwd, bwd_kernel = compiled("cuda_add_norm_fwd"), compiled("cuda_add_norm_bwd")


@ADD_NORM.implementation
class _Triton(Impl):
    """Launchers of triton_kernels/norm.py."""

    backend = "triton"
    dtypes = backends.GPU_FLOAT
    options = _NORM_OPTIONS
    features = _NORM_FEATURES
    max_hidden = 16384

    def fwd(self, x, residual, weight, bias, o):
        from ..triton_kernels import norm as tk
        rms = o.rms
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        store_res = o.return_residual and residual is not None
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
                rows, hidden, o.eps,
                HAS_RESIDUAL=residual is not None, STORE_RESIDUAL=store_res,
                HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, RMS=rms, **cfg)
        return y, res_out, mean, rstd

    def bwd(self, grads, saved, o, needs):
        from ..triton_kernels import norm as tk
        z_a, z_b, weight, _, mean, rstd = saved
        need_dw, need_db, param_dtype = _grad_plan(saved, needs)
        dy, dres_out, rms = grads[0], _dres_out(grads, o), o.rms
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
        return dz, None, dw, db


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@ADD_NORM.implementation
class _Cpu(_Compiled):
    backend = "cpu"
    features = _NORM_FEATURES | {"rows_strided"}
    fwd, bwd_kernel = compiled("add_norm_fwd"), compiled("add_norm_bwd")
    # The same kernels behind a C++ autograd node (csrc/cpu/bindings/norm.h): no Python in the
    # forward's bookkeeping or the backward (~0.1-0.2 ms per step on small rows).
    autograd = compiled("add_norm_autograd")


def _contiguous_rows(x: Tensor, residual):
    return x.contiguous(), None if residual is None else residual.contiguous()


@ADD_NORM.implementation
class _CpuStridedRows(_Cpu):
    """cpu for an x or residual whose last dim is strided, on contiguous copies of them (what
    torch's layer_norm does inside): a channels-first activation seen as (..., hidden), as
    SigLIP's residual stream is (its patch embedding's conv output transposed, (4, 196, 768)
    with strides (150528, 1, 196), a layout every residual add after it keeps). The reference
    path took 1.1-1.3 ms per bf16 LayerNorm of it on the 2-core Xeon (torch's 0.38)."""

    name = "cpu (strided rows copied to contiguous)"
    features = _Cpu.features | {"last_dim_strided"}

    def fwd(self, x, residual, weight, bias, o):
        return _Cpu.fwd(*_contiguous_rows(x, residual), weight, bias, o)

    def autograd(self, x, residual, weight, bias, o):
        return _Cpu.autograd(*_contiguous_rows(x, residual), weight, bias, o)

    def bwd(self, grads, saved, o, needs):
        """The shared Function's and the custom op's backward (torch.compile) save the inputs as
        they came: the kernels read contiguous copies of them too."""
        return super().bwd(grads, (*_contiguous_rows(*saved[:2]), *saved[2:]), o, needs)


@ADD_NORM.implementation
class _Reference(Impl):
    backend = "reference"
    options = backends.EVERY_OPTION
    features = _NORM_FEATURES | {"rows_strided", "last_dim_strided"}

    def fwd(self, x, residual, weight, bias, o):
        return ref.add_norm_fwd(x, residual, weight, bias, o.eps, o.rms, o.return_residual)

    def bwd(self, grads, saved, o, needs):
        z_a, z_b, weight, _, mean, rstd = saved
        need_dw, need_db, param_dtype = _grad_plan(saved, needs)
        dz, dw, db = ref.add_norm_bwd(grads[0], _dres_out(grads, o), z_a, z_b, weight, mean,
                                      rstd, o.rms, need_dw, need_db, param_dtype)
        return dz, None, dw, db


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
    o = NormOptions(eps=eps, rms=rms, return_residual=return_residual)
    y, res_out = ADD_NORM((x, residual, weight, bias), o)
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
