"""Triton kernels: flash attention forward and backward. Launchers: ops/attention_triton.py.

Notation (fastformer/reference/attention.py is the semantics): q (B, H, Lq, D), k and v
(B, Hkv, Lk, D); query head h reads kv head h // (H / Hkv) (GQA/MQA by index arithmetic, the
kv tensors are never repeated). s_ij = scale * q_i.k_j + bias_ij, minus infinity where the bool
attn_mask is False, the key_padding_mask is True, or causality forbids j: causal 1 (top-left)
allows j <= i, causal 2 (bottom-right) allows j <= i + Lk - Lq. The attn_mask is read tile by
tile through its four strides (a broadcast view: stride 0 on broadcast dims), never expanded.

Forward, one program per (query block of BLOCK_M rows, batch*head): online softmax over key
blocks of BLOCK_N, in fp32 and base 2. Scores t = s * log2(e) (scale and log2(e) folded into
one multiply; a float mask is multiplied by log2(e)); running max m and sum l per row:
    m' = max(m, rowmax t),  p = exp2(t - m'),  l = l * exp2(m - m') + rowsum p,
    acc = acc * exp2(m - m') + (p * keep / (1 - p_drop)) v      (p rounded to v's dtype)
then out = acc / l and lse = (m + log2 l) * ln 2 (natural log, fp32). A row with no allowed key
keeps m = -inf (exp2 is then taken against 0, so p = 0): l = 0, out = 0, lse = +inf.
Causal: key blocks right of the diagonal are never visited; blocks left of it run without
element masks; only the diagonal blocks and the block holding the Lk tail apply them.
Traffic per (query block, key block) tile: K and V tiles, 2 * BLOCK_N * D elements (+ BLOCK_M *
BLOCK_N attn_mask and BLOCK_N padding-mask elements when given); per program Q and out
(BLOCK_M * D each) and lse. Per head: 2 * Lk * D * ceil(Lq / BLOCK_M) elements of K/V (about
half when causal) + 2 * Lq * D of Q/out; nothing of size Lq * Lk is stored.

Backward, with P = exp2(t - lse * log2 e) recomputed from the saved lse:
    delta_i = sum_d dO_id * out_id                       (preprocessing kernel)
    dP' = dO v^T * keep / (1 - p_drop),  dS = P * (dP' - delta)
    dV = (P * keep / (1 - p_drop))^T dO,  dK = scale * dS^T q,  dQ = scale * dS k
(P' and dS rounded to the input dtype before their dots, as the forward's p.)
dK/dV: one program per (key block, batch*kv head), looping over the query heads of its group
and over the query blocks that see its keys (diagonal blocks masked, the rest not); dK and dV
stay in registers and are written once, already summed over the group. Per tile it reads Q and
dO (2 * BLOCK_M * D) and BLOCK_M of lse and delta. dQ: one program per (query block,
batch*head), walking key blocks like the forward; per tile it reads K and V (2 * BLOCK_N * D).
dQ has its own kernel rather than fp32 atomics from the dK/dV kernel: that recomputes Q K^T
and dO V^T (7 tile matmuls instead of 5) but is deterministic, needs no fp32 scratch buffer
to zero and convert, and writes dq in the input dtype directly.
Rows past Lq read q = dO = 0 and lse = +inf, so P = 0 there; dK/dV rows past Lk are never
stored, so the dK/dV kernel needs no key-tail mask.

Head dims 16..256: BLOCK_D is the next power of two >= D; tail columns read as 0 and are not
stored. Batch/head/block bases are int64 scalars; in-tile offsets (< BLOCK * row stride) int32.
fp32 inputs use IEEE fp32 dots (not TF32: the fp32 tolerance is 1e-5). Under Triton's
interpreter (TRITON_INTERPRET=1): bf16 dots are done in fp32 (_operand), bf16 results are
rounded by cast_to, and masks are single comparisons (it mis-types `block & scalar` of int1).
"""
import triton
import triton.language as tl

from . import interpreter_mode
from .common import cast_to

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2  # MASK_KIND: how attn_mask is read


