"""Triton kernels: flash attention backward (the notation, scores and forward: attention.py;
launchers: ops/attention_triton.py).

Backward, with P = exp2(t - lse * log2 e) recomputed from the saved lse (sink included):
    delta_i = sum_d dO_id * out_id                       (preprocessing kernel)
    dP' = dO v^T * keep / (1 - p_drop),  dS = P * (dP' - delta)
    d attn_mask += dS,  d rel_h[j - i + Lq - 1] += dS  (the gradient of every additive bias)
    softcap: dS *= 1 - tanh^2 (the tanh recomputed with the scores)
    dV = (P * keep / (1 - p_drop))^T dO,  dK = scale * dS^T q,  dQ = scale * dS k
    d sink_h = -sum_(b, i) exp(sink_h - lse_bhi) * delta_bhi   (the launcher: B * H * Lq terms)
(P' and dS rounded to the input dtype before their dots, as the forward's p.)
dK/dV: one program per (key block, batch*kv head), looping over the query heads of its group
and over the query blocks that see its keys (edge blocks masked, the rest not); dK and dV
stay in registers and are written once, already summed over the group. Per tile it reads Q and
dO (BLOCK_M * (D + Dv)) and BLOCK_M of lse and delta. dQ: one program per (query block,
batch*head), walking key blocks like the forward; per tile it reads K and V (BLOCK_N * (D + Dv)).
dQ has its own kernel rather than fp32 atomics from the dK/dV kernel: that recomputes Q K^T
and dO V^T (7 tile matmuls instead of 5) but is deterministic, needs no fp32 scratch buffer
to zero and convert, and writes dq in the input dtype directly.
Option gradients come from the dQ kernel, which meets each (b, h, i, j) of the band once: a
mask without broadcast dims gets its dS tile stored (BLOCK_M * BLOCK_N writes per tile); a
broadcast mask an fp32 atomic add into a zeroed buffer of its own shape (stride 0 on the
broadcast dims: the programs of several (b, h) share an element); the relative bias an fp32
atomic add per pair into a zeroed (H, Lq + Lk - 1) buffer. Those atomics make the two gradients
nondeterministic in their last bits on GPUs; dq, dk and dv stay deterministic.
Rows past Lq read q = dO = 0 and lse = +inf, so P = 0 there; dK/dV rows past Lk are never
stored, so the dK/dV kernel needs no key-tail mask.
"""
import triton
import triton.language as tl

from .attention_options import head_terms, key_blocks, make_band, option_grads, query_blocks, sequence
from .attention_tiles import _SPECIALIZE_NOT, _dropout_keep, _load_rows, _scores, _store_rows
from .common import LOG2E, cast_to
from .common import dot_operand as _operand  # bf16 tl.dot operands upcast under the interpreter


