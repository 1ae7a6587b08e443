"""Triton kernels: the fused feed-forward block (launchers: fastformer/ops/ffn_triton.py).

Notation (fastformer/reference/ffn.py is the semantics): x (M tokens, D), W1 / Wg / Wu (F, D),
W2 / Wd (D, F); pre = x W1^T + b1, hd = act(pre) * keep / (1 - p) with keep from Philox at
element index token * F + unit; gated: g = x Wg^T + bg, u = x Wu^T + bu, h = act(g) * u
(with swiglu_limit L: g clamped above at L and u to [-L, L] first, _gate).

Two kernels, both tiled GEMMs (BLOCK_M x BLOCK_N output tile, BLOCK_K steps, fp32 accumulators,
grouped program order so that GROUP_M row blocks share B tiles in L2):

* ``ffn_act_matmul_kernel``: C = A op(B) with the activation in the epilogue.
    MODE_FWD_SAVE: pre = acc + b1 stored (gated: g and u, two accumulators over one A tile, stored
                   as [g | u]): the training forward's first GEMM.
    MODE_FWD_ACT:  h = act(acc + b1) * keep (gated: act(g) * u) stored: the inference forward.
    MODE_BWD:      acc = dh = dy W2; dpre = dh * keep / (1 - p) * act'(pre) (gated: dg = dh * u *
                   act'(g), du = dh * act(g)), pre (g, u) read from the saved tensor.
  Traffic per tile: K/BLOCK_K tiles of A and B (2 B tiles gated), the epilogue reads 0-2 and
  writes 1-2 tiles of (M, F).
* ``ffn_matmul_kernel``: C = op(A) op(B) (+ op(A2) op(B2)) (+ bias), where an operand may be the
  hidden activation recomputed on load (A_MODE / B_MODE = HIDDEN_ACT: act(pre) * keep, HIDDEN_GATED:
  act(g) * u, from the saved pre-activation), and the program of column block 0 also writes
  the row sums of op(A) (a bias gradient, deterministic, no atomics). Used for
    y = h W2^T + b2            op(A) = act(pre) recomputed (training) or h (inference)
    dW2 = dy^T hd, db2         op(B) = hd recomputed from the saved pre; row sums of dy^T
    dx = dpre W1               gated: dg Wg + du Wu (the second operand pair)
    dW1 = dpre^T x, db1        gated: launched for dg (-> dWg, dbg) and du (-> dWu, dbu)
  so act(pre) never exists in memory.

Every operand is read through (row, column) strides: transposes are stride swaps, never copies.
fp32 uses IEEE fp32 dots (not TF32: the fp32 tolerance is 1e-5). Under TRITON_INTERPRET=1 bf16
dot operands are upcast (common.dot_operand) and fp32 -> bf16 stores round (common.cast_to).
Masks are single comparisons (the interpreter mis-types `block & block` of int1).
"""
import triton
import triton.language as tl

from . import interpreter_mode
from .common import cast_to, dot_operand, dropout_word

ACT_RELU, ACT_GELU, ACT_GELU_TANH, ACT_SILU, ACT_QUICK_GELU, ACT_RELU2 = 0, 1, 2, 3, 4, 5  # activations.h codes
MODE_FWD_SAVE, MODE_FWD_ACT, MODE_BWD = 0, 1, 2               # ffn_act_matmul_kernel
PLAIN, HIDDEN_ACT, HIDDEN_GATED = 0, 1, 2                     # operand modes, ffn_matmul_kernel

# Constants: 1/sqrt(2), 1/sqrt(2 pi), sqrt(2/pi), 0.044715 (written as literals: a module-level
# tl.constexpr on the left of a tensor product yields a constexpr under the interpreter).


# ---- activations (the formulas of csrc/common/activations.h) -----------------------------------
@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact limits +-1 for large |x| (tl has no tanh)
    return 1.0 - 2.0 / (tl.exp(x * 2.0) + 1.0)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """act(x), fp32."""
    if ACT == 0:
        return tl.where(x > 0, x, 0.0)
    elif ACT == 1:
        return x * 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
    elif ACT == 2:
        return x * 0.5 * (1.0 + _tanh((x + x * x * x * 0.044715) * 0.7978845608028654))
    elif ACT == 4:
        return x * tl.sigmoid(x * 1.702)
    elif ACT == 5:
        r = tl.where(x > 0, x, 0.0)
        return r * r
    else:
        return x * tl.sigmoid(x)


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    """act'(x), fp32 (relu'(0) = 0, as torch)."""
    if ACT == 0:
        return tl.where(x > 0, 1.0, 0.0)
    elif ACT == 1:
        return (1.0 + tl.erf(x * 0.7071067811865476)) * 0.5 + x * tl.exp(x * x * -0.5) * 0.3989422804014327
    elif ACT == 2:
        t = _tanh((x + x * x * x * 0.044715) * 0.7978845608028654)
        return (1.0 + t) * 0.5 + x * 0.5 * (1.0 - t * t) * 0.7978845608028654 * (1.0 + x * x * 0.134145)
    elif ACT == 4:
        s = tl.sigmoid(x * 1.702)
        return s * (1.0 + x * 1.702 * (1.0 - s))
    elif ACT == 5:
        return tl.where(x > 0, x * 2.0, 0.0)
    else:
        s = tl.sigmoid(x)
        return s * (1.0 + x * (1.0 - s))


