"""Variable lengths: ff.varlen_attention (packed sequences, FlashAttention's varlen layout) and
ff.attention_with_kvcache (decoding against a KV cache, contiguous or paged).

Both are the attention op (ops/attention.py, ATTENTION) with the options that describe the
lengths (AttentionOptions.cu_seqlens_q / cu_seqlens_k / seqlens_k / block_table); an
implementation that does not list them declines the call and ``auto`` falls back. On the cpu
backend a call with few queries per row of keys (decoding) takes a split-key kernel
(csrc/cpu/attention_decode.cpp: flash-decoding, the keys of one kv head split across threads
and the partial results merged by their log-sum-exp).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _checks
from ..reference.attention import CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE
from ..reference import rotary as rotary_ref
from .attention import AttentionOptions, _softcap, _window, run
from .rotary import apply_rotary


def _int32_vector(fn: str, name: str, t, n: Optional[int], device) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: `{name}` must be an int32 tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{fn}: `{name}` must be int32, got {_checks._dt(t.dtype)}")
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        want = f"({n},)" if n is not None else "1-D"
        raise ValueError(f"{fn}: `{name}` must have shape {want}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{fn}: `{name}` is on {t.device} but `q` is on {device}; all tensors "
                         "must be on one device")


def _check_cu_seqlens(fn: str, name: str, cu: Tensor, total: int, max_len, max_name: str, q):
    _int32_vector(fn, name, cu, None, q.device)
    if cu.shape[0] < 1:
        raise ValueError(f"{fn}: `{name}` must hold at least one entry (0), got shape (0,)")
    values = cu.tolist()  # small (batch + 1): one sync, as FlashAttention's checks
    if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{fn}: `{name}` must start at 0 and be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"{fn}: the last entry of `{name}` ({values[-1]}) must be the number of "
                         f"packed rows ({total})")
    longest = max((b - a for a, b in zip(values, values[1:])), default=0)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < longest:
        raise ValueError(f"{fn}: `{max_name}` must be an int >= the longest sequence "
                         f"({longest}), got {max_len!r}")
    return values


def _check_qkv(fn: str, q, k, v, q_dims: int, kv_dims: int):
    for name, t, dims in (("q", q, q_dims), ("k", k, kv_dims), ("v", v, kv_dims)):
        _checks.tensor(fn, name, t, dims=(dims,))
    _checks.same_device(fn, "q", q, k=k, v=v)
    _checks.same_dtype(fn, "q", q, k=k, v=v)


def _heads(fn: str, H: int, Hkv: int) -> None:
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"{fn}: the number of query heads of `q` ({H}) must be a multiple of the "
                         f"number of key/value heads of `k` ({Hkv})")


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False, window=None,
                     softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                     sinks: Optional[Tensor] = None, scale: Optional[float] = None,
                     dropout_p: float = 0.0, return_lse: bool = False):
    """Attention over packed sequences of different lengths, with no padding (FlashAttention's
    ``flash_attn_varlen_func`` layout).

    Args:
        q: (total_q, H, D); k, v: (total_k, Hkv, D) / (total_k, Hkv, Dv), H a multiple of Hkv.
            Sequence s is rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` of q and
            ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]`` of k and v; sequences never see each other.
        cu_seqlens_q, cu_seqlens_k: int32 (S + 1,), starting at 0, non-decreasing, ending at
            total_q / total_k (sequences of length 0 allowed).
        max_seqlen_q, max_seqlen_k: at least the longest sequence.
        causal: bottom-right aligned per sequence, as FlashAttention: query i of a sequence of
            Lq queries and Lk keys sees keys j <= i + Lk - Lq.
        window, softcap, alibi_slopes ((H,) or (S, H) fp32), sinks, scale, dropout_p: as
            ``ff.attention`` (the window aligned like causality: bottom-right with causal).
        return_lse: also return the log-sum-exp, (H, total_q) fp32.

    Returns:
        (total_q, H, Dv) in q's dtype, or ``(out, lse)``. Differentiable in q, k, v (and the
        sinks). On the cpu backend the work is split by (sequence, head, query block), so one
        long sequence among many short ones keeps every core busy; the triton backend runs
        its kernels in their packed mode (a program per sequence, head and query block; no
        copies of the packed tensors).
    """
    fn = "varlen_attention"
    _check_qkv(fn, q, k, v, 3, 3)
    T, H, D = q.shape
    Tk, Hkv, Dk = k.shape
    if Dk != D:
        raise ValueError(f"{fn}: `k` has head dim {Dk} but `q` has {D}; they must match")
    if tuple(v.shape[:2]) != (Tk, Hkv):
        raise ValueError(f"{fn}: `v` must have shape ({Tk}, {Hkv}, Dv) to match `k`, got "
                         f"{tuple(v.shape)}")
    _heads(fn, H, Hkv)
    cq = _check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, T, max_seqlen_q, "max_seqlen_q", q)
    ck = _check_cu_seqlens(fn, "cu_seqlens_k", cu_seqlens_k, Tk, max_seqlen_k, "max_seqlen_k", q)
    if len(cq) != len(ck):
        raise ValueError(f"{fn}: `cu_seqlens_q` ({len(cq) - 1} sequences) and `cu_seqlens_k` "
                         f"({len(ck) - 1}) must describe the same number of sequences")
    _checks.flag(fn, "causal", causal)
    _checks.flag(fn, "return_lse", return_lse)
    left, right = _window(fn, window)
    S = len(cq) - 1
    if alibi_slopes is not None:
        _checks.tensor(fn, "alibi_slopes", alibi_slopes, dtypes=(torch.float32,))
        _checks.same_device(fn, "q", q, alibi_slopes=alibi_slopes)
        if tuple(alibi_slopes.shape) not in ((H,), (S, H)):
            raise ValueError(f"{fn}: `alibi_slopes` must have shape ({H},) or ({S}, {H}) (per "
                             f"head, or per sequence and head), got {tuple(alibi_slopes.shape)}")
    o = AttentionOptions(causal=CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE, scale=scale,
                         dropout_p=dropout_p, window_left=left, window_right=right,
                         softcap=_softcap(fn, softcap), alibi_slopes=alibi_slopes, sinks=sinks,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                         max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k))
    if scale is not None:
        o.scale = _checks.number(fn, "scale", scale, finite=True)
    o.dropout_p = _checks.number(fn, "dropout_p", dropout_p, lo=0.0, hi=1.0, hi_open=True)
    if sinks is not None:
        _checks.tensor(fn, "sinks", sinks)
        _checks.shape(fn, "sinks", sinks, (H,), " (one logit per query head)")
        _checks.same_device(fn, "q", q, sinks=sinks)
    out, lse = run(q, k, v, o)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                           k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None, *,
                           cache_seqlens: Tensor, causal: bool = True, window=None,
                           softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                           sinks: Optional[Tensor] = None, scale: Optional[float] = None,
                           block_table: Optional[Tensor] = None, return_lse: bool = False,
                           rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None,
                           rotary_interleaved: Optional[bool] = None,
                           cache_batch_idx: Optional[Tensor] = None,
                           cache_leftpad: Optional[Tensor] = None):
    """Attention of new queries against a KV cache, appending the new keys first
    (FlashAttention's ``flash_attn_with_kvcache``). Forward only: no gradient flows.

    Args:
        q: (B, H, Lq, D): the queries of the new tokens.
        k_cache, v_cache: (B, Hkv, L_max, D) (Hugging Face's layout), or paged
            (num_blocks, Hkv, block_size, D) with ``block_table``.
        k_new, v_new: (B, Hkv, Lq, D) or None: written into the caches at positions
            ``cache_seqlens[b] .. cache_seqlens[b] + Lq`` **in place**, before attending.
        cache_seqlens: int32 (B,), or an int for every row: the tokens already in each row's
            cache (without k_new).
        causal: bottom-right aligned (query i is token cache_seqlens[b] + i when k_new is
            given), as FlashAttention.
        window, softcap, alibi_slopes, sinks, scale: as ``ff.attention``.
        block_table: int32 (B, max_blocks): block b's key j lies in cache block
            ``block_table[b, j // block_size]``.
        return_lse: also return the log-sum-exp (B, H, Lq) fp32.
        rotary_cos, rotary_sin: (L_ro, R/2) tables in fp32 (fp64 for fp64 ``q``) or ``q``'s
            dtype (FlashAttention's; taken to fp32), R <= D even, as
            ``ff.apply_rotary``'s: with ``k_new``, the new keys are rotated at their positions
            ``cache_seqlens[b] + i`` before they are written, and the queries at the same
            positions when ``causal`` or ``window`` is set, else all at ``cache_seqlens[b]``
            (FlashAttention's rule; cache positions, ``cache_leftpad`` included). ``q`` and
            ``k_new`` themselves are not modified.
        rotary_interleaved: required with the tables (FlashAttention defaults to True, Llama-style
            models need False, and a wrong guess is a silent wrong answer): True rotates channel
            pairs (2i, 2i + 1) (GPT-J), False (i, i + R/2) (GPT-NeoX, Llama's rotate_half).
        cache_batch_idx: int32 (B,): row b reads and writes cache row ``cache_batch_idx[b]``
            (the caches then have any number of rows); contiguous caches only. Duplicate indices
            with ``k_new`` leave one of the writes, unspecified which (as FlashAttention).
        cache_leftpad: int32 (B,): row b's cache starts at position ``cache_leftpad[b]``
            (left-padded prompts): keys before it are not attended, and the causal diagonal,
            window and ALiBi distances are those of the cache's positions (FlashAttention's).
            ``0 <= cache_leftpad[b] <= cache_seqlens[b]``; ``cache_seqlens`` still counts the
            padding. Contiguous and paged caches (FlashAttention takes contiguous only).

    Returns:
        (B, H, Lq, Dv), or ``(out, lse)``. Batch row b attends to its first
        ``cache_seqlens[b] + Lq`` keys (``cache_seqlens[b]`` without k_new), from
        ``cache_leftpad[b]`` on.
    """
    fn = "attention_with_kvcache"
    _checks.tensor(fn, "q", q, dims=(4,))
    _checks.tensor(fn, "k_cache", k_cache, dims=(4,))
    _checks.tensor(fn, "v_cache", v_cache, dims=(4,))
    _checks.same_device(fn, "q", q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
    _checks.same_dtype(fn, "q", q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
    B, H, Lq, D = q.shape
    Hkv = k_cache.shape[1]
    _heads(fn, H, Hkv)
    if k_cache.shape[3] != D or tuple(v_cache.shape[:3]) != tuple(k_cache.shape[:3]):
        raise ValueError(f"{fn}: `k_cache` {tuple(k_cache.shape)} and `v_cache` "
                         f"{tuple(v_cache.shape)} must share their first three dims and match "
                         f"`q`'s head dim {D}")
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((B,), cache_seqlens, dtype=torch.int32, device=q.device)
    _int32_vector(fn, "cache_seqlens", cache_seqlens, B, q.device)
    if cache_batch_idx is not None:
        block_table = _batch_idx_as_blocks(fn, cache_batch_idx, block_table, k_cache, B, q.device)
    if block_table is not None:
        if not isinstance(block_table, Tensor) or block_table.dtype != torch.int32:
            got = block_table.dtype if isinstance(block_table, Tensor) else type(block_table).__name__
            raise TypeError(f"{fn}: `block_table` must be an int32 tensor, got {got}")
        if block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(f"{fn}: `block_table` must be (B, max_blocks) = ({B}, n), got "
                             f"{tuple(block_table.shape)}")
        _checks.same_device(fn, "q", q, block_table=block_table)
        capacity = block_table.shape[1] * k_cache.shape[2]
    else:
        if k_cache.shape[0] != B:
            raise ValueError(f"{fn}: `k_cache` has batch size {k_cache.shape[0]} but `q` has {B}")
        capacity = k_cache.shape[2]
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{fn}: `k_new` and `v_new` must be given together")
    n_new = 0
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _checks.tensor(fn, name, t, dims=(4,))
        if tuple(k_new.shape) != (B, Hkv, Lq, D) or tuple(v_new.shape[:3]) != (B, Hkv, Lq):
            raise ValueError(f"{fn}: `k_new` / `v_new` must be (B, Hkv, Lq, D) = "
                             f"{(B, Hkv, Lq, D)}, got {tuple(k_new.shape)} / {tuple(v_new.shape)}")
        n_new = Lq
    lens = cache_seqlens.tolist()  # small (B,): one sync, as FlashAttention's checks
    if any(n < 0 for n in lens) or max(lens, default=0) + n_new > capacity:
        raise ValueError(f"{fn}: `cache_seqlens` {lens} + {n_new} new tokens must fit the cache "
                         f"({capacity} slots per row) and be >= 0")
    if cache_leftpad is not None:
        _int32_vector(fn, "cache_leftpad", cache_leftpad, B, q.device)
        pads = cache_leftpad.tolist()
        if any(not 0 <= p <= n for p, n in zip(pads, lens)):
            raise ValueError(f"{fn}: `cache_leftpad` {pads} must be >= 0 and <= `cache_seqlens` "
                             f"{lens}, row by row")
    _checks.flag(fn, "causal", causal)
    _checks.flag(fn, "return_lse", return_lse)
    left, right = _window(fn, window)
    with torch.no_grad():
        if rotary_cos is not None or rotary_sin is not None:
            rotate_queries_at_each_position = causal or (left, right) != (-1, -1)
            q, k_new = _rotary(fn, q, k_new, rotary_cos, rotary_sin, rotary_interleaved, cache_seqlens,
                               lens, rotate_queries_at_each_position)
        if k_new is not None:
            _append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table)
        o = AttentionOptions(causal=CAUSAL_BOTTOM_RIGHT if causal else CAUSAL_NONE, scale=scale,
                             window_left=left, window_right=right, softcap=_softcap(fn, softcap),
                             alibi_slopes=alibi_slopes, sinks=sinks,
                             seqlens_k=(cache_seqlens + n_new).to(torch.int32),
                             block_table=block_table, leftpad_k=cache_leftpad)
        if scale is not None:
            o.scale = _checks.number(fn, "scale", scale, finite=True)
        if alibi_slopes is not None:
            _checks.tensor(fn, "alibi_slopes", alibi_slopes, dtypes=(torch.float32,))
        if sinks is not None:
            _checks.shape(fn, "sinks", sinks, (H,), " (one logit per query head)")
        out, lse = run(q, k_cache, v_cache, o)
    return (out, lse) if return_lse else out


def _batch_idx_as_blocks(fn, cache_batch_idx, block_table, k_cache, B, device) -> Tensor:
    """cache_batch_idx as a block table over the cache's rows: row b's only block is cache row
    cache_batch_idx[b] (block size = the cache's length), so the paged kernels serve it."""
    _int32_vector(fn, "cache_batch_idx", cache_batch_idx, B, device)
    if block_table is not None:
        raise ValueError(f"{fn}: `cache_batch_idx` indexes a contiguous cache; with `block_table` "
                         "the table already says where each row's keys are")
    rows = k_cache.shape[0]
    if B and not 0 <= int(cache_batch_idx.min()) <= int(cache_batch_idx.max()) < rows:
        raise ValueError(f"{fn}: `cache_batch_idx` {cache_batch_idx.tolist()} must index the "
                         f"cache's {rows} rows")
    return cache_batch_idx[:, None]


def _rotary(fn, q, k_new, cos, sin, interleaved, cache_seqlens, lens, queries_at_each_position):
    """q and k_new rotated at their positions (new tensors): k_new's token i of row b at
    cache_seqlens[b] + i (lens: the same as a list), the queries there too or all at cache_seqlens[b]. Rows that all start at
    the same position take ff.apply_rotary's one pass; others the reference math on per-row
    tables gathered at their positions (decoding: a few rows of a few tokens)."""
    if cos is None or sin is None:
        raise ValueError(f"{fn}: `rotary_cos` and `rotary_sin` must be given together")
    if k_new is None:
        raise ValueError(f"{fn}: `rotary_cos` / `rotary_sin` rotate the new keys before they "
                         "are cached: pass `k_new` and `v_new`")
    if not isinstance(interleaved, bool):
        raise TypeError(f"{fn}: `rotary_interleaved` must be given as True (pairs 2i, 2i + 1: "
                        "GPT-J, FlashAttention's default) or False (i, i + R/2: Llama's "
                        f"rotate_half) with the rotary tables, got {interleaved!r}")
    B, _, Lq, D = q.shape
    acc = rotary_ref.acc_dtype(q.dtype)
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):  # q's dtype too, as FlashAttention's
        _checks.tensor(fn, name, t, dims=(2,), dtypes=(acc,) if q.dtype == acc else (acc, q.dtype))
    cos, sin = cos.to(acc), sin.to(acc)  # (L_ro, R/2): small
    _checks.same_device(fn, "q", q, rotary_cos=cos, rotary_sin=sin)
    _checks.shape(fn, "rotary_sin", sin, tuple(cos.shape), " (the shape of `rotary_cos`)")
    if not 0 < 2 * cos.shape[1] <= D:
        raise ValueError(f"{fn}: `rotary_cos` must be (L_ro, R/2) with 0 < R <= D = {D}, got "
                         f"{tuple(cos.shape)}")
    last = max(lens) + Lq if B else 0
    if last > cos.shape[0]:
        raise ValueError(f"{fn}: `rotary_cos` has {cos.shape[0]} positions; the new tokens reach "
                         f"position {last - 1}")
    if len(set(lens)) == 1:  # one start for every row: the tables' rows are one slice
        start = lens[0]
        cos_k, sin_k = cos[start:start + Lq], sin[start:start + Lq]
        k_new = apply_rotary(k_new, cos_k, sin_k, interleaved=interleaved)
        if not queries_at_each_position:
            cos_k, sin_k = cos[start].expand(Lq, -1).contiguous(), sin[start].expand(Lq, -1).contiguous()
        return apply_rotary(q, cos_k, sin_k, interleaved=interleaved), k_new
    starts = cache_seqlens.long()[:, None]
    pos = starts + torch.arange(Lq, device=q.device)  # (B, Lq)
    q_pos = pos if queries_at_each_position else starts.expand(B, Lq)
    k_new = rotary_ref.rotary(k_new, cos[pos][:, None], sin[pos][:, None], interleaved, conj=False)
    q = rotary_ref.rotary(q, cos[q_pos][:, None], sin[q_pos][:, None], interleaved, conj=False)
    return q, k_new


def _append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table) -> None:
    """k_new / v_new (B, Hkv, Lq, D) into the caches at cache_seqlens (in place)."""
    B, _, Lq, _ = k_new.shape
    pos = cache_seqlens.long()[:, None] + torch.arange(Lq, device=k_new.device)  # (B, Lq)
    if block_table is None:
        rows = torch.arange(B, device=k_new.device)[:, None].expand(B, Lq)
        k_cache[rows, :, pos] = k_new.transpose(1, 2)
        v_cache[rows, :, pos] = v_new.transpose(1, 2)
        return
    size = k_cache.shape[2]
    blocks = block_table.long().gather(1, pos // size)  # (B, Lq)
    k_cache[blocks, :, pos % size] = k_new.transpose(1, 2)
    v_cache[blocks, :, pos % size] = v_new.transpose(1, 2)


__all__ = ["varlen_attention", "attention_with_kvcache"]
