"""Reference attention forward and backward: the score matrix materialized, fp32 (fp64 for fp64).

Conventions shared by every backend (the kernels' header comments derive the same formulas):

* q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); query head h reads kv head
  h // (H // Hkv) (GQA/MQA). d = Lk - Lq for causal 2 (bottom-right), else 0: the diagonal
  the causal cut, the window and ALiBi are aligned to.
* Scores, natural units: s_ij = scale * q_i . k_j; with softcap c, s = c * tanh(s / c); then
  the additive biases: ALiBi -slope_h * |i + d - j|, the relative-position bias
  rel_bias[h, j - i + Lq - 1] (T5's: table[bucket(j - i - d), h]), the float attn_mask. A key is excluded when the bool attn_mask is
  False, the key_padding_mask is True, causality forbids it (j > i + d), or it is outside the
  window (j < i + d - left, j > i + d + right; -1: no limit on that side).
* lse_i = log(sum_j exp(s_ij) over allowed keys [+ exp(sink_h)]) (natural log), saved in fp32; a
  row with no allowed key and no sink has lse = +inf, output 0 and zero gradients.
* P = exp(s - lse); with dropout, P' = P * keep / (1 - p), keep from reference/rng.py with
  element index ((b * H + h) * Lq + i) * Lk + j; out = P' v. The sink takes probability mass
  and adds no value.
* Backward: dP' = dO v^T (* keep / (1 - p)), delta_i = sum_d dO_id * out_id,
  dS = P * (dP' - delta) (the gradient of s, so of every additive bias: d attn_mask is dS summed
  over the mask's broadcast dims, d rel_bias[h, r] the sum of dS over the pairs with j - i + Lq - 1 = r),
  d sink_h = -sum_(b, i) exp(sink_h - lse_bhi) * delta_bhi; softcap: dS *= 1 - tanh^2;
  dq = scale * dS k, dk = scale * dS^T q, dv = P'^T dO (dk, dv summed over the query heads of a
  kv head).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import varlen
from .rng import keep_mask

CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def diagonal_offset(Lq: int, Lk: int, causal: int) -> int:
    """d: key i + d is query i's diagonal (bottom-right alignment for causal 2, else top-left)."""
    return Lk - Lq if causal == CAUSAL_BOTTOM_RIGHT else 0


def band_mask(Lq: int, Lk: int, causal: int, window_left: int = -1, window_right: int = -1,
              device=None) -> Optional[Tensor]:
    """Bool (Lq, Lk) of the pairs causality and the window allow, or None (all)."""
    if not causal and window_left < 0 and window_right < 0:
        return None
    d = diagonal_offset(Lq, Lk, causal)
    rel = torch.arange(Lk, device=device)[None, :] - torch.arange(Lq, device=device)[:, None] - d
    allowed = torch.ones(Lq, Lk, dtype=torch.bool, device=device)
    if causal:
        allowed &= rel <= 0
    if window_right >= 0:
        allowed &= rel <= window_right
    if window_left >= 0:
        allowed &= rel >= -window_left
    return allowed


def allowed_mask(B: int, H: int, Lq: int, Lk: int, attn_mask: Optional[Tensor],
                 key_padding_mask: Optional[Tensor], causal: int, device, window_left: int = -1,
                 window_right: int = -1) -> Optional[Tensor]:
    """Bool (broadcastable to (B, H, Lq, Lk)) of allowed (query, key) pairs, or None (all)."""
    allowed = None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = attn_mask
    if key_padding_mask is not None:
        kp = ~key_padding_mask[:, None, None, :]
        allowed = kp if allowed is None else allowed & kp
    band = band_mask(Lq, Lk, causal, window_left, window_right, device)
    if band is not None:
        allowed = band if allowed is None else allowed & band
    return allowed


