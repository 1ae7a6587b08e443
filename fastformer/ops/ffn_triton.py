"""Launchers of the Triton feed-forward kernels (triton_kernels/ffn.py).

Called by ``_Triton`` in ops/ffn.py with validated inputs: x (..., D) whose rows have one
stride (any column stride; never copied), weights (F, D) / (D, F) with any strides, biases
contiguous, rng_state None or an int64 CPU tensor [seed, offset]. Every GEMM reads its operands
through strides (transposes are free) and every elementwise step runs inside a GEMM:

  forward   saved = x W1^T + b1 ([g | u] for gated)     ffn_act_matmul_kernel, MODE_FWD_SAVE
            y = act(saved) W2^T + b2                    ffn_matmul_kernel, A recomputed on load
            (inference: h = act(x W1^T + b1) stored by MODE_FWD_ACT, then y = h W2^T + b2)
  backward  dW2 = dy^T hd, db2 = row sums of dy^T       ffn_matmul_kernel, B recomputed on load
            d_hidden = (dy W2) * act'(saved) ...        ffn_act_matmul_kernel, MODE_BWD
            dx = d_hidden [W1 ; Wu]                      ffn_matmul_kernel (second pair: gated)
            dW1 = d_hidden^T x, db1 = its row sums      ffn_matmul_kernel (per half: gated)
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
from torch import Tensor

from ..reference.rng import threshold


def _dropout_args(dropout_p: float, rng_state: Optional[Tensor]):
    """(seed, offset, threshold, 1 / (1 - p)) as the kernels take them."""
    if dropout_p <= 0:
        return 0, 0, 0, 1.0
    seed, offset = (int(v) for v in rng_state.tolist())
    return seed, offset, threshold(dropout_p), 1.0 / (1.0 - dropout_p)


def _grid(M: int, N: int):
    return lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)


def _matmul(a, a_strides, b, b_strides, c, c_strides, M, N, K, *, a_mode=0, b_mode=0, act=0,
            dropout=(0, 0, 0, 1.0), limit=0.0, second=None, bias=None, row_sum=None):
    """C = op(A) op(B) (+ op(A2) op(B2)) (+ bias) with ffn_matmul_kernel; row_sum: (M,) fp32 or None."""
    from ..triton_kernels import ffn as tk
    from ..triton_kernels import interpreter_mode
    kernel, config = tk.kernel_and_config("matmul")
    a2, b2 = second if second is not None else (a, b)
    kernel[_grid(M, N)](
        a, b, a2, b2, bias if bias is not None else c, c, row_sum if row_sum is not None else c,
        *a_strides, *b_strides, *c_strides, M, N, K, *dropout, limit,
        A_MODE=a_mode, B_MODE=b_mode, ACT=act, DROPOUT=dropout[3] != 1.0, CLAMP=limit > 0,
        HAS_SECOND=second is not None, HAS_BIAS=bias is not None, ROW_SUM=row_sum is not None,
        INTERPRET=interpreter_mode(), **config)


def _same_strides(w_up: Tensor, w1: Tensor) -> Tensor:
    """The up weight read with the gate weight's strides (a copy only if they differ)."""
    if w_up.stride() == w1.stride():
        return w_up
    return torch.empty_strided(w1.shape, w1.stride(), dtype=w1.dtype, device=w1.device).copy_(w_up)


def ffn_fwd(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
            w_up: Optional[Tensor], b_up: Optional[Tensor], o, save_preactivation: bool = True):
    """o: ops/ffn.py's FfnOptions. Returns (y, the pre-activation if save_preactivation (a backward
    follows) else an empty tensor)."""
    from ..triton_kernels import ffn as tk
    from ..triton_kernels import interpreter_mode
    act, dropout_p = o.activation, o.dropout_p
    D, F = x.shape[-1], w1.shape[0]
    gated = w_up is not None
    x2 = x.reshape(-1, D)  # a view: rows have one stride (the backend's declaration)
    M = x2.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    hidden = torch.empty((M, 2 * F if gated and save_preactivation else F), dtype=x.dtype,
                         device=x.device)
    if M == 0:
        return y, (hidden if save_preactivation else x.new_empty((0,)))
    dropout = _dropout_args(0.0 if gated else dropout_p, o.rng_state)
    w_up = _same_strides(w_up, w1) if gated else w1
    kernel, config = tk.kernel_and_config("act", gated)
    kernel[_grid(M, F)](
        x2, w1, w_up, b1 if b1 is not None else x2, b_up if b_up is not None else x2,
        hidden, hidden, x2.stride(0), x2.stride(1), w1.stride(1), w1.stride(0),
        hidden.stride(0), hidden.stride(0), M, F, D, *dropout, o.swiglu_limit,
        MODE=tk.MODE_FWD_SAVE if save_preactivation else tk.MODE_FWD_ACT, ACT=act, GATED=gated,
        CLAMP=gated and o.swiglu_limit > 0,
        DROPOUT=dropout_p > 0 and not gated and not save_preactivation,
        HAS_BIAS=b1 is not None, HAS_BIAS_UP=gated and b_up is not None,
        INTERPRET=interpreter_mode(), **config)
    a_mode = tk.PLAIN
    if save_preactivation:
        a_mode = tk.HIDDEN_GATED if gated else tk.HIDDEN_ACT
    y2 = y.view(M, D)
    _matmul(hidden, (hidden.stride(0), 1), w2, (w2.stride(1), w2.stride(0)), y2, y2.stride(),
            M, D, F, a_mode=a_mode, act=act, limit=o.swiglu_limit if gated else 0.0,
            dropout=dropout if save_preactivation else (0, 0, 0, 1.0), bias=b2)
    return y, (hidden if save_preactivation else x.new_empty((0,)))


