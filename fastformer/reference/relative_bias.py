"""Reference disentangled relative-position bias (DeBERTa-v2 / v3): the semantics every backend
implements.

c2p (B, H, Lq, W) holds each query row's dot products with the W = 2S relative-position
embeddings (content -> position), p2c (B, H, Lk, W) each key row's (position -> content); either
may be absent. Two (Lq, Lk) int64 tables pick one column per (query i, key j):

    out[b, h, i, j] = c2p[b, h, i, c2p_index[i, j]] + p2c[b, h, j, p2c_index[i, j]]

and -inf where ``visible[b, i, j]`` (bool (1 or B, Lq, Lk), True = attend) is False. Summed in
fp32 (fp64 for fp64) and rounded once. The backward sums each output's gradient into the c2p /
p2c entry it was read from (masked entries carry none).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .rotary import acc_dtype


def relative_bias_fwd(c2p: Optional[Tensor], p2c: Optional[Tensor], c2p_index: Optional[Tensor],
                      p2c_index: Optional[Tensor], visible: Optional[Tensor]) -> Tensor:
    like = c2p if c2p is not None else p2c
    B, H = like.shape[:2]
    index = c2p_index if c2p is not None else p2c_index
    shape = (B, H, *index.shape)
    acc = acc_dtype(like.dtype)
    out = torch.zeros(shape, dtype=acc, device=like.device)
    if c2p is not None:
        out += torch.gather(c2p.to(acc), -1, c2p_index.expand(shape))
    if p2c is not None:  # out[i, j] = p2c[j, p2c_index[i, j]]: a gather along the key axis of p2c^T
        out += torch.gather(p2c.to(acc).transpose(-1, -2), -2, p2c_index.expand(shape))
    if visible is not None:
        out = out.masked_fill(~visible[:, None], float("-inf"))
    return out.to(like.dtype)


def relative_bias_bwd(dout: Tensor, c2p: Optional[Tensor], p2c: Optional[Tensor],
                      c2p_index: Optional[Tensor], p2c_index: Optional[Tensor],
                      visible: Optional[Tensor]) -> tuple:
    """(d c2p, d p2c), None for an absent input."""
    acc = acc_dtype(dout.dtype)
    g = dout.to(acc)
    if visible is not None:
        g = g.masked_fill(~visible[:, None], 0)
    dc2p = dp2c = None
    if c2p is not None:
        dc2p = torch.zeros(c2p.shape, dtype=acc, device=g.device)
        dc2p.scatter_add_(-1, c2p_index.expand(g.shape), g)
        dc2p = dc2p.to(c2p.dtype)
    if p2c is not None:
        dp2c = torch.zeros(p2c.shape, dtype=acc, device=g.device).transpose(-1, -2)
        dp2c.scatter_add_(-2, p2c_index.expand(g.shape), g)
        dp2c = dp2c.transpose(-1, -2).contiguous().to(p2c.dtype)
    return dc2p, dp2c