def t5_buckets(relative_position: Tensor, bidirectional: bool, num_buckets: int,
               max_distance: int) -> Tensor:
    """T5's bucket of each relative position (key index - query index), as Hugging Face's
    ``T5Attention._relative_position_bucket`` computes it."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(relative_position.dtype) * num_buckets
        relative_position = relative_position.abs()
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact)
                         / torch.log(torch.tensor(max_distance / max_exact))
                         * (num_buckets - max_exact)).to(relative_position.dtype)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, large)


def _rel_index(Lq: int, Lk: int, device) -> Tensor:
    """(Lq, Lk): the index j - i + Lq - 1 into a relative-position bias vector."""
    return (torch.arange(Lk, device=device)[None, :] - torch.arange(Lq, device=device)[:, None]
            + (Lq - 1))


def _expand_kv(t: Tensor, H: int) -> Tensor:
    groups = H // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(t: Tensor, Hkv: int) -> Tensor:
    B, H = t.shape[:2]
    return t if H == Hkv else t.reshape(B, Hkv, H // Hkv, *t.shape[2:]).sum(2)


def _sum_to(t: Tensor, shape) -> Tensor:
    """t (B, H, Lq, Lk) summed over the dims `shape` broadcasts (shape: a mask's own shape)."""
    lead = t.dim() - len(shape)
    dims = [i for i in range(t.dim()) if i < lead or shape[i - lead] == 1 and t.shape[i] != 1]
    out = t.sum(dims, keepdim=True) if dims else t
    return out.reshape(shape)


def _scores(q: Tensor, k: Tensor, o):
    """(s, softcap's tanh or None, allowed or None): s in the accumulation dtype, every bias
    added, excluded pairs not yet filled."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), _expand_kv(k, H).to(acc).transpose(-1, -2)) * o.scale_for(D)
    tanh = None
    if o.softcap:
        tanh = torch.tanh(s / o.softcap)
        s = o.softcap * tanh
    d = diagonal_offset(Lq, Lk, o.causal)
    if o.alibi_slopes is not None:
        dist = (torch.arange(Lq, device=q.device)[:, None] + d
                - torch.arange(Lk, device=q.device)[None, :]).abs().to(acc)
        slopes = o.alibi_slopes.to(acc)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        s = s - slopes * dist
    if o.rel_bias is not None:
        s = s + o.rel_bias.to(acc)[:, _rel_index(Lq, Lk, q.device)][None]  # (1, H, Lq, Lk)
    attn_mask = o.attn_mask
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + attn_mask.to(acc)
    allowed = allowed_mask(B, H, Lq, Lk, attn_mask, o.key_padding_mask, o.causal, q.device,
                           o.window_left, o.window_right)
    return s, tanh, allowed


def _probs(q, k, o):
    """(P, lse, softcap's tanh) in the accumulation dtype; P rows without an allowed key are 0."""
    s, tanh, allowed = _scores(q, k, o)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    if o.sinks is not None:
        lse = torch.logaddexp(lse, o.sinks.to(lse.dtype)[None, :, None])
    empty = torch.isneginf(lse)
    p = torch.exp(s - lse.unsqueeze(-1))
    p = torch.where(empty.unsqueeze(-1), torch.zeros_like(p), p)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    return p, lse, tanh


def _dropout_scale(o, shape, device, dtype):
    keep = keep_mask(o.rng_state, shape, o.dropout_p, device=device)
    return keep.to(dtype) / (1.0 - o.dropout_p)


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, o, with_residual: bool = False):
    """o: ops/attention.py's AttentionOptions. Returns (out (B, H, Lq, Dv) in q's dtype,
    lse (B, H, Lq) fp32 (fp64 for fp64 inputs)); variable lengths: reference/varlen.py.
    with_residual: a third output, what rounding the output to q's dtype lost (the fp32 output
    minus out, in q's dtype; zeros for packed sequences), for attention_bwd's delta."""
    if with_residual:
        if o.cu_seqlens_q is None and o.seqlens_k is None:
            out, lse, exact = _fwd(q, k, v, o)
            return out, lse, (exact - out.to(exact.dtype)).to(out.dtype)
        out, lse = attention_fwd(q, k, v, o)
        return out, lse, torch.zeros_like(out)
    if o.cu_seqlens_q is not None:
        return varlen.varlen_fwd(attention_fwd, q, k, v, o)
    if o.seqlens_k is not None:
        return varlen.kvcache_fwd(attention_fwd, q, k, v, o)
    return _fwd(q, k, v, o)[:2]


def _fwd(q: Tensor, k: Tensor, v: Tensor, o):
    """(out in q's dtype, lse, out in the accumulation dtype) of a dense call."""
    H = q.shape[1]
    p, lse, _ = _probs(q, k, o)
    if o.dropout_p > 0:
        p = p * _dropout_scale(o, p.shape, q.device, p.dtype)
    exact = torch.matmul(p, _expand_kv(v, H).to(p.dtype))
    return exact.to(q.dtype), lse.to(acc_dtype(q.dtype)), exact


def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, o,
                  out_residual: Optional[Tensor] = None):
    """Returns (dq, dk, dv, d attn_mask, d sinks, d rel_bias) in the inputs' dtypes, None for
    the options that are absent or have no gradient. Recomputes P (the saved lse is not needed
    by the reference, which recomputes it too; it is part of the interface of the kernels).
    out_residual (attention_fwd's): delta = dO . (out + residual), from the unrounded output."""
    if o.cu_seqlens_q is not None:
        return varlen.varlen_bwd(attention_bwd, dout, q, k, v, out, lse, o)
    if o.seqlens_k is not None:
        raise NotImplementedError("attention_with_kvcache is forward only")
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[3]
    p, lse_acc, tanh = _probs(q, k, o)
    acc = p.dtype
    do = dout.to(acc)
    dp = torch.matmul(do, _expand_kv(v, H).to(acc).transpose(-1, -2))
    p_drop = p
    if o.dropout_p > 0:
        drop = _dropout_scale(o, p.shape, q.device, acc)
        dp = dp * drop
        p_drop = p * drop
    exact = out.to(acc) if out_residual is None or out_residual.numel() == 0 else out.to(acc) + out_residual.to(acc)
    delta = (do * exact).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    d_mask = d_sinks = d_table = None
    if o.attn_mask is not None and o.attn_mask.dtype != torch.bool:
        d_mask = _sum_to(ds, o.attn_mask.shape).to(o.attn_mask.dtype)
    if o.sinks is not None:
        p_sink = torch.exp(o.sinks.to(acc)[None, :, None] - lse_acc)
        d_sinks = -(p_sink * delta[..., 0]).sum((0, 2)).to(o.sinks.dtype)
    if o.rel_bias is not None:
        Lq, Lk = q.shape[2], k.shape[2]
        per_pair = ds.sum(0).reshape(H, -1)                                  # (H, Lq * Lk)
        d_table = torch.zeros(H, Lq + Lk - 1, dtype=acc, device=q.device)
        d_table.index_add_(1, _rel_index(Lq, Lk, q.device).reshape(-1), per_pair)
        d_table = d_table.to(o.rel_bias.dtype)
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    scale = o.scale_for(D)
    dq = torch.matmul(ds, _expand_kv(k, H).to(acc)) * scale
    dk = _reduce_kv(torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale, Hkv)
    dv = _reduce_kv(torch.matmul(p_drop.transpose(-1, -2), do), Hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_mask, d_sinks, d_table
