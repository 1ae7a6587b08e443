"""``F.linear`` for the few-row calls of decoding: csrc/cpu/linear_rows.cpp.

A decode step multiplies one token's activations (a few rows: one per sequence) by every weight
matrix of the model, so its time is the time to read the weights. torch's CPU matmul for such
calls (MKL / oneDNN GEMV) read fp32 weights at 14-18 GB/s on a 2-core Zen 5 where
linear_rows.cpp reads 20-61 GB/s (1-4 rows, weights of (1024..32000) x (1024..2816), eight
matrices in turn so that none stays cached). bf16 / fp16 weights take it for one row only: with
more rows the bf16-to-fp32 conversion per weight vector made it 0.6-0.9x torch's (which uses
AVX512-BF16 dot products there).

Used by ``ff.convert`` on Hugging Face models (every nn.Linear, the LM head included) and by
the FFN's cpu.onednn route. Forward only: a call that needs a gradient, runs under tracing or
torch.compile, or is not a plain CPU tensor call takes ``F.linear``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _ext

# Most rows a call may have to take the kernel, per weight dtype (measured, see above).
MAX_ROWS = {torch.float32: 8, torch.bfloat16: 1, torch.float16: 1}


def _plain(t) -> bool:
    """A tensor or parameter, not a subclass that intercepts ops (FakeTensor, DTensor, ...)."""
    return type(t) in (Tensor, torch.nn.Parameter)


def rows_kernel_takes(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether linear_rows.cpp computes x @ weight.T + bias for this call (no autograd check:
    the caller knows whether a gradient is needed)."""
    if x.dim() == 0 or x.shape[-1] == 0 or not (_plain(x) and _plain(weight)):
        return False
    rows = x.numel() // x.shape[-1]
    return (x.device.type == "cpu" and weight.device.type == "cpu"
            and 1 <= rows <= MAX_ROWS.get(x.dtype, 0) and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.shape[1] == x.shape[-1] and weight.stride(1) == 1
            and (bias is None or (_plain(bias) and bias.dtype == x.dtype
                                  and bias.shape == (weight.shape[0],) and bias.is_contiguous()))
            and _ext.C is not None and hasattr(_ext.C, "linear_rows")
            and not torch.compiler.is_compiling())


def rows_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x @ weight.T + bias on linear_rows.cpp (rows_kernel_takes() must hold)."""
    y = _ext.C.linear_rows(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x, weight, bias)``; a few rows without autograd on linear_rows.cpp."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    if not grad and rows_kernel_takes(x, weight, bias):
        return rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


__all__ = ["linear"]
