"""Triton helpers of the attention kernels for the options: packed sequences (sequence), the
window band (its block ranges and element mask), softcap, ALiBi, the relative-position bias,
the option gradients.

triton_kernels/attention.py states the algorithm and the formulas; fastformer/reference/
attention.py is the semantics. Conventions here: scores t are in base 2 (t = s * log2 e);
q_idx, k_idx are query and key indices shaped (M, 1) and (1, N); band = (shift, left, right)
(make_band): key j is visible to query i iff i + shift - left <= j <= i + shift + right, the
left side checked iff WINDOW_LEFT, the right one iff WINDOW_RIGHT (1: right = 0, causality,
folded in by the launcher; 2: a window's right limit); terms = (qk_scale, softcap_in, alibi2,
rel_head) of one head (head_terms). Masks are single comparisons (the
interpreter mis-types `block & scalar` of int1); integer divisions see non-negative operands.
"""
import triton
import triton.language as tl

from .common import LOG2E, cast_to, tanh


@triton.jit
def sequence(b, H, Lq, Lk, rng_offset, cu_q_ptr, cu_k_ptr, rng_seq_ptr, PACKED: tl.constexpr,
             DROPOUT: tl.constexpr):
    """(q_start, k_start, Lq, Lk, rng_b) of batch row b, or with PACKED of sequence b: its first
    row in q / k (int64; compile-time 0 unpacked), its lengths (packed: cu_q[b + 1] - cu_q[b]
    and cu_k[b + 1] - cu_k[b]; unpacked Lq, Lk as given) and the dropout counter of its
    element (h, i, j) = (0, 0, 0): rng_offset + b * H * Lq * Lk unpacked, rng_offset +
    rng_seq[b] packed (the host's int64 prefix sums of H * Lq_s * Lk_s; read iff DROPOUT)."""
    if PACKED:
        q_lo = tl.load(cu_q_ptr + b)
        k_lo = tl.load(cu_k_ptr + b)
        rng_b = rng_offset + b * 0
        if DROPOUT:
            rng_b += tl.load(rng_seq_ptr + b)
        return (q_lo.to(tl.int64), k_lo.to(tl.int64), tl.load(cu_q_ptr + b + 1) - q_lo,
                tl.load(cu_k_ptr + b + 1) - k_lo, rng_b)
    else:
        return 0, 0, Lq, Lk, rng_offset + b * H * Lq * Lk


@triton.jit
def make_band(Lq, Lk, win_left, win_right, BOTTOM_RIGHT: tl.constexpr,
              WINDOW_RIGHT: tl.constexpr):
    """band = (shift, left, right) with compile-time zeros where the flags say so (shift = d =
    Lk - Lq iff BOTTOM_RIGHT, else 0; right = 0 for WINDOW_RIGHT 1): a causal kernel then keeps
    the registers it had before windows existed."""
    shift = 0
    right = 0
    if BOTTOM_RIGHT:
        shift = Lk - Lq
    if WINDOW_RIGHT == 2:
        right = win_right
    return shift, win_left, right


@triton.jit
def head_terms(qk_scale, softcap_in, alibi_ptr, rel_head, ALIBI: tl.constexpr):
    """terms of one (batch, head): alibi2 = slope * log2 e, loaded once per program and head
    (0 without ALiBi); rel_head: the head's relative-position bias vector."""
    alibi2 = 0.0
    if ALIBI:
        alibi2 = tl.load(alibi_ptr) * LOG2E
    return qk_scale, softcap_in, alibi2, rel_head


