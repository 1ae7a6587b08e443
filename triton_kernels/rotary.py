"""Triton kernel: rotary position embedding (RoPE), forward and backward (launcher: fastformer/ops/rotary.py).

For row (b, h, l) of x (B, H, L, D) and channel j < R (R = 2 * table width), with the pair
partner p(j) and table index t(j):
    rotate-half:  p(j) = j + R/2 (j < R/2) or j - R/2,  t(j) = j mod R/2
    interleaved:  p(j) = j xor 1,                        t(j) = j // 2
    y[j] = x[j] * cos[l, t(j)] + sign(j) * x[p(j)] * sin[l, t(j)]
with sign(j) = -1 for the first channel of a pair (j < R/2, or j even), +1 for the second, and
negated for the backward (CONJ: the rotation by -theta; dx = R(-theta) dy). Channels j >= R
pass through (cos = 1, sin = 0 there). fp32 math, one rounding to the output type.

One program per BLOCK_ROWS rows, each row whole (BLOCK_D = next power of two >= D, masked).
Traffic per element: read x (the partner load hits the same cache lines), write y; the tables
are read per row (R * 4 bytes) and are L2-resident across heads.
"""
import triton
import triton.language as tl

from . import interpreter_mode
from .common import cast_to


@triton.jit
def rotary_kernel(
    x_ptr,            # (B, H, L, D) input; element (b, h, l, d) at b*sxb + h*sxh + l*sxl + d
    sxb, sxh, sxl,
    y_ptr,            # (B, H, L, D) output, same addressing with its own strides
    syb, syh, syl,
    cos_ptr,          # (L, R/2) fp32 table, contiguous
    sin_ptr,          # (L, R/2) fp32 table, contiguous
    rows, H, L, D, HALF,  # rows = B*H*L; HALF = R/2
    INTERLEAVED: tl.constexpr, CONJ: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    row_ids = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = row_ids < rows
    # cols < (D for rows that exist, else 0): one comparison (the interpreter mis-types a
    # block & block of int1 as an integer mask)
    mask = cols[None, :] < tl.where(row_ok, D, 0)[:, None]
    rot = cols[None, :] < tl.where(row_ok, 2 * HALF, 0)[:, None]

    pos = row_ids % L
    bh = row_ids // L
    x_row = (bh // H) * sxb + (bh % H) * sxh + pos * sxl
    y_row = (bh // H) * syb + (bh % H) * syh + pos * syl

    if INTERLEAVED:
        partner = cols ^ 1
        table_col = cols // 2
        first = (cols % 2) == 0
    else:
        first = cols < HALF
        partner = tl.where(first, cols + HALF, cols - HALF)
        table_col = tl.where(first, cols, cols - HALF)
    x = tl.load(x_ptr + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + x_row[:, None] + partner[None, :], mask=rot, other=0.0).to(tl.float32)
    table = pos[:, None] * HALF + table_col[None, :]
    c = tl.load(cos_ptr + table, mask=rot, other=1.0)
    s = tl.load(sin_ptr + table, mask=rot, other=0.0)
    if CONJ:
        s = -s
    s = tl.where(first[None, :], -s, s)
    y = x * c + xp * s
    tl.store(y_ptr + y_row[:, None] + cols[None, :], cast_to(y, y_ptr.dtype.element_ty, INTERPRET),
             mask=mask)


def config(head_dim: int) -> dict:
    """GPU: ~4K elements per program; interpreter: ~64K (it costs ~20 ms per program whatever
    the block size, measured for the norm kernels)."""
    block_d = triton.next_power_of_2(head_dim)
    target = 65536 if interpreter_mode() else 4096
    block_rows = max(1, min(256, target // block_d))
    return dict(BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=4 if block_rows * block_d <= 4096 else 8,
                INTERPRET=interpreter_mode())
