"""Scaled dot-product attention: ff.attention, custom ops, autograd, backend wiring.

One call, top to bottom:
  ff.attention / ff.scaled_dot_product_attention (ops/sdpa.py)        checks, mask plumbing
    -> torch.ops.fastformer.attention_fwd (or the eager Function, see ops/_common.py)
    -> backends.select(Call("attention", ...))
    -> _C.attention_fwd (cpu: csrc/cpu/attention_*.cpp, cuda: csrc/cuda/attention*.cu)
       | ops/attention_triton.py (triton_kernels/attention.py) | reference/attention.py

Saved for the backward: q, k, v, the output and the per-row log-sum-exp (fp32); the backward
recomputes the probabilities tile by tile. Masks are passed as views (an attn_mask broadcast to
(B, H, Lq, Lk) has stride 0 on broadcast dims) and never materialized. Dropout keeps only
(seed, offset) and regenerates its mask (reference/rng.py).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from .. import _checks, _ext, backends
from ..reference import attention as ref
from ..reference.attention import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT
from ..reference.rng import draw_rng_state, keep_mask
from ._common import LazyLaunchers, needs_grad, via_custom_op

_CAUSAL_NAMES = {"top_left": CAUSAL_TOP_LEFT, "bottom_right": CAUSAL_BOTTOM_RIGHT}


def causal_mode(fn: str, causal) -> int:
    """False/None -> 0, True/'top_left' -> 1 (torch's is_causal), 'bottom_right' -> 2."""
    if causal is None or isinstance(causal, bool):
        return CAUSAL_TOP_LEFT if causal else CAUSAL_NONE
    if isinstance(causal, str) and causal in _CAUSAL_NAMES:
        return _CAUSAL_NAMES[causal]
    raise ValueError(f"{fn}: `causal` must be False, True (= 'top_left', as torch's is_causal), "
                     f"'top_left' or 'bottom_right'; got {causal!r}")


# ---- dispatch -------------------------------------------------------------------------------
def _features(q, k, v, attn_mask, key_padding_mask, causal, dropout_p) -> frozenset:
    f = set()
    if causal == CAUSAL_TOP_LEFT:
        f.add("causal_top_left")
    elif causal == CAUSAL_BOTTOM_RIGHT:
        f.add("causal_bottom_right")
    if key_padding_mask is not None:
        f.add("key_padding_mask")
    if attn_mask is not None:
        f.add("attn_mask_bool" if attn_mask.dtype == torch.bool else "attn_mask_float")
    if dropout_p > 0:
        f.add("dropout")
    if k.shape[1] != q.shape[1]:
        f.add("gqa")
    if v.shape[-1] != q.shape[-1]:
        f.add("v_head_dim_differs")
    if any(t.stride(-1) != 1 and t.shape[-1] > 1 for t in (q, k, v)):
        f.add("last_dim_strided")
    return frozenset(f)


def _call(q, k, v, attn_mask, key_padding_mask, causal, dropout_p) -> backends.Call:
    return backends.Call("attention", q.device.type, q.dtype,
                         _features(q, k, v, attn_mask, key_padding_mask, causal, dropout_p),
                         head_dim=q.shape[-1])


# ---- backend implementations ----------------------------------------------------------------
def _seed_offset(rng_state: Optional[Tensor]):
    if rng_state is None:
        return 0, 0
    seed, offset = rng_state.tolist()
    return int(seed), int(offset)


class _CompiledImpl:
    """cpu and cuda: fastformer._C (it dispatches on the tensors' device)."""

    @staticmethod
    def fwd(q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p, rng_state):
        seed, offset = _seed_offset(rng_state)
        out, lse = _ext.C.attention_fwd(q, k, v, attn_mask, key_padding_mask, causal, scale,
                                        dropout_p, seed, offset)
        return out, lse

    @staticmethod
    def bwd(dout, q, k, v, out, lse, attn_mask, key_padding_mask, causal, scale, dropout_p,
            rng_state):
        seed, offset = _seed_offset(rng_state)
        if dout.stride(-1) != 1:  # autograd may hand over an expanded grad (y.sum())
            dout = dout.contiguous()
        dq, dk, dv = _ext.C.attention_bwd(dout, q, k, v, out, lse, attn_mask, key_padding_mask,
                                          causal, scale, dropout_p, seed, offset)
        return dq, dk, dv


_TritonImpl = LazyLaunchers(".attention_triton", "attention_fwd", "attention_bwd")


class _ReferenceImpl:
    fwd = staticmethod(ref.attention_fwd)
    bwd = staticmethod(ref.attention_bwd)


backends.register_impl("attention", "reference", _ReferenceImpl)


def register_compiled_impls() -> None:
    """cpu/cuda/triton implementations, registered once their kernels exist in this build."""
    if _ext.C is not None and hasattr(_ext.C, "attention_fwd"):
        backends.register_impl("attention", "cpu", _CompiledImpl)
        if _ext.has_cuda_kernels():
            backends.register_impl("attention", "cuda", _CompiledImpl)
    import importlib.util
    if importlib.util.find_spec("fastformer.ops.attention_triton") is not None:
        backends.register_impl("attention", "triton", _TritonImpl)


register_compiled_impls()


def _fwd_impl(q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p, rng_state):
    chosen = backends.select(_call(q, k, v, attn_mask, key_padding_mask, causal, dropout_p))
    return chosen, chosen.impls["attention"].fwd(q, k, v, attn_mask, key_padding_mask, causal,
                                                 scale, dropout_p, rng_state)


# ---- custom ops (torch.compile / export route) ----------------------------------------------
def _out_like(q: Tensor, v: Tensor) -> Tensor:
    """(B, H, Lq, Dv) stored as (B, Lq, H, Dv): the transpose + reshape to (B, Lq, H*Dv) that
    multi-head attention does next is then free."""
    B, H, Lq, _ = q.shape
    return q.new_empty((B, Lq, H, v.shape[-1])).transpose(1, 2)


@torch.library.custom_op("fastformer::attention_fwd", mutates_args=())
def attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                     key_padding_mask: Optional[Tensor], causal: int, scale: float,
                     dropout_p: float, rng_state: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    out, lse = _fwd_impl(q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p,
                         rng_state)[1]
    return out, lse


@attention_fwd_op.register_fake
def _(q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p, rng_state):
    B, H, Lq, _ = q.shape
    return _out_like(q, v), q.new_empty((B, H, Lq), dtype=ref.acc_dtype(q.dtype))


@torch.library.custom_op("fastformer::attention_bwd", mutates_args=())
def attention_bwd_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], causal: int,
                     scale: float, dropout_p: float,
                     rng_state: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    chosen = backends.select(_call(q, k, v, attn_mask, key_padding_mask, causal, dropout_p))
    return tuple(chosen.impls["attention"].bwd(dout, q, k, v, out, lse, attn_mask,
                                               key_padding_mask, causal, scale, dropout_p,
                                               rng_state))


@attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse, attn_mask, key_padding_mask, causal, scale, dropout_p, rng_state):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p, rng_state, out,
          lse):
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, rng_state)
    ctx.causal, ctx.scale, ctx.dropout_p = causal, scale, dropout_p


def _grads(ctx, dout, bwd):
    q, k, v, out, lse, attn_mask, key_padding_mask, rng_state = ctx.saved_tensors
    dq, dk, dv = bwd(dout, q, k, v, out, lse, attn_mask, key_padding_mask, ctx.causal, ctx.scale,
                     ctx.dropout_p, rng_state)
    return dq, dk, dv, None, None, None, None, None, None


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p, rng_state = inputs
    out, lse = output
    _save(ctx, q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p, rng_state, out, lse)


def _op_backward(ctx, dout, _dlse):
    return _grads(ctx, dout, attention_bwd_op)


attention_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


class _AttentionFunction(torch.autograd.Function):
    """Eager route: same implementations as the custom ops, fewer dispatcher round trips."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p, rng_state):
        backend, (out, lse) = _fwd_impl(q, k, v, attn_mask, key_padding_mask, causal, scale,
                                        dropout_p, rng_state)
        _save(ctx, q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p, rng_state,
              out, lse)
        ctx.backend, ctx.dispatch = backend, backends.last_dispatch()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        backends.record(ctx.dispatch)  # the forward's backend runs the backward
        return _grads(ctx, dout, ctx.backend.impls["attention"].bwd)


# ---- public API ---------------------------------------------------------------------------
def _check(fn, q, k, v, attn_mask, key_padding_mask, scale, dropout_p):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(fn, name, t, dims=(4,))
    _checks.same_device(fn, "q", q, k=k, v=v, attn_mask=attn_mask,
                        key_padding_mask=key_padding_mask)
    _checks.same_dtype(fn, "q", q, k=k, v=v)
    B, H, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"{fn}: `k` has batch size {Bk} but `q` has {B} (q is (B, H, Lq, D), "
                         f"k and v are (B, Hkv, Lk, D)); got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if Dk != D:
        raise ValueError(f"{fn}: `k` has head dim {Dk} but `q` has {D}; they must match")
    if tuple(v.shape[:3]) != (B, Hkv, Lk):
        raise ValueError(f"{fn}: `v` must have shape ({B}, {Hkv}, {Lk}, Dv) to match `k`; "
                         f"got {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"{fn}: the number of query heads of `q` ({H}) must be a multiple of the "
                         f"number of key/value heads of `k` ({Hkv})")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            got = key_padding_mask.dtype if isinstance(key_padding_mask, Tensor) else type(key_padding_mask).__name__
            raise TypeError(f"{fn}: `key_padding_mask` must be a bool tensor (True = padding), "
                            f"got {got}; pass additive float masks as `attn_mask`")
        _checks.shape(fn, "key_padding_mask", key_padding_mask, (B, Lk), " (B, Lk)")
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"{fn}: `attn_mask` must be a tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in (q.dtype, torch.float32):
            raise TypeError(f"{fn}: `attn_mask` must be bool (True = attend) or float ({_checks._dt(q.dtype)} "
                            f"or float32, added to the scores), got {_checks._dt(attn_mask.dtype)}")
        try:
            full = torch.broadcast_shapes(attn_mask.shape, (B, H, Lq, Lk))
        except RuntimeError:
            full = None
        if full != (B, H, Lq, Lk):
            raise ValueError(f"{fn}: `attn_mask` of shape {tuple(attn_mask.shape)} does not "
                             f"broadcast to (B, H, Lq, Lk) = {(B, H, Lq, Lk)}")
    if scale is not None:
        scale = _checks.number(fn, "scale", scale)
        if not math.isfinite(scale):
            raise ValueError(f"{fn}: `scale` must be finite, got {scale}")
    dropout_p = _checks.number(fn, "dropout_p", dropout_p, lo=0.0, hi=1.0, hi_open=True)
    return scale, dropout_p


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: Union[bool, str] = False,
              key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
              scale: Optional[float] = None, dropout_p: float = 0.0) -> Tensor:
    """Fused (flash) attention: ``softmax(q k^T * scale + mask) v``, the score matrix never stored.

    Args:
        q: (B, H, Lq, D); k: (B, Hkv, Lk, D); v: (B, Hkv, Lk, Dv). H must be a multiple of Hkv
            (grouped-query / multi-query attention); any strides with a contiguous last dim.
        causal: False; True or ``"top_left"``: query i sees keys j <= i (torch's ``is_causal``);
            ``"bottom_right"``: query i sees keys j <= i + Lk - Lq (FlashAttention's alignment,
            what decoding with a KV cache needs when Lq < Lk).
        key_padding_mask: bool (B, Lk), **True = padding** (ignored), as nn.MultiheadAttention.
        attn_mask: bool (**True = attend**, as torch SDPA) or float (added to the scores),
            broadcastable to (B, H, Lq, Lk); read blockwise, never expanded.
        scale: default 1/sqrt(D).
        dropout_p: dropout on the attention probabilities, in [0, 1). The mask comes from a
            counter-based RNG seeded from torch's default generator (torch.manual_seed
            reproduces it) and is regenerated, not stored, for the backward.

    Returns:
        (B, H, Lq, Dv) in q's dtype. A query row whose keys are all masked gets zeros (and zero
        gradients), never NaN.
    """
    fn = "attention"
    mode = causal_mode(fn, causal)
    scale, dropout_p = _check(fn, q, k, v, attn_mask, key_padding_mask, scale, dropout_p)
    return _attention(q, k, v, attn_mask, key_padding_mask, mode, scale, dropout_p)


def _attention(q, k, v, attn_mask, key_padding_mask, causal: int, scale, dropout_p) -> Tensor:
    """Validated inputs -> output. attn_mask is broadcast to 4-D here (a view)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if attn_mask is not None:
        attn_mask = attn_mask.expand(B, H, Lq, Lk)
    rng_state = draw_rng_state() if dropout_p > 0 else None
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        # A learned additive bias (e.g. T5's relative positions) needs d(bias) = dS, a full
        # (B, H, Lq, Lk) tensor that no kernel writes: the reference runs it with autograd.
        backends.record(backends.Dispatch("attention", "reference", False,
                                          {"kernels": ["attn_mask requires grad"]}))
        return _differentiable_reference(q, k, v, attn_mask, key_padding_mask, causal, scale,
                                         dropout_p, rng_state)
    if via_custom_op(q, k, v, attn_mask, key_padding_mask):
        out, _ = attention_fwd_op(q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p,
                                  rng_state)
    elif needs_grad(q, k, v):
        out, _ = _AttentionFunction.apply(q, k, v, attn_mask, key_padding_mask, causal, scale,
                                          dropout_p, rng_state)
    else:
        _, (out, _) = _fwd_impl(q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p,
                                rng_state)
    return out


