"""Fused feed-forward block: ff.ffn and ff.swiglu_ffn, custom ops, autograd, backend wiring.

One call, top to bottom:
  ff.ffn / ff.swiglu_ffn                                          checks (below)
    -> torch.ops.fastformer.ffn_fwd (or the eager Function, see ops/_common.py)
    -> backends.select(Call("ffn" | "swiglu", ...))
    -> _C.ffn_fwd (cpu: csrc/cpu/ffn.cpp) | ops/ffn_triton.py (triton_kernels/ffn.py)
       | reference/ffn.py

The gated variant is the same op with ``w_up`` given (w1/b1 = gate, w2/b2 = down). Saved for
the backward: x, the weights and the pre-activation (gated: [gate | up] as one (N, 2F) tensor)
in x's dtype, never the post-activation; the backward recomputes act() from it. Dropout keeps
only (seed, offset) and regenerates its mask (reference/rng.py, element index n * F + f).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _checks, _ext, backends
from ..reference import ffn as ref
from ..reference.ffn import ACTIVATIONS
from ..reference.rng import draw_rng_state
from ._common import LazyLaunchers, needs_grad, rowwise, via_custom_op

_ACT_CODE = {name: code for code, name in enumerate(ACTIVATIONS)}
_NO_GRADS = (False,) * 7


# ---- dispatch -------------------------------------------------------------------------------
def _uniform_rows(t: Tensor) -> bool:
    """Whether t viewed as (-1, t.shape[-1]) has one row stride (a view, no copy)."""
    expected = None
    for size, st in reversed(list(zip(t.shape[:-1], t.stride()[:-1]))):
        if size == 1:
            continue
        if expected is not None and st != expected:
            return False
        expected = st * size
    return True


def _call(x: Tensor, hidden: int, has_bias: bool, gated: bool, dropout_p: float) -> backends.Call:
    f = set()
    if has_bias:
        f.add("bias")
    if dropout_p > 0:
        f.add("dropout")
    if not x.is_contiguous():
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            f.add("last_dim_strided")
        if not _uniform_rows(x):
            f.add("rows_strided")
    return backends.Call("swiglu" if gated else "ffn", x.device.type, x.dtype, frozenset(f),
                         hidden=hidden, size=x.numel())


def _seed_offset(rng_state: Optional[Tensor]):
    if rng_state is None:
        return 0, 0
    seed, offset = rng_state.tolist()
    return int(seed), int(offset)


# ---- backend implementations ----------------------------------------------------------------
class _VendorGemmImpl:
    """GEMMs through the vendor library (torch.addmm / mm: cuBLAS on CUDA, oneDNN on CPU, the
    bias in its epilogue) and the activation / gate as one elementwise step on the GEMM output,
    forward and backward, with the hooks below. Dropout is not taken here. Gated: the gate and
    up GEMMs write the two halves of one (N, 2F) buffer, the layout every backend saves."""

    # elementwise hooks: h = act(pre); d_pre = dh * act'(pre); h = act(g) * u; (dg, du)
    act_fwd = act_bwd = gated_fwd = gated_bwd = None

    @staticmethod
    def _linear(a, w, b, out=None):
        if b is not None:
            return torch.addmm(b, a, w.t(), out=out)
        return torch.mm(a, w.t(), out=out)

    @classmethod
    def fwd(cls, x, w1, b1, w2, b2, w_up, b_up, act, dropout_p, rng_state, save_preactivation):
        x2 = x.reshape(-1, x.shape[-1])
        lin = cls._linear
        if w_up is None:
            pre = lin(x2, w1, b1)
            h = cls.act_fwd(pre, act)
        else:
            F_ = w1.shape[0]
            pre = x2.new_empty((x2.shape[0], 2 * F_))  # [gate | up]
            gate, up = pre[:, :F_], pre[:, F_:]
            lin(x2, w1, b1, out=gate)  # strided outputs: the GEMM writes them with ldc = 2F
            lin(x2, w_up, b_up, out=up)
            h = cls.gated_fwd(gate, up, act)
        y = lin(h, w2, b2).reshape(x.shape)
        return y, (pre if save_preactivation else x.new_empty((0,)))

    @classmethod
    def bwd(cls, dy, x, w1, w2, w_up, saved, act, dropout_p, rng_state, needs):
        x2 = x.reshape(-1, x.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1])
        F_ = w1.shape[0]
        empty = x.new_empty((0,))
        dh = dy2 @ w2
        if w_up is None:
            h = cls.act_fwd(saved, act)
            d_pre = cls.act_bwd(dh, saved, act)
            d_up = None
        else:
            gate, up = saved[:, :F_], saved[:, F_:]
            h = cls.gated_fwd(gate, up, act)
            d_pre, d_up = cls.gated_bwd(dh, gate, up, act)
        dx = empty
        if needs[0]:
            dx = d_pre @ w1
            if d_up is not None:
                dx = dx.addmm_(d_up, w_up)
            dx = dx.reshape(x.shape)
        grads = [dx,
                 d_pre.t() @ x2 if needs[1] else empty,
                 d_pre.sum(0) if needs[2] else empty,
                 dy2.t() @ h if needs[3] else empty,
                 dy2.sum(0) if needs[4] else empty,
                 d_up.t() @ x2 if d_up is not None and needs[5] else empty,
                 d_up.sum(0) if d_up is not None and needs[6] else empty]
        return tuple(grads)


class _CudaImpl(_VendorGemmImpl):
    """cuda: cuBLAS GEMMs, the activation / gate fused in one kernel (csrc/cuda/ffn_epilogue.cu).
    Dropout goes to triton (select())."""

    act_fwd = staticmethod(lambda pre, act: _ext.C.ffn_bias_act_fwd(pre, None, act))
    act_bwd = staticmethod(lambda dh, pre, act: _ext.C.ffn_bias_act_bwd(dh, pre, None, act, False)[0])
    gated_fwd = staticmethod(lambda g, u, act: _ext.C.ffn_gated_act_fwd(g, u, act))
    gated_bwd = staticmethod(lambda dh, g, u, act: tuple(_ext.C.ffn_gated_act_bwd(dh, g, u, act)))


def _act_bwd_torch(dh: Tensor, pre: Tensor, act: int) -> Tensor:
    """dh * act'(pre) with torch's fused backward ops (fp32 inside, one rounding)."""
    if act == 0:
        return torch.ops.aten.threshold_backward(dh, pre, 0)
    if act in (1, 2):
        return torch.ops.aten.gelu_backward(dh, pre, approximate="none" if act == 1 else "tanh")
    return torch.ops.aten.silu_backward(dh, pre)


class _CpuAmxImpl(_VendorGemmImpl):
    """cpu, bf16 on CPUs with AMX-BF16 (the avx512 kernels with AMX on, `ff.info()`), without
    dropout: torch's bf16 GEMMs run on AMX tiles (oneDNN, ~1-1.5 TFLOP/s on this 2-core Xeon),
    4-7x the fp32 FMAs of csrc/cpu/ffn.cpp's packed GEMM, so the GEMMs go there and the
    activation / gate are torch's elementwise ops. Saves what the fused kernel saves (the
    pre-activation, never act(pre)); h is rounded to bf16 before the second GEMM, as eager
    PyTorch's is."""

    act_fwd = staticmethod(lambda pre, act: ref.activation(pre, act))
    act_bwd = staticmethod(_act_bwd_torch)
    gated_fwd = staticmethod(lambda g, u, act: ref.activation(g, act) * u)
    gated_bwd = staticmethod(lambda dh, g, u, act: (_act_bwd_torch(dh * u, g, act),
                                                    dh * ref.activation(g, act)))

    @staticmethod
    def takes(x: Tensor, dropout_p: float) -> bool:
        return x.dtype == torch.bfloat16 and dropout_p == 0 and bool(_ext.C.use_amx_bf16())


