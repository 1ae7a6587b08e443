"""Reference attention forward and backward: the score matrix materialized, fp32 (fp64 for fp64).

Conventions shared by every backend (the kernels' header comments derive the same formulas):

* q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); query head h reads kv head
  h // (H // Hkv) (GQA/MQA).
* s_ij = scale * q_i . k_j + bias_ij, where the float attn_mask is the bias; a key is excluded
  when the bool attn_mask is False, the key_padding_mask is True, or causality forbids it:
  causal 1 (top-left, torch's is_causal) allows j <= i; causal 2 (bottom-right, FlashAttention's,
  for KV-cache decoding) allows j <= i + Lk - Lq.
* lse_i = log sum_j exp(s_ij) over allowed keys (natural log), saved in fp32; a row with no
  allowed key (or all scores -inf) has lse = +inf, output 0 and zero gradients.
* P = exp(s - lse); with dropout, P' = P * keep / (1 - p), keep from reference/rng.py with
  element index ((b * H + h) * Lq + i) * Lk + j; out = P' v.
* Backward: dP' = dO v^T (* keep / (1 - p)), delta_i = sum_d dO_id * out_id,
  dS = P * (dP' - delta), dq = scale * dS k, dk = scale * dS^T q, dv = P'^T dO (dk, dv summed
  over the query heads of a kv head).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .rng import keep_mask

CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def allowed_mask(B: int, H: int, Lq: int, Lk: int, attn_mask: Optional[Tensor],
                 key_padding_mask: Optional[Tensor], causal: int, device) -> Optional[Tensor]:
    """Bool (broadcastable to (B, H, Lq, Lk)) of allowed (query, key) pairs, or None (all)."""
    allowed = None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed = attn_mask
    if key_padding_mask is not None:
        kp = ~key_padding_mask[:, None, None, :]
        allowed = kp if allowed is None else allowed & kp
    if causal:
        i = torch.arange(Lq, device=device)[:, None]
        j = torch.arange(Lk, device=device)[None, :]
        c = j <= i if causal == CAUSAL_TOP_LEFT else j <= i + (Lk - Lq)
        allowed = c if allowed is None else allowed & c
    return allowed


def _expand_kv(t: Tensor, H: int) -> Tensor:
    groups = H // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(t: Tensor, Hkv: int) -> Tensor:
    B, H = t.shape[:2]
    return t if H == Hkv else t.reshape(B, Hkv, H // Hkv, *t.shape[2:]).sum(2)


def _probs(q, k, o):
    """(P, lse) in the accumulation dtype; P rows of fully masked queries are 0."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), _expand_kv(k, H).to(acc).transpose(-1, -2)) * o.scale_for(D)
    attn_mask = o.attn_mask
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        s = s + attn_mask.to(acc)
    allowed = allowed_mask(B, H, Lq, Lk, attn_mask, o.key_padding_mask, o.causal, q.device)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - lse.unsqueeze(-1))
    p = torch.where(empty.unsqueeze(-1), torch.zeros_like(p), p)
    lse = torch.where(empty, torch.full_like(lse, float("inf")), lse)
    return p, lse


def _dropout_scale(o, shape, device, dtype):
    keep = keep_mask(o.rng_state, shape, o.dropout_p, device=device)
    return keep.to(dtype) / (1.0 - o.dropout_p)


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, o):
    """o: ops/attention.py's AttentionOptions. Returns (out (B, H, Lq, Dv) in q's dtype,
    lse (B, H, Lq) fp32 (fp64 for fp64 inputs))."""
    H = q.shape[1]
    p, lse = _probs(q, k, o)
    if o.dropout_p > 0:
        p = p * _dropout_scale(o, p.shape, q.device, p.dtype)
    out = torch.matmul(p, _expand_kv(v, H).to(p.dtype))
    return out.to(q.dtype), lse.to(acc_dtype(q.dtype))


def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, o):
    """Returns (dq, dk, dv) in the input dtypes. Recomputes P (the saved lse is not needed by
    the reference, which recomputes it too; it is part of the interface of the kernels)."""
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[3]
    p, _ = _probs(q, k, o)
    acc = p.dtype
    do = dout.to(acc)
    dp = torch.matmul(do, _expand_kv(v, H).to(acc).transpose(-1, -2))
    p_drop = p
    if o.dropout_p > 0:
        drop = _dropout_scale(o, p.shape, q.device, acc)
        dp = dp * drop
        p_drop = p * drop
    delta = (do * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    scale = o.scale_for(D)
    dq = torch.matmul(ds, _expand_kv(k, H).to(acc)) * scale
    dk = _reduce_kv(torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale, Hkv)
    dv = _reduce_kv(torch.matmul(p_drop.transpose(-1, -2), do), Hkv)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