@triton.jit
def _keep_scale(tok, unit, hidden, seed, rng_offset, drop_threshold, drop_scale):
    """keep / (1 - p) for tokens tok (column vector) x units unit (row vector), or the transpose:
    Philox word of element rng_offset + token * hidden + unit (reference/rng.py)."""
    word = dropout_word(seed, rng_offset + tok.to(tl.int64) * hidden + unit)
    return tl.where(word >= drop_threshold.to(tl.uint32), drop_scale, 0.0)


@triton.jit
def _gate(g, u, limit, ACT: tl.constexpr, CLAMP: tl.constexpr):
    """act(g) * u; CLAMP: g clamped above at limit and u to [-limit, limit] first (DeepSeek-V4)."""
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return _act(g, ACT) * u


@triton.jit
def _gate_grads(dh, g, u, limit, ACT: tl.constexpr, CLAMP: tl.constexpr):
    """(d g, d u) of h = _gate(g, u): the clamps pass the gradient where their bounds hold."""
    if CLAMP:
        g_pass = g <= limit
        u_pass = (u >= -limit) & (u <= limit)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return tl.where(g_pass, dh * u * _act_grad(g, ACT), 0.0), tl.where(u_pass, dh * _act(g, ACT), 0.0)
    return dh * u * _act_grad(g, ACT), dh * _act(g, ACT)


# ---- tiles -----------------------------------------------------------------------------------
@triton.jit
def _load(ptr, rows, cols, stride_r, stride_c, n_rows, n_cols):
    """(len(rows), len(cols)) tile, zero outside [0, n_rows) x [0, n_cols)."""
    mask = cols[None, :] < tl.where(rows < n_rows, n_cols, 0)[:, None]
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :] * stride_c,
                   mask=mask, other=0.0)


@triton.jit
def _hidden_tile(ptr, tok, unit, stride_tok, n_tok, hidden, seed, rng_offset, drop_threshold,
                 drop_scale, limit, MODE: tl.constexpr, ACT: tl.constexpr, DROPOUT: tl.constexpr,
                 CLAMP: tl.constexpr):
    """(tokens x units) tile of the hidden activation, fp32: the stored h (PLAIN), act(pre) *
    keep from the saved pre (HIDDEN_ACT), act(g) * u from the saved [g | u] (HIDDEN_GATED)."""
    v = _load(ptr, tok, unit, stride_tok, 1, n_tok, hidden).to(tl.float32)
    if MODE == 1:
        v = _act(v, ACT)
        if DROPOUT:
            v *= _keep_scale(tok[:, None], unit[None, :], hidden, seed, rng_offset,
                             drop_threshold, drop_scale)
    elif MODE == 2:
        u = _load(ptr + hidden, tok, unit, stride_tok, 1, n_tok, hidden).to(tl.float32)
        v = _gate(v, u, limit, ACT, CLAMP)
    return v


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of this program, GROUP_M row blocks per column sweep."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n


