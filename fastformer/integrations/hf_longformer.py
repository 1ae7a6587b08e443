"""ff.convert for Longformer's and LED's encoder attention (``LongformerSelfAttention``,
``LEDEncoderSelfAttention``): a sliding window with global tokens, on ff.attention.

The attention, as transformers computes it (its layers take the model's (B, L) mask turned into
-10000 padded / 0 local / +10000 global, L padded by the model to a multiple of the window):
  local    every query row i sees the keys j with |i - j| <= w (w = attention_window / 2), padded
           and global keys left out of that band, plus every global key, all through the query /
           key / value projections; padded query rows get no keys at all (their output is 0)
  global   the rows of global tokens are then replaced: their query_global projection against
           key_global / value_global of every unpadded token
Its eager code forms (B, L, H, 2w + 1) band scores by overlapping chunks of 2w (a copy of the
keys per chunk, diagonals rolled into place), concatenates the global keys' scores, takes an fp32
softmax and reverses the chunking for the values: at L = 4096, w = 256 the scores and
probabilities alone are 2 x 12 x 4096 x 513 x 4 bytes per sequence and layer, and the chunk
copies several times that.

Converted, the local part is one ``ff.attention`` call with a (B, 1, L, L) bool mask of exactly
that visibility (the band less padded and global keys, the global columns, no key for a padded
row): the cpu kernels read the mask's structure first and visit only the tiles it leaves
partly or wholly visible (the band's and the global columns'), no score tensor. The global rows
are gathered (padded to the batch's largest count) and attend with the global projections under
the key padding mask in a second call, their outputs written over the local ones. The mask is
built per layer (its window may differ per layer): L^2 bytes per sequence.

``output_attentions`` (the original returns the band and global probabilities) and activations
in another dtype than the weights run the original.
"""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch
from torch import nn

from ..ops.attention import attention


def _local_visibility(masked: torch.Tensor, glob: torch.Tensor, window: int) -> torch.Tensor:
    """(B, 1, L, L) bool: the keys each query row sees in the local part. The encoder hands every
    layer the same masked / glob tensors, so the last mask built is reused while they are alive
    and unchanged (one build per forward where the layers share a window: at 4096 tokens built
    per layer from int64 distances it took 90 ms of each layer's 280, built from a cached band
    in three bool passes 10 ms per forward)."""
    key = (masked._version, glob._version, window, masked.shape, masked.device)
    cached = _last_visibility
    if cached and cached[0]() is masked and cached[1]() is glob and cached[2] == key:
        return cached[3]
    length = masked.shape[1]
    band = torch.ones(length, length, dtype=torch.bool, device=masked.device).triu_(-window).tril_(window)
    visible = band & ~(masked | glob)[:, None, :]                           # (B, L, L)
    visible |= glob[:, None, :]
    visible &= ~masked[:, :, None]
    visible = visible.unsqueeze(1)
    # dropped with the encoder's masks (the weakref's callback): L^2 bytes per sequence not kept
    _last_visibility[:] = [weakref.ref(masked, _forget), weakref.ref(glob), key, visible]
    return visible


_last_visibility: list = []  # [weakref(masked), weakref(glob), key, visibility] of the last build


def _forget(_ref) -> None:
    _last_visibility.clear()


class LongformerSelfAttentionMixin:
    _ff_what = "ff.attention (the window and global tokens as one bool mask; the global rows in a second call)"

    def forward(self, hidden_states, attention_mask=None, is_index_masked=None, is_index_global_attn=None,
                is_global_attn=None, output_attentions=False, **kwargs):
        if output_attentions or hidden_states.dtype != self.query.weight.dtype or is_index_masked is None:
            return super().forward(hidden_states, attention_mask, is_index_masked, is_index_global_attn,
                                   is_global_attn, output_attentions, **kwargs)
        batch, length, width = hidden_states.shape
        heads, d = self.num_heads, self.head_dim

        def heads_of(x):
            return x.view(x.shape[0], x.shape[1], heads, d).transpose(1, 2)
        glob = is_index_global_attn  # all False without global tokens
        p = self.dropout if self.training else 0.0
        scale = 1.0 / math.sqrt(d)
        q, k, v = (heads_of(proj(hidden_states)) for proj in (self.query, self.key, self.value))
        visible = _local_visibility(is_index_masked, glob, self.one_sided_attn_window_size)
        out = attention(q, k, v, attn_mask=visible, dropout_p=p, scale=scale)
        out = out.transpose(1, 2).reshape(batch, length, width)
        if not is_global_attn:
            return (out,)
        # The global rows: each sequence's global positions, padded to the batch's largest count;
        # a padding slot reads row 0 and writes to a row past the end, sliced off (no gradient).
        counts = glob.sum(1)
        slots = int(counts.max())
        order = torch.argsort((~glob).to(torch.int8), dim=1, stable=True)[:, :slots]      # globals first
        real = torch.arange(slots, device=glob.device)[None, :] < counts[:, None]
        rows = hidden_states.gather(1, torch.where(real, order, 0)[:, :, None].expand(-1, -1, width))  # (B, G, E)
        qg = heads_of(self.query_global(rows))
        kg, vg = heads_of(self.key_global(hidden_states)), heads_of(self.value_global(hidden_states))
        og = attention(qg, kg, vg, attn_mask=~is_index_masked[:, None, None, :], dropout_p=p, scale=scale)
        og = og.transpose(1, 2).reshape(batch, slots, width)
        to = torch.where(real, order, length)[:, :, None].expand(-1, -1, width)
        return (torch.cat([out, out.new_zeros(batch, 1, width)], 1).scatter(1, to, og)[:, :length],)


def convert_longformer_attention(m: nn.Module, swap) -> Optional[str]:
    """Swap a LongformerSelfAttention / LEDEncoderSelfAttention for the mixin, or say why not."""
    names = ("query", "key", "value", "query_global", "key_global", "value_global")
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in names) \
            or not isinstance(getattr(m, "one_sided_attn_window_size", None), int) \
            or not isinstance(getattr(m, "dropout", None), float):
        return "not Longformer's self-attention form (six projections, a one-sided window, a float dropout)"
    swap(m, LongformerSelfAttentionMixin)
    return None


LONGFORMER_ATTENTION = {"LongformerSelfAttention": convert_longformer_attention,
                        "LEDEncoderSelfAttention": convert_longformer_attention}

__all__ = ["LONGFORMER_ATTENTION"]
