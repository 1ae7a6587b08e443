"""Dropout with the Philox mask every fastformer backend shares (reference/rng.py).

``dropout(x, p)`` = x * keep / (1 - p), keep of element e (x's row-major index) drawn from a
fresh (seed, offset) as the fused kernels draw theirs; the backward regenerates the mask from
those two numbers, so nothing of x's size is saved (torch's dropout keeps a mask the size of x).

cpu: csrc/cpu/ffn_elementwise.cpp's elementwise pass in its identity mode: one read and one
write, the mask drawn 64 words per Philox call of 16 lanes (cpu/philox_vec.h), the product in
fp32 (fp64 for fp64) and one rounding. Elsewhere (other devices, a missing extension, under
torch.compile) the reference, the same mask from torch ops.

Why: ``ff.convert`` sends a Hugging Face model's ``nn.Dropout`` modules here (the residual
dropouts of BERT, GPT-2, T5, ...). On the 2-core Xeon torch's CPU dropout (``bernoulli_``) took
106 ms of a converted BERT-base bf16 training step (4 x 256 tokens, 25 calls on (4, 256, 768),
~5 ns per element; torch.profiler).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _ext
from ..reference.rng import draw_rng_state, keep_mask
from ._opdef import owned, rowwise

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _kernel_takes(x: Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES and x.dim() >= 1
            and type(x) in (Tensor, torch.nn.Parameter) and _ext.C is not None
            and hasattr(_ext.C, "dropout") and not torch.compiler.is_compiling())


def _apply(x: Tensor, p: float, rng_state: Tensor) -> Tensor:
    """x * keep / (1 - p) for the mask of rng_state (forward, and the backward on dy)."""
    if x.numel() == 0:
        return x.clone()
    if _kernel_takes(x):
        rows = rowwise(x).reshape(-1, x.shape[-1])
        return _ext.C.dropout(rows, p, rng_state).view(x.shape)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    keep = keep_mask(rng_state, x.shape, p, x.device)
    scale = torch.tensor(1.0 / (1.0 - p), dtype=acc)
    return (x.to(acc) * keep.to(acc) * scale.to(x.device)).to(x.dtype)


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, rng_state):
        ctx.p, ctx.rng_state = p, rng_state
        return owned(_apply(x, p, rng_state))

    @staticmethod
    def backward(ctx, dy):
        return _apply(dy, ctx.p, ctx.rng_state), None, None


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)`` with fastformer's Philox mask (module docstring)."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"dropout: `x` must be a floating-point tensor, got "
                        f"{type(x).__name__ if not isinstance(x, Tensor) else x.dtype}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: `p` must be a number in [0, 1], got {p!r}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    return _Dropout.apply(x, float(p), draw_rng_state())


__all__ = ["dropout"]