@triton.jit
def key_blocks(start_m, Lq, Lk, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Key blocks of query rows [start_m, start_m + BLOCK_M) (forward, dQ) as (lo, full_lo,
    full_hi, hi): [lo, full_lo) and [full_hi, hi) are cut by an edge of the band or hold the Lk
    tail (element masks), [full_lo, full_hi) lie wholly inside the band for every row (no
    mask); keys outside [lo, hi) are never visited. Rows past Lq are not counted."""
    shift, left, right = band
    first = start_m + shift                                # diagonal key of the first row
    last = tl.minimum(start_m + BLOCK_M, Lq) - 1 + shift   # ... and of the last row
    lo = start_m * 0
    full_lo = start_m * 0
    hi = Lk + start_m * 0
    full_hi = Lk // BLOCK_N * BLOCK_N + start_m * 0
    if WINDOW_LEFT:   # j >= i + shift - left
        lo = tl.maximum(first - left, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last - left, 0), BLOCK_N) * BLOCK_N
    if WINDOW_RIGHT:  # j <= i + shift + right
        hi = tl.minimum(last + right + 1, Lk)
        full_hi = tl.minimum(tl.maximum(first + right + 1, 0), Lk) // BLOCK_N * BLOCK_N
    if WINDOW_LEFT:  # else lo = full_lo = 0 <= full_hi <= hi, or every range is empty
        full_lo = tl.minimum(full_lo, hi)  # (these clamps cost the forward registers)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def query_blocks(start_n, Lq, Lk, band, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Query blocks that see keys [start_n, start_n + BLOCK_N) (dK/dV) as (lo, full_lo,
    full_hi, hi), split as in key_blocks, except that full_lo may pass hi: the edge blocks are
    [lo, min(full_lo, hi)) (clamping there, not here, keeps the registers of the causal
    kernel). Keys past Lk are not counted (their dK, dV are never stored) and rows past Lq
    need no mask (their P is 0: lse = +inf)."""
    shift, left, right = band
    first = start_n - shift                                # query whose diagonal is the first key
    last = tl.minimum(start_n + BLOCK_N, Lk) - 1 - shift   # ... the last key
    lo = start_n * 0
    full_lo = start_n * 0
    hi = Lq + start_n * 0
    full_hi = Lq + start_n * 0
    if WINDOW_RIGHT:  # i >= j - shift - right
        lo = tl.maximum(first - right, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(last - right, 0), BLOCK_M) * BLOCK_M
    if WINDOW_LEFT:   # i <= j - shift + left
        hi = tl.minimum(last + left + 1, Lq)
        full_hi = tl.maximum(first + left + 1, 0)
        full_hi = tl.where(full_hi >= Lq, Lq, full_hi // BLOCK_M * BLOCK_M)
    if WINDOW_RIGHT and WINDOW_LEFT:  # else full_hi = hi = Lq, or lo = full_lo = 0
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def band_mask(t, q_idx, k_idx, Lk, band, WINDOW_LEFT: tl.constexpr,
              WINDOW_RIGHT: tl.constexpr):
    """t with -inf outside the band and past Lk (the edge blocks' element mask)."""
    shift, left, right = band
    if WINDOW_RIGHT:
        t = tl.where(k_idx < tl.minimum(q_idx + shift + right + 1, Lk), t, float("-inf"))
    else:
        t = tl.where(k_idx < Lk, t, float("-inf"))
    if WINDOW_LEFT:
        t = tl.where(k_idx >= q_idx + shift - left, t, float("-inf"))
    return t


@triton.jit
def score_terms(qk, q_idx, k_idx, Lq, Lk, shift, terms, SOFTCAP: tl.constexpr,
                ALIBI: tl.constexpr, TABLE: tl.constexpr):
    """(t, u) from the raw dot products qk: t = qk_scale * qk, or with softcap
    t = qk_scale * u, u = tanh(softcap_in * qk) (qk_scale = c log2 e, softcap_in = scale / c);
    then t -= alibi2 * |i + shift - j| and (TABLE) t += rel[j - i + Lq - 1] * log2 e, the head's
    relative-position bias. u (softcap's tanh, for the backward's factor) is 0 without softcap."""
    qk_scale, softcap_in, alibi2, rel_head = terms
    if SOFTCAP:
        u = tanh(qk * softcap_in)
        t = u * qk_scale
    else:
        u = 0.0
        t = qk * qk_scale
    if ALIBI:
        t -= alibi2 * tl.abs(q_idx + shift - k_idx).to(tl.float32)
    if TABLE:
        in_bounds = k_idx < tl.where(q_idx < Lq, Lk, 0)
        t += tl.load(rel_head + (k_idx - q_idx + (Lq - 1)), mask=in_bounds, other=0.0) * LOG2E
    return t, u


@triton.jit
def option_grads(ds, q_idx, k_idx, Lq, Lk, dmask_ptrs, drel_head, MASK_GRAD: tl.constexpr,
                 TABLE_GRAD: tl.constexpr, INTERPRET: tl.constexpr):
    """Adds one tile's dS (fp32, before softcap's factor) to the mask and relative-bias
    gradients: MASK_GRAD 1 stores it (a mask without broadcast dims: each element is one
    (b, h, i, j)), 2 adds it with fp32 atomics (a broadcast mask: several programs share an
    element); the relative bias's gradient is an fp32 atomic add at [h, j - i + Lq - 1] (the
    pairs of one diagonal share it). Pairs past Lq / Lk are left out."""
    in_bounds = k_idx < tl.where(q_idx < Lq, Lk, 0)
    if MASK_GRAD == 1:
        tl.store(dmask_ptrs, cast_to(ds, dmask_ptrs.dtype.element_ty, INTERPRET), mask=in_bounds)
    elif MASK_GRAD == 2:
        tl.atomic_add(dmask_ptrs, ds, mask=in_bounds, sem="relaxed")
    if TABLE_GRAD:
        tl.atomic_add(drel_head + (k_idx - q_idx + (Lq - 1)), ds, mask=in_bounds, sem="relaxed")
