"""Scaled dot-product attention: ff.attention, its options, its op definition and backends.

One call, top to bottom:
  ff.attention / ff.scaled_dot_product_attention (ops/sdpa.py)      checks, AttentionOptions
    -> ATTENTION((q, k, v), o)                                      ops/_opdef.py: eager
       autograd.Function, or the custom ops fastformer::attention_fwd / _bwd when tracing
    -> backends.select(Call)                                        the first Impl below
       that takes the call
    -> _C.attention_fwd (cpu: csrc/cpu/attention_*.cpp) | _C.cuda_attention_fwd
       (csrc/cuda/attention*.cu) | ops/attention_triton.py (triton_kernels/attention.py)
       | reference/attention.py

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
from ..backends import ALL_FLOAT, EVERY_OPTION, GPU_FLOAT, Impl
from ..reference import attention as ref
from ..reference.attention import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT
from ..reference.rng import draw_rng_state, keep_mask
from ._opdef import OpDef, Options, compiled, options, rowwise

_CAUSAL_NAMES = {"top_left": CAUSAL_TOP_LEFT, "bottom_right": CAUSAL_BOTTOM_RIGHT}


@options
class AttentionOptions(Options):
    """Every option of one attention call, validated (csrc/options.h mirrors the fields).

    A backend's Impl lists the fields it honours; a call setting any other one is declined
    with the field's name as the reason (and ``auto`` falls back).
    """

    causal: int = CAUSAL_NONE             # 0 none, 1 top-left (j <= i), 2 bottom-right
    scale: Optional[float] = None         # None: 1 / sqrt(D)
    dropout_p: float = 0.0                # on the probabilities, in [0, 1)
    rng_state: Optional[Tensor] = None    # int64 CPU [seed, offset] of the dropout stream
    attn_mask: Optional[Tensor] = None    # (B, H, Lq, Lk) view; bool True = attend, float added
    key_padding_mask: Optional[Tensor] = None  # bool (B, Lk), True = padding

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)


# The options every kernel takes.
_CORE = frozenset({"causal", "scale"})
_MASKS_DROPOUT = frozenset({"dropout_p", "rng_state", "attn_mask", "key_padding_mask"})


def causal_mode(fn: str, causal) -> int:
    """False/None -> 0, True/'top_left' -> 1 (torch's is_causal), 'bottom_right' -> 2."""
    if causal is None or isinstance(causal, bool):
        return CAUSAL_TOP_LEFT if causal else CAUSAL_NONE
    if isinstance(causal, str) and causal in _CAUSAL_NAMES:
        return _CAUSAL_NAMES[causal]
    raise ValueError(f"{fn}: `causal` must be False, True (= 'top_left', as torch's is_causal), "
                     f"'top_left' or 'bottom_right'; got {causal!r}")


# ---- the op -----------------------------------------------------------------------------------
def _call(inputs, o: AttentionOptions) -> backends.Call:
    q, k, v = inputs
    features = []
    if k.shape[1] != q.shape[1]:
        features.append("gqa")
    if v.shape[-1] != q.shape[-1]:
        features.append("v_head_dim_differs")
    if any(t.stride(-1) != 1 and t.shape[-1] > 1 for t in inputs):
        features.append("last_dim_strided")
    return backends.Call("attention", q.device.type, q.dtype, o.set_fields(),
                         frozenset(features), head_dim=q.shape[-1])


def _out_like(q: Tensor, v: Tensor) -> Tensor:
    """(B, H, Lq, Dv) stored as (B, Lq, H, Dv): the transpose + reshape to (B, Lq, H*Dv) that
    multi-head attention does next is then free."""
    B, H, Lq, _ = q.shape
    return q.new_empty((B, Lq, H, v.shape[-1])).transpose(1, 2)


def _fake_fwd(q, k, v, o):
    B, H, Lq, _ = q.shape
    return _out_like(q, v), q.new_empty((B, H, Lq), dtype=ref.acc_dtype(q.dtype))


def _fake_bwd(grads, saved, o, needs):
    q, k, v = saved[:3]
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


ATTENTION = OpDef("attention", inputs=("q", "k", "v"), options=AttentionOptions,
                  outputs=("out", "lse"), visible=1,
                  save=lambda inputs, o, outputs: (*inputs, *outputs),
                  fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, call=_call)


# ---- implementations ------------------------------------------------------------------------
@ATTENTION.implementation
class _Cuda(Impl):
    """csrc/cuda/attention_*.cu: tensor cores, fp16/bf16, head dims 64 and 128."""

    backend = "cuda"
    dtypes = frozenset({torch.float16, torch.bfloat16})
    options = _CORE | {"key_padding_mask"}
    features = frozenset({"gqa"})
    head_dim_set = frozenset({64, 128})

    fwd = compiled("cuda_attention_fwd")

    def bwd(self, grads, saved, o, needs):
        return _ext.C.cuda_attention_bwd(rowwise(grads[0]), *saved, o)


@ATTENTION.implementation
class _Triton(Impl):
    """ops/attention_triton.py (triton_kernels/attention.py): head dims 16..256."""

    backend = "triton"
    dtypes = GPU_FLOAT
    options = _CORE | _MASKS_DROPOUT
    features = frozenset({"gqa"})
    head_dims = (16, 256)

    def fwd(self, q, k, v, o):
        from . import attention_triton
        return attention_triton.attention_fwd(q, k, v, o)

    def bwd(self, grads, saved, o, needs):
        from . import attention_triton
        return attention_triton.attention_bwd(grads[0], *saved, o)


@ATTENTION.implementation
class _Cpu(Impl):
    """csrc/cpu/attention_*.cpp: every dtype, head dims 1..256, bf16 on AMX tiles."""

    backend = "cpu"
    dtypes = ALL_FLOAT
    options = _CORE | _MASKS_DROPOUT
    features = frozenset({"gqa"})
    head_dims = (1, 256)

    fwd = compiled("attention_fwd")

    def bwd(self, grads, saved, o, needs):
        return _ext.C.attention_bwd(rowwise(grads[0]), *saved, o)


@ATTENTION.implementation
class _Reference(Impl):
    """reference/attention.py: the score matrix materialized; takes everything."""

    backend = "reference"
    options = EVERY_OPTION
    features = frozenset({"gqa", "v_head_dim_differs", "last_dim_strided"})

    def fwd(self, q, k, v, o):
        return ref.attention_fwd(q, k, v, o)

    def bwd(self, grads, saved, o, needs):
        return ref.attention_bwd(grads[0], *saved, o)


# ---- public API ---------------------------------------------------------------------------
def _check(fn: str, q, k, v, o: AttentionOptions) -> AttentionOptions:
    """Validates the tensors and the options; returns o with scale and dropout_p as floats."""
    attn_mask, key_padding_mask = o.attn_mask, o.key_padding_mask
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
    if o.scale is not None:
        o.scale = _checks.number(fn, "scale", o.scale, finite=True)
    o.dropout_p = _checks.number(fn, "dropout_p", o.dropout_p, lo=0.0, hi=1.0, hi_open=True)
    return o


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
    o = AttentionOptions(causal=causal_mode(fn, causal), scale=scale, dropout_p=dropout_p,
                         attn_mask=attn_mask, key_padding_mask=key_padding_mask)
    return run(q, k, v, _check(fn, q, k, v, o))


def run(q: Tensor, k: Tensor, v: Tensor, o: AttentionOptions) -> Tensor:
    """Validated inputs -> output: attn_mask broadcast to 4-D (a view), the dropout stream
    drawn, the op run."""
    B, H, Lq, _ = q.shape
    if o.attn_mask is not None:
        o.attn_mask = o.attn_mask.expand(B, H, Lq, k.shape[2])
    if o.dropout_p > 0:
        o.rng_state = draw_rng_state()
    if o.attn_mask is not None and o.attn_mask.requires_grad and torch.is_grad_enabled():
        # A learned additive bias (e.g. T5's relative positions) needs d(bias) = dS, a full
        # (B, H, Lq, Lk) tensor that no kernel writes: the reference runs it with autograd.
        backends.record(backends.Dispatch("attention", "reference", False,
                                          {"kernels": ["attn_mask requires grad"]}, "reference"))
        return _differentiable_reference(q, k, v, o)
    return ATTENTION((q, k, v), o)[0]


def _differentiable_reference(q, k, v, o: AttentionOptions):
    """Eager PyTorch math with autograd (gradients for every input, the bias included)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    acc = ref.acc_dtype(q.dtype)
    groups = H // k.shape[1]
    kf = k.repeat_interleave(groups, 1) if groups > 1 else k
    vf = v.repeat_interleave(groups, 1) if groups > 1 else v
    s = torch.matmul(q.to(acc), kf.to(acc).transpose(-1, -2)) * o.scale_for(D) + o.attn_mask.to(acc)
    allowed = ref.allowed_mask(B, H, Lq, Lk, None, o.key_padding_mask, o.causal, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(s.amax(-1, keepdim=True))
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if o.dropout_p > 0:
        keep = keep_mask(o.rng_state, p.shape, o.dropout_p, device=q.device)
        p = p * keep.to(acc) / (1 - o.dropout_p)
    return torch.matmul(p, vf.to(acc)).to(q.dtype)


def dropout_keep_mask(rng_state: Tensor, shape, dropout_p: float) -> Tensor:
    """The exact keep mask (B, H, Lq, Lk) a kernel drew for `rng_state` (tests, debugging)."""
    return keep_mask(rng_state, shape, dropout_p)


__all__ = ["attention", "AttentionOptions", "ATTENTION", "dropout_keep_mask", "causal_mode"]
