"""ff.convert for BLOOM's and MPT's attention: their ALiBi inside the attention kernels
(``alibi_slopes``).

transformers' ``BloomAttention`` has no attention interface: it forms the (B * H, Lq, Lk)
scores with ``alibi.baddbmm(q, k^T)`` in the model's dtype, adds the 4-D mask, takes an fp32
softmax into another (B, H, Lq, Lk) tensor and multiplies by V, so its memory and time grow
with L^2 whatever kernels the rest of the model runs on. Its ALiBi bias is ``slope_h * p_j``,
p_j key j's position among the row's unpadded keys (``build_alibi_tensor``), the same for every
query. Within a query's visible keys (j <= i + Lk - Lq: the model is causal) that differs from
FlashAttention's ``-slope_h * |i + Lk - Lq - j|`` by an amount that depends on the row only
(``slope_h * (i + Lk - Lq)``, and a left padding's shift), which the softmax cancels. So the
converted forward calls ``ff.attention(q, k, v, causal="bottom_right", alibi_slopes=slopes,
attn_mask=mask)`` with BLOOM's own slopes (``_get_alibi_slopes``, fp32) and the mask the model
built: the bias computed in fp32 inside the kernels, no score tensor.

Calls the kernels do not cover run the original forward: ``output_attentions`` (it returns the
probabilities), tensor-parallel slicing (``pretraining_tp > 1`` with ``slow_but_exact``), and
activations in another dtype than the weights. Query rows that see no unpadded key (left padding
of a prompt) are don't-care rows in both: the original spreads them over every key, ours over
the keys up to the diagonal.

MPT (``MptAttention``) is the same computation in another form: its bias ``slope_h * (j - n)``
over the key positions (its own slopes, ``build_mpt_alibi_tensor``, read back from the function
itself), a bool mask that is True where a key is masked (inverted for ``attn_mask``), an
optional clamp of the fused q / k / v projection. Its block asks the attention for the
probabilities on every call and keeps them only with ``output_attentions``, so the block tells
its attention module whether they are wanted (``MptBlockMixin``); keys beyond the model's
``max_seq_len`` (where the original's bias no longer lines up) run the original.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from ..ops.attention import attention


class BloomAttentionMixin:
    _ff_what = "ff.attention with BLOOM's ALiBi slopes (no (B * H, Lq, Lk) scores)"

    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None,
                use_cache=False, output_attentions=False, **kwargs):
        weight = self.query_key_value.weight
        if (output_attentions or (self.pretraining_tp > 1 and self.slow_but_exact)
                or hidden_states.dtype != weight.dtype):
            return super().forward(hidden_states, residual, alibi, attention_mask, layer_past,
                                   use_cache, output_attentions, **kwargs)
        batch, q_length, _ = hidden_states.shape
        q, k, v = self._reshape(self.query_key_value(hidden_states))  # (B, H, L, D) views
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        slopes = self._ff_slopes
        if slopes.device != q.device:
            slopes = self._ff_slopes = slopes.to(q.device)
        if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(q.dtype)
        p = self.attention_dropout.p if self.training else 0.0
        context = attention(q, k, v, causal="bottom_right", attn_mask=attention_mask,
                            alibi_slopes=slopes, dropout_p=p, scale=self.inv_norm_factor)
        context = context.transpose(1, 2).reshape(batch, q_length, self.num_heads * self.head_dim)
        out = self.dense(context)
        return _module_of(self).dropout_add(out, residual, self.hidden_dropout, self.training), None


class MptAttentionMixin:
    _ff_what = "ff.attention with MPT's ALiBi slopes (no (B, H, Lq, Lk) scores)"
    _ff_need_weights = False

    def forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
        weight = self.Wqkv.weight
        past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
        if (self._ff_need_weights or hidden_states.dtype != weight.dtype or position_bias is None
                or past + hidden_states.shape[1] > position_bias.shape[-1]):
            return super().forward(hidden_states, position_bias, cache, attention_mask, **kwargs)
        batch, q_length, _ = hidden_states.shape
        qkv = self.Wqkv(hidden_states)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = (t.unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2) for t in qkv.chunk(3, dim=2))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        slopes = self._ff_slopes
        if slopes.device != q.device:
            slopes = self._ff_slopes = slopes.to(q.device)
        attend = ~attention_mask if attention_mask is not None else None  # MPT's True: masked
        p = self.attn_dropout_p if self.training else 0.0
        context = attention(q, k, v, causal="bottom_right", attn_mask=attend, alibi_slopes=slopes,
                            dropout_p=p, scale=self.softmax_scale)
        return self.out_proj(context.transpose(1, 2).reshape(batch, q_length, -1)), None


class MptBlockMixin:
    _ff_what = "tells its attention whether the probabilities are wanted (output_attentions)"

    def forward(self, hidden_states, position_bias, attention_mask, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        self.attn._ff_need_weights = bool(output_attentions)
        return super().forward(hidden_states, position_bias, attention_mask, layer_past, use_cache,
                               output_attentions, **kwargs)


def _module_of(m: nn.Module):
    return sys.modules[type(m)._fastformer_original.__module__]


def convert_bloom_attention(m: nn.Module, swap) -> Optional[str]:
    """Swap a BloomAttention for BloomAttentionMixin, or say why not."""
    module = sys.modules.get(type(m).__module__)
    get_slopes = getattr(module, "_get_alibi_slopes", None)
    if get_slopes is None or not hasattr(module, "dropout_add"):
        return "its module has no _get_alibi_slopes / dropout_add (another BLOOM version)"
    if getattr(m, "beta", 1.0) != 1.0 or not isinstance(getattr(m, "query_key_value", None), nn.Linear):
        return "not the BloomAttention form (beta != 1 or no fused query_key_value linear)"
    m._ff_slopes = get_slopes(m.num_heads, m.query_key_value.weight.device).float()
    swap(m, BloomAttentionMixin)
    return None


def convert_mpt_attention(m: nn.Module, swap) -> Optional[str]:
    """Swap an MptAttention for MptAttentionMixin (its block: convert_mpt_block), or say why not."""
    module = sys.modules.get(type(m).__module__)
    build = getattr(module, "build_mpt_alibi_tensor", None)
    if build is None or not isinstance(getattr(m, "Wqkv", None), nn.Linear):
        return "its module has no build_mpt_alibi_tensor, or no fused Wqkv linear (another MPT version)"
    # The bias of the last two keys is (-slope, 0) per head: the slopes, from the model's own code.
    # (MptModel builds the bias with the function's default alibi_bias_max, whatever its config says.)
    m._ff_slopes = -build(m.n_heads, 2, device=m.Wqkv.weight.device)[:, 0, 0].float()
    swap(m, MptAttentionMixin)
    return None


def convert_mpt_block(m: nn.Module, swap) -> Optional[str]:
    if not isinstance(getattr(m, "attn", None), nn.Module):
        return "no attn module"
    swap(m, MptBlockMixin)
    return None


__all__ = ["convert_bloom_attention", "convert_mpt_attention", "convert_mpt_block"]