# ---- helpers ---------------------------------------------------------------------------------
@triton.jit
def _operand(x, INTERPRET: tl.constexpr):
    """A tl.dot operand. Triton 3.9's interpreter computes tl.dot on bfloat16 wrongly
    (triton-lang/triton#11584): under the interpreter only, bf16 tiles are upcast to fp32
    (exact; products then sum in fp32 as on tensor cores). GPUs keep bf16 tensor-core dots."""
    if INTERPRET and x.dtype == tl.bfloat16:
        return x.to(tl.float32)
    return x


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
def _scores(qk, q_idx, k_idx, mask_ptrs, kpm_ptrs, Lq, Lk, causal_shift, qk_scale,
            CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
            EDGE: tl.constexpr):
    """Scores in base 2 with -inf where a key is excluded. q_idx, k_idx: query and key indices
    shaped (M, 1) and (1, N); mask_ptrs: attn_mask pointers (M, N); kpm_ptrs: key_padding_mask
    pointers (1, N). EDGE applies causality and the Lk tail (diagonal and last key blocks)."""
    t = qk * qk_scale
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
        if CAUSAL:
            t = tl.where(k_idx < tl.minimum(q_idx + causal_shift + 1, Lk), t, float("-inf"))
        else:
            t = tl.where(k_idx < Lk, t, float("-inf"))
    return t


@triton.jit
def _dropout_keep(seed, rng_q, k_idx, drop_threshold):
    """Keep mask of reference/rng.py: Philox word of counter rng_q + k_idx (int64, rng_q =
    offset + (bh * Lq + i) * Lk) kept iff word >= threshold, compared as uint32."""
    word = tl.randint(seed, rng_q + k_idx)
    return word >= drop_threshold.to(tl.uint32)