# ---- first GEMM / d(hidden) GEMM, activation in the epilogue ----------------------------------
@triton.jit(do_not_specialize=["seed", "rng_offset", "drop_threshold"])
def ffn_act_matmul_kernel(
    a_ptr,          # (M, K) x (forward) or dy (backward); element (m, k) at m*stride_am + k*stride_ak
    b_ptr,          # op(B) (K, N): W1^T / Wg^T (forward), W2 (backward); (k, n) at k*stride_bk + n*stride_bn
    bu_ptr,         # Wu^T, the up projection, same strides as b (read iff GATED and forward)
    bias_ptr,       # (N,) b1 / bg (read iff HAS_BIAS)
    bias_up_ptr,    # (N,) bu (read iff HAS_BIAS_UP)
    saved_ptr,      # (M, N) pre or (M, 2N) [g | u], row stride stride_sm, unit stride 1:
                    # written by MODE_FWD_SAVE, read by MODE_BWD
    out_ptr,        # MODE_FWD_ACT: h (M, N); MODE_BWD: dpre (M, N) or [dg | du] (M, 2N);
                    # row stride stride_om, unit stride 1
    stride_am, stride_ak, stride_bk, stride_bn, stride_sm, stride_om,
    M, N, K,
    seed, rng_offset, drop_threshold, drop_scale,  # dropout: Philox key, counter base,
                                                   # round(p * 2^32), 1 / (1 - p)
    limit,          # gated, CLAMP: the gate's clamps (_gate)
    MODE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, DROPOUT: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_BIAS_UP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    TWO_ACC: tl.constexpr = GATED and MODE != 2
    if TWO_ACC:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = dot_operand(_load(a_ptr, rows, ks, stride_am, stride_ak, M, K), INTERPRET)
        b = dot_operand(_load(b_ptr, ks, cols, stride_bk, stride_bn, K, N), INTERPRET)
        acc = tl.dot(a, b, acc, input_precision="ieee")
        if TWO_ACC:
            bu = dot_operand(_load(bu_ptr, ks, cols, stride_bk, stride_bn, K, N), INTERPRET)
            acc_up = tl.dot(a, bu, acc_up, input_precision="ieee")

    mask = cols[None, :] < tl.where(rows < M, N, 0)[:, None]
    s_ptrs = saved_ptr + rows[:, None].to(tl.int64) * stride_sm + cols[None, :]
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    dtype = out_ptr.dtype.element_ty
    if MODE != 2:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if TWO_ACC:
            if HAS_BIAS_UP:
                acc_up += tl.load(bias_up_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if MODE == 0:
            tl.store(s_ptrs, cast_to(acc, dtype, INTERPRET), mask=mask)
            if TWO_ACC:
                tl.store(s_ptrs + N, cast_to(acc_up, dtype, INTERPRET), mask=mask)
        else:
            if TWO_ACC:
                h = _gate(acc, acc_up, limit, ACT, CLAMP)
            else:
                h = _act(acc, ACT)
                if DROPOUT:
                    h *= _keep_scale(rows[:, None], cols[None, :], N, seed, rng_offset,
                                     drop_threshold, drop_scale)
            tl.store(o_ptrs, cast_to(h, dtype, INTERPRET), mask=mask)
    else:
        pre = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(s_ptrs + N, mask=mask, other=0.0).to(tl.float32)
            d_gate, d_up = _gate_grads(acc, pre, up, limit, ACT, CLAMP)
            tl.store(o_ptrs, cast_to(d_gate, dtype, INTERPRET), mask=mask)
            tl.store(o_ptrs + N, cast_to(d_up, dtype, INTERPRET), mask=mask)
        else:
            if DROPOUT:
                acc *= _keep_scale(rows[:, None], cols[None, :], N, seed, rng_offset,
                                   drop_threshold, drop_scale)
            tl.store(o_ptrs, cast_to(acc * _act_grad(pre, ACT), dtype, INTERPRET), mask=mask)


# ---- GEMM with the hidden activation recomputed on load ---------------------------------------
@triton.jit
def _a_tile(ptr, rows, ks, stride_am, stride_ak, M, K, seed, rng_offset, drop_threshold,
            drop_scale, limit, MODE: tl.constexpr, ACT: tl.constexpr, DROPOUT: tl.constexpr,
            CLAMP: tl.constexpr):
    if MODE == 0:
        return _load(ptr, rows, ks, stride_am, stride_ak, M, K)
    # rows are tokens, ks hidden units (K = F)
    return _hidden_tile(ptr, rows, ks, stride_am, M, K, seed, rng_offset, drop_threshold,
                        drop_scale, limit, MODE, ACT, DROPOUT, CLAMP)


@triton.jit
def _b_tile(ptr, ks, cols, stride_bk, stride_bn, K, N, seed, rng_offset, drop_threshold,
            drop_scale, limit, MODE: tl.constexpr, ACT: tl.constexpr, DROPOUT: tl.constexpr,
            CLAMP: tl.constexpr):
    if MODE == 0:
        return _load(ptr, ks, cols, stride_bk, stride_bn, K, N)
    # ks are tokens, cols hidden units (N = F)
    return _hidden_tile(ptr, ks, cols, stride_bk, K, N, seed, rng_offset, drop_threshold,
                        drop_scale, limit, MODE, ACT, DROPOUT, CLAMP)


@triton.jit(do_not_specialize=["seed", "rng_offset", "drop_threshold"])
def ffn_matmul_kernel(
    a_ptr,          # op(A) (M, K): (m, k) at m*stride_am + k*stride_ak; HIDDEN_* modes: the saved
                    # pre / [g | u] with tokens as rows (stride_am) and units as columns (stride 1)
    b_ptr,          # op(B) (K, N): (k, n) at k*stride_bk + n*stride_bn; HIDDEN_* modes: tokens as
                    # rows (stride_bk), units as columns
    a2_ptr,         # second pair, same strides and modes PLAIN (read iff HAS_SECOND):
    b2_ptr,         #   C += op(A2) op(B2)
    bias_ptr,       # (N,) added to C (read iff HAS_BIAS)
    c_ptr,          # (M, N) output, (m, n) at m*stride_cm + n*stride_cn, in its own dtype
    rowsum_ptr,     # (M,) fp32 row sums of op(A) (+ op(A2)), written by column block 0 (iff ROW_SUM)
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    M, N, K,
    seed, rng_offset, drop_threshold, drop_scale, limit,
    A_MODE: tl.constexpr, B_MODE: tl.constexpr, ACT: tl.constexpr, DROPOUT: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_SECOND: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_SUM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    dot_dtype = a_ptr.dtype.element_ty  # every tensor of the op has x's dtype
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = _a_tile(a_ptr, rows, ks, stride_am, stride_ak, M, K, seed, rng_offset,
                    drop_threshold, drop_scale, limit, A_MODE, ACT, DROPOUT, CLAMP)
        b = _b_tile(b_ptr, ks, cols, stride_bk, stride_bn, K, N, seed, rng_offset,
                    drop_threshold, drop_scale, limit, B_MODE, ACT, DROPOUT, CLAMP)
        if ROW_SUM:
            row_sum += tl.sum(a.to(tl.float32), axis=1)
        if A_MODE != 0:  # recomputed in fp32: the dot takes the operands' dtype
            a = cast_to(a, dot_dtype, INTERPRET)
        if B_MODE != 0:
            b = cast_to(b, dot_dtype, INTERPRET)
        acc = tl.dot(dot_operand(a, INTERPRET), dot_operand(b, INTERPRET), acc,
                     input_precision="ieee")
        if HAS_SECOND:
            a2 = _load(a2_ptr, rows, ks, stride_am, stride_ak, M, K)
            b2 = _load(b2_ptr, ks, cols, stride_bk, stride_bn, K, N)
            if ROW_SUM:
                row_sum += tl.sum(a2.to(tl.float32), axis=1)
            acc = tl.dot(dot_operand(a2, INTERPRET), dot_operand(b2, INTERPRET), acc,
                         input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = cols[None, :] < tl.where(rows < M, N, 0)[:, None]
    tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn,
             cast_to(acc, c_ptr.dtype.element_ty, INTERPRET), mask=mask)
    if ROW_SUM:  # every program sums (one reduction per K step); column block 0 stores
        tl.store(rowsum_ptr + rows, row_sum, mask=rows < tl.where(pid_n == 0, M, 0))


# ---- launch configurations -------------------------------------------------------------------
def _configs(shapes):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8},
                          num_warps=w, num_stages=s) for m, n, k, w, s in shapes]