def _differentiable_reference(q, k, v, attn_mask, key_padding_mask, causal, scale, dropout_p,
                              rng_state):
    """Eager PyTorch math with autograd (gradients for every input, the bias included)."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    acc = ref.acc_dtype(q.dtype)
    groups = H // k.shape[1]
    kf = k.repeat_interleave(groups, 1) if groups > 1 else k
    vf = v.repeat_interleave(groups, 1) if groups > 1 else v
    s = torch.matmul(q.to(acc), kf.to(acc).transpose(-1, -2)) * scale + attn_mask.to(acc)
    allowed = ref.allowed_mask(B, H, Lq, Lk, None, key_padding_mask, causal, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(s.amax(-1, keepdim=True))
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if dropout_p > 0:
        p = p * keep_mask(rng_state, p.shape, dropout_p, device=q.device).to(acc) / (1 - dropout_p)
    return torch.matmul(p, vf.to(acc)).to(q.dtype)


def dropout_keep_mask(rng_state: Tensor, shape, dropout_p: float) -> Tensor:
    """The exact keep mask (B, H, Lq, Lk) a kernel drew for `rng_state` (tests, debugging)."""
    return keep_mask(rng_state, shape, dropout_p)


__all__ = ["attention", "dropout_keep_mask", "causal_mode"]
