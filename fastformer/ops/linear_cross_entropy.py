"""Fused LM head + cross-entropy: ff.linear_cross_entropy, its op definition and backends.

One call, top to bottom:
  ff.linear_cross_entropy                          checks (below), LinearCrossEntropyOptions
    -> LINEAR_CROSS_ENTROPY((x, weight, bias), o)  ops/_opdef.py (the eager Function below, or
                                                   the custom ops fastformer::
                                                   linear_cross_entropy_fwd/_bwd)
    -> backends.select(Call("linear_cross_entropy", ...))   the first Impl below that takes it
    -> reference/linear_cross_entropy.py: forward / backward_none, the chunk loop with torch's
       GEMMs around a row pass: _C.lce_rows (cpu: csrc/cpu/linear_cross_entropy.cpp) |
       triton_kernels/linear_cross_entropy.py | reference rows()

The algorithm (chunks, the gradients computed in the forward for "mean" / "sum", the
recomputation for "none", d weight's accumulation, memory and traffic) is described in
reference/linear_cross_entropy.py. Saved for the backward: "mean" / "sum", the gradients
themselves (the backward scales them by the upstream scalar); "none", lse (N,) fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _checks, _ext, backends
from ..backends import EVERY_OPTION, GPU_FLOAT, Impl
from ..reference import linear_cross_entropy as ref
from . import linear
from ._opdef import OpDef, Options, options, owned


@options
class LinearCrossEntropyOptions(Options):
    """The options of one call (csrc/options.h mirrors the fields)."""

    target: Optional[Tensor] = None   # (N,) int64 contiguous class indices
    ignore_index: int = -100
    label_smoothing: float = 0.0      # in [0, 1)
    reduction: int = ref.MEAN         # ref.NONE, MEAN, SUM
    softcap: float = 0.0              # > 0: logits = softcap * tanh(logits / softcap)
    grad_x: bool = False              # the gradients the forward prepares ("mean" / "sum":
    grad_weight: bool = False         #   computes) for the backward
    grad_bias: bool = False


def _call(inputs, o: LinearCrossEntropyOptions) -> backends.Call:
    x = inputs[0]
    return backends.Call("linear_cross_entropy", x.device.type, x.dtype, o.set_fields(),
                         hidden=x.shape[-1])


def _save(inputs, o, outputs):
    """(x, weight, bias, lse) for "none" (recomputed backward), else the gradients."""
    x, weight, bias = inputs
    _, dx, dw, db, lse = outputs
    if o.reduction == ref.NONE:
        return x, weight, bias, lse, None, None, None
    return None, None, None, None, dx, dw, db


def _fake_fwd(x, weight, bias, o):
    N, d = x.shape
    V = weight.shape[0]
    acc = ref.acc_dtype(x.dtype)
    grads = o.reduction != ref.NONE
    loss = x.new_empty((N,) if o.reduction == ref.NONE else (), dtype=acc)
    dx = x.new_empty((N, d) if grads and o.grad_x else (0,))
    dw = weight.new_empty((V, d) if grads and o.grad_weight else (0,))
    db = (bias.new_empty((V,)) if grads and o.grad_bias and bias is not None
          else weight.new_empty((0,)))
    return loss, dx, dw, db, x.new_empty((N,), dtype=acc)


def _fake_bwd(grads, saved, o, needs):
    x, weight, bias, _, dx, dw, db = saved
    like = (x, weight, bias) if o.reduction == ref.NONE else (dx, dw, db)
    return tuple(t.new_empty(t.shape) if need and t is not None else None
                 for t, need in zip(like, needs))


LINEAR_CROSS_ENTROPY = OpDef(
    "linear_cross_entropy", inputs=("x", "weight", "bias?"), options=LinearCrossEntropyOptions,
    outputs=("loss", "dx", "dweight", "dbias", "lse"), visible=1, save=_save,
    fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, call=_call)
_OPTIONS = frozenset(LinearCrossEntropyOptions.fields)


# ---- implementations ------------------------------------------------------------------------
class _Chunked(Impl):
    """The chunk loop of reference/linear_cross_entropy.py around this backend's row pass
    (``rows``) and compensated pair accumulation (``pair_add``)."""

    options = _OPTIONS

    def rows(self, *args):
        raise NotImplementedError

    def pair_add(self, hi, lo, p, read_lo=True, write_lo=True):
        ref.pair_add(hi, lo, p, read_lo, write_lo)

    def gemms(self, dtype: torch.dtype):
        """The chunk loop's GEMMs for inputs of dtype (reference.TorchGemms' methods)."""
        return ref.TorchGemms

    def fwd(self, x, weight, bias, o):
        return ref.forward(x, weight, bias, o, self.rows, self.pair_add, self.gemms(x.dtype))

    def bwd(self, grads, saved, o, needs, alias=False):
        x, weight, bias, lse, dx, dw, db = saved
        if o.reduction == ref.NONE:
            return ref.backward_none(grads[0], x, weight, bias, lse, o, needs, self.rows,
                                     self.pair_add, self.gemms(x.dtype))
        return ref.scale_grads(grads[0], (dx, dw, db), needs, alias)

    def autograd(self, x, weight, bias, o):
        """The eager route: as ops/_opdef.py's shared Function, except that the backward of
        "mean" / "sum" hands back the forward's gradients themselves when the upstream gradient
        is 1 (no copy of dW)."""
        return (_Function.apply(self, o, x, weight, bias),)


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, impl, o, x, weight, bias):
        outputs = impl.fwd(x, weight, bias, o)
        saved = _save((x, weight, bias), o, outputs)
        ctx.save_for_backward(*saved, *o.tensors())
        ctx.impl, ctx.o, ctx.n_saved = impl, o.without_tensors(), len(saved)
        ctx.dispatch = backends.last_dispatch()
        return owned(outputs[0])

    @staticmethod
    def backward(ctx, grad):
        backends.record(ctx.dispatch)
        tensors = ctx.saved_tensors
        o = ctx.o.with_tensors(tensors[ctx.n_saved:])
        needs = tuple(ctx.needs_input_grad[2:5])
        dx, dw, db = ctx.impl.bwd((grad,), tensors[:ctx.n_saved], o, needs, True)  # alias
        return None, None, dx, dw, db


@LINEAR_CROSS_ENTROPY.implementation
class _Triton(_Chunked):
    """Row pass: triton_kernels/linear_cross_entropy.py; GEMMs: torch (cuBLAS)."""

    backend = "triton"
    dtypes = GPU_FLOAT

    def rows(self, *args):
        from . import linear_cross_entropy_triton
        linear_cross_entropy_triton.rows(*args)


class _PackedGemms:
    """The chunk loop's GEMMs on csrc/cpu/ffn.cpp's packed GEMM (ops/linear.py's, taken where
    torch's GEMM in the dtype is generic code: bf16 on AVX2-only CPUs ran 19 GFLOP/s in torch, 150
    here on a 2-core Zen 3). Its gradients come out as new tensors: d weight is added per vocab
    slice (the slice of dz copied contiguous, C x SLICE_ELEMENTS / d values) instead of in place."""

    accumulates_in_place = False

    @staticmethod
    def logits(xc, weight, bias, out):
        return linear.packed_mm(xc, weight, bias, out)

    @staticmethod
    def input_grad(dz, xc, weight, out):
        out.copy_(linear.packed_input_grad(dz, xc, weight))

    @staticmethod
    def weight_grad(dz, xc, out):
        return linear.packed_weight_grad(dz, xc, out)


@LINEAR_CROSS_ENTROPY.implementation
class _Cpu(_Chunked):
    """Row pass and pair accumulation: csrc/cpu/linear_cross_entropy.cpp; GEMMs: torch
    (oneDNN / MKL), or the packed GEMM where torch's is generic code in the dtype
    (ops/linear.py's packed_gemm_wins())."""

    backend = "cpu"

    def gemms(self, dtype):
        return _PackedGemms if linear.packed_gemm_wins(dtype) else ref.TorchGemms

    @staticmethod
    def rows(z, target, loss, lse, o, scale, row_scale, compute_loss, write_grad, dbias):
        _ext.C.lce_rows(z, target, loss, lse, row_scale, dbias, o, float(scale), compute_loss,
                        write_grad)

    @staticmethod
    def pair_add(hi, lo, p, read_lo=True, write_lo=True):
        _ext.C.lce_pair_add(hi, lo, p, read_lo, write_lo)

    def unavailable(self):
        if _ext.C is not None and not hasattr(_ext.C, "lce_rows"):
            return "fastformer._C was built without linear_cross_entropy (rebuild it)"
        return None


@LINEAR_CROSS_ENTROPY.implementation
class _Reference(_Chunked):
    backend = "reference"
    options = EVERY_OPTION
    rows = staticmethod(ref.rows)


# ---- public API ---------------------------------------------------------------------------
def _check(fn, x, weight, target, bias, ignore_index, label_smoothing, reduction, softcap):
    _checks.tensor(fn, "x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{fn}: `x` must have shape (..., d) with d >= 1, got {tuple(x.shape)}")
    d = x.shape[-1]
    _checks.tensor(fn, "weight", weight)
    _checks.same_device(fn, "x", x, weight=weight)
    _checks.same_dtype(fn, "x", x, weight=weight)
    if weight.dim() != 2 or weight.shape[0] < 1 or weight.shape[1] != d:
        raise ValueError(f"{fn}: `weight` must be (V, d) = (vocab, {d}) with V >= 1 (the "
                         f"nn.Linear / lm_head layout; d is the last dim of `x` of shape "
                         f"{tuple(x.shape)}), got {tuple(weight.shape)}")
    V = weight.shape[0]
    if not isinstance(target, Tensor):
        raise TypeError(f"{fn}: `target` must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype != torch.int64:
        raise TypeError(f"{fn}: `target` must be int64 class indices, got "
                        f"{str(target.dtype).replace('torch.', '')}")
    _checks.same_device(fn, "x", x, target=target)
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{fn}: `target` must have shape {tuple(x.shape[:-1])} (the leading "
                         f"dims of `x`), got {tuple(target.shape)}")
    _checks.tensor(fn, "bias", bias, optional=True)
    if bias is not None:
        _checks.same_device(fn, "x", x, bias=bias)
        _checks.same_dtype(fn, "x", x, bias=bias)
        _checks.shape(fn, "bias", bias, (V,), " (the rows of `weight`)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}: `ignore_index` must be an int, got {type(ignore_index).__name__}")
    label_smoothing = _checks.number(fn, "label_smoothing", label_smoothing, lo=0.0, hi=1.0,
                                     hi_open=True)
    code = ref.REDUCTIONS[_checks.choice(fn, "reduction", reduction, tuple(ref.REDUCTIONS))]
    if softcap is not None:
        softcap = _checks.number(fn, "softcap", softcap, lo=0.0, lo_open=True, finite=True)
    return label_smoothing, code, softcap


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
                         *, ignore_index: int = -100, label_smoothing: float = 0.0,
                         reduction: str = "mean", softcap: Optional[float] = None) -> Tensor:
    """``F.cross_entropy(softcap(x @ weight.T + bias).float(), target, ...)`` without the
    (tokens, vocab) logits: the LM head and the loss fused and chunked over tokens (as
    Liger-Kernel's FusedLinearCrossEntropy), forward and backward.

    Args:
        x: (..., d) float16/bfloat16/float32/float64 hidden states; the leading dims are the
            tokens (N of them).
        weight: (V, d) in x's dtype and device: an ``nn.Linear`` / lm_head weight.
        target: int64 (...,), x's leading dims: class indices in [0, V) or ``ignore_index``.
        bias: (V,) in x's dtype, or None.
        ignore_index: targets equal to it contribute no loss and no gradient.
        label_smoothing: in [0, 1), as ``F.cross_entropy``'s.
        reduction: ``"mean"`` (over the targets not ignored; NaN if every one is, as torch),
            ``"sum"`` or ``"none"`` (a loss per token, 0 where ignored).
        softcap: > 0: the logits are ``softcap * tanh(logits / softcap)`` before the loss (Gemma
            2's ``final_logit_softcapping``); None: no cap.

    Returns:
        The loss in float32 (float64 for float64 inputs), whatever the input dtype (as HF's
        loss, which upcasts the logits, and Liger's): 0-dim for "mean" / "sum", target's shape
        for "none". Logits are computed chunk by chunk with fp32 accumulation (in x's dtype, as
        ``x @ weight.T``), the loss in fp32; gradients for x, weight and bias in their dtypes.
        With autograd and "mean" / "sum" the gradients are computed during the forward (the
        backward scales them by the upstream gradient), so the forward takes about as long as
        an eager forward + backward; "none" recomputes the logits in the backward.
    """
    fn = "linear_cross_entropy"
    label_smoothing, code, softcap = _check(fn, x, weight, target, bias, ignore_index,
                                            label_smoothing, reduction, softcap)
    d = x.shape[-1]
    enabled = torch.is_grad_enabled()
    o = LinearCrossEntropyOptions(
        target=target.reshape(-1).contiguous(), ignore_index=ignore_index,
        label_smoothing=label_smoothing, reduction=code,
        softcap=softcap if softcap is not None else 0.0,
        grad_x=enabled and x.requires_grad, grad_weight=enabled and weight.requires_grad,
        grad_bias=enabled and bias is not None and bias.requires_grad)
    loss = LINEAR_CROSS_ENTROPY((x.reshape(-1, d), weight, bias), o)[0]
    return loss.reshape(target.shape) if code == ref.NONE else loss


__all__ = ["linear_cross_entropy"]
