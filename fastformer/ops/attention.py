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

Saved for the backward: q, k, v, the output and the per-row log-sum-exp (fp32), and for bf16 /
fp16 on the CPU the output's rounding residual (out_residual: the fp32 output minus out, in the
inputs' dtype; one more output-sized tensor), from which the backward's delta = dO . O is the
unrounded output's (csrc/cpu/attention_common.h, store_out_row: gradients that cancel exactly,
a key projection's bias, ~10x closer to fp64 than FlashAttention's delta from the rounded
output); the backward recomputes the probabilities tile by tile. Masks are passed as views (an attn_mask broadcast to
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
    with the field's name as the reason (and ``auto`` falls back). Semantics:
    reference/attention.py.
    """

    causal: int = CAUSAL_NONE             # 0 none, 1 top-left (j <= i), 2 bottom-right
    scale: Optional[float] = None         # None: 1 / sqrt(D)
    dropout_p: float = 0.0                # on the probabilities, in [0, 1)
    rng_state: Optional[Tensor] = None    # int64 CPU [seed, offset] of the dropout stream
    attn_mask: Optional[Tensor] = None    # broadcastable to (B, H, Lq, Lk); bool True = attend,
                                          # float added (may require grad)
    key_padding_mask: Optional[Tensor] = None  # bool (B, Lk), True = padding
    window_left: int = -1                 # keys j >= i + d - left are visible (-1: no limit)
    window_right: int = -1                # keys j <= i + d + right (-1: no limit)
    softcap: float = 0.0                  # > 0: s = softcap * tanh(s / softcap)
    alibi_slopes: Optional[Tensor] = None  # fp32 (H,) or (B, H): s -= slope * |i + d - j|
    sinks: Optional[Tensor] = None        # fp32 (H,): a logit in every row's denominator
    rel_bias: Optional[Tensor] = None     # (H, Lq + Lk - 1) accumulation dtype: a bias that
                                          # depends on j - i only, s += rel_bias[h, j - i + Lq - 1]
                                          # (T5's, gathered from its table)
    # Variable lengths (ops/varlen.py). Packed sequences: q (total_q, H, D), k and v
    # (total_k, Hkv, D); sequence s is rows cu_seqlens_q[s] .. cu_seqlens_q[s + 1] of q and
    # cu_seqlens_k[s] .. of k / v (int32), each attended alone; lse is (H, total_q).
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    max_seqlen_q: int = 0                 # the longest sequences (grids; the kernels check)
    max_seqlen_k: int = 0
    seqlens_k: Optional[Tensor] = None    # int32 (B,): batch b's keys are rows 0 .. seqlens_k[b]
                                          # of k / v (a KV cache; d = seqlens_k[b] - Lq)
    block_table: Optional[Tensor] = None  # int32 (B, max_blocks): k, v paged (blocks, Hkv,
                                          # block_size, D), key j of batch b in block
                                          # block_table[b, j // block_size]
    leftpad_k: Optional[Tensor] = None    # int32 (B,), with seqlens_k: batch b's keys are rows
                                          # leftpad_k[b] .. seqlens_k[b] (FlashAttention's
                                          # cache_leftpad; d = seqlens_k[b] - leftpad_k[b] - Lq)

    differentiable = ("attn_mask", "sinks", "rel_bias")

    def scale_for(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)


class RelativePositionBias:
    """T5's bucketed relative-position bias, for ``ff.attention(position_bias=...)``.

    The bias of (query i, key j) is ``table[bucket(j - i - d), h]`` with T5's bucket function
    (Hugging Face's ``T5Attention._relative_position_bucket``; d is the causal alignment's
    offset, Lk - Lq for ``causal="bottom_right"``, else 0). It depends on j - i only: the
    kernels read it from an (H, Lq + Lk - 1) vector of the table's rows (``rel_bias``, a
    differentiable gather), never forming an (Lq, Lk) tensor, and their backward returns that
    vector's gradient, which autograd sums into the table's.

    Args:
        table: (num_buckets, H) (``nn.Embedding(num_buckets, H).weight``), may require grad.
        bidirectional: T5's encoder (True) or decoder (False) buckets.
        max_distance: distances from which every pair shares the last bucket.
    """

    def __init__(self, table: Tensor, bidirectional: bool = True, max_distance: int = 128):
        fn = "RelativePositionBias"
        _checks.tensor(fn, "table", table, dims=(2,))
        _checks.flag(fn, "bidirectional", bidirectional)
        if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 1:
            raise ValueError(f"{fn}: `max_distance` must be a positive int, got {max_distance!r}")
        min_buckets = 4 if bidirectional else 2
        if table.shape[0] < min_buckets:
            raise ValueError(f"{fn}: `table` must have at least {min_buckets} buckets (rows) "
                             f"with bidirectional={bidirectional}, got shape {tuple(table.shape)}")
        self.table, self.bidirectional, self.max_distance = table, bidirectional, max_distance

    @property
    def num_buckets(self) -> int:
        return self.table.shape[0]

    def buckets(self, Lq: int, Lk: int, d: int = 0) -> Tensor:
        """int32 (Lq + Lk - 1,): the bucket of key j for query i at index j - i + Lq - 1."""
        rel = torch.arange(-(Lq - 1), Lk, device=self.table.device) - d
        return ref.t5_buckets(rel, self.bidirectional, self.num_buckets,
                              self.max_distance).to(torch.int32)

    def rel_bias(self, Lq: int, Lk: int, d: int = 0) -> Tensor:
        """(H, Lq + Lk - 1): the bias of key j for query i at [h, j - i + Lq - 1]."""
        return self.table[self.buckets(Lq, Lk, d).long()].t()

    def materialize(self, Lq: int, Lk: int, d: int = 0) -> Tensor:
        """The (1, H, Lq, Lk) bias itself (tests, eager fallbacks)."""
        rel = torch.arange(Lk, device=self.table.device)[None, :] - torch.arange(Lq, device=self.table.device)[:, None]
        return self.table[self.buckets(Lq, Lk, d).long()[rel + Lq - 1]].permute(2, 0, 1)[None]

    def __repr__(self) -> str:
        return (f"RelativePositionBias(num_buckets={self.num_buckets}, heads={self.table.shape[1]}, "
                f"bidirectional={self.bidirectional}, max_distance={self.max_distance})")


# The options every kernel takes.
_CORE = frozenset({"causal", "scale"})
_MASKS_DROPOUT = frozenset({"dropout_p", "rng_state", "attn_mask", "key_padding_mask"})
_VARIANTS = frozenset({"window_left", "window_right", "softcap", "alibi_slopes", "sinks",
                       "rel_bias"})
_PACKED = frozenset({"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"})
_LENGTHS = _PACKED | {"seqlens_k", "block_table", "leftpad_k"}


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
    mask = o.attn_mask
    if (mask is not None and mask.requires_grad and mask.dtype != torch.bool
            and torch.is_grad_enabled()):
        features.append("attn_mask_grad")  # a learned bias: the backward writes its gradient
    return backends.Call("attention", q.device.type, q.dtype, o.set_fields(),
                         frozenset(features), head_dim=q.shape[-1], v_head_dim=v.shape[-1])


def _out_like(q: Tensor, v: Tensor) -> Tensor:
    """(B, H, Lq, Dv) stored as (B, Lq, H, Dv): the transpose + reshape to (B, Lq, H*Dv) that
    multi-head attention does next is then free."""
    B, H, Lq, _ = q.shape
    return q.new_empty((B, Lq, H, v.shape[-1])).transpose(1, 2)


def _with_residual(q: Tensor) -> bool:
    """Whether a call's forward returns the output's rounding residual (bf16 / fp16 on the CPU;
    the GPU kernels take delta from the rounded output, as FlashAttention does)."""
    return q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu"


def _no_residual(q: Tensor) -> Tensor:
    return q.new_empty((0,))


def _fake_fwd(q, k, v, o):
    if o.cu_seqlens_q is not None:  # packed: (total_q, H, Dv) and (H, total_q)
        T, H, _ = q.shape
        out = q.new_empty((T, H, v.shape[-1]))
        return out, q.new_empty((H, T), dtype=ref.acc_dtype(q.dtype)), (
            torch.empty_like(out) if _with_residual(q) else _no_residual(q))
    B, H, Lq, _ = q.shape
    out = _out_like(q, v)
    return (out, q.new_empty((B, H, Lq), dtype=ref.acc_dtype(q.dtype)),
            torch.empty_like(out) if _with_residual(q) else _no_residual(q))


def _option_grads_like(o: AttentionOptions, needs) -> tuple:
    """Gradients of the differentiable options, as the backward returns them (fakes)."""
    mask = o.attn_mask if needs[3] and o.attn_mask is not None else None
    return (None if mask is None else torch.empty_like(mask, memory_format=torch.contiguous_format),
            None if not needs[4] or o.sinks is None else torch.empty_like(o.sinks),
            None if not needs[5] or o.rel_bias is None else torch.empty_like(o.rel_bias))


def _fake_bwd(grads, saved, o, needs):
    q, k, v = saved[:3]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            *_option_grads_like(o, needs))
ATTENTION = OpDef("attention", inputs=("q", "k", "v"), options=AttentionOptions,
                  outputs=("out", "lse", "out_residual"), visible=2, non_differentiable=(1,),
                  save=lambda inputs, o, outputs: (*inputs, *outputs),
                  fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, call=_call)


# ---- implementations ------------------------------------------------------------------------
@ATTENTION.implementation
class _Cuda(Impl):
    """csrc/cuda/attention_*.cu: tensor cores, fp16/bf16, head dims 64 and 128."""

    backend = "cuda"
    dtypes = frozenset({torch.float16, torch.bfloat16})
    options = _CORE | {"key_padding_mask", "window_left", "window_right", "softcap"}
    features = frozenset({"gqa"})
    head_dim_set = frozenset({64, 128})

    def fwd(self, q, k, v, o):
        return (*_ext.C.cuda_attention_fwd(q, k, v, o), _no_residual(q))

    def bwd(self, grads, saved, o, needs):
        return (*_ext.C.cuda_attention_bwd(rowwise(grads[0]), *saved[:5], o), None, None, None)


@ATTENTION.implementation
class _Triton(Impl):
    """ops/attention_triton.py (triton_kernels/attention.py): head dims 16..256 (D of q, k
    and Dv of v, which may differ: MLA), every option (windows, softcap, ALiBi, sinks, the T5
    bias table, learned float masks), packed sequences (without masks or the bias table; no KV
    cache)."""

    backend = "triton"
    dtypes = GPU_FLOAT
    options = _CORE | _MASKS_DROPOUT | _VARIANTS | _PACKED
    features = frozenset({"gqa", "v_head_dim_differs", "attn_mask_grad"})
    head_dims = (16, 256)

    def reasons(self, call):
        why = super().reasons(call)
        lo, hi = self.head_dims
        if call.v_head_dim is not None and not lo <= call.v_head_dim <= hi:
            why.append(f"v head dim (Dv) {call.v_head_dim} outside {lo}..{hi}")
        if "cu_seqlens_q" in call.options:
            clash = sorted(call.options & {"attn_mask", "key_padding_mask", "rel_bias"})
            if clash:
                why.append("does not take option " + ", ".join(f"`{n}`" for n in clash)
                           + " with packed sequences")
        return why

    def fwd(self, q, k, v, o):
        from . import attention_triton
        out, lse = attention_triton.attention_fwd(q, k, v, o)
        # (a CPU tensor only under TRITON_INTERPRET=1: the residual _fake_fwd expects, unused)
        return out, lse, torch.zeros_like(out) if _with_residual(q) else _no_residual(q)

    def bwd(self, grads, saved, o, needs):
        # (dq, dk, dv, d attn_mask, d sinks, d rel_bias); needs: (q, k, v, attn_mask, sinks,
        # rel_bias)
        from . import attention_triton
        return attention_triton.attention_bwd(grads[0], *saved[:5], o, needs)


@ATTENTION.implementation
class _Cpu(Impl):
    """csrc/cpu/attention_*.cpp: every dtype, head dims 1..256 (a value head dim Dv of its own:
    MLA), bf16 on AMX tiles, packed sequences and KV caches (contiguous or paged; decoding:
    attention_decode.cpp)."""

    backend = "cpu"
    dtypes = ALL_FLOAT
    options = _CORE | _MASKS_DROPOUT | _VARIANTS | _LENGTHS
    features = frozenset({"gqa", "v_head_dim_differs", "attn_mask_grad"})
    head_dims = (1, 256)

    fwd = compiled("attention_fwd")

    @staticmethod
    def inference(q, k, v, o):
        # No residual: bf16 on bf16 instructions then rounds P once (attention_fwd.cpp, Bf16Gemms).
        return _ext.C.attention_fwd(q, k, v, o, False)

    def bwd(self, grads, saved, o, needs):
        return _ext.C.attention_bwd(rowwise(grads[0]), *saved, o, *needs[3:])


@ATTENTION.implementation
class _Reference(Impl):
    """reference/attention.py: the score matrix materialized; takes everything."""

    backend = "reference"
    options = EVERY_OPTION
    features = frozenset({"gqa", "v_head_dim_differs", "last_dim_strided", "attn_mask_grad"})

    def fwd(self, q, k, v, o):
        if _with_residual(q):
            return ref.attention_fwd(q, k, v, o, with_residual=True)
        return (*ref.attention_fwd(q, k, v, o), _no_residual(q))

    def bwd(self, grads, saved, o, needs):
        return ref.attention_bwd(grads[0], *saved[:5], o, out_residual=saved[5])


# ---- public API ---------------------------------------------------------------------------
def _check_tensor_option(fn: str, name: str, t, q: Tensor, shapes: tuple, what: str,
                         dtypes=(torch.float32,)) -> None:
    if t is None:
        return
    _checks.tensor(fn, name, t, dtypes=dtypes)
    _checks.same_device(fn, "q", q, **{name: t})
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{fn}: `{name}` must have shape {' or '.join(map(str, shapes))} "
                         f"{what}, got {tuple(t.shape)}")


def _check(fn: str, q, k, v, o: AttentionOptions) -> AttentionOptions:
    """Validates the tensors and the options; returns o with its numbers as floats."""
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
        if full != (B, H, Lq, Lk) or attn_mask.dim() > 4:
            raise ValueError(f"{fn}: `attn_mask` of shape {tuple(attn_mask.shape)} does not "
                             f"broadcast to (B, H, Lq, Lk) = {(B, H, Lq, Lk)}")
    if o.scale is not None:
        o.scale = _checks.number(fn, "scale", o.scale, finite=True)
    o.dropout_p = _checks.number(fn, "dropout_p", o.dropout_p, lo=0.0, hi=1.0, hi_open=True)
    _check_tensor_option(fn, "alibi_slopes", o.alibi_slopes, q, ((H,), (B, H)),
                         "(one fp32 slope per head, or per batch row and head)")
    _check_tensor_option(fn, "sinks", o.sinks, q, ((H,),), "(one sink logit per query head)",
                         dtypes=_checks.FLOAT_DTYPES)
    return o


def _check_position_bias(fn: str, q: Tensor, position_bias) -> None:
    if position_bias is None:
        return
    if not isinstance(position_bias, RelativePositionBias):
        raise TypeError(f"{fn}: `position_bias` must be a ff.RelativePositionBias, got "
                        f"{type(position_bias).__name__} (pass a materialized bias as a float "
                        "`attn_mask`)")
    table, H = position_bias.table, q.shape[1]
    if table.shape[1] != H:
        raise ValueError(f"{fn}: `position_bias`'s table must be (num_buckets, H) with H = {H} "
                         f"heads of `q`, got {tuple(table.shape)}")
    _checks.same_device(fn, "q", q, **{"position_bias.table": table})


def _window(fn: str, window) -> tuple:
    if window is None:
        return -1, -1
    ok = (isinstance(window, (tuple, list)) and len(window) == 2
          and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window))
    if not ok:
        raise ValueError(f"{fn}: `window` must be a pair of ints (left, right), each >= 0 or -1 "
                         f"(no limit on that side), got {window!r}")
    return int(window[0]), int(window[1])


def _softcap(fn: str, softcap) -> float:
    if softcap is None:
        return 0.0
    return _checks.number(fn, "softcap", softcap, lo=0.0, lo_open=True, finite=True)


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: Union[bool, str] = False,
              key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
              scale: Optional[float] = None, dropout_p: float = 0.0, window=None,
              softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None,
              position_bias: Optional[RelativePositionBias] = None, return_lse: bool = False):
    """Fused (flash) attention: ``softmax(q k^T * scale + biases) v``, the scores never stored.

    Args:
        q: (B, H, Lq, D); k: (B, Hkv, Lk, D); v: (B, Hkv, Lk, Dv). H must be a multiple of Hkv
            (grouped-query / multi-query attention); any strides with a contiguous last dim.
        causal: False; True or ``"top_left"``: query i sees keys j <= i (torch's ``is_causal``);
            ``"bottom_right"``: query i sees keys j <= i + Lk - Lq (FlashAttention's alignment,
            what decoding with a KV cache needs when Lq < Lk).
        key_padding_mask: bool (B, Lk), **True = padding** (ignored), as nn.MultiheadAttention.
        attn_mask: bool (**True = attend**, as torch SDPA) or float (added to the scores),
            broadcastable to (B, H, Lq, Lk); read blockwise, never expanded. A float mask may
            require grad (a learned bias): its gradient, summed over the dims it broadcasts,
            comes from the kernels' backward.
        scale: default 1/sqrt(D).
        dropout_p: dropout on the attention probabilities, in [0, 1). The mask comes from a
            counter-based RNG seeded from torch's default generator (torch.manual_seed
            reproduces it) and is regenerated, not stored, for the backward.
        window: ``(left, right)``, FlashAttention's ``window_size``: key j is visible to query
            i iff ``i + d - left <= j <= i + d + right``, d = Lk - Lq with
            ``causal="bottom_right"``, else 0; -1: no limit on that side. ``causal=True`` is
            right = 0. Tiles outside the band are never visited: cost grows with
            L * (left + right), not L^2.
        softcap: c > 0: scores become ``c * tanh(s / c)`` after scaling, before the biases and
            masks (Gemma 2).
        alibi_slopes: fp32 (H,) or (B, H): adds ``-slope * |i + d - j|`` (ALiBi). Constants:
            no gradient reaches them.
        sinks: (H,): a per-head logit that joins every row's softmax denominator and adds no
            value (gpt-oss); may require grad.
        position_bias: an :class:`RelativePositionBias` (T5's bucketed bias), computed inside
            the kernels; its table's gradient comes from the backward.
        return_lse: also return the per-row log-sum-exp (B, H, Lq), fp32, natural log (sinks
            included), e.g. to merge partial attentions; it carries no gradient.

    Returns:
        out (B, H, Lq, Dv) in q's dtype, or ``(out, lse)`` with ``return_lse``. A query row
        whose keys are all masked (and no sink) gets zeros (and zero gradients), never NaN.
    """
    fn = "attention"
    _checks.flag(fn, "return_lse", return_lse)
    left, right = _window(fn, window)
    o = AttentionOptions(causal=causal_mode(fn, causal), scale=scale, dropout_p=dropout_p,
                         attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                         window_left=left, window_right=right, softcap=_softcap(fn, softcap),
                         alibi_slopes=alibi_slopes, sinks=sinks)
    _check(fn, q, k, v, o)
    _check_position_bias(fn, q, position_bias)
    out, lse = run(q, k, v, o, position_bias)
    return (out, lse) if return_lse else out


def run(q: Tensor, k: Tensor, v: Tensor, o: AttentionOptions,
        position_bias: Optional[RelativePositionBias] = None):
    """Validated inputs -> (out, lse): the dropout stream drawn, the sinks and the relative
    bias in the accumulation dtype (fp32; fp64 for fp64), the latter gathered from the T5
    table (differentiable casts and gathers of (H,) / (H, Lq + Lk - 1) tensors), then the op."""
    if o.dropout_p > 0:
        o.rng_state = draw_rng_state()
    acc = ref.acc_dtype(q.dtype)
    if o.sinks is not None and o.sinks.dtype != acc:
        o.sinks = o.sinks.to(acc)
    if position_bias is not None:
        Lq, Lk = q.shape[2], k.shape[2]
        rel = position_bias.rel_bias(Lq, Lk, ref.diagonal_offset(Lq, Lk, o.causal))
        o.rel_bias = rel.to(acc).contiguous()
    return ATTENTION((q, k, v), o)


def dropout_keep_mask(rng_state: Tensor, shape, dropout_p: float) -> Tensor:
    """The exact keep mask (B, H, Lq, Lk) a kernel drew for `rng_state` (tests, debugging)."""
    return keep_mask(rng_state, shape, dropout_p)


__all__ = ["attention", "AttentionOptions", "ATTENTION", "dropout_keep_mask", "causal_mode"]