# ---- backward --------------------------------------------------------------------------------
@triton.jit
def attn_bwd_delta_kernel(
    out_ptr,    # (B, H, Lq, Dv) forward output, strides (stride_ob, stride_oh, stride_om, 1)
    do_ptr,     # (B, H, Lq, Dv) grad of the output, strides (stride_dob, stride_doh, stride_dom, 1)
    delta_ptr,  # (B, H, Lq) fp32 contiguous: rowsum(dO * out)
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom, H, Lq,
    HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    num_m = tl.cdiv(Lq, BLOCK_M)
    start_m = (tl.program_id(0) % num_m) * BLOCK_M
    bh = tl.program_id(0) // num_m
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    m64 = start_m.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = start_m + offs_m
    cols_v = tl.arange(0, BLOCK_DV)
    o = _load_rows(out_ptr + b * stride_ob + h * stride_oh + m64 * stride_om
                   + offs_m[:, None] * stride_om + cols_v[None, :], q_idx, Lq, cols_v,
                   HEAD_DIM_V, BLOCK_DV, True)
    do = _load_rows(do_ptr + b * stride_dob + h * stride_doh + m64 * stride_dom
                    + offs_m[:, None] * stride_dom + cols_v[None, :], q_idx, Lq, cols_v,
                    HEAD_DIM_V, BLOCK_DV, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + bh.to(tl.int64) * Lq + q_idx, delta, mask=q_idx < Lq)


@triton.jit
def _dkdv_query_blocks(dk, dv, k, v, k_idx, q_head, do_head, q_offs, do_offs, lse_head,
                       delta_head, mask_head, mask_offs, kpm_ptrs, start_m, end_m, stride_qm,
                       stride_dom, stride_mm, Lq, Lk, band, terms, seed, rng_head,
                       drop_threshold, drop_scale,
                       MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
                       WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                       SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, TABLE: tl.constexpr,
                       EDGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                       INTERPRET: tl.constexpr):
    """Accumulate dK, dV of one key block over query blocks [start_m, end_m) of one head.
    Score tiles are (queries, keys) as in the forward, so K and V are the B operands of
    Q K^T and dO V^T (shared memory on Hopper) instead of register-held A operands: the
    transposed formulation (S^T = K Q^T) spilled 2x more at D = 128."""
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    for block_m in range(start_m, end_m, BLOCK_M):
        m64 = tl.cast(block_m, tl.int64)
        q_idx = block_m + offs_m
        q = _operand(_load_rows(q_head + m64 * stride_qm + q_offs, q_idx, Lq, cols, HEAD_DIM,
                                BLOCK_D, True), INTERPRET)
        do = _operand(_load_rows(do_head + m64 * stride_dom + do_offs, q_idx, Lq, cols_v,
                                 HEAD_DIM_V, BLOCK_DV, True), INTERPRET)
        lse2 = tl.load(lse_head + q_idx, mask=q_idx < Lq, other=float("inf")) * LOG2E
        delta = tl.load(delta_head + q_idx, mask=q_idx < Lq, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        t, u = _scores(qk, q_idx[:, None], k_idx[None, :], mask_head + m64 * stride_mm + mask_offs,
                       kpm_ptrs, Lq, Lk, band, terms, MASK_KIND, HAS_KPM, WINDOW_LEFT,
                       WINDOW_RIGHT, SOFTCAP, ALIBI, TABLE, EDGE)
        p = tl.exp2(t - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        if DROPOUT:
            keep = _dropout_keep(seed, rng_head + q_idx.to(tl.int64)[:, None] * Lk,
                                 k_idx[None, :], drop_threshold)
            p_drop = tl.where(keep, p * drop_scale, 0.0)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        else:
            p_drop = p
        p_op = _operand(cast_to(p_drop, do_head.dtype.element_ty, INTERPRET), INTERPRET)
        dv = tl.dot(tl.trans(p_op), do, dv, input_precision="ieee")
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - u * u)
        ds_op = _operand(cast_to(ds, q_head.dtype.element_ty, INTERPRET), INTERPRET)
        dk = tl.dot(tl.trans(ds_op), q, dk, input_precision="ieee")
    return dk, dv


@triton.jit(do_not_specialize=_SPECIALIZE_NOT)
def attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr,   # as in attn_fwd_kernel
    mask_ptr, kpm_ptr,     # as in attn_fwd_kernel
    alibi_ptr, rel_ptr, cu_q_ptr, cu_k_ptr, rng_seq_ptr,  # as in attn_fwd_kernel
    do_ptr,      # (B, H, Lq, Dv) grad of the output, strides (stride_do*, 1)
    lse_ptr,     # (B, H, Lq) fp32, from the forward, strides (stride_lb, stride_lh, 1)
    delta_ptr,   # (B, H, Lq) fp32, from attn_bwd_delta_kernel, strides as lse
    dk_ptr,      # (B, Hkv, Lk, D) grad of k in k's dtype; strides (stride_dk*, 1)
    dv_ptr,      # (B, Hkv, Lk, Dv) grad of v in v's dtype; strides (stride_dv*, 1)
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_ab, stride_ah, stride_rh, stride_lb, stride_lh,
    H, Hkv, GROUPS, Lq, Lk, win_left, win_right, qk_scale, softcap_in, scale,
    seed, rng_offset, drop_threshold, drop_scale,
    HEAD_DIM: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
    DROPOUT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, TABLE: tl.constexpr,
    PACKED: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    num_n = tl.cdiv(Lk, BLOCK_N)
    start_n = (tl.program_id(0) % num_n) * BLOCK_N
    bhkv = tl.program_id(0) // num_n
    b = (bhkv // Hkv).to(tl.int64)
    hkv = (bhkv % Hkv).to(tl.int64)
    q_start, k_start, Lq, Lk, rng_b = sequence(b, H, Lq, Lk, rng_offset, cu_q_ptr, cu_k_ptr,
                                               rng_seq_ptr, PACKED, DROPOUT)
    if PACKED:  # (a sequence without queries still stores its zero dK, dV)
        if start_n >= Lk:
            return
    n64 = start_n.to(tl.int64) + k_start
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    k_idx = start_n + offs_n
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    k = _operand(_load_rows(k_ptr + b * stride_kb + hkv * stride_kh + n64 * stride_kn
                            + offs_n[:, None] * stride_kn + cols[None, :], k_idx, Lk, cols,
                            HEAD_DIM, BLOCK_D, True), INTERPRET)
    v = _operand(_load_rows(v_ptr + b * stride_vb + hkv * stride_vh + n64 * stride_vn
                            + offs_n[:, None] * stride_vn + cols_v[None, :], k_idx, Lk, cols_v,
                            HEAD_DIM_V, BLOCK_DV, True), INTERPRET)
    q_offs = offs_m[:, None] * stride_qm + cols[None, :]
    do_offs = offs_m[:, None] * stride_dom + cols_v[None, :]
    mask_offs = offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    kpm_ptrs = (kpm_ptr + b * stride_kpb + n64 * stride_kpn + offs_n * stride_kpn)[None, :]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    band = make_band(Lq, Lk, win_left, win_right, BOTTOM_RIGHT, WINDOW_RIGHT)
    lo, full_lo, full_hi, hi = query_blocks(start_n, Lq, Lk, band, BLOCK_M, BLOCK_N,
                                            WINDOW_LEFT, WINDOW_RIGHT)
    for g in range(GROUPS):
        h = hkv * GROUPS + g
        q_head = q_ptr + b * stride_qb + h * stride_qh + q_start * stride_qm
        do_head = do_ptr + b * stride_dob + h * stride_doh + q_start * stride_dom
        mask_head = mask_ptr + b * stride_mb + h * stride_mh + n64 * stride_mn
        lse_head = lse_ptr + b * stride_lb + h * stride_lh + q_start
        delta_head = delta_ptr + b * stride_lb + h * stride_lh + q_start
        rng_head = rng_b + h * Lq * Lk
        terms = head_terms(qk_scale, softcap_in, alibi_ptr + b * stride_ab + h * stride_ah,
                       rel_ptr + h * stride_rh, ALIBI)
        for part in tl.static_range(3):  # edge blocks above (if any), inner, below (if any)
            if part == 0:
                start_m, end_m = lo, tl.minimum(full_lo, hi)
            elif part == 1:
                start_m, end_m = full_lo, full_hi
            else:
                start_m, end_m = full_hi, hi
            if (part == 0 and WINDOW_RIGHT) or part == 1 or (part == 2 and WINDOW_LEFT):
                dk, dv = _dkdv_query_blocks(
                    dk, dv, k, v, k_idx, q_head, do_head, q_offs, do_offs, lse_head,
                    delta_head, mask_head, mask_offs, kpm_ptrs, start_m, end_m, stride_qm,
                    stride_dom, stride_mm, Lq, Lk, band, terms, seed, rng_head, drop_threshold,
                    drop_scale, MASK_KIND, HAS_KPM, DROPOUT, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                    ALIBI, TABLE, part != 1, BLOCK_M, BLOCK_D, HEAD_DIM, BLOCK_DV,
                    HEAD_DIM_V, INTERPRET)
    _store_rows(dk_ptr + b * stride_dkb + hkv * stride_dkh + n64 * stride_dkn
                + offs_n[:, None] * stride_dkn + cols[None, :],
                dk * scale, k_idx, Lk, cols, HEAD_DIM, INTERPRET)
    _store_rows(dv_ptr + b * stride_dvb + hkv * stride_dvh + n64 * stride_dvn
                + offs_n[:, None] * stride_dvn + cols_v[None, :],
                dv, k_idx, Lk, cols_v, HEAD_DIM_V, INTERPRET)


@triton.jit
def _dq_key_blocks(dq, q, do, lse2, delta, q_idx, k_head, v_head, k_offs, v_offs, mask_rows,
                   mask_offs, kpm_head, dmask_rows, dmask_offs, dtable_head, start_n, end_n,
                   stride_kn, stride_vn, stride_mn, stride_kpn, stride_dmn, H, Lq, Lk, band,
                   terms, seed, rng_q, drop_threshold, drop_scale,
                   MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
                   WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                   SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, TABLE: tl.constexpr,
                   MASK_GRAD: tl.constexpr, TABLE_GRAD: tl.constexpr, EDGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_DV: tl.constexpr, HEAD_DIM_V: tl.constexpr, INTERPRET: tl.constexpr):
    """Accumulate dQ (unscaled) of one query block over key blocks [start_n, end_n), and add
    their dS to the mask and table gradients."""
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    cols_v = tl.arange(0, BLOCK_DV)
    for block_n in range(start_n, end_n, BLOCK_N):
        n64 = tl.cast(block_n, tl.int64)
        k_idx = block_n + offs_n
        k = _operand(_load_rows(k_head + n64 * stride_kn + k_offs, k_idx, Lk, cols, HEAD_DIM,
                                BLOCK_D, EDGE), INTERPRET)
        v = _operand(_load_rows(v_head + n64 * stride_vn + v_offs, k_idx, Lk, cols_v,
                                HEAD_DIM_V, BLOCK_DV, EDGE), INTERPRET)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        t, u = _scores(qk, q_idx[:, None], k_idx[None, :], mask_rows + n64 * stride_mn + mask_offs,
                       (kpm_head + n64 * stride_kpn + offs_n * stride_kpn)[None, :], Lq, Lk,
                       band, terms, MASK_KIND, HAS_KPM, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP,
                       ALIBI, TABLE, EDGE)
        p = tl.exp2(t - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        if DROPOUT:
            keep = _dropout_keep(seed, rng_q[:, None], k_idx[None, :], drop_threshold)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if MASK_GRAD != 0 or TABLE_GRAD:
            option_grads(ds, q_idx[:, None], k_idx[None, :], Lq, Lk,
                         dmask_rows + n64 * stride_dmn + dmask_offs, dtable_head, MASK_GRAD,
                         TABLE_GRAD, INTERPRET)
        if SOFTCAP:
            ds = ds * (1.0 - u * u)
        ds_op = _operand(cast_to(ds, k_head.dtype.element_ty, INTERPRET), INTERPRET)
        dq = tl.dot(ds_op, k, dq, input_precision="ieee")
    return dq


@triton.jit(do_not_specialize=_SPECIALIZE_NOT)
def attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, kpm_ptr,  # as in attn_fwd_kernel
    alibi_ptr, rel_ptr, cu_q_ptr, cu_k_ptr, rng_seq_ptr,  # as in attn_fwd_kernel
    do_ptr, lse_ptr, delta_ptr,              # as in attn_bwd_dkdv_kernel
    dq_ptr,      # (B, H, Lq, D) grad of q in q's dtype; strides (stride_dq*, 1)
    dmask_ptr,   # d attn_mask as a (B, H, Lq, Lk) view, strides stride_dm* (0 on broadcast
                 # dims): the mask's dtype (MASK_GRAD 1) or fp32 zeros (2); iff MASK_GRAD
    dtable_ptr,  # (H, Lq + Lk - 1) fp32 zeros, contiguous: d rel_bias; iff TABLE_GRAD
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm, stride_dmb, stride_dmh, stride_dmm, stride_dmn,
    stride_ab, stride_ah, stride_rh, stride_lb, stride_lh,
    H, GROUPS, Lq, Lk, win_left, win_right, qk_scale, softcap_in, scale,
    seed, rng_offset, drop_threshold, drop_scale,
    HEAD_DIM: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
    DROPOUT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, TABLE: tl.constexpr,
    MASK_GRAD: tl.constexpr, TABLE_GRAD: tl.constexpr, PACKED: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
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
    q = _operand(_load_rows(q_ptr + b * stride_qb + h * stride_qh + m64 * stride_qm
                            + offs_m[:, None] * stride_qm + cols[None, :], q_idx, Lq, cols,
                            HEAD_DIM, BLOCK_D, True), INTERPRET)
    do = _operand(_load_rows(do_ptr + b * stride_dob + h * stride_doh + m64 * stride_dom
                             + offs_m[:, None] * stride_dom + cols_v[None, :], q_idx, Lq, cols_v,
                             HEAD_DIM_V, BLOCK_DV, True), INTERPRET)
    row = b * stride_lb + h * stride_lh + q_start + q_idx
    lse2 = tl.load(lse_ptr + row, mask=q_idx < Lq, other=float("inf")) * LOG2E
    delta = tl.load(delta_ptr + row, mask=q_idx < Lq, other=0.0)
    k_head = k_ptr + b * stride_kb + hkv * stride_kh + k_start * stride_kn
    v_head = v_ptr + b * stride_vb + hkv * stride_vh + k_start * stride_vn
    k_offs = offs_n[:, None] * stride_kn + cols[None, :]
    v_offs = offs_n[:, None] * stride_vn + cols_v[None, :]
    mask_rows = mask_ptr + b * stride_mb + h * stride_mh + m64 * stride_mm
    mask_offs = offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    dmask_rows = dmask_ptr + b * stride_dmb + h * stride_dmh + m64 * stride_dmm
    dmask_offs = offs_m[:, None] * stride_dmm + offs_n[None, :] * stride_dmn
    kpm_head = kpm_ptr + b * stride_kpb
    rng_q = rng_b + (h * Lq + q_idx) * Lk
    band = make_band(Lq, Lk, win_left, win_right, BOTTOM_RIGHT, WINDOW_RIGHT)
    terms = head_terms(qk_scale, softcap_in, alibi_ptr + b * stride_ab + h * stride_ah,
                       rel_ptr + h * stride_rh, ALIBI)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
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
            dq = _dq_key_blocks(
                dq, q, do, lse2, delta, q_idx, k_head, v_head, k_offs, v_offs, mask_rows,
                mask_offs, kpm_head, dmask_rows, dmask_offs, dtable_ptr + h * (Lq + Lk - 1),
                start_n, end_n,
                stride_kn, stride_vn, stride_mn, stride_kpn, stride_dmn, H, Lq, Lk, band, terms,
                seed, rng_q, drop_threshold, drop_scale, MASK_KIND, HAS_KPM, DROPOUT,
                WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP, ALIBI, TABLE, MASK_GRAD, TABLE_GRAD,
                part != 1, BLOCK_N, BLOCK_D, HEAD_DIM, BLOCK_DV, HEAD_DIM_V, INTERPRET)
    _store_rows(dq_ptr + b * stride_dqb + h * stride_dqh + m64 * stride_dqm
                + offs_m[:, None] * stride_dqm + cols[None, :],
                dq * scale, q_idx, Lq, cols, HEAD_DIM, INTERPRET)
