"""Triton kernels: flash attention forward (the backward: attention_bwd.py; shared tile helpers:
attention_tiles.py). Launchers: ops/attention_triton.py.

Notation (fastformer/reference/attention.py is the semantics): q (B, H, Lq, D), k (B, Hkv, Lk,
D), v (B, Hkv, Lk, Dv), out (B, H, Lq, Dv): the value head dim Dv may differ from D (MLA:
DeepSeek-V2/V3's D = 192, Dv = 128); query head h reads kv head h // (H / Hkv) (GQA/MQA by index
arithmetic, the kv tensors are never repeated); d = Lk - Lq for bottom-right causality, else 0.
Scores:
    s_ij = scale * q_i.k_j, or with softcap c: s_ij = c * tanh(scale * q_i.k_j / c)  (tanh
                                                of exp2: attention_options.tanh)
    s_ij += -slope_bh * |i + d - j|             (ALiBi, slopes (H,) or (B, H))
          + rel_h[j - i + Lq - 1]               (the relative-position bias, T5's: its (H,
                                                Lq + Lk - 1) vector per head, from the table)
          + attn_mask_ij                        (a float mask)
and -inf where the bool attn_mask is False, the key_padding_mask is True, or j is outside the
band i + d - left <= j <= i + d + right (the window; causality is right = 0; no limit on a
side given as -1). The attn_mask is read tile by tile through its four strides (a broadcast
view: stride 0 on broadcast dims), never expanded; no (Lq, Lk) bias tensor is ever formed.
The kernels work in base 2: t = s * log2(e), scale and log2(e) folded into one multiply.

Band (attention_options.key_blocks / query_blocks): a program walks only the blocks that meet
its rows' band. Blocks cut by an edge of the band, and the one holding the Lk tail, apply the
element masks; blocks wholly inside run without; blocks wholly outside are never visited: a
window (left, right) costs about L * (left + right + 2 * BLOCK) per head instead of L^2.

Forward, one program per (query block of BLOCK_M rows, batch*head): online softmax over key
blocks of BLOCK_N, in fp32. Running max m and sum l per row, starting at m = -inf, l = 0, or
with a sink at m = sink_h * log2 e, l = 1 (the sink joins the denominator, adds no value):
    m' = max(m, rowmax t),  p = exp2(t - m'),  l = l * exp2(m - m') + rowsum p,
    acc = acc * exp2(m - m') + (p * keep / (1 - p_drop)) v      (p rounded to v's dtype)
then out = acc / l and lse = (m + log2 l) * ln 2 (natural log, fp32). A row with no allowed key
keeps m = -inf (exp2 is then taken against 0, so p = 0): l = 0, out = 0, lse = +inf; with a
sink: out = 0, lse = sink.
Traffic per (query block, key block) tile: K and V tiles, BLOCK_N * (D + Dv) elements (+ BLOCK_M
* BLOCK_N attn_mask and BLOCK_N padding-mask elements when given; with a relative bias, BLOCK_M *
BLOCK_N gathers from its head's vector, a few KB that stay in cache); per program Q and out
(BLOCK_M * D and BLOCK_M * Dv), lse, one slope and one sink. Per head: Lk * (D + Dv) *
ceil(Lq / BLOCK_M) elements of K/V (about half when causal, ~ (window + BLOCK_M) / Lk of it
with a window) + Lq * (D + Dv) of Q/out; nothing of size Lq * Lk is stored.

Backward: attention_bwd.py (P recomputed from the saved lse; dK/dV and dQ kernels).

Head dims D, Dv 16..256 (HEAD_DIM, HEAD_DIM_V): BLOCK_D, BLOCK_DV are the next powers of two >=
D, Dv. q, k, dq, dk are D wide (Q K^T sums over D; dS K, dS^T Q give D columns); v, out, dO,
dv are Dv wide (dO V^T sums over Dv; P V, P^T dO give Dv columns): no padded copies. Tail
columns read as 0 and are not stored. Batch/head/block bases are int64 scalars; in-tile
offsets (< BLOCK * row stride) int32. fp32 inputs use IEEE fp32 dots (not TF32: the fp32
tolerance is 1e-5). Under Triton's interpreter (TRITON_INTERPRET=1): bf16 dots are done in fp32
(_operand), bf16 results are rounded by cast_to, and masks are single comparisons (it
mis-types `block & scalar` of int1).
"""
import triton
import triton.language as tl

