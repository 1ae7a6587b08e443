"""Reference add + LayerNorm / RMSNorm forward and backward (formulas in csrc/common/norm_math.h)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def add_norm_fwd(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
                 bias: Optional[Tensor], eps: float, rms: bool, return_residual: bool):
    """Returns (y, residual_out or empty, mean (rows,) or empty, rstd (rows,))."""
    z = x if residual is None else x + residual  # rounded to x.dtype, as eager does
    acc = acc_dtype(x.dtype)
    hidden = x.shape[-1]
    zf = z.reshape(-1, hidden).to(acc)
    if rms:
        mean = None
        rstd = torch.rsqrt(zf.square().mean(-1) + eps)
        x_hat = zf * rstd[:, None]
    else:
        mean = zf.mean(-1)
        centered = zf - mean[:, None]
        rstd = torch.rsqrt(centered.square().mean(-1) + eps)
        x_hat = centered * rstd[:, None]
    y = x_hat
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    y = y.to(x.dtype).reshape(x.shape)
    res_out = z.contiguous() if (return_residual and residual is not None) else x.new_empty((0,))
    mean_out = mean if mean is not None else zf.new_empty((0,))
    return y, res_out, mean_out, rstd


def add_norm_bwd(dy: Tensor, dresidual_out: Optional[Tensor], z_a: Tensor, z_b: Optional[Tensor],
                 weight: Optional[Tensor], mean: Tensor, rstd: Tensor, rms: bool,
                 need_dweight: bool, need_dbias: bool, param_dtype: torch.dtype):
    """Returns (dz, dweight or empty, dbias or empty); dx = dresidual = dz."""
    z = z_a if z_b is None else z_a + z_b
    acc = acc_dtype(z.dtype)
    hidden = z.shape[-1]
    zf = z.reshape(-1, hidden).to(acc)
    dyf = dy.reshape(-1, hidden).to(acc)
    x_hat = (zf if rms else zf - mean[:, None]) * rstd[:, None]
    g = dyf if weight is None else dyf * weight.to(acc)
    c_xhat = (g * x_hat).mean(-1, keepdim=True)
    c_g = 0.0 if rms else g.mean(-1, keepdim=True)
    dz = (g - x_hat * c_xhat - c_g) * rstd[:, None]
    if dresidual_out is not None:
        dz = dz + dresidual_out.reshape(-1, hidden).to(acc)
    empty = z.new_empty((0,), dtype=param_dtype)
    dweight = (dyf * x_hat).sum(0).to(param_dtype) if need_dweight else empty
    dbias = dyf.sum(0).to(param_dtype) if need_dbias else empty
    return dz.to(z.dtype).reshape(z.shape), dweight, dbias
