"""``F.linear`` with three CPU kernels of ours: the few-row calls of decoding
(csrc/cpu/linear_rows.cpp), fp32 calls on the packed GEMM where torch's fp32 GEMM is generic
code (csrc/cpu/ffn.cpp's first layer alone) and, in bf16 training on AMX, the weight gradient
(csrc/cpu/weight_grad.cpp).

A decode step multiplies one token's activations (a few rows: one per sequence, or the few
tokens a speculative step verifies) by every weight matrix of the model, so its time is the time
to read the weights. torch's fp32 CPU matmul for such calls (MKL) reads them at ~28 GB/s for 1-3
rows but at 14 GB/s for 4-6 rows and 6-9 GB/s for 8-64 rows on the 2-core AMX Xeon (it packs the
weight as a GEMM operand), where linear_rows.cpp streams them at 24-27 GB/s up to 16 rows and
runs at 250-270 GFLOP/s (~80% of the calibrated fp32 peak) for 32-48 rows. fp32 weights of
(11008 x 4096, 4096 x 11008, 4096 x 4096), eight matrices in turn so that none stays cached,
median of 7 interleaved with torch, ours / torch: rows 4 1.8x, 8 2.7x, 16 2.7x, 32 2.1x, 48
1.6x, 64 1.25x, 80 0.84x (rows beyond one 64-row chunk re-read the weight block); the avx2
kernels on the same CPU (against torch's AVX-512 MKL) 1.9x, 2.8x, 2.1x, 1.2x for 4-32 rows and
0.77x at 48; 1-2 rows: 0.94-1.01x (on a 2-core Zen 5 torch read 14-18 GB/s there, the kernel
20-61). The default (no AVX2) level's emulated vectors ran 0.36-0.73x of torch: not taken.
bf16 weights on AMX (in features a multiple of 32) take its AMX form, the weight rows read in
place as tile rows: 26-27 GB/s for 1-16 rows where torch's oneDNN GEMM reads 20-22 (it reorders
the weight on every call; ff.convert's prepacked copies read 22-23), same eight bf16 matrices:
rows 1 1.22x, 2 1.26x, 8 1.29x, 16 1.29x, 32 1.23x, 64 1.23x, 96 1.10x; up to 64 taken. Without
AMX but with AVX512-BF16 (Zen 4 / Zen 5), bf16 weights (in features a multiple of 32) take its
VDPBF16PS forms, which read the weight as it lies where torch's oneDNN GEMM streams it at 16-21
GB/s for 1-8 rows and 13 GB/s at 16: 2-core Zen 4, the same matrices, ours / torch, rows 1
1.72x, 2 1.42x, 4 1.28x, 5 1.10x, 6 1.20x, 8 1.28x, 16 1.61x, 32 1.38x, 64 1.18x (425 GFLOP/s),
96 1.09x; up to 64 taken. On a CPU with neither but with torch's bf16 GEMMs on dot products
(an avx2 kernel level forced on such a CPU), bf16 / fp16 weights take the fp32 dot form for one
row only: with more rows the bf16-to-fp32 conversion per weight vector made it 0.6-0.9x torch's.

Where torch's bf16 / fp16 GEMMs are generic code (cpu_gemm.fast_lowp_gemm(): AVX2-only CPUs
such as Zen 3), every such call is ours: 1-8 rows on the fp32 dot form (SLOW_LOWP_MAX_ROWS), more
rows, with or without a gradient, on the packed GEMM, which converts the operands to fp32 as it
packs them and rounds the output once (torch's own accumulation and rounding). 2-core Zen 3:
torch's bf16 GEMM 19 GFLOP/s, the packed GEMM 135-151 forward and backward; a converted model's
bf16 projections would otherwise run at an eighth of its fp32 speed.

Weights stored in-major ((in, out), passed as the transposed view: GPT-2's Conv1D, gpt-oss's and
Llama 4's stacked experts) take the kernel's in-major form for 1-8 rows (IN_MAJOR_MAX_ROWS below):
torch reads such a bf16 weight at 8-17 GB/s, the kernel at 20-34.

fp32 calls of more rows, forward and backward: torch's fp32 GEMM is MKL's, whose AVX-512 code
runs only on Intel CPUs (cpu_gemm.torch_fp32_gemm_wins(), the FFN's rule); elsewhere the packed
GEMM of the FFN kernels runs at about twice its rate. 2-core Zen 5 (torch.mm 223 GFLOP/s), ours /
torch, medians of 5-9 in one process, forward and backward (dx, dW, db): (tokens, in, out)
(2048, 2048, 2048) 2.02x / 1.94x (448 / 412 GFLOP/s), (2048, 2048, 512) 2.02x / 1.95x,
(4096, 768, 2304) 1.73x / 2.01x, (2048, 2048, 32000) (an LM head) 1.90x / 1.93x, (128, 2048,
2048) 1.92x / 2.00x. Taken from the few-row kernel's last row on (64 at avx512, 32 at avx2),
with or without a gradient. Fewer rows with a gradient ran faster too (8-16 rows 1.12-2.24x over
512^2 .. 4096 x 11008) but stay with torch: the FFN's few-token route sends its projections
here, and an fp32 dW of 17 tokens (d = 1000) came out 2.6e-5 from fp64 there, against eager's
2.0e-5 and the numerical policy's 2.2e-5.

The weight gradient: autograd's is ``grad.t().mm(input)``, and torch's CPU bf16 mm runs a
transposed A at 0.83-0.93 TFLOP/s on the 2-core AMX Xeon (SwiGLU (2048, 4096, 11008)'s dW
shapes; the forward's x W^T runs 1.7-2.0), where weight_grad.cpp's AMX kernel runs 1.5-2.0
(best of 5, one process): (2048 tokens, 11008 x 4096) 198 -> 113 ms, (8192, 4096 x 1024) 67 ->
45, (4096, 3072 x 768) 14.7 -> 12.0, (2048, 2816 x 1024) 9.7 -> 6.0. The operand packed whole
(Q) is the narrower one: (8192, 4096 x 1024) with Q the 4096 columns ran 63 ms against 45.

Used by ``ff.convert`` on Hugging Face models (every nn.Linear, the LM head included) and by
the FFN's cpu.onednn route. Under torch.compile a bf16 CPU call with a weight gradient on AMX,
and a call the packed GEMM takes, is the custom op ``fastformer::linear`` (its body and
backward take the kernels); other traced calls and calls that are not plain CPU tensor calls
take ``F.linear``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _ext
from . import cpu_gemm, prepack
from ._opdef import owned, plain_tensor as _plain, rowwise

# Most rows a call may have to take the kernel, per CPU kernel level and weight dtype (measured,
# see above); none at the default level; bf16 on AMX tiles up to MAX_AMX_ROWS.
MAX_ROWS = {"avx512": {torch.float32: 64, torch.bfloat16: 1, torch.float16: 1},
            "avx2": {torch.float32: 32, torch.bfloat16: 1, torch.float16: 1}}
MAX_AMX_ROWS = 64
MAX_DOT_ROWS = 64  # bf16 on AVX512-BF16 without AMX
# bf16 / fp16 where torch's GEMMs in that dtype are generic code (cpu_gemm.fast_lowp_gemm()):
# torch's bf16 call costs a GEMV per row, the fp32 dot form reads the weight once. 2-core Zen 3
# (AVX2), x (rows, 4096) by four 4096^2 bf16 weights in turn, medians of 12, torch / ours: rows 1
# 1.37x, 2 2.31x, 3 2.41x, 4 2.75x, 6 2.48x, 8 2.14x (the packed GEMM, which converts and packs
# the weight on every call: 0.29x at 1 row, 0.85x at 4, 1.51x at 6, 1.54x at 8, 5.0x at 64);
# fp16 weights alike (rows 1 1.36x, 2 2.55x, 4 2.34x, 8 3.31x; the packed GEMM at 9 rows 2.50x).
SLOW_LOWP_MAX_ROWS = 8
# MKL's fp32 GEMM on an Intel CPU reads the weights as fast as the kernel for 1-3 rows and has
# less per-call cost: 2-core AMX Xeon, ours / torch, (11008 x 4096, 4096 x 11008, 4096 x 4096)
# fp32 weights in turn (memory-bound) 1 row 1.01x, 2 rows 0.98x, 3 rows 0.94x, 4 rows 1.78x;
# (512 x 512, 2048 x 512, 512 x 2048), a Marian-size decoder's, which stay in the 480 MiB L3:
# 1-3 rows 0.82-0.88x. And weights under 2M values (8 MiB), where the transposed form's 4-8 rows
# fill a quarter to half of each 16-row vector and MKL is ahead: 2048 x 512 and 1024 x 1024 at 4
# rows 183-210 us against torch's 75-85 (one matrix, cached), 274-312 against 246-282 (64 in
# turn, from L3); at 8 rows 184-197 against 120-134 cached, 274-315 against 298-369 from L3.
# From 2816 x 1024 on the kernel leads from memory at 4 rows (633 against 793 us) and 8 (638
# against 1044; 4096 x 1024: 876 / 878 against 1174 / 1540). Elsewhere torch's fp32 GEMM is
# generic code (Zen 5: 14-18 GB/s at 1-2 rows, the kernel 20-61): from one row, any size.
MKL_MIN_ROWS = 4
MKL_MIN_WEIGHTS = 1 << 21
# Weights stored in-major ((in, out) rows, passed as a transposed view: GPT-2's Conv1D, gpt-oss's
# and Llama 4's stacked experts): torch multiplies x by W^T as it lies (MKL's fp32 GEMV reads it
# at 29-31 GB/s for one row but 15-19 for 2-8; bf16 at 8-17 GB/s from 1 row), linear_rows.cpp's
# in-major form streams each thread's block of W^T's rows (2-core AMX Xeon, ours / torch, medians
# of 9, 768 x 768 / 2304 / 3072 and 3072 x 768 once (cached), 64 x 768^2, 12 x 1024 x 4096 and
# 16 x 2048 x 1024 in turn (streamed)): fp32 1 row 0.86-1.27x, 2-4 rows 1.03-2.05x, 6-8 rows
# 1.15-1.83x (0.84-0.91x for the 64 streamed 768^2); bf16 1 row 1.72-3.04x, 2 rows 1.39-2.67x,
# 3 rows 1.03-2.15x, 4 rows 0.74-1.90x, 8 rows 0.46-1.14x (its 16 FMAs per 32 weights: FMA-
# bound). The avx2 level on the same CPU: fp32 2-4 rows 0.76-1.99x (streamed 768^2 0.76-0.93x),
# 6-8 rows 0.39-0.95x; bf16 1 row 1.07-3.03x, 2 rows 1.12-1.99x, 3-4 0.56-2.05x. fp16 weights
# were not measured: not taken. fp32 calls of one row on MKL's Intel CPUs stay with torch.
IN_MAJOR_MAX_ROWS = {"avx512": {torch.float32: 8, torch.bfloat16: 3},
                     "avx2": {torch.float32: 4, torch.bfloat16: 2}}


def min_rows(dtype: torch.dtype) -> int:
    """Fewest rows of x for which linear_rows.cpp takes a call with dtype weights: fp32 from
    MKL_MIN_ROWS on an Intel CPU with MKL, else 1."""
    return MKL_MIN_ROWS if dtype == torch.float32 and cpu_gemm.mkl_on_intel() else 1


def max_rows(dtype: torch.dtype) -> int:
    """Most rows of x for which linear_rows.cpp takes a call with dtype weights (0: none)."""
    most = MAX_ROWS.get(_ext.cpu_level(), {}).get(dtype, 0)
    if most and dtype in LOW_PRECISION and not cpu_gemm.fast_lowp_gemm(dtype):
        return SLOW_LOWP_MAX_ROWS  # (FASTFORMER_CPU_LOWP_GEMM=kernels on a bf16-dot CPU too: its rule)
    if dtype == torch.bfloat16 and _ext.amx_in_use():
        return MAX_AMX_ROWS
    if dtype == torch.bfloat16 and _ext.bf16_dot_in_use():
        return MAX_DOT_ROWS
    return most


def rows_kernel_takes(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether linear_rows.cpp computes x @ weight.T + bias for this call (no autograd check:
    the caller knows whether a gradient is needed)."""
    if x.dim() == 0 or x.shape[-1] == 0 or torch.compiler.is_compiling():
        return False
    rows = x.numel() // x.shape[-1]  # the cheap tests first: this runs on every decode-time call
    if weight.dim() == 2 and weight.stride(1) != 1:
        if not _in_major_takes(x.dtype, weight, rows):
            return False
    elif not min_rows(x.dtype) <= rows <= max_rows(x.dtype):
        return False
    elif x.dtype == torch.float32 and weight.numel() < MKL_MIN_WEIGHTS and cpu_gemm.mkl_on_intel():
        return False
    if not (_plain(x) and _plain(weight)):
        return False
    return (x.device.type == "cpu" and weight.device.type == "cpu" and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
            and (x.dtype == torch.float32 or x.shape[-1] % 32 == 0  # AMX / dot forms: 32-value steps
                 or weight.stride(1) != 1 or rows == 1  # the fp32 dot form, any in: 1 row, or up to 8
                 or (rows <= SLOW_LOWP_MAX_ROWS and not cpu_gemm.fast_lowp_gemm(x.dtype)))  # (see above)
            and (bias is None or (_plain(bias) and bias.dtype == x.dtype
                                  and bias.shape == (weight.shape[0],) and bias.is_contiguous()))
            and _ext.C is not None and hasattr(_ext.C, "linear_rows"))


