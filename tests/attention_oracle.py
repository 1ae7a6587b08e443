"""Eager-PyTorch oracle for attention tests: softmax(q k^T * scale + bias) v with torch autograd.

Independent of fastformer's kernels and of its explicit backward formulas: gradients come from
autograd. Fully masked rows are defined as zeros (fastformer's documented rule).
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

import fastformer as ff
from fastformer.reference.rng import keep_mask


def t5_bucket(rel, bidirectional, num_buckets, max_distance):
    """T5's relative-position bucket (the formula of the T5 paper's code, written here
    independently of fastformer)."""
    n = num_buckets
    out = torch.zeros_like(rel)
    if bidirectional:
        n //= 2
        out = out + (rel > 0).long() * n
        rel = rel.abs()
    else:
        rel = (-rel).clamp(min=0)
    exact = n // 2
    large = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact)
                     * (n - exact)).long()
    large = large.clamp(max=n - 1)
    return out + torch.where(rel < exact, rel, large)


def oracle_attention(q, k, v, *, causal=False, key_padding_mask=None, attn_mask=None, scale=None,
                     keep=None, dropout_p=0.0, window=None, softcap=None, alibi_slopes=None,
                     sinks=None, position_bias=None, return_lse=False):
    """position_bias: (table, bidirectional, max_distance). With return_lse: (out, lse)."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    d = Lk - Lq if causal == "bottom_right" else 0
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype).reshape(-1 if alibi_slopes.dim() == 2 else 1, H, 1, 1)
        s = s - slopes * (i + d - j).abs().to(s.dtype)
    if position_bias is not None:
        table, bidirectional, max_distance = position_bias
        bucket = t5_bucket(j - i - d, bidirectional, table.shape[0], max_distance)
        s = s + table.to(s.dtype)[bucket].permute(2, 0, 1)[None]
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            allowed = allowed & attn_mask
        else:
            s = s + attn_mask.to(s.dtype)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    if causal:
        allowed = allowed & (j <= i + d)
    if window is not None:
        left, right = window
        if left >= 0:
            allowed = allowed & (j >= i + d - left)
        if right >= 0:
            allowed = allowed & (j <= i + d + right)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        # as Hugging Face's gpt-oss eager attention: the sink is one more logit per row
        logits = torch.cat([s, sinks.to(s.dtype).reshape(1, H, 1, 1).expand(B, H, Lq, 1)], -1)
        lse = torch.logsumexp(logits, -1)
        p = torch.softmax(logits, dim=-1)[..., :-1]
    else:
        empty = torch.isneginf(s.amax(-1, keepdim=True))
        lse = torch.logsumexp(s, -1).masked_fill(empty[..., 0], float("inf"))
        p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if keep is not None:
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    out = torch.matmul(p, v)
    return (out, lse) if return_lse else out


def to_ff_kwargs(kw: dict) -> dict:
    """The oracle's keyword arguments as ff.attention's (position_bias as an object)."""
    kw = dict(kw)
    if kw.get("position_bias") is not None:
        table, bidirectional, max_distance = kw["position_bias"]
        kw["position_bias"] = ff.RelativePositionBias(table, bidirectional, max_distance)
    kw.pop("keep", None)
    return kw


def run_with_options(fn, q, k, v, grad_out, grad_options=(), dtype=None, **kwargs):
    """(out, dq, dk, dv, *gradients of the options named in grad_options) of fn, with fresh
    leaves (in `dtype` if given; the position bias's table is named "table")."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    leaves = [cast(t.detach()).clone().requires_grad_(True) for t in (q, k, v)]
    kw, extra = dict(kwargs), []
    for name in grad_options:
        if name == "table":
            table, bidirectional, max_distance = kw["position_bias"]
            leaf = cast(table.detach()).clone().requires_grad_(True)
            kw["position_bias"] = (leaf, bidirectional, max_distance)
        else:
            leaf = cast(kw[name].detach()).clone().requires_grad_(True)
            kw[name] = leaf
        extra.append(leaf)
    for name, val in list(kw.items()):
        if isinstance(val, torch.Tensor) and val.is_floating_point() and name not in grad_options \
                and name != "alibi_slopes":
            kw[name] = cast(val)
    out = fn(*leaves, **kw)
    grads = torch.autograd.grad(out, leaves + extra, cast(grad_out).to(out.dtype))
    return (out.detach(), *grads)


def ff_attention_oracle_kwargs(q, k, v, **kw):
    return ff.attention(q, k, v, **to_ff_kwargs(kw))


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


# The instructions of the avx512 level's bf16 attention GEMMs (csrc/cpu/bf16_gemm.h).
BF16_GEMMS = ["amx", "avx512_bf16", "fp32"]


@contextlib.contextmanager
def bf16_attention_gemm(mode):
    """Runs the block with the CPU kernels' bf16 attention GEMMs on `mode` (one of BF16_GEMMS),
    or skips the test saying why this machine cannot."""
    info = ff._ext.cpu_info()
    if info.get("capability") != "avx512":
        if mode != "fp32":
            pytest.skip(f"bf16 GEMMs on {mode} run at the avx512 level only (this machine runs "
                        f"{info.get('capability')})")
        yield  # the fp32 micro-kernel is the only bf16 path at this level
        return
    if mode == "amx" and not info.get("amx_bf16"):
        pytest.skip(f"AMX-BF16 not usable here: {info.get('amx_note')}")
    if mode == "avx512_bf16" and not info.get("avx512_bf16"):
        pytest.skip(f"AVX512-BF16 not usable here: {info.get('avx512_bf16_note')}")
    ff._ext.set_cpu_amx(mode == "amx")
    ff._ext.set_cpu_avx512_bf16(mode == "avx512_bf16")
    try:
        assert ff._ext.cpu_info()["bf16_attention_gemm"] == mode
        yield
    finally:
        ff._ext.set_cpu_amx(bool(info.get("amx_bf16")))
        ff._ext.set_cpu_avx512_bf16(bool(info.get("avx512_bf16")))
