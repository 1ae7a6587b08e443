"""The dropout RNG of every backend, in PyTorch: Philox4x32-10, four elements per call.

Bit-exact twin of csrc/common/philox.h (and of Triton's tl.randint4x with a 64-bit offset):
element e (offset + index, a 64-bit number) takes word e mod 4 of Philox(counter = e // 4 split
into low/high 32 bits, 0, 0; key = seed split into low/high 32 bits). Kept iff word >=
round(p * 2^32). The tests use :func:`keep_mask` to recompute the exact mask a kernel used.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def draw_rng_state(generator=None) -> torch.Tensor:
    """(seed, offset) as an int64 CPU tensor, drawn from torch's default generator, so that
    torch.manual_seed makes dropout reproducible and successive calls differ."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, generator=generator)


def threshold(p: float) -> int:
    t = int(p * 4294967296.0 + 0.5)
    return min(t, _M32)


def philox_words(elements: torch.Tensor, seed: int) -> torch.Tensor:
    """uint32 dropout words (as int64) of int64 element numbers (any shape; a negative value
    is the 64-bit number it stands for)."""
    group = (elements >> 2) & ((1 << 62) - 1)  # the 64-bit number's logical shift
    c0 = group & _M32
    c1 = (group >> 32) & _M32
    c2 = torch.zeros_like(group)
    c3 = torch.zeros_like(group)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        prod_b = 0xCD9E8D57 * c2  # < 2**64: wraps in int64, low 64 bits stay exact
        prod_a = 0xD2511F53 * c0
        new_c0 = ((prod_b >> 32) & _M32) ^ c1 ^ k0
        new_c2 = ((prod_a >> 32) & _M32) ^ c3 ^ k1
        c1 = prod_b & _M32
        c3 = prod_a & _M32
        c0, c2 = new_c0, new_c2
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return torch.stack([c0, c1, c2, c3], -1).gather(-1, (elements & 3).unsqueeze(-1)).squeeze(-1)


def keep_mask(rng_state: torch.Tensor, shape, p: float, device=None) -> torch.Tensor:
    """Bool mask of kept elements for a dense row-major tensor of `shape` (the attention
    probabilities (B, H, Lq, Lk), or the FFN hidden activations (N, F))."""
    seed, offset = (int(v) for v in rng_state.tolist())
    n = 1
    for s in shape:
        n *= int(s)
    counters = torch.arange(n, dtype=torch.int64, device=device) + offset
    return (philox_words(counters, seed) >= threshold(p)).reshape(shape)
