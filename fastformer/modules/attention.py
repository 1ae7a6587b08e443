"""ff.MultiheadAttention: nn.MultiheadAttention on fastformer's fused attention.

A subclass of ``nn.MultiheadAttention``: the same constructor, parameters (``in_proj_weight``
/ ``in_proj_bias``, or ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when kdim/vdim
differ from embed_dim, and ``out_proj``), initialisation, state_dict keys and
``isinstance(m, nn.MultiheadAttention)``; only ``forward`` differs.

One call (batch-first shown; the (L, B, E) layout is handled with views, nothing is copied):
  query (B, Lq, E) --in_proj (one GEMM for self-attention)--> (B, Lq, 3, H, D)
    --views--> q, k, v (B, H, L, D)  [--ff.apply_rotary--> q, k  when rotary is on]
    --ff.attention (flash: the (Lq, Lk) scores are never stored)--> (B, H, Lq, D) stored as
    (B, Lq, H, D) --free reshape--> (B, Lq, E) --out_proj--> output
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.attention import attention
from ..ops.linear import linear
from ..reference.attention import CAUSAL_NONE, CAUSAL_TOP_LEFT, allowed_mask
from .positional import RotaryEmbedding

_FN = "MultiheadAttention"


def _split_heads(t: Tensor, n: int, heads: int, batch_first: bool) -> list:
    """(B, L, n*H*D) (or (L, B, n*H*D)) -> n views (B, H, L, D), last dim contiguous."""
    if batch_first:
        parts = t.unflatten(-1, (n, heads, -1)).permute(2, 0, 3, 1, 4)
    else:
        parts = t.unflatten(-1, (n, heads, -1)).permute(2, 1, 3, 0, 4)
    return list(parts.unbind(0))


def _check_mask_dtype(name: str, mask: Optional[Tensor]) -> None:
    if mask is not None and mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{_FN}: `{name}` must be a bool or floating-point tensor, got {mask.dtype}")


class MultiheadAttention(nn.MultiheadAttention):
    """Drop-in ``nn.MultiheadAttention`` running ``ff.attention``.

    Constructor: nn.MultiheadAttention's (embed_dim, num_heads, dropout, bias, add_bias_kv,
    add_zero_attn, kdim, vdim, batch_first, device, dtype), plus keyword-only ``rotary``:
    ``True`` applies a ``ff.RotaryEmbedding(head_dim)`` to q and k (positions 0..L-1 of each),
    or pass a ``RotaryEmbedding`` to choose its dim/base/layout. Off by default; it adds no
    state. ``add_bias_kv=True`` and ``add_zero_attn=True`` raise ``NotImplementedError``.

    forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) follows nn.MultiheadAttention:

    * ``key_padding_mask`` (B, Lk) ((Lk,) unbatched): bool, **True = ignore that key**, or float,
      added to the scores.
    * ``attn_mask`` (Lq, Lk) or (B*num_heads, Lq, Lk): bool, **True = not allowed to attend**
      (the opposite of ``ff.attention``'s bool mask; converted here), or float, added.
    * ``is_causal=True``: the kernel applies the causal (top-left) structure itself and does
      not read ``attn_mask``, which must be the causal mask if given (torch calls it a hint and
      also skips the mask on its SDPA path). Unlike torch it may be used without ``attn_mask``.
    * ``need_weights=False``: fused flash attention (dropout from fastformer's counter-based
      RNG), no (Lq, Lk) matrix is stored. ``need_weights=True`` (torch's default): the
      reference path, which materializes the softmax weights in fp32 (with torch's dropout)
      and returns them (averaged over heads if ``average_attn_weights``), as torch does.
    * A query whose keys are all masked gets a zero output (torch gives NaN).
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim=None, vdim=None,
                 batch_first: bool = False, device=None, dtype=None, *,
                 rotary: Union[bool, RotaryEmbedding] = False):
        if add_bias_kv:
            raise NotImplementedError(f"{_FN}: add_bias_kv=True is not supported (learned bias "
                                      "keys/values); use torch.nn.MultiheadAttention for it")
        if add_zero_attn:
            raise NotImplementedError(f"{_FN}: add_zero_attn=True is not supported; use "
                                      "torch.nn.MultiheadAttention for it")
        for name, v in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{_FN}: `{name}` must be a positive int, got {v!r}")
        if embed_dim % num_heads:
            raise ValueError(f"{_FN}: `embed_dim` ({embed_dim}) must be divisible by `num_heads` "
                             f"({num_heads})")
        super().__init__(embed_dim, num_heads, dropout, bias, False, False, kdim, vdim,
                         batch_first, device, dtype)
        if rotary is True:
            rotary = RotaryEmbedding(self.head_dim)
        elif rotary is False or rotary is None:
            rotary = None
        elif not isinstance(rotary, RotaryEmbedding):
            raise TypeError(f"{_FN}: `rotary` must be a bool or a ff.RotaryEmbedding, got "
                            f"{type(rotary).__name__}")
        if rotary is not None and rotary.dim > self.head_dim:
            raise ValueError(f"{_FN}: the rotary dim {rotary.dim} exceeds head_dim = "
                             f"{self.head_dim}")
        self.rotary = rotary

    # ---- input handling -----------------------------------------------------------------------
    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask):
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{_FN}: `{name}` must be a tensor, got {type(t).__name__}")
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"{_FN}: `query`, `key`, `value` must all be 3-D (batched) or 2-D "
                             f"(unbatched); got {query.dim()}-D, {key.dim()}-D, {value.dim()}-D")
        for name, t, want in (("query", query, self.embed_dim), ("key", key, self.kdim),
                              ("value", value, self.vdim)):
            if t.shape[-1] != want:
                raise ValueError(f"{_FN}: the last dim of `{name}` must be {want}, got shape "
                                 f"{tuple(t.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"{_FN}: `key` {tuple(key.shape)} and `value` {tuple(value.shape)} "
                             "must have the same sequence and batch dims")
        _check_mask_dtype("key_padding_mask", key_padding_mask)
        _check_mask_dtype("attn_mask", attn_mask)

    def _masks(self, attn_mask, key_padding_mask, B, Lq, Lk, dtype, batched):
        """nn conventions -> ff.attention's (attn_mask True = attend or float, kpm True = pad)."""
        H = self.num_heads
        if key_padding_mask is not None:
            want = (B, Lk) if batched else (Lk,)
            if tuple(key_padding_mask.shape) != want:
                raise ValueError(f"{_FN}: `key_padding_mask` must have shape {want} "
                                 f"((batch, key length)), got {tuple(key_padding_mask.shape)}")
            key_padding_mask = key_padding_mask.reshape(B, Lk)
        if attn_mask is not None:
            if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (Lq, Lk):
                pass
            elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == (B * H, Lq, Lk):
                attn_mask = attn_mask.view(B, H, Lq, Lk)
            else:
                raise ValueError(f"{_FN}: `attn_mask` must have shape (Lq, Lk) = {(Lq, Lk)} or "
                                 f"(batch * num_heads, Lq, Lk) = {(B * H, Lq, Lk)}, got "
                                 f"{tuple(attn_mask.shape)}")
            if attn_mask.dtype == torch.bool:
                attn_mask = ~attn_mask  # nn: True = blocked; ff: True = attend
            elif attn_mask.dtype not in (dtype, torch.float32):
                attn_mask = attn_mask.to(dtype)
        if key_padding_mask is not None and key_padding_mask.is_floating_point():
            # A float padding mask is added to the scores: fold it into a float attn_mask.
            bias = key_padding_mask.to(dtype if attn_mask is None or attn_mask.dtype == torch.bool
                                       else attn_mask.dtype).view(B, 1, 1, Lk)
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros(attn_mask.shape, dtype=bias.dtype,
                                        device=bias.device).masked_fill_(~attn_mask, float("-inf"))
            attn_mask = bias if attn_mask is None else attn_mask + bias
            key_padding_mask = None
        return attn_mask, key_padding_mask

    def _project(self, query, key, value):
        """q (B, H, Lq, D), k, v (B, H, Lk, D) as views of the projections."""
        H, E, bf = self.num_heads, self.embed_dim, self.batch_first
        w, b = self.in_proj_weight, self.in_proj_bias
        if not self._qkv_same_embed_dim:
            bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)
            return [_split_heads(linear(x, wx, bx), 1, H, bf)[0] for x, wx, bx in
                    ((query, self.q_proj_weight, bq), (key, self.k_proj_weight, bk),
                     (value, self.v_proj_weight, bv))]
        if query is key and key is value:
            return _split_heads(linear(query, w, b), 3, H, bf)
        bq, bkv = (b[:E], b[E:]) if b is not None else (None, None)
        q = _split_heads(linear(query, w[:E], bq), 1, H, bf)[0]
        if key is value:
            return [q] + _split_heads(linear(key, w[E:], bkv), 2, H, bf)
        bk, bv = (b[E:2 * E], b[2 * E:]) if b is not None else (None, None)
        return [q, _split_heads(linear(key, w[E:2 * E], bk), 1, H, bf)[0],
                _split_heads(linear(value, w[2 * E:], bv), 1, H, bf)[0]]

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        """Returns (attn_output, attn_weights or None); see the class docstring."""
        self._check_inputs(query, key, value, key_padding_mask, attn_mask)
        batched = query.dim() == 3
        if not batched:  # a batch of one, in the layout batch_first says
            dim = 0 if self.batch_first else 1
            # identities are kept: `query is key is value` selects the fused projection
            q_in = query.unsqueeze(dim)
            k_in = q_in if key is query else key.unsqueeze(dim)
            value = k_in if value is key else (q_in if value is query else value.unsqueeze(dim))
            query, key = q_in, k_in
        bdim, ldim = (0, 1) if self.batch_first else (1, 0)
        B, Lq, Lk = query.shape[bdim], query.shape[ldim], key.shape[ldim]
        if key.shape[bdim] != B:
            raise ValueError(f"{_FN}: `key` has batch size {key.shape[bdim]} but `query` has {B}")
        attn_mask_ff, kpm_ff = self._masks(None if is_causal else attn_mask, key_padding_mask,
                                           B, Lq, Lk, query.dtype, batched)
        q, k, v = self._project(query, key, value)
        if self.rotary is not None:
            q, k = self.rotary(q, k)
        dropout_p = self.dropout if self.training else 0.0
        causal = CAUSAL_TOP_LEFT if is_causal else CAUSAL_NONE
        if need_weights:
            out, weights = self._attention_with_weights(q, k, v, attn_mask_ff, kpm_ff, causal,
                                                        dropout_p, average_attn_weights)
        else:
            out, weights = attention(q, k, v, causal=bool(causal), key_padding_mask=kpm_ff,
                                     attn_mask=attn_mask_ff, dropout_p=dropout_p), None
        # (B, H, Lq, D) stored as (B, Lq, H, D): merging the heads is a free reshape.
        out = linear(out.transpose(1, 2).reshape(B, Lq, self.embed_dim), self.out_proj.weight,
                       self.out_proj.bias)
        if not batched:
            out = out[0]
            weights = weights[0] if weights is not None else None
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _attention_with_weights(self, q, k, v, attn_mask, key_padding_mask, causal, dropout_p,
                                average):
        """The reference path: softmax weights materialized in fp32 (fp64 for fp64), autograd
        through plain PyTorch, torch's dropout on the weights (as nn.MultiheadAttention)."""
        B, H, Lq, D = q.shape
        Lk = k.shape[2]
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) / math.sqrt(D)
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            scores = scores + attn_mask.to(acc)
        allowed = allowed_mask(B, H, Lq, Lk, attn_mask, key_padding_mask, causal, q.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        empty = torch.isneginf(scores.amax(-1, keepdim=True))
        weights = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
        if dropout_p > 0:
            weights = F.dropout(weights, dropout_p, training=True)
        out = torch.matmul(weights, v.to(acc)).to(q.dtype)
        weights = weights.mean(1) if average else weights
        return out, weights.to(q.dtype)


__all__ = ["MultiheadAttention"]