class _CompiledImpl:
    """cpu: fastformer._C (csrc/cpu/ffn.cpp); bf16 on AMX without dropout: _CpuAmxImpl."""

    @staticmethod
    def fwd(x, w1, b1, w2, b2, w_up, b_up, act, dropout_p, rng_state, save_preactivation):
        if _CpuAmxImpl.takes(x, dropout_p):
            return _CpuAmxImpl.fwd(x, w1, b1, w2, b2, w_up, b_up, act, dropout_p, rng_state,
                                   save_preactivation)
        seed, offset = _seed_offset(rng_state)
        y, saved = _ext.C.ffn_fwd(x, w1, b1, w2, b2, w_up, b_up, act, dropout_p, seed, offset,
                                  save_preactivation)
        return y, saved

    @staticmethod
    def bwd(dy, x, w1, w2, w_up, saved, act, dropout_p, rng_state, needs):
        if _CpuAmxImpl.takes(x, dropout_p):
            return _CpuAmxImpl.bwd(dy, x, w1, w2, w_up, saved, act, dropout_p, rng_state, needs)
        seed, offset = _seed_offset(rng_state)
        return tuple(_ext.C.ffn_bwd(dy, x, w1, w2, w_up, saved, act, dropout_p, seed, offset,
                                    *needs))


