"""Triton kernel of ff.linear_cross_entropy: the row pass over one chunk of logits (the chunk
loop and its GEMMs are torch's: fastformer/reference/linear_cross_entropy.py, which states the
semantics; the launcher is fastformer/ops/linear_cross_entropy_triton.py).

One program per row of the (C, V) chunk z (contiguous, the input dtype), sweeping it in
BLOCK_V blocks:
  COMPUTE_LOSS: one sweep with the online max / sum (m, l) of s = softcap(z) (and sum s for
    label smoothing): lse = m + log l, loss = lse - (1 - eps) s_t - eps/V sum s; 0 when ignored.
    Else lse is read (a backward).
  WRITE_GRAD: one sweep writing dz = f (exp(s - lse) - eps/V - (1 - eps) [j == t]) (1 - (s/c)^2)
    over z in place, f = scale (* row_scale); 0 at ignored rows.
Traffic per row: read z once (twice with both), write dz once; fp32 throughout.
"""
import triton
import triton.language as tl

from .common import cast_to, tanh


@triton.jit
def _capped(row, idx, mask, cap, inv_cap, CAPPED: tl.constexpr):
    """One block of the row's logits in fp32, softcapped when CAPPED (0 where masked)."""
    s = tl.load(row + idx, mask=mask, other=0.0).to(tl.float32)
    if CAPPED:
        s = cap * tanh(s * inv_cap)
    return s


@triton.jit
def lce_rows_kernel(
    z_ptr,            # (C, V) contiguous logits, overwritten by their gradient (WRITE_GRAD)
    target_ptr,       # (C,) int64
    loss_ptr,         # (C,) fp32, written iff COMPUTE_LOSS
    lse_ptr,          # (C,) fp32, written iff COMPUTE_LOSS, else read
    row_scale_ptr,    # (C,) fp32, read iff HAS_ROW_SCALE
    scale_ptr,        # (1,) fp32 gradient scale, read iff SCALE_PTR (else `scale`)
    scale, V, ignore_index, target_weight, eps_per_class, cap, inv_cap,
    COMPUTE_LOSS: tl.constexpr, WRITE_GRAD: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
    SCALE_PTR: tl.constexpr, CAPPED: tl.constexpr, SMOOTHING: tl.constexpr,
    BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = z_ptr + r * V
    t = tl.load(target_ptr + r)
    ignored = t == ignore_index
    t_safe = tl.where(ignored, 0, t)
    cols = tl.arange(0, BLOCK_V)
    if COMPUTE_LOSS:
        m = tl.zeros([], dtype=tl.float32) - float("inf")
        l = tl.zeros([], dtype=tl.float32)
        s_sum = tl.zeros([], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            mask = idx < V
            s = _capped(row, idx, mask, cap, inv_cap, CAPPED)
            if SMOOTHING:
                s_sum += tl.sum(tl.where(mask, s, 0.0), 0)
            s = tl.where(mask, s, -float("inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new), 0)
            m = m_new
        lse = m + tl.log(l)
        s_t = tl.load(row + t_safe).to(tl.float32)
        if CAPPED:
            s_t = cap * tanh(s_t * inv_cap)
        loss = lse - target_weight * s_t
        if SMOOTHING:
            loss -= eps_per_class * s_sum
        tl.store(loss_ptr + r, tl.where(ignored, 0.0, loss))
        tl.store(lse_ptr + r, tl.where(ignored, 0.0, lse))
    else:
        lse = tl.load(lse_ptr + r).to(tl.float32)
    if WRITE_GRAD:
        if SCALE_PTR:
            f = tl.load(scale_ptr).to(tl.float32)
        else:
            f = scale
        if HAS_ROW_SCALE:
            f = f * tl.load(row_scale_ptr + r).to(tl.float32)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            mask = idx < V
            s = _capped(row, idx, mask, cap, inv_cap, CAPPED)
            g = tl.exp(s - lse) - eps_per_class - tl.where(idx == t, target_weight, 0.0)
            if CAPPED:
                u = s * inv_cap
                g = g * (1.0 - u * u)
            g = tl.where(ignored, 0.0, g * f)
            tl.store(row + idx, cast_to(g, z_ptr.dtype.element_ty, INTERPRET), mask=mask)


def config(vocab: int, interpret: bool) -> dict:
    block = min(triton.next_power_of_2(max(vocab, 1)), 8192 if interpret else 4096)
    return dict(BLOCK_V=block, num_warps=8 if block >= 2048 else 4)
