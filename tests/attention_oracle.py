"""Eager-PyTorch oracle for attention tests: softmax(q k^T * scale + bias) v with torch autograd.

Independent of fastformer's kernels and of its explicit backward formulas: gradients come from
autograd. Fully masked rows are defined as zeros (fastformer's documented rule).
"""
from __future__ import annotations

import torch

import fastformer as ff
from fastformer.reference.rng import keep_mask


def oracle_attention(q, k, v, *, causal=False, key_padding_mask=None, attn_mask=None, scale=None,
                     keep=None, dropout_p=0.0):
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            s = s + attn_mask.to(s.dtype)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    if causal:
        shift = 0 if causal in (True, "top_left") else Lk - Lq
        i = torch.arange(Lq)[:, None]
        j = torch.arange(Lk)[None, :]
        allowed = allowed & (j <= i + shift)
    s = s.masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(s.amax(-1, keepdim=True))
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    return torch.matmul(p, v)


def run(fn, q, k, v, grad_out, **kwargs):
    """(out, dq, dk, dv) of fn with fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves, **kwargs)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return (out.detach(), *grads)


def ff_attention(q, k, v, **kwargs):
    return ff.attention(q, k, v, **kwargs)


def oracle_grads(q, k, v, grad_out, **kwargs):
    """Oracle in fp64 for fp32/fp64 inputs, in fp32 for fp16/bf16 inputs."""
    dt = torch.float64 if q.dtype in (torch.float32, torch.float64) else torch.float32
    up = {key: (val.to(dt) if isinstance(val, torch.Tensor) and val.is_floating_point() else val)
          for key, val in kwargs.items()}
    return run(oracle_attention, q.to(dt), k.to(dt), v.to(dt), grad_out.to(dt), **up)


def dropout_keep(rng_state, shape, p):
    return keep_mask(rng_state, shape, p)


def rising_score_inputs(jump: float, B=1, H=2, Lq=70, Lk=None, D=16, seed=3, block=128):
    """fp32 q, k, v, grad_out whose scores (at scale 1) are jump * (block-key block index) plus
    terms in [-4, 4]: large scores that rise from block to block (three blocks unless Lk is
    given; block: the key block of the kernel under test). Entries are multiples of 1/64,
    so Q K^T is exact in fp32; the large part is split as c * (jump / c) so that neither q nor k
    is large (a gradient's fp32 rounding grows with the other operand's magnitude)."""
    Lk = 3 * block if Lk is None else Lk
    g = torch.Generator().manual_seed(seed)
    grid = lambda *s: torch.randint(-16, 17, s, generator=g).double() / 16  # noqa: E731
    q, k, v, go = grid(B, H, Lq, D), grid(B, H, Lk, D) / 4, grid(B, H, Lk, D), grid(B, H, Lq, D)
    c = min(jump, 8.0)
    q[..., 0] = c
    k[..., 0] = (jump / c) * (torch.arange(Lk) // block).double()
    return tuple(t.float() for t in (q, k, v, go))
