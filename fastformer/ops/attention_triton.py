"""Launchers of the Triton flash-attention kernels (triton_kernels/attention.py).

Called by ``_Triton`` in ops/attention.py with validated inputs: q (B, H, Lq, D), k (B, Hkv, Lk, D)
and v (B, Hkv, Lk, Dv) (Dv may differ from D, as in MLA: the kernels take both head dims, nothing is
padded) with any strides and a contiguous last dim (activations are never copied), and the call's
AttentionOptions ``o`` (reference/attention.py is the semantics of every field): attn_mask None or a
bool / float tensor in its own shape, broadcastable to (B, H, Lq, Lk) (expanded here as a view:
stride 0 on broadcast dims); key_padding_mask None or bool (B, Lk); causal 0/1/2; window_left /
window_right (-1: no limit); softcap (0: off); alibi_slopes None or fp32 (H,) / (B, H); sinks None
or fp32 (H,); rel_bias None or fp32 (H, Lq + Lk - 1); rng_state None or an int64 CPU tensor [seed,
offset].

Packed sequences (o.cu_seqlens_q set, FlashAttention's varlen layout): q (total_q, H, D), k
(total_k, Hkv, D), v (total_k, Hkv, Dv), out (total_q, H, Dv) and lse (H, total_q). The kernels take
these (T, H, D) tensors as they are, with batch stride 0 (_strides3), and run in their PACKED mode:
the grid's batch index is the sequence, sized by max_seqlen_q / max_seqlen_k; each program reads its
sequence's first rows and lengths from cu_seqlens_q / cu_seqlens_k and its dropout counter base from
the prefix sums of H * Lq_s * Lk_s (_packed_args). No attn_mask, key_padding_mask or relative bias
with them (``_Triton`` declines those calls).
"""
from __future__ import annotations

import math
import torch
import triton
from torch import Tensor

from ..reference.rng import threshold
from ._opdef import rowwise, seed_offset

_LOG2E = 1.0 / math.log(2.0)


def _mask_args(q: Tensor, Lk: int, o):
    """(mask tensor, its 4 strides, kpm tensor, its 2 strides, MASK_KIND, HAS_KPM); q stands in
    for an absent mask (never read)."""
    from ..triton_kernels import attention as tk
    attn_mask, key_padding_mask = o.attn_mask, o.key_padding_mask
    if attn_mask is not None:
        attn_mask = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], Lk)  # a view
    if attn_mask is None:
        mask, mask_strides, kind = q, (0, 0, 0, 0), tk.MASK_NONE
    else:
        mask, mask_strides = attn_mask, attn_mask.stride()
        kind = tk.MASK_BOOL if attn_mask.dtype == torch.bool else tk.MASK_FLOAT
    if key_padding_mask is None:
        kpm, kpm_strides = q, (0, 0)
    else:
        kpm, kpm_strides = key_padding_mask, key_padding_mask.stride()
    return mask, mask_strides, kpm, kpm_strides, kind, key_padding_mask is not None


def _dropout_args(o):
    """(seed, offset, threshold, 1 / (1 - p)) as the kernels take them."""
    if o.dropout_p <= 0:
        return 0, 0, 0, 1.0
    seed, offset = seed_offset(o.rng_state)
    return seed, offset, threshold(o.dropout_p), 1.0 / (1.0 - o.dropout_p)


def _band(Lq: int, Lk: int, o):
    """(left, right, WINDOW_LEFT, WINDOW_RIGHT): the band i + d - left <= j <= i + d + right
    (d = Lk - Lq for causal 2, else 0: the kernels' BOTTOM_RIGHT); causality is right = 0. A
    limit of max(Lq, Lk) or more excludes no pair: it becomes no limit (no edge masks).
    WINDOW_RIGHT: 0 no limit, 1 right = 0 (a compile-time 0), 2 right > 0."""
    left, right = o.window_left, o.window_right
    if o.causal:
        right = 0
    reach = max(Lq, Lk)
    left = -1 if left >= reach else left
    right = -1 if right >= reach else right
    return max(left, 0), max(right, 0), left >= 0, 0 if right < 0 else 1 if right == 0 else 2


