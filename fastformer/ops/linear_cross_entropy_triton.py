"""Launcher of the Triton row pass of ff.linear_cross_entropy
(triton_kernels/linear_cross_entropy.py). Called by ``_Triton`` in ops/linear_cross_entropy.py
from the chunk loop of reference/linear_cross_entropy.py with that module's ``rows()``
signature; the GEMMs around it are torch's."""
from __future__ import annotations

import torch


def rows(z, target, loss, lse, o, scale, row_scale, compute_loss, write_grad, dbias):
    from ..triton_kernels import interpreter_mode
    from ..triton_kernels import linear_cross_entropy as tk
    C, V = z.shape
    if C == 0:
        return
    interpret = interpreter_mode()
    scale_is_tensor = isinstance(scale, torch.Tensor)
    scale_t = scale.reshape(1).to(torch.float32) if scale_is_tensor else lse
    eps = float(o.label_smoothing)
    cap = float(o.softcap)
    tk.lce_rows_kernel[(C,)](
        z, target, loss, lse, row_scale if row_scale is not None else lse, scale_t,
        1.0 if scale_is_tensor else float(scale), V, int(o.ignore_index), 1.0 - eps, eps / V,
        cap if cap > 0 else 1.0, 1.0 / cap if cap > 0 else 1.0,
        COMPUTE_LOSS=compute_loss, WRITE_GRAD=write_grad, HAS_ROW_SCALE=row_scale is not None,
        SCALE_PTR=scale_is_tensor, CAPPED=cap > 0, SMOOTHING=eps > 0, INTERPRET=interpret,
        **tk.config(V, interpret))
    if write_grad and dbias is not None:
        dbias.add_(z.sum(0, dtype=torch.float64))
