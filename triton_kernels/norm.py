"""Triton kernels: fused residual-add + LayerNorm / RMSNorm, forward and backward.

Forward: one program per block of BLOCK_ROWS rows, each row held whole in registers
(BLOCK_H = next power of two >= H, masked tail): z = x + residual (rounded to the input dtype,
as eager does), mean and variance by a two-pass reduction over the registers, y = x_hat*w + b.
Traffic per element: read x, residual; write y (+ residual_out). Per row: write mean, rstd.

Backward: a fixed grid of programs, each walking a contiguous range of rows: recompute
x_hat from z and the saved (mean, rstd); g = dy*w; dz = (g - x_hat*mean(g*x_hat) - mean(g))*rstd
(+ d residual_out); dw/db partials accumulate in registers and are written once per program
to a (programs, H) fp32 buffer that the launcher sums. Traffic: read dy, z (or x and residual),
write dz; plus programs*H*8 bytes of partials.

The math is csrc/common/norm_math.h's; names follow it.
"""
import triton
import triton.language as tl

from . import interpreter_mode
from .common import cast_to


@triton.jit
def add_norm_fwd_kernel(
    x_ptr,            # (rows, H) input; row r at x_ptr + r*x_row_stride, last dim contiguous
    x_row_stride,
    res_ptr,          # residual, same layout rules as x (read iff HAS_RESIDUAL)
    res_row_stride,
    w_ptr,            # (H,) weight (read iff HAS_WEIGHT)
    b_ptr,            # (H,) bias (read iff HAS_BIAS)
    y_ptr,            # (rows, H) contiguous output, input dtype
    res_out_ptr,      # (rows, H) contiguous x + residual (written iff STORE_RESIDUAL)
    mean_ptr,         # (rows,) fp32 mean (written iff not RMS)
    rstd_ptr,         # (rows,) fp32 1/sqrt(var + eps)
    rows, H, eps,
    HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, RMS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
):
    row_ids = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ok = row_ids < rows
    col_ok = cols < H
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = row_ids.to(tl.int64)

    z = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    z = z.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows64[:, None] * res_row_stride + cols[None, :], mask=mask, other=0.0)
        z = cast_to(z + r.to(tl.float32), y_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
        if STORE_RESIDUAL:
            tl.store(res_out_ptr + rows64[:, None] * H + cols[None, :],
                     cast_to(z, res_out_ptr.dtype.element_ty, INTERPRET), mask=mask)

    if RMS:
        row_rstd = 1.0 / tl.sqrt(tl.sum(z * z, axis=1) / H + eps)
        x_hat = z * row_rstd[:, None]
    else:
        row_mean = tl.sum(z, axis=1) / H
        centered = tl.where(mask, z - row_mean[:, None], 0.0)
        row_rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / H + eps)
        x_hat = centered * row_rstd[:, None]
        tl.store(mean_ptr + row_ids, row_mean, mask=row_ok)
    tl.store(rstd_ptr + row_ids, row_rstd, mask=row_ok)

    y = x_hat
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64[:, None] * H + cols[None, :], cast_to(y, y_ptr.dtype.element_ty, INTERPRET),
             mask=mask)


