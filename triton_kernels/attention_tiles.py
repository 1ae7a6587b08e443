"""Shared pieces of the Triton flash-attention kernels (attention.py: forward and the notation;
attention_bwd.py: backward): how a mask is read and its gradient written, row tiles loaded
and stored with their tails masked, the scores of a tile with every option, dropout's keep
mask."""
import triton
import triton.language as tl

from .attention_options import band_mask, score_terms
from .common import LOG2E, cast_to, dropout_word


LN2 = tl.constexpr(0.6931471805599453)
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2  # MASK_KIND: how attn_mask is read
GRAD_NONE, GRAD_STORE, GRAD_ATOMIC = 0, 1, 2  # MASK_GRAD: how d attn_mask is written (dQ kernel)
_SPECIALIZE_NOT = ["seed", "rng_offset", "drop_threshold", "win_left", "win_right"]


# ---- helpers ---------------------------------------------------------------------------------
@triton.jit
def _load_rows(ptrs, row_idx, n_rows, cols, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASK_ROWS: tl.constexpr):
    """(rows, BLOCK_D) tile; rows >= n_rows (if MASK_ROWS) and columns >= HEAD_DIM read as 0.
    The mask is one comparison (the interpreter mis-types block & scalar of int1)."""
    if MASK_ROWS:
        return tl.load(ptrs, mask=cols[None, :] < tl.where(row_idx < n_rows, HEAD_DIM, 0)[:, None],
                       other=0.0)
    elif HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _store_rows(ptrs, x, row_idx, n_rows, cols, HEAD_DIM: tl.constexpr, INTERPRET: tl.constexpr):
    tl.store(ptrs, cast_to(x, ptrs.dtype.element_ty, INTERPRET),
             mask=cols[None, :] < tl.where(row_idx < n_rows, HEAD_DIM, 0)[:, None])


@triton.jit
def _scores(qk, q_idx, k_idx, mask_ptrs, kpm_ptrs, Lq, Lk, band, terms,
            MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, WINDOW_LEFT: tl.constexpr,
            WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
            TABLE: tl.constexpr, EDGE: tl.constexpr):
    """(t, u): scores in base 2 with -inf where a key is excluded, and softcap's tanh (u). q_idx,
    k_idx: query and key indices shaped (M, 1) and (1, N); mask_ptrs: attn_mask pointers
    (M, N); kpm_ptrs: key_padding_mask pointers (1, N). EDGE applies the band and the Lk tail."""
    t, u = score_terms(qk, q_idx, k_idx, Lq, Lk, band[0], terms, SOFTCAP, ALIBI, TABLE)
    if MASK_KIND != 0:
        in_bounds = k_idx < tl.where(q_idx < Lq, Lk, 0)
        if MASK_KIND == 1:  # MASK_BOOL; else MASK_FLOAT
            t = tl.where(tl.load(mask_ptrs, mask=in_bounds, other=0) != 0, t, float("-inf"))
        else:
            t += tl.load(mask_ptrs, mask=in_bounds, other=0.0).to(tl.float32) * LOG2E
    if HAS_KPM:
        padded = tl.load(kpm_ptrs, mask=k_idx < Lk, other=0)
        t = tl.where(padded != 0, float("-inf"), t)
    if EDGE:
        t = band_mask(t, q_idx, k_idx, Lk, band, WINDOW_LEFT, WINDOW_RIGHT)
    return t, u


@triton.jit
def _dropout_keep(seed, rng_q, k_idx, drop_threshold):
    """Keep mask of reference/rng.py: the Philox word of element rng_q + k_idx (int64, rng_q =
    offset + (bh * Lq + i) * Lk) kept iff word >= threshold, compared as uint32."""
    return dropout_word(seed, rng_q + k_idx) >= drop_threshold.to(tl.uint32)


# Pointers: a program computes int64 scalar bases (batch, head, block start) and adds int32
# in-tile offsets (at most BLOCK * row stride) computed once, outside its loops. Every
# kernel takes, after its own pointers: alibi_ptr (fp32 slopes at b * stride_ab + h *
# stride_ah; stride_ab = 0 for (H,) slopes), rel_ptr (fp32 (H, Lq + Lk - 1), the relative-
# position bias, head stride stride_rh, contiguous per head), each read only when its flag is
# set; win_left, win_right (the band: i + d - win_left <= j <= i + d + win_right, the
# left side checked iff WINDOW_LEFT, the right one iff WINDOW_RIGHT: 1 at right = 0, 2 at
# win_right; d = Lk - Lq iff BOTTOM_RIGHT, else 0); qk_scale = scale * log2 e (with
# softcap: c * log2 e) and softcap_in = scale / c; stride_lb, stride_lh: lse's and delta's.
# PACKED (varlen): q, k, v, out and their grads are (total, H, D) with batch stride 0, the
# grid's batch index is the sequence s, its rows start at cu_q[s] / cu_k[s] and its lengths
# replace Lq, Lk (the longest, which size the grid; programs past them exit); lse (H, total_q)
# has strides (0, total_q). No masks or relative bias then (attention_options.sequence).