def _variant_args(q: Tensor, Lq: int, Lk: int, o):
    """The score-variant arguments every kernel takes: (pointers, strides, scalars, flags) =
    ((alibi, rel_bias), (alibi b, h; rel_bias head), (left, right, qk_scale, softcap_in),
    constexprs). q stands in for absent tensors (never read)."""
    D = q.shape[-1]
    scale, cap = o.scale_for(D), float(o.softcap)
    left, right, has_left, has_right = _band(Lq, Lk, o)
    slopes, rel = o.alibi_slopes, o.rel_bias
    if slopes is None:
        slopes, slope_strides = q, (0, 0)
    else:
        slope_strides = (0, slopes.stride(0)) if slopes.dim() == 1 else slopes.stride()
    if rel is None:
        rel, rel_stride = q, 0
    else:
        rel = rel.contiguous()  # (H, Lq + Lk - 1): ours is (a permuted gather, no copy below)
        rel_stride = rel.stride(0)
    qk_scale = (cap if cap > 0 else scale) * _LOG2E
    softcap_in = scale / cap if cap > 0 else 0.0
    flags = dict(BOTTOM_RIGHT=o.causal == 2, WINDOW_LEFT=has_left, WINDOW_RIGHT=has_right,
                 SOFTCAP=cap > 0, ALIBI=o.alibi_slopes is not None,
                 TABLE=o.rel_bias is not None)
    return ((slopes, rel), (*slope_strides, rel_stride),
            (left, right, float(qk_scale), float(softcap_in)), flags)


def _strides3(t: Tensor):
    """(batch, head, row) strides of a (B, H, L, D) tensor whose last dim is contiguous; of a
    packed (T, H, D) one (0, head, row): the kernels find its sequences through cu_seqlens."""
    if t.dim() == 3:
        return 0, t.stride(1), t.stride(0)
    return t.stride(0), t.stride(1), t.stride(2)


def _shape(q: Tensor, k: Tensor, o):
    """(B, H, Hkv, Lq, Lk, D) as the grids and kernels see them: packed, B is the number of
    sequences and Lq, Lk the longest lengths."""
    if o.cu_seqlens_q is None:
        B, H, Lq, D = q.shape
        return B, H, k.shape[1], Lq, k.shape[2], D
    for name in ("attn_mask", "key_padding_mask", "rel_bias"):
        if getattr(o, name) is not None:
            raise ValueError(f"attention (triton): `{name}` is not supported with packed "
                             "sequences (cu_seqlens_q)")
    return (o.cu_seqlens_q.shape[0] - 1, q.shape[1], k.shape[1], int(o.max_seqlen_q),
            int(o.max_seqlen_k), q.shape[2])


def _packed_args(q: Tensor, lse: Tensor, o):
    """(cu_q, cu_k, rng_seq), (lse batch, head strides), PACKED: rng_seq is the int64 prefix
    sums of H * Lq_s * Lk_s (sequence s's dropout counter base, relative to the offset); q
    stands in for absent tensors (never read). lse and delta share these strides."""
    if o.cu_seqlens_q is None:
        return (q, q, q), (lse.stride(0), lse.stride(1)), False
    cu_q, cu_k = o.cu_seqlens_q, o.cu_seqlens_k
    rng_seq = q
    if o.dropout_p > 0:
        n = q.shape[1] * (cu_q[1:] - cu_q[:-1]).long() * (cu_k[1:] - cu_k[:-1]).long()
        rng_seq = n.cumsum(0) - n
    return (cu_q, cu_k, rng_seq), (0, lse.stride(0)), True