# GPU: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), the usual tensor-core GEMM tiles; the gated
# first GEMM holds two accumulators, so its largest tile is 128 x 128.
CONFIGS = _configs([(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4),
                    (128, 128, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
                    (64, 64, 32, 4, 4)])
GATED_CONFIGS = _configs([(128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4),
                          (64, 128, 32, 4, 4), (64, 64, 32, 4, 4)])
TUNE_KEY = ["M", "N", "K"]

# Interpreter: one fixed config, large tiles (each program costs ~20 ms whatever its size).
INTERPRETER_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4)

_tuned = {}


def kernel_and_config(kind: str, gated: bool = False):
    """(kernel, fixed meta-parameters) for kind in act (ffn_act_matmul_kernel), matmul
    (ffn_matmul_kernel): on GPUs the autotuned kernel and {}, under the interpreter the plain
    kernel and INTERPRETER_CONFIG. The grid is a function of BLOCK_M and BLOCK_N either way."""
    kernel = ffn_act_matmul_kernel if kind == "act" else ffn_matmul_kernel
    if interpreter_mode():
        return kernel, dict(INTERPRETER_CONFIG)
    key = (kind, gated)
    if key not in _tuned:
        configs = GATED_CONFIGS if gated else CONFIGS
        _tuned[key] = triton.autotune(configs=configs, key=TUNE_KEY)(kernel)
    return _tuned[key], {}