def _in_major_takes(dtype: torch.dtype, weight: Tensor, rows: int) -> bool:
    """linear_rows.cpp's in-major form takes `rows` rows against this weight (a transposed view of
    an (in, out) matrix); the measured rule above."""
    if not (weight.stride(0) == 1 and weight.shape[0] > 1 and weight.shape[1] > 1
            and weight.stride(1) >= weight.shape[0]):
        return False
    if rows < 1 or rows > IN_MAJOR_MAX_ROWS.get(_ext.cpu_level(), {}).get(dtype, 0):
        return False
    return rows > 1 or dtype != torch.float32 or not cpu_gemm.mkl_on_intel()


def rows_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x @ weight.T + bias on linear_rows.cpp (rows_kernel_takes() must hold)."""
    y = _ext.C.linear_rows(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def packed_mm(a: Tensor, w: Tensor, b: Optional[Tensor] = None, out: Optional[Tensor] = None) -> Tensor:
    """a w^T (+ b) on the packed GEMM; written into `out` (contiguous rows of a buffer) when given."""
    return _ext.C.ffn_linear_fwd(a, w, b, out)


def packed_input_grad(dy: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """dy w on the packed GEMM: the input gradient of x w^T (only x's shape is read)."""
    return _ext.C.ffn_linear_bwd(dy.contiguous(), x, w, True, False, False)[0]


def packed_weight_grad(dy: Tensor, x: Tensor, like: Tensor) -> Tensor:
    """dy^T x on the packed GEMM: the weight gradient of x w^T, a new tensor shaped as `like`
    (the weight or a buffer of its shape; only its shape is read)."""
    return _ext.C.ffn_linear_bwd(dy.contiguous(), x, like, False, True, False)[1]


class PackedLinear(torch.autograd.Function):
    """x @ w.T + b on csrc/cpu/ffn.cpp's packed GEMM (its first layer alone, kFfnFirst), and its
    gradients on the same GEMM. x (..., in) with any strides; returns (tokens, out)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return owned(packed_mm(x, w, b))

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw, db = _ext.C.ffn_linear_bwd(dy.contiguous(), x, w, *ctx.needs_input_grad)
        return tuple(g if need else None for g, need in zip((dx, dw, db), ctx.needs_input_grad))


LOW_PRECISION = (torch.bfloat16, torch.float16)


def packed_gemm_wins(dtype: torch.dtype) -> bool:
    """Whether calls in dtype of more rows than max_rows() run on the packed GEMM here: fp32 where
    torch's fp32 GEMM is generic code (the rule measured above), bf16 / fp16 where torch's GEMMs
    in them are (cpu_gemm.fast_lowp_gemm(): on a 2-core Zen 3 the packed GEMM converts to fp32 and
    runs at 135-151 GFLOP/s forward and backward, torch's bf16 GEMM at 19)."""
    if _ext.C is None or not hasattr(_ext.C, "ffn_linear_fwd") or _ext.cpu_level() not in ("avx2", "avx512"):
        return False
    if dtype == torch.float32:
        return not cpu_gemm.torch_fp32_gemm_wins()[0]
    return dtype in LOW_PRECISION and not cpu_gemm.fast_lowp_gemm(dtype)


def packed_takes(x: Tensor, weight: Tensor, bias: Optional[Tensor], rows: int) -> bool:
    """Whether a call of `rows` rows runs on the packed GEMM (packed_gemm_wins() and its layout)."""
    return (rows > max_rows(x.dtype) and weight.dtype == x.dtype
            and x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] == x.shape[-1] and not torch.compiler.is_compiling()
            and _plain(x) and _plain(weight)
            and (bias is None or (_plain(bias) and bias.dtype == x.dtype
                                  and bias.shape == (weight.shape[0],) and bias.is_contiguous()))
            and packed_gemm_wins(x.dtype))


# Fewest tokens (the GEMM's K) for which weight_grad.cpp takes a weight gradient. torch's mm
# with a transposed A slows down as K grows; at K = 512 it is still at or above the kernel
# (out x in = 512^2..1024^2: 0.78-0.91x for the kernel, 2048^2: 1.24x), from K = 1024 below it
# (512^2: 1.10x, 768^2 at K = 2048: 1.43x, the FFN's shapes above: 1.2-2.0x). Median of 15,
# one process, 2-core Xeon. Without AMX torch's transposed-A bf16 mm keeps pace: 2-core Zen 4
# (AVX512-BF16), best of 5, dW against the forward's x W^T at the same (tokens, in, out): Llama's
# (1024, 2048 / 5632, 5632 / 2048 / 512) 405-419 against 432-437 GFLOP/s, SwiGLU (2048, 4096,
# 11008) both ways 347-375 against 392-409, (4096, 768, 3072) 367-370 against 400-434; a
# contiguous copy of dy^T first ran 292-407: no dW kernel there.
MIN_WEIGHT_GRAD_TOKENS = 1024


def _weight_grad_fits(x: Tensor, out_features: int) -> bool:
    """Whether weight_grad.cpp takes the weight gradient of a layer of out_features outputs
    whose inputs are the rows of x (last dim: the in-features)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and _plain(x) and x.dim() >= 1
            and x.numel() >= MIN_WEIGHT_GRAD_TOKENS * max(1, x.shape[-1]) and out_features > 0
            and _ext.C is not None and hasattr(_ext.C, "weight_grad") and _ext.C.use_amx_bf16()
            and not torch.compiler.is_compiling())


def weight_grad_kernel_takes(dy: Tensor, x: Tensor) -> bool:
    """Whether weight_grad.cpp computes dy^T x for these (tokens, out) and (tokens, in) rows."""
    return (dy.dtype == torch.bfloat16 and dy.device.type == "cpu" and _plain(dy) and dy.dim() == 2
            and x.dim() == 2 and dy.shape[0] == x.shape[0] and _weight_grad_fits(x, dy.shape[1]))


def weight_grad(dy: Tensor, x: Tensor) -> Tensor:
    """dy^T x: the (out, in) weight gradient of a linear layer from its (tokens, out) output
    gradient and (tokens, in) input; weight_grad.cpp where weight_grad_kernel_takes(), else
    torch's mm."""
    if not weight_grad_kernel_takes(dy, x):
        return dy.t() @ x
    dy, x = rowwise(dy), rowwise(x)
    if dy.shape[1] <= x.shape[1]:  # Q (packed whole) the narrower: C^T = x^T dy, stored transposed
        return _ext.C.weight_grad(x, dy, True, dy.dtype)
    return _ext.C.weight_grad(dy, x, False, dy.dtype)


def _linear_grads(dy: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_w: bool, need_b: bool):
    """(dx, dW, db) of y = x W^T + b, None where not needed: dx on torch's GEMM (oneDNN runs it
    at 1.7-2.1 TFLOP/s on AMX), dW from weight_grad(); calls the packed GEMM takes (under
    torch.compile, through fastformer::linear_bwd) all three on it."""
    dy2 = rowwise(dy).reshape(-1, dy.shape[-1])
    if packed_takes(x, weight, None, dy2.shape[0]):
        grads = _ext.C.ffn_linear_bwd(dy2.contiguous(), x, weight, need_x, need_w, need_b)
        return tuple(g if need else None for g, need in zip(grads, (need_x, need_w, need_b)))
    dx = (dy2 @ weight).reshape(x.shape) if need_x else None
    dw = weight_grad(dy2, x.reshape(-1, x.shape[-1])) if need_w else None
    db = dy2.sum(0) if need_b else None
    return dx, dw, db


class _Linear(torch.autograd.Function):
    """F.linear whose backward is _linear_grads() (eager autograd)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return owned(F.linear(x, weight, bias))

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        return _linear_grads(dy, x, weight, need_x, need_w, need_b and ctx.has_bias)


# The same under torch.compile: a custom-op pair, opaque to the compiler, whose backward decides
# at run time (inside the op) whether the kernel takes the weight gradient. Eager calls keep the
# lighter autograd.Function above.
@torch.library.custom_op("fastformer::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    rows = x.numel() // x.shape[-1] if x.dim() >= 1 and x.shape[-1] > 0 else 0
    if packed_takes(x, weight, bias, rows):
        return packed_mm(x, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


@_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("fastformer::linear_bwd", mutates_args=())
def _linear_bwd_op(dy: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_w: bool,
                   need_b: bool) -> list[Tensor]:
    grads = _linear_grads(dy, x, weight, need_x, need_w, need_b)
    return [g if g is not None else dy.new_empty((0,)) for g in grads]


@_linear_bwd_op.register_fake
def _(dy, x, weight, need_x, need_w, need_b):
    shapes = (x.shape, weight.shape, weight.shape[:1])
    return [dy.new_empty(s if need else (0,)) for s, need in zip(shapes, (need_x, need_w, need_b))]


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    need_b = need_b and ctx.has_bias
    dx, dw, db = _linear_bwd_op(dy, x, weight, need_x, need_w, need_b)
    return dx if need_x else None, dw if need_w else None, db if need_b else None


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)
# Under torch.compile bf16 CPU linears take the op where the kernel ran at import (AMX at the
# selected level); elsewhere F.linear stays visible to the compiler.
_COMPILE_VIA_OP = _ext.C is not None and hasattr(_ext.C, "weight_grad") and bool(_ext.C.use_amx_bf16())


def _compiled_min_rows() -> dict:
    """Under torch.compile, per dtype, the fewest rows for which a CPU call takes the op (whose
    body runs the packed GEMM where packed_takes() holds at run time); none where the packed GEMM
    is not taken here. Read once at import into _COMPILE_MIN_ROWS, a constant of every trace:
    the rule reads the CPU and the environment, which dynamo does not trace (and
    torch.compiler.assume_constant_result, applied at import, imports dynamo and with it
    triton). Compiled without it, a converted fp32 Llama-style model ran 1.42x (inference) and
    1.16x (training step) slower than uncompiled on a 2-core Zen 5 (torch's generic fp32 GEMMs)."""
    least = {}
    for dtype in (torch.float32, *LOW_PRECISION):
        try:
            if packed_gemm_wins(dtype):
                least[dtype] = max_rows(dtype) + 1
        except ValueError:  # a bad FASTFORMER_CPU_FFN_FP32_GEMM: the eager call says so
            pass
    return least


_COMPILE_MIN_ROWS = _compiled_min_rows()


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)``; a few rows without autograd on linear_rows.cpp, calls of
    more rows on the packed GEMM where torch's GEMM in their dtype is generic code, bf16 calls without
    autograd on a prepacked weight's blocked copy (ops/prepack.py), a bf16 weight gradient on
    weight_grad.cpp (eager, and under torch.compile through the custom op fastformer::linear)."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    if x.dtype in (torch.float32, *LOW_PRECISION) and x.dim() >= 1 and x.shape[-1] > 0:
        rows = x.numel() // x.shape[-1]
        if torch.compiler.is_compiling():
            least = _COMPILE_MIN_ROWS.get(x.dtype)
            if (least and rows >= least and weight.dtype == x.dtype and weight.dim() == 2
                    and x.device.type == "cpu"):
                return _linear_op(x, weight, bias)
        elif packed_takes(x, weight, bias, rows):
            # Without autograd, the kernel straight: Function.apply was ~20 us of a call (2-core Zen 3).
            y = PackedLinear.apply(x, weight, bias) if grad else packed_mm(x, weight, bias)
            return y.reshape(*x.shape[:-1], weight.shape[0])
    if not grad:
        if rows_kernel_takes(x, weight, bias):
            return rows_linear(x, weight, bias)
        # (compiled calls never look: dynamo does not trace the registry's weak dictionary)
        if (x.dtype == torch.bfloat16 and not torch.compiler.is_compiling() and prepack.registered(weight)
                and x.dim() >= 1 and x.shape[-1] > 0):
            x2 = x.reshape(-1, x.shape[-1])
            if prepack.takes(x2, (weight,), (bias,)):  # ff.convert(..., prepack_weights=True)
                return prepack.linear(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    elif weight.requires_grad and weight.dtype == x.dtype and weight.dim() == 2:
        if torch.compiler.is_compiling():
            # The kernel's run-time conditions (AMX, sizes) are checked inside the op.
            if x.dtype == torch.bfloat16 and x.device.type == "cpu" and _COMPILE_VIA_OP:
                return _linear_op(x, weight, bias)
        elif _plain(weight) and _weight_grad_fits(x, weight.shape[0]):
            return _Linear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


__all__ = ["linear"]