def _head_dims(q: Tensor, v: Tensor) -> dict:
    """The kernels' head-dim constexprs: HEAD_DIM, BLOCK_D of q / k (D) and HEAD_DIM_V, BLOCK_DV
    of v / out (Dv); BLOCK_* the next powers of two."""
    D, Dv = q.shape[-1], v.shape[-1]
    return dict(HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), HEAD_DIM_V=Dv,
                BLOCK_DV=triton.next_power_of_2(Dv))


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, o):
    """Returns (out (B, H, Lq, Dv) in q's dtype, stored as (B, Lq, H, Dv); lse (B, H, Lq) fp32,
    natural log, the sink included; +inf on rows with no allowed key and no sink). Packed:
    out (total_q, H, Dv) and lse (H, total_q)."""
    from ..triton_kernels import attention as tk
    B, H, Hkv, Lq, Lk, _ = _shape(q, k, o)
    if o.cu_seqlens_q is None:
        out = q.new_empty((B, Lq, H, v.shape[-1])).transpose(1, 2)
        lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    else:
        out = q.new_empty((q.shape[0], H, v.shape[-1]))
        lse = torch.empty((H, q.shape[0]), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    mask, mask_strides, kpm, kpm_strides, mask_kind, has_kpm = _mask_args(q, Lk, o)
    ptrs, var_strides, scalars, flags = _variant_args(q, Lq, Lk, o)
    seq_ptrs, lse_strides, packed = _packed_args(q, lse, o)
    sinks = q if o.sinks is None else o.sinks.contiguous()
    kernel, config = tk.kernel_and_config("fwd")
    kernel[lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]) * B * H,)](
        q, k, v, mask, kpm, *ptrs, *seq_ptrs, sinks, out, lse,
        *_strides3(q), *_strides3(k), *_strides3(v), *mask_strides, *kpm_strides,
        *_strides3(out), *var_strides, *lse_strides,
        H, H // Hkv, Lq, Lk, *scalars, *_dropout_args(o),
        MASK_KIND=mask_kind, HAS_KPM=has_kpm, DROPOUT=o.dropout_p > 0,
        SINKS=o.sinks is not None, PACKED=packed, **flags, **_head_dims(q, v),
        INTERPRET=tk.interpreter_mode(), **config)
    return out, lse


def _mask_grad_buffer(o, B: int, H: int, Lq: int, Lk: int):
    """(buffer in the mask's shape, its (B, H, Lq, Lk) view, MASK_GRAD): zeros in the mask's
    dtype, stored tile by tile, when the view has no stride-0 dim of size > 1 (each element is
    one (b, h, i, j)); else fp32 zeros the kernel adds into with atomics."""
    from ..triton_kernels import attention as tk
    mask = o.attn_mask
    shape = (B, H, Lq, Lk)
    probe = torch.empty(mask.shape, device="meta").expand(shape)
    broadcast = any(st == 0 and n > 1 for st, n in zip(probe.stride(), shape))
    kind = tk.GRAD_ATOMIC if broadcast else tk.GRAD_STORE
    buf = torch.zeros(mask.shape, device=mask.device,
                      dtype=torch.float32 if broadcast else mask.dtype)
    return buf, buf.expand(shape), kind


