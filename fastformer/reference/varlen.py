"""Reference of the variable-length calls (ops/varlen.py): each sequence (or batch row) attended
alone by reference/attention.py.

* Packed (cu_seqlens_q / cu_seqlens_k): sequence s is q[cu_q[s]:cu_q[s+1]] against
  k, v[cu_k[s]:cu_k[s+1]], as a (1, H, Lq_s, D) call with ALiBi slopes row s when they are
  (S, H); its dropout stream starts at offset + sum over earlier sequences of H * Lq * Lk (the
  element index of (s, h, i, j) is that base + (h * Lq_s + i) * Lk_s + j). lse is (H, total_q).
* KV cache (seqlens_k, block_table, leftpad_k): batch row b attends to its first seqlens_k[b]
  keys, or with leftpad_k to keys leftpad_k[b] .. seqlens_k[b] as if the row began there; the
  diagonal aligned to them (d = seqlens_k[b] - leftpad_k[b] - Lq for causal 2); a paged cache
  is gathered through block_table.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor


def _one(o, **changes):
    """o for one sequence: the length options cleared."""
    return dataclasses.replace(o, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                               max_seqlen_k=0, seqlens_k=None, block_table=None, leftpad_k=None,
                               **changes)


def sequences(o):
    """[(q rows, k rows, alibi slopes)] per packed sequence."""
    cq, ck = o.cu_seqlens_q.tolist(), o.cu_seqlens_k.tolist()
    out = []
    for s in range(len(cq) - 1):
        slopes = o.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[s]
        out.append((slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1]), slopes))
    return out


def _heads_first(t: Tensor) -> Tensor:
    """(L, H, D) rows of a packed tensor as a (1, H, L, D) view."""
    return t.transpose(0, 1)[None]


def varlen_fwd(attention_fwd, q, k, v, o):
    """(out (total_q, H, Dv), lse (H, total_q))."""
    T, H, _ = q.shape
    out = q.new_empty((T, H, v.shape[-1]))
    lse = torch.empty((H, T), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                      device=q.device)
    base = 0
    for qs, ks, slopes in sequences(o):
        o_s = _one(o, alibi_slopes=slopes, rng_state=_shifted(o.rng_state, base))
        out_s, lse_s = attention_fwd(_heads_first(q[qs]), _heads_first(k[ks]), _heads_first(v[ks]), o_s)
        out[qs] = out_s[0].transpose(0, 1)
        lse[:, qs] = lse_s[0]
        base += H * (qs.stop - qs.start) * (ks.stop - ks.start)
    return out, lse


def varlen_bwd(attention_bwd, dout, q, k, v, out, lse, o):
    """(dq, dk, dv, None, d sinks, None) of the packed call."""
    T, H, _ = q.shape
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    d_sinks = None if o.sinks is None else torch.zeros_like(o.sinks)
    base = 0
    for qs, ks, slopes in sequences(o):
        o_s = _one(o, alibi_slopes=slopes, rng_state=_shifted(o.rng_state, base))
        g = attention_bwd(_heads_first(dout[qs]), _heads_first(q[qs]), _heads_first(k[ks]),
                          _heads_first(v[ks]), _heads_first(out[qs]), lse[:, qs][None], o_s)
        dq[qs] = g[0][0].transpose(0, 1)
        dk[ks] = g[1][0].transpose(0, 1)
        dv[ks] = g[2][0].transpose(0, 1)
        if d_sinks is not None and g[4] is not None:
            d_sinks += g[4]
        base += H * (qs.stop - qs.start) * (ks.stop - ks.start)
    return dq, dk, dv, None, d_sinks, None


def _shifted(rng_state, by: int):
    if rng_state is None:
        return None
    seed, offset = rng_state.tolist()
    return torch.tensor([seed, offset + by], dtype=torch.int64)


def cache_rows(k: Tensor, v: Tensor, o, b: int):
    """Batch row b's keys and values (1, Hkv, seqlens_k[b] - leftpad_k[b], D), gathered from the
    pages."""
    n = int(o.seqlens_k[b])
    start = int(o.leftpad_k[b]) if o.leftpad_k is not None else 0
    if o.block_table is None:
        return k[b:b + 1, :, start:n], v[b:b + 1, :, start:n]
    size = k.shape[2]
    blocks = o.block_table[b, :(n + size - 1) // size].long()
    gather = lambda t: t[blocks].transpose(0, 1).reshape(t.shape[1], -1, t.shape[3])[:, start:n][None]  # noqa: E731
    return gather(k), gather(v)


def kvcache_fwd(attention_fwd, q, k, v, o):
    """(out (B, H, Lq, Dv), lse (B, H, Lq)) against each row's first seqlens_k[b] keys."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        kb, vb = cache_rows(k, v, o, b)
        slopes = o.alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b:b + 1]
        out_b, lse_b = attention_fwd(q[b:b + 1], kb, vb, _one(o, alibi_slopes=slopes))
        outs.append(out_b)
        lses.append(lse_b)
    return torch.cat(outs), torch.cat(lses)
