"""Reference rotary position embedding (RoPE): the semantics every backend implements.

x is (B, H, L, D); the first R = 2 * cos.shape[-1] <= D channels of each row are rotated by the
angles of its position l (row l of the tables), the other D - R channels pass through. With
c = cos[l, i], s = sin[l, i] for i < R/2, the pair (a, b) of channels

    rotate-half (GPT-NeoX, Llama; interleaved=False): a = i, b = i + R/2
    interleaved (GPT-J, the RoFormer paper):           a = 2i, b = 2i + 1

becomes (x_a c - x_b s, x_b c + x_a s). The rotation is orthogonal, so the backward is the
rotation by the opposite angle: dx = the same op on dy with s -> -s (``conj=True``). The
tables are constants: no gradient flows to cos and sin.
"""
from __future__ import annotations

import torch
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, conj: bool) -> Tensor:
    """Returns the rotated x in x's dtype, computed in fp32 (fp64 for fp64), rounded once."""
    acc = acc_dtype(x.dtype)
    half = cos.shape[-1]
    rot = 2 * half
    c = cos.to(acc)
    s = -sin.to(acc) if conj else sin.to(acc)
    xr = x[..., :rot].to(acc)
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = xr[..., :half], xr[..., half:]
        y = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    out = torch.cat((y.to(x.dtype), x[..., rot:]), dim=-1)
    return out.transpose(1, 2).contiguous().transpose(1, 2)  # stored (B, L, H, D), as the kernels'