_TritonImpl = LazyLaunchers(".ffn_triton", "ffn_fwd", "ffn_bwd")


class _ReferenceImpl:
    fwd = staticmethod(ref.ffn_fwd)
    bwd = staticmethod(ref.ffn_bwd)


def register_impls() -> None:
    for op in ("ffn", "swiglu"):
        backends.register_impl(op, "reference", _ReferenceImpl)
        if _ext.C is not None and hasattr(_ext.C, "ffn_fwd"):
            backends.register_impl(op, "cpu", _CompiledImpl)
        if _ext.C is not None and hasattr(_ext.C, "ffn_bias_act_fwd"):
            backends.register_impl(op, "cuda", _CudaImpl)
        import importlib.util
        if importlib.util.find_spec("fastformer.ops.ffn_triton") is not None:
            backends.register_impl(op, "triton", _TritonImpl)


register_impls()


def _fwd_impl(x, w1, b1, w2, b2, w_up, b_up, act, dropout_p, rng_state, save_preactivation):
    has_bias = b1 is not None or b2 is not None or b_up is not None
    chosen = backends.select(_call(x, w1.shape[0], has_bias, w_up is not None, dropout_p))
    impl = chosen.impls["swiglu" if w_up is not None else "ffn"]
    return chosen, impl.fwd(x, w1, b1, w2, b2, w_up, b_up, act, dropout_p, rng_state,
                            save_preactivation)


# ---- custom ops (torch.compile / export route) ----------------------------------------------
@torch.library.custom_op("fastformer::ffn_fwd", mutates_args=())
def ffn_fwd_op(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
               w_up: Optional[Tensor], b_up: Optional[Tensor], activation: int,
               dropout_p: float, rng_state: Optional[Tensor],
               save_preactivation: bool) -> tuple[Tensor, Tensor]:
    y, saved = _fwd_impl(x, w1, b1, w2, b2, w_up, b_up, activation, dropout_p, rng_state,
                         save_preactivation)[1]
    return y, saved


@ffn_fwd_op.register_fake
def _(x, w1, b1, w2, b2, w_up, b_up, activation, dropout_p, rng_state, save_preactivation):
    tokens = x.numel() // x.shape[-1]
    width = w1.shape[0] * (2 if w_up is not None else 1)
    saved = x.new_empty((tokens, width)) if save_preactivation else x.new_empty((0,))
    return x.new_empty(x.shape), saved