def ffn_bwd(dy: Tensor, x: Tensor, w1: Tensor, w2: Tensor, w_up: Optional[Tensor], saved: Tensor,
            o, needs: tuple):
    """Returns (dx, dw1, db1, dw2, db2, dw_up, db_up); those not in `needs` are empty."""
    act, dropout_p = o.activation, o.dropout_p
    from ..triton_kernels import ffn as tk
    from ..triton_kernels import interpreter_mode
    need_dx, need_dw1, need_db1, need_dw2, need_db2, need_dwu, need_dbu = needs
    D, F = x.shape[-1], w1.shape[0]
    gated = w_up is not None
    x2 = x.reshape(-1, D)
    dy2 = dy.reshape(-1, D)  # dy's last dim is contiguous (the caller's rowwise)
    M = x2.shape[0]
    H = saved.shape[1] if saved.dim() == 2 else F
    empty = lambda: x.new_empty((0,))  # noqa: E731  (distinct tensors: outputs never alias)
    dropout = _dropout_args(0.0 if gated else dropout_p, o.rng_state)
    hidden_mode = tk.HIDDEN_GATED if gated else tk.HIDDEN_ACT
    opts = dict(dtype=x.dtype, device=x.device)
    f32 = dict(dtype=torch.float32, device=x.device)

    dw2 = torch.empty((D, F), **opts) if need_dw2 else empty()
    db2 = empty()
    if need_dw2:
        db2_acc = torch.empty(D, **f32) if need_db2 else None
        _matmul(dy2, (dy2.stride(1), dy2.stride(0)), saved, (saved.stride(0), 1), dw2,
                dw2.stride(), D, F, M, b_mode=hidden_mode, act=act, dropout=dropout,
                limit=o.swiglu_limit if gated else 0.0, row_sum=db2_acc)
        db2 = db2_acc.to(x.dtype) if need_db2 else empty()
    elif need_db2:
        db2 = dy2.sum(0, dtype=torch.float32).to(x.dtype)

    grads = [empty(), empty(), empty(), dw2, db2, empty(), empty()]
    if not (need_dx or need_dw1 or need_db1 or need_dwu or need_dbu):
        return tuple(grads)
    d_hidden = torch.empty((M, H), **opts)
    if M > 0:
        kernel, config = tk.kernel_and_config("act", gated)
        kernel[_grid(M, F)](
            dy2, w2, w2, dy2, dy2, saved, d_hidden, dy2.stride(0), dy2.stride(1),
            w2.stride(0), w2.stride(1), saved.stride(0), d_hidden.stride(0), M, F, D, *dropout,
            o.swiglu_limit, MODE=tk.MODE_BWD, ACT=act, GATED=gated, DROPOUT=dropout_p > 0 and not gated,
            CLAMP=gated and o.swiglu_limit > 0,
            HAS_BIAS=False, HAS_BIAS_UP=False, INTERPRET=interpreter_mode(), **config)

    if need_dx:
        dx = torch.empty(x.shape, **opts)
        dx2 = dx.view(M, D)
        if M > 0:
            second = (d_hidden[:, F:], _same_strides(w_up, w1)) if gated else None
            _matmul(d_hidden, (H, 1), w1, w1.stride(), dx2, dx2.stride(), M, D, F,
                    second=second)
        grads[0] = dx
    parts = [(d_hidden[:, :F], need_dw1, need_db1, 1)]
    if gated:
        parts.append((d_hidden[:, F:], need_dwu, need_dbu, 5))
    for d_part, need_w, need_b, slot in parts:
        if need_w:
            dw = torch.empty((F, D), **opts)
            db_acc = torch.empty(F, **f32) if need_b else None
            _matmul(d_part, (1, H), x2, x2.stride(), dw, dw.stride(), F, D, M, row_sum=db_acc)
            grads[slot] = dw
            if need_b:
                grads[slot + 1] = db_acc.to(x.dtype)
        elif need_b:
            grads[slot + 1] = d_part.sum(0, dtype=torch.float32).to(x.dtype)
    return tuple(grads)