@triton.jit
def add_norm_bwd_kernel(
    dy_ptr,           # (rows, H) grad of y; row stride dy_row_stride, last dim contiguous
    dy_row_stride,
    dres_ptr,         # grad of residual_out, same layout rules (read iff HAS_DRES)
    dres_row_stride,
    za_ptr,           # z = za (+ zb, rounded to the input dtype): residual_out, or x
    za_row_stride,
    zb_ptr,           # residual (read iff HAS_ZB)
    zb_row_stride,
    w_ptr,            # (H,) weight (read iff HAS_WEIGHT)
    mean_ptr,         # (rows,) fp32 saved mean (read iff not RMS)
    rstd_ptr,         # (rows,) fp32 saved rstd
    dz_ptr,           # (rows, H) contiguous output: dx = dresidual = dz
    dw_part_ptr,      # (programs, H) fp32 partial sums of dy*x_hat (written iff NEED_DW)
    db_part_ptr,      # (programs, H) fp32 partial sums of dy (written iff NEED_DB)
    rows, H, rows_per_program,  # rows_per_program is a multiple of BLOCK_ROWS
    HAS_DRES: tl.constexpr, HAS_ZB: tl.constexpr, HAS_WEIGHT: tl.constexpr, RMS: tl.constexpr,
    NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        w = tl.where(col_ok, 1.0, 0.0)
    dw_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, rows)
    for i in range(0, rows_per_program, BLOCK_ROWS):
        row_ids = row_start + i + tl.arange(0, BLOCK_ROWS)
        row_ok = row_ids < row_end
        # cols < (H for rows that exist, else 0): one comparison (the interpreter mis-types a
        # block & block of int1 as an integer mask)
        mask = cols[None, :] < tl.where(row_ok, H, 0)[:, None]
        z = tl.load(za_ptr + row_ids[:, None] * za_row_stride + cols[None, :], mask=mask, other=0.0)
        z = z.to(tl.float32)
        if HAS_ZB:
            zb = tl.load(zb_ptr + row_ids[:, None] * zb_row_stride + cols[None, :], mask=mask, other=0.0)
            z = cast_to(z + zb.to(tl.float32), dz_ptr.dtype.element_ty, INTERPRET).to(tl.float32)
        dy = tl.load(dy_ptr + row_ids[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        row_rstd = tl.load(rstd_ptr + row_ids, mask=row_ok, other=0.0)
        if RMS:
            x_hat = z * row_rstd[:, None]
        else:
            row_mean = tl.load(mean_ptr + row_ids, mask=row_ok, other=0.0)
            x_hat = tl.where(mask, (z - row_mean[:, None]) * row_rstd[:, None], 0.0)
        g = dy * w[None, :]
        c_xhat = tl.sum(g * x_hat, axis=1) / H
        if RMS:
            dz = (g - x_hat * c_xhat[:, None]) * row_rstd[:, None]
        else:
            c_g = tl.sum(g, axis=1) / H
            dz = (g - x_hat * c_xhat[:, None] - c_g[:, None]) * row_rstd[:, None]
        if HAS_DRES:
            dres = tl.load(dres_ptr + row_ids[:, None] * dres_row_stride + cols[None, :], mask=mask, other=0.0)
            dz += dres.to(tl.float32)
        tl.store(dz_ptr + row_ids[:, None] * H + cols[None, :],
                 cast_to(dz, dz_ptr.dtype.element_ty, INTERPRET), mask=mask)
        if NEED_DW:
            dw_acc += tl.sum(dy * x_hat, axis=0)
        if NEED_DB:
            db_acc += tl.sum(dy, axis=0)
    if NEED_DW:
        tl.store(dw_part_ptr + pid * H + cols, dw_acc, mask=col_ok)
    if NEED_DB:
        tl.store(db_part_ptr + pid * H + cols, db_acc, mask=col_ok)


MAX_HIDDEN = 16384  # one row in registers; beyond this the launcher's select() falls back


def fwd_config(hidden: int) -> dict:
    """Block shape and warps for the forward. GPU: ~4K elements per program (enough loads in
    flight for bandwidth without spilling); interpreter: ~64K (it costs ~20 ms per program
    whatever the block size, measured)."""
    block_h = triton.next_power_of_2(hidden)
    target = 65536 if interpreter_mode() else 4096
    block_rows = max(1, min(256, target // block_h))
    num_warps = 4 if block_h * block_rows <= 4096 else (8 if block_h * block_rows <= 8192 else 16)
    return dict(BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=num_warps,
                INTERPRET=interpreter_mode())


def bwd_config(hidden: int, rows: int, sm_count: int) -> dict:
    """Grid for the backward: a few programs per SM on GPU (partials cost programs*H*8 bytes),
    each walking its rows BLOCK_ROWS at a time. Each program sums its rows' dw/db in fp32, so
    rows per program bound the rounding error. Under the interpreter: 16 programs walking 64K
    elements per step (a sequential 1024-row fp32 sum measured dweight 9e-5 off at 4096 rows,
    above the 2e-5 the tests demand; within a step the rows are summed pairwise)."""
    block_h = triton.next_power_of_2(hidden)
    programs = max(1, min(rows, 16 if interpreter_mode() else 4 * sm_count))
    target = 65536 if interpreter_mode() else 2048
    block_rows = max(1, min(256 if interpreter_mode() else 16, target // block_h))
    per_program = -(-rows // programs)
    per_program = -(-per_program // block_rows) * block_rows
    num_warps = 4 if block_h * block_rows <= 2048 else (8 if block_h * block_rows <= 8192 else 16)
    return dict(programs=programs, rows_per_program=max(per_program, block_rows),
                BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=num_warps,
                INTERPRET=interpreter_mode())