@torch.library.custom_op("fastformer::ffn_bwd", mutates_args=())
def ffn_bwd_op(dy: Tensor, x: Tensor, w1: Tensor, w2: Tensor, w_up: Optional[Tensor],
               saved: Tensor, activation: int, dropout_p: float, rng_state: Optional[Tensor],
               has_bias: bool,
               needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # has_bias: only so that selection sees the forward's features
    chosen = backends.select(_call(x, w1.shape[0], has_bias, w_up is not None, dropout_p))
    impl = chosen.impls["swiglu" if w_up is not None else "ffn"]
    return tuple(impl.bwd(rowwise(dy), x, w1, w2, w_up, saved, activation, dropout_p, rng_state,
                          tuple(needs)))


@ffn_bwd_op.register_fake
def _(dy, x, w1, w2, w_up, saved, activation, dropout_p, rng_state, has_bias, needs):
    F_, D = w1.shape
    shapes = [x.shape, (F_, D), (F_,), (D, F_), (D,), (F_, D), (F_,)]
    return tuple(x.new_empty(s if need else (0,)) for s, need in zip(shapes, needs))


def _needs(ctx, has_b1, has_b2, has_up, has_b_up) -> tuple:
    """needs_input_grad of (x, w1, b1, w2, b2, w_up, b_up) -> the 7 flags of the bwd kernels."""
    n = ctx.needs_input_grad
    return (n[0], n[1], has_b1 and n[2], n[3], has_b2 and n[4], has_up and n[5],
            has_b_up and n[6])


def _save(ctx, x, w1, b1, w2, b2, w_up, b_up, activation, dropout_p, rng_state, saved):
    ctx.save_for_backward(x, w1, w2, w_up, saved, rng_state)
    ctx.activation, ctx.dropout_p = activation, dropout_p
    ctx.has = (b1 is not None, b2 is not None, w_up is not None, b_up is not None)


def _grads(ctx, dy, bwd):
    x, w1, w2, w_up, saved, rng_state = ctx.saved_tensors
    needs = _needs(ctx, *ctx.has)
    grads = bwd(dy, x, w1, w2, w_up, saved, ctx.activation, ctx.dropout_p, rng_state, needs)
    out = tuple(g if need else None for g, need in zip(grads, needs))
    return out + (None,) * 4


def _setup_context(ctx, inputs, output):
    x, w1, b1, w2, b2, w_up, b_up, activation, dropout_p, rng_state, _ = inputs
    _save(ctx, x, w1, b1, w2, b2, w_up, b_up, activation, dropout_p, rng_state, output[1])


def _op_backward(ctx, dy, _dsaved):
    has_bias = ctx.has[0] or ctx.has[1] or ctx.has[3]

    def bwd(dy, x, w1, w2, w_up, saved, act, p, rng_state, needs):
        return ffn_bwd_op(dy, x, w1, w2, w_up, saved, act, p, rng_state, has_bias, list(needs))
    return _grads(ctx, dy, bwd)


ffn_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


class _FFNFunction(torch.autograd.Function):
    """Eager route: same implementations as the custom ops, fewer dispatcher round trips."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, w_up, b_up, activation, dropout_p, rng_state):
        backend, (y, saved) = _fwd_impl(x, w1, b1, w2, b2, w_up, b_up, activation, dropout_p,
                                        rng_state, True)
        _save(ctx, x, w1, b1, w2, b2, w_up, b_up, activation, dropout_p, rng_state, saved)
        ctx.backend, ctx.dispatch = backend, backends.last_dispatch()
        return y

    @staticmethod
    def backward(ctx, dy):
        backends.record(ctx.dispatch)  # the forward's backend runs the backward
        impl = ctx.backend.impls["swiglu" if ctx.has[2] else "ffn"]

        def bwd(dy, *rest):
            return impl.bwd(rowwise(dy), *rest)
        return _grads(ctx, dy, bwd)[:10]


# ---- public API ---------------------------------------------------------------------------
def _check_linear(fn: str, x: Tensor, pairs) -> None:
    """pairs: (name, tensor, expected shape, what the shape means, optional)."""
    for name, t, shape, why, optional in pairs:
        _checks.tensor(fn, name, t, optional=optional)
        if t is None:
            continue
        _checks.same_device(fn, "x", x, **{name: t})
        _checks.same_dtype(fn, "x", x, **{name: t})
        if t.dim() != len(shape):
            raise ValueError(f"{fn}: `{name}` must be {len(shape)}-D with shape {shape}{why}, "
                             f"got {t.dim()}-D with shape {tuple(t.shape)}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{fn}: `{name}` must have shape {tuple(shape)}{why} to match `x` "
                             f"of shape {tuple(x.shape)} (d_model = its last dim), got "
                             f"{tuple(t.shape)}")


def _check_x(fn: str, x) -> int:
    _checks.tensor(fn, "x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{fn}: `x` must have shape (..., d_model) with d_model >= 1, got "
                         f"{tuple(x.shape)}")
    return x.shape[-1]


def _check_activation(fn: str, activation) -> int:
    if not isinstance(activation, str) or activation not in _ACT_CODE:
        raise ValueError(f"{fn}: `activation` must be one of {', '.join(map(repr, ACTIVATIONS))}; "
                         f"got {activation!r}")
    return _ACT_CODE[activation]


def _weight_rows(fn: str, name: str, w, what: str) -> int:
    _checks.tensor(fn, name, w)
    if w.dim() != 2 or w.shape[0] < 1:
        raise ValueError(f"{fn}: `{name}` must be 2-D ({what}, d_model) in nn.Linear's "
                         f"(out_features, in_features) layout, got shape {tuple(w.shape)}")
    return w.shape[0]


def _run(x, w1, b1, w2, b2, w_up, b_up, act: int, dropout_p: float) -> Tensor:
    rng_state = draw_rng_state() if dropout_p > 0 else None
    if via_custom_op(x, w1, b1, w2, b2, w_up, b_up):
        save = needs_grad(x, w1, b1, w2, b2, w_up, b_up)
        y, _ = ffn_fwd_op(x, w1, b1, w2, b2, w_up, b_up, act, dropout_p, rng_state, save)
        return y
    if needs_grad(x, w1, b1, w2, b2, w_up, b_up):
        return _FFNFunction.apply(x, w1, b1, w2, b2, w_up, b_up, act, dropout_p, rng_state)
    return _fwd_impl(x, w1, b1, w2, b2, w_up, b_up, act, dropout_p, rng_state, False)[1][0]


def ffn(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
        activation: str = "relu", dropout_p: float = 0.0) -> Tensor:
    """``Linear -> activation -> dropout -> Linear`` with the bias and activation fused into the
    GEMMs: ``y = dropout(act(x @ w1.T + b1)) @ w2.T + b2``.

    Args:
        x: (..., d_model) float16/bfloat16/float32/float64, any leading dims and strides.
        w1: (dim_feedforward, d_model), b1: (dim_feedforward,) or None (``nn.Linear`` layout).
        w2: (d_model, dim_feedforward), b2: (d_model,) or None. All in x's dtype and device.
        activation: ``"relu"``, ``"gelu"`` (exact erf, torch's default), ``"gelu_tanh"``,
            ``"silu"``.
        dropout_p: dropout on the hidden activation, in [0, 1) (applied whenever > 0, like
            ``F.dropout(training=True)``; modules pass 0 in eval mode). The mask comes from a
            counter-based RNG seeded from torch's default generator (torch.manual_seed
            reproduces it) and is regenerated, not stored, for the backward.

    Returns:
        (..., d_model) in x's dtype. With autograd, only the pre-activation (..., dim_feedforward)
        is saved besides x and the weights; act() is recomputed in the backward.
    """
    fn = "ffn"
    D = _check_x(fn, x)
    F_ = _weight_rows(fn, "w1", w1, "dim_feedforward")
    _check_linear(fn, x, [
        ("w1", w1, (F_, D), " (dim_feedforward, d_model)", False),
        ("b1", b1, (F_,), " (dim_feedforward,)", True),
        ("w2", w2, (D, F_), " (d_model, dim_feedforward)", False),
        ("b2", b2, (D,), " (d_model,)", True)])
    act = _check_activation(fn, activation)
    dropout_p = _checks.number(fn, "dropout_p", dropout_p, lo=0.0, hi=1.0, hi_open=True)
    return _run(x, w1, b1, w2, b2, None, None, act, dropout_p)


def swiglu_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
               b_gate: Optional[Tensor] = None, b_up: Optional[Tensor] = None,
               b_down: Optional[Tensor] = None, activation: str = "silu") -> Tensor:
    """Gated feed-forward: ``y = (act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)) @ w_down.T
    + b_down``: SwiGLU with ``"silu"``, GeGLU with ``"gelu"`` / ``"gelu_tanh"``, ReGLU with
    ``"relu"``.

    Args:
        x: (..., d_model), any leading dims and strides.
        w_gate, w_up: (hidden, d_model); w_down: (d_model, hidden) (``nn.Linear`` layout);
            b_gate, b_up: (hidden,) or None; b_down: (d_model,) or None. x's dtype and device.
        activation: as :func:`ffn`.

    Returns:
        (..., d_model). The two gated projections run as one GEMM; with autograd the gate and up
        projections are saved (2 tensors of (..., hidden), eager keeps 4).
    """
    fn = "swiglu_ffn"
    D = _check_x(fn, x)
    F_ = _weight_rows(fn, "w_gate", w_gate, "hidden")
    _check_linear(fn, x, [
        ("w_gate", w_gate, (F_, D), " (hidden, d_model)", False),
        ("w_up", w_up, (F_, D), " (hidden, d_model), the shape of `w_gate`", False),
        ("w_down", w_down, (D, F_), " (d_model, hidden)", False),
        ("b_gate", b_gate, (F_,), " (hidden,)", True),
        ("b_up", b_up, (F_,), " (hidden,)", True),
        ("b_down", b_down, (D,), " (d_model,)", True)])
    act = _check_activation(fn, activation)
    return _run(x, w_gate, b_gate, w_down, b_down, w_up, b_up, act, 0.0)


__all__ = ["ffn", "swiglu_ffn", "ACTIVATIONS"]