from . import interpreter_mode
# The launchers (ops/attention_triton.py) read every kernel and code through this module.
from .attention_bwd import attn_bwd_delta_kernel, attn_bwd_dkdv_kernel, attn_bwd_dq_kernel  # noqa: F401
from .attention_options import head_terms, key_blocks, make_band, sequence
from .attention_tiles import (GRAD_ATOMIC, GRAD_NONE, GRAD_STORE, LN2, MASK_BOOL,  # noqa: F401
                              MASK_FLOAT, MASK_NONE, _SPECIALIZE_NOT, _dropout_keep, _load_rows,
                              _scores, _store_rows)
from .common import LOG2E, cast_to
from .common import dot_operand as _operand  # bf16 tl.dot operands upcast under the interpreter


# ---- forward ---------------------------------------------------------------------------------
@triton.jit
def _fwd_key_blocks(acc, l_i, m_i, q, q_idx, k_head, v_head, k_offs, v_offs, mask_rows,
                    mask_offs, kpm_head, start_n, end_n, stride_kn, stride_vn, stride_mn,
                    stride_kpn, Lq, Lk, band, terms, seed, rng_q, drop_threshold, drop_scale,
                    MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
                    WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, TABLE: tl.constexpr,
                    EDGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) with key blocks [start_n, end_n)."""
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    for block_n in range(start_n, end_n, BLOCK_N):
        n64 = tl.cast(block_n, tl.int64)
        k_idx = block_n + offs_n
        k = _load_rows(k_head + n64 * stride_kn + k_offs, k_idx, Lk, cols, HEAD_DIM, BLOCK_D,
                       EDGE)
        qk = tl.dot(q, tl.trans(_operand(k, INTERPRET)), input_precision="ieee")
        t, _ = _scores(qk, q_idx[:, None], k_idx[None, :], mask_rows + n64 * stride_mn + mask_offs,
                       (kpm_head + n64 * stride_kpn + offs_n * stride_kpn)[None, :], Lq, Lk,
                       band, terms, MASK_KIND, HAS_KPM, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                       ALIBI, TABLE, EDGE)
        m_new = tl.maximum(m_i, tl.max(t, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no allowed key yet
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(t - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = _dropout_keep(seed, rng_q[:, None], k_idx[None, :], drop_threshold)
            p = tl.where(keep, p * drop_scale, 0.0)
        v = _load_rows(v_head + n64 * stride_vn + v_offs, k_idx, Lk, cols_v, HEAD_DIM_V,
                       BLOCK_DV, EDGE)
        p_op = _operand(cast_to(p, v_head.dtype.element_ty, INTERPRET), INTERPRET)
        acc = tl.dot(p_op, _operand(v, INTERPRET), acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_SPECIALIZE_NOT)
def attn_fwd_kernel(
    q_ptr,      # (B, H, Lq, D) queries, strides (stride_qb, stride_qh, stride_qm, 1)
    k_ptr,      # (B, Hkv, Lk, D) keys, strides (stride_kb, stride_kh, stride_kn, 1)
    v_ptr,      # (B, Hkv, Lk, Dv) values, strides (stride_vb, stride_vh, stride_vn, 1)
    mask_ptr,   # (B, H, Lq, Lk) attn_mask view, any strides (0 on broadcast dims); bool
                # (True = attend) or float (added); read iff MASK_KIND != 0
    kpm_ptr,    # (B, Lk) bool key_padding_mask, True = padding; read iff HAS_KPM
    alibi_ptr, rel_ptr,  # the score terms (see above)
    cu_q_ptr, cu_k_ptr, rng_seq_ptr,  # packed sequences (see above); read iff PACKED
    sinks_ptr,  # (H,) fp32 contiguous sink logits; read iff SINKS
    out_ptr,    # (B, H, Lq, Dv) output in q's dtype, strides (stride_ob, stride_oh, stride_om, 1)
    lse_ptr,    # (B, H, Lq) fp32: natural-log log-sum-exp, +inf for empty rows
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn, stride_ob, stride_oh, stride_om,
    stride_ab, stride_ah, stride_rh, stride_lb, stride_lh,
    H, GROUPS, Lq, Lk,            # GROUPS = H // Hkv; PACKED: the longest lengths
    win_left, win_right, qk_scale, softcap_in,
    seed, rng_offset, drop_threshold, drop_scale,  # dropout: Philox key, counter base,
                                                   # round(p * 2^32), 1 / (1 - p)
    HEAD_DIM: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
    DROPOUT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, TABLE: tl.constexpr,
    SINKS: tl.constexpr, PACKED: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    # 1-D grid, query blocks fastest: programs running together share K/V in L2, and B*H is
    # not bound by CUDA's 65535 limit on grid dims 1 and 2.
    num_m = tl.cdiv(Lq, BLOCK_M)
    start_m = (tl.program_id(0) % num_m) * BLOCK_M
    bh = tl.program_id(0) // num_m
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    q_start, k_start, Lq, Lk, rng_b = sequence(b, H, Lq, Lk, rng_offset, cu_q_ptr, cu_k_ptr,
                                               rng_seq_ptr, PACKED, DROPOUT)
    if PACKED:
        if start_m >= Lq:
            return
    hkv = h // GROUPS
    m64 = start_m.to(tl.int64) + q_start
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q_idx = start_m + offs_m
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)

    q = _load_rows(q_ptr + b * stride_qb + h * stride_qh + m64 * stride_qm
                   + offs_m[:, None] * stride_qm + cols[None, :], q_idx, Lq, cols, HEAD_DIM,
                   BLOCK_D, True)
    q = _operand(q, INTERPRET)
    k_head = k_ptr + b * stride_kb + hkv * stride_kh + k_start * stride_kn
    v_head = v_ptr + b * stride_vb + hkv * stride_vh + k_start * stride_vn
    k_offs = offs_n[:, None] * stride_kn + cols[None, :]
    v_offs = offs_n[:, None] * stride_vn + cols_v[None, :]
    mask_rows = mask_ptr + b * stride_mb + h * stride_mh + m64 * stride_mm
    mask_offs = offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    kpm_head = kpm_ptr + b * stride_kpb
    rng_q = rng_b + (h * Lq + q_idx) * Lk
    band = make_band(Lq, Lk, win_left, win_right, BOTTOM_RIGHT, WINDOW_RIGHT)
    terms = head_terms(qk_scale, softcap_in, alibi_ptr + b * stride_ab + h * stride_ah,
                       rel_ptr + h * stride_rh, ALIBI)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if SINKS:  # the sink as a first key of score sink * log2 e: m = that, l = 1
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + h) * LOG2E
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)  # a sink of -inf is no sink
    lo, full_lo, full_hi, hi = key_blocks(start_m, Lq, Lk, band, BLOCK_M, BLOCK_N, WINDOW_LEFT,
                                          WINDOW_RIGHT)
    for part in tl.static_range(3):  # left edge blocks (if any), inner blocks, right edge
        if part == 0:
            start_n, end_n = lo, full_lo
        elif part == 1:
            start_n, end_n = full_lo, full_hi
        else:
            start_n, end_n = full_hi, hi
        if part != 0 or WINDOW_LEFT:
            acc, l_i, m_i = _fwd_key_blocks(
                acc, l_i, m_i, q, q_idx, k_head, v_head, k_offs, v_offs, mask_rows, mask_offs,
                kpm_head, start_n, end_n, stride_kn, stride_vn, stride_mn, stride_kpn, Lq, Lk,
                band, terms, seed, rng_q, drop_threshold, drop_scale, MASK_KIND, HAS_KPM,
                DROPOUT, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, TABLE, part != 1, BLOCK_N,
                BLOCK_D, HEAD_DIM, BLOCK_DV, HEAD_DIM_V, INTERPRET)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    _store_rows(out_ptr + b * stride_ob + h * stride_oh + m64 * stride_om
                + offs_m[:, None] * stride_om + cols_v[None, :],
                acc / l_safe[:, None], q_idx, Lq, cols_v, HEAD_DIM_V, INTERPRET)
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * LN2)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + q_start + q_idx, lse, mask=q_idx < Lq)


# ---- launch configurations -------------------------------------------------------------------
def _configs(shapes):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in shapes]


# GPU: (BLOCK_M, BLOCK_N, warps, stages), autotuned per TUNE_KEY (lengths, head dims, band) and
# dtype.
# Chosen from what ptxas reports at D = 128, bf16, sm_90 (compiled on a machine without a GPU;
# run times not measured): these spill at most 48 bytes of registers there, while 4-warp
# programs with 128-row tiles, and dK/dV with 64 x 128 tiles, spill 500-1900 bytes. The larger
# tiles stay for head dims <= 64; configs that do not fit a head dim fail to compile and the
# autotuner skips them.
FWD_CONFIGS = _configs([(128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 4), (64, 64, 8, 3),
                        (128, 64, 4, 3), (128, 128, 8, 3)])
# dK/dV: BLOCK_M is the query block walked, BLOCK_N the key block a program owns.
DKDV_CONFIGS = _configs([(32, 64, 8, 2), (32, 64, 8, 3), (16, 64, 8, 3), (32, 128, 8, 2),
                         (64, 64, 4, 3)])
DQ_CONFIGS = _configs([(64, 32, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3),
                       (128, 64, 8, 2)])
TUNE_KEY = ["Lq", "Lk", "HEAD_DIM", "HEAD_DIM_V", "BOTTOM_RIGHT", "WINDOW_LEFT", "WINDOW_RIGHT"]

# Interpreter: one fixed config of large blocks. It pays ~1 ms per program and per helper call
# (its tl.dot is a plain numpy loop, as costly per multiply-add at any tile size): 128-wide
# blocks ran fwd+bwd of the test shapes (113, 203), (203, 113), (17, 17) 1.4x faster than 64.
INTERPRETER_CONFIGS = {
    "fwd": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4),
    "dkdv": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4),
    "dq": dict(BLOCK_M=128, BLOCK_N=128, num_warps=4),
}
DELTA_BLOCK_M = 128

_KERNELS = {"fwd": (attn_fwd_kernel, FWD_CONFIGS), "dkdv": (attn_bwd_dkdv_kernel, DKDV_CONFIGS),
            "dq": (attn_bwd_dq_kernel, DQ_CONFIGS)}
_tuned = {}


def kernel_and_config(kind: str):
    """(kernel, fixed launch meta-parameters) for kind in fwd, dkdv, dq: on GPUs the autotuned
    kernel and {} (it picks BLOCK_M, BLOCK_N, warps, stages); under TRITON_INTERPRET=1 the plain
    kernel and INTERPRETER_CONFIGS[kind]. Either way the grid is a function of BLOCK_M/BLOCK_N."""
    kernel, configs = _KERNELS[kind]
    if interpreter_mode():
        return kernel, dict(INTERPRETER_CONFIGS[kind])
    if kind not in _tuned:
        _tuned[kind] = triton.autotune(configs=configs, key=TUNE_KEY)(kernel)
    return _tuned[kind], {}


def fixed_config(kind: str):
    """(plain kernel, its first GPU config): what GPU tests launch, so that each variant they
    cover compiles once instead of once per autotuning candidate."""
    kernel, configs = _KERNELS[kind]
    first = configs[0]
    return kernel, dict(first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)