def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, o,
                  needs=None):
    """Returns (dq, dk, dv, d attn_mask, d sinks, d rel_bias) in the inputs' dtypes (dv, like v and
    dout, Dv wide); dk, dv summed over each kv head's group; an option's gradient is None when the
    option is absent (or a bool mask) or `needs` (q, k, v, attn_mask, sinks, rel_bias flags; None:
    all) does not ask for it. d attn_mask has the mask's own shape (dS summed over its broadcast
    dims); d sinks comes from the saved lse and delta: -sum_(b, i) exp(sink_h - lse) * delta.
    Packed: dq, dk, dv in the packed layout of q, k, v; lse (H, total_q)."""
    from ..triton_kernels import attention as tk
    B, H, Hkv, Lq, Lk, D = _shape(q, k, o)
    scale = float(o.scale_for(D))  # a Python int would be specialized as an integer argument
    needs = (True,) * 6 if needs is None else tuple(needs)
    want_mask = (needs[3] and o.attn_mask is not None and o.attn_mask.dtype != torch.bool)
    want_sinks = needs[4] and o.sinks is not None
    want_table = needs[5] and o.rel_bias is not None
    dout = rowwise(dout)  # autograd may hand over an expanded (stride-0) grad
    lse = lse.contiguous()  # ours: already contiguous (no copy)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if want_mask:
        dmask, dmask_view, mask_grad = _mask_grad_buffer(o, B, H, Lq, Lk)
    else:
        dmask, dmask_view, mask_grad = None, q, tk.GRAD_NONE
    dtable = None
    if want_table:
        dtable = torch.zeros(H, Lq + Lk - 1, dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:  # no score at all: every gradient is zero
        d_sinks = torch.zeros_like(o.sinks) if want_sinks else None
        return (dq.zero_(), dk.zero_(), dv.zero_(), dmask if dmask is None else
                dmask.to(o.attn_mask.dtype), d_sinks,
                dtable if dtable is None else dtable.to(o.rel_bias.dtype))
    mask, mask_strides, kpm, kpm_strides, mask_kind, has_kpm = _mask_args(q, Lk, o)
    ptrs, var_strides, scalars, flags = _variant_args(q, Lq, Lk, o)
    seq_ptrs, lse_strides, packed = _packed_args(q, lse, o)
    dims = _head_dims(q, v)

    delta = torch.empty_like(lse)  # row by row: packed, one batch row of total_q rows
    rows, batch = (q.shape[0], 1) if packed else (Lq, B)
    tk.attn_bwd_delta_kernel[(triton.cdiv(rows, tk.DELTA_BLOCK_M) * batch * H,)](
        out, dout, delta, *_strides3(out), *_strides3(dout), H, rows,
        HEAD_DIM_V=dims["HEAD_DIM_V"], BLOCK_M=tk.DELTA_BLOCK_M, BLOCK_DV=dims["BLOCK_DV"])

    common = (*_strides3(q), *_strides3(k), *_strides3(v), *mask_strides, *kpm_strides,
              *_strides3(dout))
    flags = dict(MASK_KIND=mask_kind, HAS_KPM=has_kpm, DROPOUT=o.dropout_p > 0,
                 PACKED=packed, **flags, **dims, INTERPRET=tk.interpreter_mode())
    tail = (*scalars, scale, *_dropout_args(o))

    kernel, config = tk.kernel_and_config("dkdv")
    kernel[lambda meta: (triton.cdiv(Lk, meta["BLOCK_N"]) * B * Hkv,)](
        q, k, v, mask, kpm, *ptrs, *seq_ptrs, dout, lse, delta, dk, dv, *common, *_strides3(dk),
        *_strides3(dv), *var_strides, *lse_strides, H, Hkv, H // Hkv, Lq, Lk, *tail, **flags,
        **config)

    kernel, config = tk.kernel_and_config("dq")
    kernel[lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]) * B * H,)](
        q, k, v, mask, kpm, *ptrs, *seq_ptrs, dout, lse, delta, dq, dmask_view,
        q if dtable is None else dtable, *common, *_strides3(dq),
        *(dmask_view.stride() if want_mask else (0, 0, 0, 0)), *var_strides, *lse_strides,
        H, H // Hkv, Lq, Lk, *tail, MASK_GRAD=mask_grad, TABLE_GRAD=want_table, **flags,
        **config)

    d_mask = None if dmask is None else dmask.to(o.attn_mask.dtype)
    d_sinks = None
    if want_sinks:
        p_sink = torch.exp(o.sinks.to(torch.float32)[None, :, None] - lse)  # 0 where lse = inf
        d_sinks = (-(p_sink * delta).sum((0, 2))).to(o.sinks.dtype)
    d_table = None if dtable is None else dtable.to(o.rel_bias.dtype)
    return dq, dk, dv, d_mask, d_sinks, d_table