@triton.jit
def _causal_key_range(start_m, Lq, Lk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      CAUSAL: tl.constexpr):
    """For query rows [start_m, start_m + BLOCK_M): (shift, full_end, end). Key blocks below
    full_end need no element mask; [full_end, end) are the diagonal/tail blocks."""
    if CAUSAL == 2:
        shift = Lk - Lq
    else:
        shift = 0
    if CAUSAL:
        end = tl.minimum(Lk, start_m + BLOCK_M + shift)
        full_end = tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N
        full_end = tl.minimum(full_end, Lk // BLOCK_N * BLOCK_N)
    else:
        end = Lk
        full_end = Lk // BLOCK_N * BLOCK_N
    return shift, full_end, end


# Pointers: a program computes int64 scalar bases (batch, head, block start) and adds int32
# in-tile offsets (at most BLOCK * row stride) computed once, outside its loops.

# ---- forward ---------------------------------------------------------------------------------
@triton.jit
def _fwd_key_blocks(acc, l_i, m_i, q, q_idx, k_head, v_head, k_offs, v_offs, mask_rows,
                    mask_offs, kpm_head, start_n, end_n, stride_kn, stride_vn, stride_mn,
                    stride_kpn, Lq, Lk, causal_shift, qk_scale, seed, rng_q, drop_threshold,
                    drop_scale, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                    HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, EDGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Online-softmax update of (acc, l_i, m_i) with key blocks [start_n, end_n)."""
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    for block_n in range(start_n, end_n, BLOCK_N):
        n64 = tl.cast(block_n, tl.int64)
        k_idx = block_n + offs_n
        k = _load_rows(k_head + n64 * stride_kn + k_offs, k_idx, Lk, cols, HEAD_DIM, BLOCK_D,
                       EDGE)
        qk = tl.dot(q, tl.trans(_operand(k, INTERPRET)), input_precision="ieee")
        t = _scores(qk, q_idx[:, None], k_idx[None, :], mask_rows + n64 * stride_mn + mask_offs,
                    (kpm_head + n64 * stride_kpn + offs_n * stride_kpn)[None, :], Lq, Lk,
                    causal_shift, qk_scale, CAUSAL, MASK_KIND, HAS_KPM, EDGE)
        m_new = tl.maximum(m_i, tl.max(t, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no allowed key yet
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(t - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            keep = _dropout_keep(seed, rng_q[:, None], k_idx[None, :], drop_threshold)
            p = tl.where(keep, p * drop_scale, 0.0)
        v = _load_rows(v_head + n64 * stride_vn + v_offs, k_idx, Lk, cols, HEAD_DIM, BLOCK_D,
                       EDGE)
        p_op = _operand(cast_to(p, v_head.dtype.element_ty, INTERPRET), INTERPRET)
        acc = tl.dot(p_op, _operand(v, INTERPRET), acc * alpha[:, None], input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seed", "rng_offset", "drop_threshold"])
def attn_fwd_kernel(
    q_ptr,      # (B, H, Lq, D) queries, strides (stride_qb, stride_qh, stride_qm, 1)
    k_ptr,      # (B, Hkv, Lk, D) keys, strides (stride_kb, stride_kh, stride_kn, 1)
    v_ptr,      # (B, Hkv, Lk, D) values, strides (stride_vb, stride_vh, stride_vn, 1)
    mask_ptr,   # (B, H, Lq, Lk) attn_mask view, any strides (0 on broadcast dims); bool
                # (True = attend) or float (added); read iff MASK_KIND != 0
    kpm_ptr,    # (B, Lk) bool key_padding_mask, True = padding; read iff HAS_KPM
    out_ptr,    # (B, H, Lq, D) output in q's dtype, strides (stride_ob, stride_oh, stride_om, 1)
    lse_ptr,    # (B, H, Lq) fp32 contiguous: natural-log log-sum-exp, +inf for empty rows
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn, stride_ob, stride_oh, stride_om,
    H, GROUPS, Lq, Lk,            # GROUPS = H // Hkv
    qk_scale,                     # scale * log2(e)
    seed, rng_offset, drop_threshold, drop_scale,  # dropout: Philox key, counter base,
                                                   # round(p * 2^32), 1 / (1 - p)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    # 1-D grid, query blocks fastest: programs running together share K/V in L2, and B*H is
    # not bound by CUDA's 65535 limit on grid dims 1 and 2.
    num_m = tl.cdiv(Lq, BLOCK_M)
    start_m = (tl.program_id(0) % num_m) * BLOCK_M
    bh = tl.program_id(0) // num_m
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hkv = h // GROUPS
    m64 = start_m.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q_idx = start_m + offs_m
    cols = tl.arange(0, BLOCK_D)

    q = _load_rows(q_ptr + b * stride_qb + h * stride_qh + m64 * stride_qm
                   + offs_m[:, None] * stride_qm + cols[None, :], q_idx, Lq, cols, HEAD_DIM,
                   BLOCK_D, True)
    q = _operand(q, INTERPRET)
    k_head = k_ptr + b * stride_kb + hkv * stride_kh
    v_head = v_ptr + b * stride_vb + hkv * stride_vh
    k_offs = offs_n[:, None] * stride_kn + cols[None, :]
    v_offs = offs_n[:, None] * stride_vn + cols[None, :]
    mask_rows = mask_ptr + b * stride_mb + h * stride_mh + m64 * stride_mm
    mask_offs = offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    kpm_head = kpm_ptr + b * stride_kpb
    rng_q = rng_offset + (bh.to(tl.int64) * Lq + q_idx) * Lk

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    shift, full_end, end = _causal_key_range(start_m, Lq, Lk, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fwd_key_blocks(
        acc, l_i, m_i, q, q_idx, k_head, v_head, k_offs, v_offs, mask_rows, mask_offs, kpm_head,
        0, full_end, stride_kn, stride_vn, stride_mn, stride_kpn, Lq, Lk, shift, qk_scale, seed,
        rng_q, drop_threshold, drop_scale, CAUSAL, MASK_KIND, HAS_KPM, DROPOUT, False, BLOCK_N,
        BLOCK_D, HEAD_DIM, INTERPRET)
    acc, l_i, m_i = _fwd_key_blocks(
        acc, l_i, m_i, q, q_idx, k_head, v_head, k_offs, v_offs, mask_rows, mask_offs, kpm_head,
        full_end, end, stride_kn, stride_vn, stride_mn, stride_kpn, Lq, Lk, shift, qk_scale, seed,
        rng_q, drop_threshold, drop_scale, CAUSAL, MASK_KIND, HAS_KPM, DROPOUT, True, BLOCK_N,
        BLOCK_D, HEAD_DIM, INTERPRET)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    _store_rows(out_ptr + b * stride_ob + h * stride_oh + m64 * stride_om
                + offs_m[:, None] * stride_om + cols[None, :],
                acc / l_safe[:, None], q_idx, Lq, cols, HEAD_DIM, INTERPRET)
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(l_safe)) * LN2)
    tl.store(lse_ptr + bh.to(tl.int64) * Lq + q_idx, lse, mask=q_idx < Lq)


# ---- backward --------------------------------------------------------------------------------
@triton.jit
def attn_bwd_delta_kernel(
    out_ptr,    # (B, H, Lq, D) forward output, strides (stride_ob, stride_oh, stride_om, 1)
    do_ptr,     # (B, H, Lq, D) grad of the output, strides (stride_dob, stride_doh, stride_dom, 1)
    delta_ptr,  # (B, H, Lq) fp32 contiguous: rowsum(dO * out)
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom, H, Lq,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    num_m = tl.cdiv(Lq, BLOCK_M)
    start_m = (tl.program_id(0) % num_m) * BLOCK_M
    bh = tl.program_id(0) // num_m
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    m64 = start_m.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = start_m + offs_m
    cols = tl.arange(0, BLOCK_D)
    o = _load_rows(out_ptr + b * stride_ob + h * stride_oh + m64 * stride_om
                   + offs_m[:, None] * stride_om + cols[None, :], q_idx, Lq, cols, HEAD_DIM,
                   BLOCK_D, True)
    do = _load_rows(do_ptr + b * stride_dob + h * stride_doh + m64 * stride_dom
                    + offs_m[:, None] * stride_dom + cols[None, :], q_idx, Lq, cols, HEAD_DIM,
                    BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + bh.to(tl.int64) * Lq + q_idx, delta, mask=q_idx < Lq)


@triton.jit
def _dkdv_query_blocks(dk, dv, k, v, k_idx, q_head, do_head, q_offs, do_offs, lse_head,
                       delta_head, mask_head, mask_offs, kpm_ptrs, start_m, end_m, stride_qm,
                       stride_dom, stride_mm, Lq, Lk, causal_shift, qk_scale, seed, rng_head,
                       drop_threshold, drop_scale,
                       CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_KPM: tl.constexpr,
                       DROPOUT: tl.constexpr, EDGE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, INTERPRET: tl.constexpr):
    """Accumulate dK, dV of one key block over query blocks [start_m, end_m) of one head.
    Score tiles are (queries, keys) as in the forward, so K and V are the B operands of
    Q K^T and dO V^T (shared memory on Hopper) instead of register-held A operands: the
    transposed formulation (S^T = K Q^T) spilled 2x more at D = 128."""
    offs_m = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    for block_m in range(start_m, end_m, BLOCK_M):
        m64 = tl.cast(block_m, tl.int64)
        q_idx = block_m + offs_m
        q = _operand(_load_rows(q_head + m64 * stride_qm + q_offs, q_idx, Lq, cols, HEAD_DIM,
                                BLOCK_D, True), INTERPRET)
        do = _operand(_load_rows(do_head + m64 * stride_dom + do_offs, q_idx, Lq, cols,
                                 HEAD_DIM, BLOCK_D, True), INTERPRET)
        lse2 = tl.load(lse_head + q_idx, mask=q_idx < Lq, other=float("inf")) * LOG2E
        delta = tl.load(delta_head + q_idx, mask=q_idx < Lq, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        t = _scores(qk, q_idx[:, None], k_idx[None, :], mask_head + m64 * stride_mm + mask_offs,
                    kpm_ptrs, Lq, Lk, causal_shift, qk_scale, CAUSAL, MASK_KIND, HAS_KPM, EDGE)
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
        ds_op = _operand(cast_to(ds, q_head.dtype.element_ty, INTERPRET), INTERPRET)
        dk = tl.dot(tl.trans(ds_op), q, dk, input_precision="ieee")
    return dk, dv


@triton.jit(do_not_specialize=["seed", "rng_offset", "drop_threshold"])
def attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr,   # as in attn_fwd_kernel
    mask_ptr, kpm_ptr,     # as in attn_fwd_kernel
    do_ptr,      # (B, H, Lq, D) grad of the output, strides (stride_dob, stride_doh, stride_dom, 1)
    lse_ptr,     # (B, H, Lq) fp32 contiguous, from the forward
    delta_ptr,   # (B, H, Lq) fp32 contiguous, from attn_bwd_delta_kernel
    dk_ptr,      # (B, Hkv, Lk, D) grad of k in k's dtype; strides (stride_dk*, 1)
    dv_ptr,      # (B, Hkv, Lk, D) grad of v in v's dtype; strides (stride_dv*, 1)
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    H, Hkv, GROUPS, Lq, Lk, qk_scale, scale, seed, rng_offset, drop_threshold, drop_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    num_n = tl.cdiv(Lk, BLOCK_N)
    start_n = (tl.program_id(0) % num_n) * BLOCK_N
    bhkv = tl.program_id(0) // num_n
    b = (bhkv // Hkv).to(tl.int64)
    hkv = (bhkv % Hkv).to(tl.int64)
    n64 = start_n.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    k_idx = start_n + offs_n
    cols = tl.arange(0, BLOCK_D)
    k = _operand(_load_rows(k_ptr + b * stride_kb + hkv * stride_kh + n64 * stride_kn
                            + offs_n[:, None] * stride_kn + cols[None, :], k_idx, Lk, cols,
                            HEAD_DIM, BLOCK_D, True), INTERPRET)
    v = _operand(_load_rows(v_ptr + b * stride_vb + hkv * stride_vh + n64 * stride_vn
                            + offs_n[:, None] * stride_vn + cols[None, :], k_idx, Lk, cols,
                            HEAD_DIM, BLOCK_D, True), INTERPRET)
    q_offs = offs_m[:, None] * stride_qm + cols[None, :]
    do_offs = offs_m[:, None] * stride_dom + cols[None, :]
    mask_offs = offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    kpm_ptrs = (kpm_ptr + b * stride_kpb + n64 * stride_kpn + offs_n * stride_kpn)[None, :]
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query blocks that see some key of this block: rows i >= start_n - shift. Those whose rows
    # all see every key of the block (i >= start_n + BLOCK_N - 1 - shift) need no causal mask.
    if CAUSAL == 2:
        shift = Lk - Lq
    else:
        shift = 0
    if CAUSAL:
        start_m = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
        full_start = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M
    else:
        start_m = 0
        full_start = 0
    for g in range(GROUPS):
        h = hkv * GROUPS + g
        bh = b * H + h
        q_head = q_ptr + b * stride_qb + h * stride_qh
        do_head = do_ptr + b * stride_dob + h * stride_doh
        mask_head = mask_ptr + b * stride_mb + h * stride_mh + n64 * stride_mn
        lse_head = lse_ptr + bh * Lq
        delta_head = delta_ptr + bh * Lq
        rng_head = rng_offset + bh * Lq * Lk
        dk, dv = _dkdv_query_blocks(
            dk, dv, k, v, k_idx, q_head, do_head, q_offs, do_offs, lse_head, delta_head,
            mask_head, mask_offs, kpm_ptrs, start_m, tl.minimum(full_start, Lq), stride_qm,
            stride_dom, stride_mm, Lq, Lk, shift, qk_scale, seed, rng_head, drop_threshold,
            drop_scale, CAUSAL, MASK_KIND, HAS_KPM, DROPOUT, True, BLOCK_M, BLOCK_D, HEAD_DIM,
            INTERPRET)
        dk, dv = _dkdv_query_blocks(
            dk, dv, k, v, k_idx, q_head, do_head, q_offs, do_offs, lse_head, delta_head,
            mask_head, mask_offs, kpm_ptrs, full_start, Lq, stride_qm,
            stride_dom, stride_mm, Lq, Lk, shift, qk_scale, seed, rng_head, drop_threshold,
            drop_scale, CAUSAL, MASK_KIND, HAS_KPM, DROPOUT, False, BLOCK_M, BLOCK_D, HEAD_DIM,
            INTERPRET)
    _store_rows(dk_ptr + b * stride_dkb + hkv * stride_dkh + n64 * stride_dkn
                + offs_n[:, None] * stride_dkn + cols[None, :],
                dk * scale, k_idx, Lk, cols, HEAD_DIM, INTERPRET)
    _store_rows(dv_ptr + b * stride_dvb + hkv * stride_dvh + n64 * stride_dvn
                + offs_n[:, None] * stride_dvn + cols[None, :],
                dv, k_idx, Lk, cols, HEAD_DIM, INTERPRET)


@triton.jit
def _dq_key_blocks(dq, q, do, lse2, delta, q_idx, k_head, v_head, k_offs, v_offs, mask_rows,
                   mask_offs, kpm_head, start_n, end_n, stride_kn, stride_vn, stride_mn,
                   stride_kpn, Lq, Lk, causal_shift, qk_scale, seed, rng_q, drop_threshold,
                   drop_scale, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
                   HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, EDGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Accumulate dQ (unscaled) of one query block over key blocks [start_n, end_n)."""
    offs_n = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    for block_n in range(start_n, end_n, BLOCK_N):
        n64 = tl.cast(block_n, tl.int64)
        k_idx = block_n + offs_n
        k = _operand(_load_rows(k_head + n64 * stride_kn + k_offs, k_idx, Lk, cols, HEAD_DIM,
                                BLOCK_D, EDGE), INTERPRET)
        v = _operand(_load_rows(v_head + n64 * stride_vn + v_offs, k_idx, Lk, cols, HEAD_DIM,
                                BLOCK_D, EDGE), INTERPRET)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        t = _scores(qk, q_idx[:, None], k_idx[None, :], mask_rows + n64 * stride_mn + mask_offs,
                    (kpm_head + n64 * stride_kpn + offs_n * stride_kpn)[None, :], Lq, Lk,
                    causal_shift, qk_scale, CAUSAL, MASK_KIND, HAS_KPM, EDGE)
        p = tl.exp2(t - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        if DROPOUT:
            keep = _dropout_keep(seed, rng_q[:, None], k_idx[None, :], drop_threshold)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        ds_op = _operand(cast_to(ds, k_head.dtype.element_ty, INTERPRET), INTERPRET)
        dq = tl.dot(ds_op, k, dq, input_precision="ieee")
    return dq


@triton.jit(do_not_specialize=["seed", "rng_offset", "drop_threshold"])
def attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, kpm_ptr,  # as in attn_fwd_kernel
    do_ptr, lse_ptr, delta_ptr,              # as in attn_bwd_dkdv_kernel
    dq_ptr,      # (B, H, Lq, D) grad of q in q's dtype; strides (stride_dq*, 1)
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_kpb, stride_kpn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    H, GROUPS, Lq, Lk, qk_scale, scale, seed, rng_offset, drop_threshold, drop_scale,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):
    num_m = tl.cdiv(Lq, BLOCK_M)
    start_m = (tl.program_id(0) % num_m) * BLOCK_M
    bh = tl.program_id(0) // num_m
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hkv = h // GROUPS
    m64 = start_m.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q_idx = start_m + offs_m
    cols = tl.arange(0, BLOCK_D)
    q = _operand(_load_rows(q_ptr + b * stride_qb + h * stride_qh + m64 * stride_qm
                            + offs_m[:, None] * stride_qm + cols[None, :], q_idx, Lq, cols,
                            HEAD_DIM, BLOCK_D, True), INTERPRET)
    do = _operand(_load_rows(do_ptr + b * stride_dob + h * stride_doh + m64 * stride_dom
                             + offs_m[:, None] * stride_dom + cols[None, :], q_idx, Lq, cols,
                             HEAD_DIM, BLOCK_D, True), INTERPRET)
    row = bh.to(tl.int64) * Lq + q_idx
    lse2 = tl.load(lse_ptr + row, mask=q_idx < Lq, other=float("inf")) * LOG2E
    delta = tl.load(delta_ptr + row, mask=q_idx < Lq, other=0.0)
    k_head = k_ptr + b * stride_kb + hkv * stride_kh
    v_head = v_ptr + b * stride_vb + hkv * stride_vh
    k_offs = offs_n[:, None] * stride_kn + cols[None, :]
    v_offs = offs_n[:, None] * stride_vn + cols[None, :]
    mask_rows = mask_ptr + b * stride_mb + h * stride_mh + m64 * stride_mm
    mask_offs = offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn
    kpm_head = kpm_ptr + b * stride_kpb
    rng_q = rng_offset + row * Lk

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    shift, full_end, end = _causal_key_range(start_m, Lq, Lk, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _dq_key_blocks(dq, q, do, lse2, delta, q_idx, k_head, v_head, k_offs, v_offs, mask_rows,
                        mask_offs, kpm_head, 0, full_end, stride_kn, stride_vn, stride_mn,
                        stride_kpn, Lq, Lk, shift, qk_scale, seed, rng_q, drop_threshold,
                        drop_scale, CAUSAL, MASK_KIND, HAS_KPM, DROPOUT, False, BLOCK_N, BLOCK_D,
                        HEAD_DIM, INTERPRET)
    dq = _dq_key_blocks(dq, q, do, lse2, delta, q_idx, k_head, v_head, k_offs, v_offs, mask_rows,
                        mask_offs, kpm_head, full_end, end, stride_kn, stride_vn, stride_mn,
                        stride_kpn, Lq, Lk, shift, qk_scale, seed, rng_q, drop_threshold,
                        drop_scale, CAUSAL, MASK_KIND, HAS_KPM, DROPOUT, True, BLOCK_N, BLOCK_D,
                        HEAD_DIM, INTERPRET)
    _store_rows(dq_ptr + b * stride_dqb + h * stride_dqh + m64 * stride_dqm
                + offs_m[:, None] * stride_dqm + cols[None, :],
                dq * scale, q_idx, Lq, cols, HEAD_DIM, INTERPRET)


# ---- launch configurations -------------------------------------------------------------------
def _configs(shapes):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in shapes]


# GPU: (BLOCK_M, BLOCK_N, warps, stages), autotuned per (Lq, Lk, head dim, causal) and dtype.
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
TUNE_KEY = ["Lq", "Lk", "HEAD_DIM", "CAUSAL"]

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
