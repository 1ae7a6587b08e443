"""Launchers of the Triton flash-attention kernels (triton_kernels/attention.py).

Called by ``_Triton`` in ops/attention.py with validated inputs: q (B, H, Lq, D), k and v
(B, Hkv, Lk, D) with any strides and a contiguous last dim (activations are never copied), and
the call's AttentionOptions ``o``: attn_mask None or a (B, H, Lq, Lk) broadcast view (bool or
float); key_padding_mask None or bool (B, Lk); causal 0/1/2; rng_state None or an int64 CPU
tensor [seed, offset].
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


def _strides3(t: Tensor):
    """(batch, head, row) strides of a (B, H, L, D) tensor whose last dim is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, o):
    """Returns (out (B, H, Lq, D) in q's dtype, stored as (B, Lq, H, D); lse (B, H, Lq) fp32)."""
    from ..triton_kernels import attention as tk
    B, H, Lq, D = q.shape
    scale, dropout_p = o.scale_for(D), o.dropout_p
    Hkv, Lk = k.shape[1], k.shape[2]
    out = q.new_empty((B, Lq, H, v.shape[-1])).transpose(1, 2)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    mask, mask_strides, kpm, kpm_strides, mask_kind, has_kpm = _mask_args(q, Lk, o)
    seed, offset, drop_threshold, drop_scale = _dropout_args(o)
    kernel, config = tk.kernel_and_config("fwd")
    kernel[lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]) * B * H,)](
        q, k, v, mask, kpm, out, lse,
        *_strides3(q), *_strides3(k), *_strides3(v), *mask_strides, *kpm_strides,
        *_strides3(out),
        H, H // Hkv, Lq, Lk, scale * _LOG2E, seed, offset, drop_threshold, drop_scale,
        HEAD_DIM=D, CAUSAL=o.causal, MASK_KIND=mask_kind, HAS_KPM=has_kpm,
        DROPOUT=dropout_p > 0, BLOCK_D=triton.next_power_of_2(D),
        INTERPRET=tk.interpreter_mode(), **config)
    return out, lse


def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, o):
    """Returns (dq, dk, dv) in the input dtypes; dk, dv summed over each kv head's group."""
    from ..triton_kernels import attention as tk
    B, H, Lq, D = q.shape
    scale, dropout_p = o.scale_for(D), o.dropout_p
    Hkv, Lk = k.shape[1], k.shape[2]
    dout = rowwise(dout)  # autograd may hand over an expanded (stride-0) grad
    lse = lse.contiguous()  # ours: already contiguous (no copy)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0 or k.numel() == 0:  # no score at all: every gradient is zero
        return dq.zero_(), dk.zero_(), dv.zero_()
    mask, mask_strides, kpm, kpm_strides, mask_kind, has_kpm = _mask_args(q, Lk, o)
    seed, offset, drop_threshold, drop_scale = _dropout_args(o)
    block_d = triton.next_power_of_2(D)
    interpret = tk.interpreter_mode()

    delta = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    tk.attn_bwd_delta_kernel[(triton.cdiv(Lq, tk.DELTA_BLOCK_M) * B * H,)](
        out, dout, delta, *_strides3(out), *_strides3(dout), H, Lq,
        HEAD_DIM=D, BLOCK_M=tk.DELTA_BLOCK_M, BLOCK_D=block_d)

    common = (*_strides3(q), *_strides3(k), *_strides3(v), *mask_strides, *kpm_strides,
              *_strides3(dout))
    flags = dict(HEAD_DIM=D, CAUSAL=o.causal, MASK_KIND=mask_kind, HAS_KPM=has_kpm,
                 DROPOUT=dropout_p > 0, BLOCK_D=block_d, INTERPRET=interpret)
    dropout = (seed, offset, drop_threshold, drop_scale)
    scale = float(scale)  # a Python int would be specialized as an integer argument

    kernel, config = tk.kernel_and_config("dkdv")
    kernel[lambda meta: (triton.cdiv(Lk, meta["BLOCK_N"]) * B * Hkv,)](
        q, k, v, mask, kpm, dout, lse, delta, dk, dv, *common, *_strides3(dk), *_strides3(dv),
        H, Hkv, H // Hkv, Lq, Lk, scale * _LOG2E, scale, *dropout, **flags, **config)

    kernel, config = tk.kernel_and_config("dq")
    kernel[lambda meta: (triton.cdiv(Lq, meta["BLOCK_M"]) * B * H,)](
        q, k, v, mask, kpm, dout, lse, delta, dq, *common, *_strides3(dq),
        H, H // Hkv, Lq, Lk, scale * _LOG2E, scale, *dropout, **flags, **config)
    return dq, dk, dv
