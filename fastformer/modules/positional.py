"""Positional encodings: sinusoidal (fixed), learned (a table), rotary (applied to q and k).

The sinusoidal and learned encodings add a (L, d_model) table to token embeddings laid out as
torch.nn's Transformer modules take them: (L, B, E) by default, (B, L, E) with
``batch_first=True``, or (L, E) unbatched. Neither scales the embeddings by sqrt(d_model): the
paper does that in the embedding layer.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from .. import _checks
from ..ops.rotary import apply_rotary
from ..reference.rotary import acc_dtype


def _check_offset(fn: str, offset) -> int:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{fn}: `offset` must be an int >= 0, got {offset!r}")
    return offset


def _seq_dim(fn: str, x: Tensor, d_model: int, batch_first: bool) -> int:
    _checks.tensor(fn, "x", x, dims=(2, 3))
    if x.shape[-1] != d_model:
        raise ValueError(f"{fn}: the last dim of `x` must be d_model = {d_model}, got shape "
                         f"{tuple(x.shape)}")
    return 1 if (batch_first and x.dim() == 3) else 0


def _add_table(x: Tensor, table: Tensor, seq_dim: int) -> Tensor:
    """x + table, the (L, E) table broadcast over the batch dim of a 3-D x."""
    if x.dim() == 2:
        return x + table
    return x + (table.unsqueeze(0) if seq_dim == 1 else table.unsqueeze(1))


class _TableCache:
    """Tables computed in fp64 for positions 0..n-1, kept per (device, dtype) and regrown by
    doubling when a longer sequence arrives: a longer call never changes earlier rows, and no
    length limit exists (the encodings extrapolate). Not a buffer: nothing in the state_dict."""

    def __init__(self, make):
        self._make = make  # (positions fp64 (n,)) -> tuple of fp64 tables (n, ...)
        self._tables: dict = {}

    def get(self, start: int, length: int, device, dtype) -> tuple:
        key = (torch.device(device), dtype)
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < start + length:
            n = max(start + length, 2 * cached[0].shape[0] if cached is not None else 256)
            positions = torch.arange(n, dtype=torch.float64, device=device)
            cached = tuple(t.to(dtype) for t in self._make(positions))
            self._tables[key] = cached
        return tuple(t[start:start + length] for t in cached)


class SinusoidalPositionalEncoding(nn.Module):
    """``x + PE[offset : offset + L]`` then dropout, with the original paper's encoding:

        PE(pos, 2i) = sin(pos / base^(2i / d_model)),   PE(pos, 2i + 1) = cos(pos / base^(2i / d_model))

    computed in fp64 and rounded to x's dtype. It has no parameters and no length limit: any
    position can be encoded (the encoding extrapolates past the lengths seen in training).

    Args:
        d_model: embedding size E.
        dropout: dropout applied to the sum (as in the paper), in [0, 1).
        batch_first: x is (B, L, E) instead of (L, B, E); (L, E) is taken either way.
        base: the wavelength base (10000 in the paper).
    """

    def __init__(self, d_model: int, dropout: float = 0.0, batch_first: bool = False,
                 base: float = 10000.0):
        super().__init__()
        fn = "SinusoidalPositionalEncoding"
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"{fn}: `d_model` must be a positive int, got {d_model!r}")
        _checks.number(fn, "dropout", dropout, lo=0.0, hi=1.0, hi_open=True)
        _checks.number(fn, "base", base, lo=1.0, lo_open=True)
        self.d_model, self.batch_first, self.base = d_model, batch_first, float(base)
        self.dropout = nn.Dropout(dropout)
        inv_freq = self.base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)

        def make(positions):
            angles = positions[:, None] * inv_freq.to(positions.device)[None, :]
            pe = torch.empty(positions.shape[0], d_model, dtype=torch.float64, device=positions.device)
            pe[:, 0::2] = torch.sin(angles)
            pe[:, 1::2] = torch.cos(angles[:, : d_model // 2])
            return (pe,)

        self._cache = _TableCache(make)

    def encoding(self, length: int, offset: int = 0, *, device=None,
                 dtype: torch.dtype = torch.float32) -> Tensor:
        """PE for positions ``offset .. offset + length - 1``: (length, d_model)."""
        offset = _check_offset("SinusoidalPositionalEncoding", offset)
        return self._cache.get(offset, length, device or "cpu", dtype)[0]

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        seq_dim = _seq_dim("SinusoidalPositionalEncoding", x, self.d_model, self.batch_first)
        pe = self.encoding(x.shape[seq_dim], offset, device=x.device, dtype=x.dtype)
        return self.dropout(_add_table(x, pe, seq_dim))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, batch_first={self.batch_first}, base={self.base:g}"


class LearnedPositionalEncoding(nn.Module):
    """``x + weight[offset : offset + L]`` then dropout: one learned vector per position.

    ``weight`` is a (max_len, d_model) parameter initialised N(0, 0.02^2) (as BERT/GPT-2). A
    sequence reaching past ``max_len`` raises ``ValueError``: a learned table has nothing to
    say about positions it never saw (use ``SinusoidalPositionalEncoding`` or rotary
    embeddings to extrapolate).

    Args: max_len, d_model; dropout, batch_first as in ``SinusoidalPositionalEncoding``.
    """

    def __init__(self, max_len: int, d_model: int, dropout: float = 0.0,
                 batch_first: bool = False, device=None, dtype=None):
        super().__init__()
        fn = "LearnedPositionalEncoding"
        for name, v in (("max_len", max_len), ("d_model", d_model)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{fn}: `{name}` must be a positive int, got {v!r}")
        _checks.number(fn, "dropout", dropout, lo=0.0, hi=1.0, hi_open=True)
        self.max_len, self.d_model, self.batch_first = max_len, d_model, batch_first
        self.weight = nn.Parameter(torch.empty(max_len, d_model, device=device, dtype=dtype))
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        fn = "LearnedPositionalEncoding"
        seq_dim = _seq_dim(fn, x, self.d_model, self.batch_first)
        offset = _check_offset(fn, offset)
        end = offset + x.shape[seq_dim]
        if end > self.max_len:
            raise ValueError(f"{fn}: positions {offset}..{end - 1} reach past max_len = "
                             f"{self.max_len} (sequence length {x.shape[seq_dim]}, offset "
                             f"{offset}); build it with a larger max_len, or use "
                             "SinusoidalPositionalEncoding / RotaryEmbedding, which extrapolate")
        return self.dropout(_add_table(x, self.weight[offset:end].to(x.dtype), seq_dim))

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, d_model={self.d_model}, batch_first={self.batch_first}"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021) applied to queries and keys by the
    fused kernel of ``ff.apply_rotary`` (one read and one write of each tensor).

    Channel pair i of a head (i < dim/2) at position p is rotated by the angle
    ``p * base^(-2i / dim)``; channels ``dim..head_dim-1`` pass through (partial rotary, as
    GPT-NeoX). The cos/sin tables are computed in fp64 for any length on demand (no limit)
    and rounded to fp32 (fp64 for fp64 inputs); they hold no parameters and add nothing to the
    state_dict, so a module using them keeps its torch.nn state_dict keys.

    Args:
        dim: rotated channels per head (even); usually the head dim.
        base: the frequency base (10000 as in the paper and Llama 1/2).
        interleaved: pairs (2i, 2i+1) (GPT-J, RoFormer) instead of (i, i + dim/2)
            (GPT-NeoX, Llama's ``rotate_half``, the default).
    """

    def __init__(self, dim: int, base: float = 10000.0, *, interleaved: bool = False):
        super().__init__()
        fn = "RotaryEmbedding"
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
            raise ValueError(f"{fn}: `dim` must be a positive even int, got {dim!r}")
        _checks.number(fn, "base", base, lo=1.0, lo_open=True)
        _checks.flag(fn, "interleaved", interleaved)
        self.dim, self.base, self.interleaved = dim, float(base), interleaved
        inv_freq = self.base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)

        def make(positions):
            angles = positions[:, None] * inv_freq.to(positions.device)[None, :]
            return torch.cos(angles), torch.sin(angles)

        self._cache = _TableCache(make)

    def tables(self, length: int, offset: int = 0, *, device=None,
               dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
        """(cos, sin) for positions ``offset .. offset + length - 1``: each (length, dim/2)."""
        offset = _check_offset("RotaryEmbedding", offset)
        return self._cache.get(offset, length, device or "cpu", dtype)

    def rotate(self, x: Tensor, offset: int = 0) -> Tensor:
        """One (B, H, L, head_dim) tensor, positions offset..offset+L-1."""
        if isinstance(x, Tensor) and x.dim() == 4 and x.shape[-1] < self.dim:
            raise ValueError(f"RotaryEmbedding: head dim {x.shape[-1]} of `x` is smaller than "
                             f"the rotated dim {self.dim}")
        _checks.tensor("RotaryEmbedding", "x", x, dims=(4,))
        cos, sin = self.tables(x.shape[2], offset, device=x.device, dtype=acc_dtype(x.dtype))
        return apply_rotary(x, cos, sin, interleaved=self.interleaved)

    def forward(self, q: Tensor, k: Optional[Tensor] = None, offset: int = 0):
        """Rotate q (and k) of shape (B, H, L, head_dim); returns q or (q, k). Both start at
        position ``offset`` (for a KV cache, rotate new keys at their own offset with
        :meth:`rotate`)."""
        if k is None:
            return self.rotate(q, offset)
        return self.rotate(q, offset), self.rotate(k, offset)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}, interleaved={self.interleaved}"


__all__ = ["SinusoidalPositionalEncoding", "LearnedPositionalEncoding", "RotaryEmbedding"]
