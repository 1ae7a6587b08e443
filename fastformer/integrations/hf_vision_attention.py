"""ff.convert for BERT's self-attention written out in vision backbones' own code: MobileViT's
(over each patch position's tokens), the sequence-reduction attention of PVT, PVT v2 and GLPN
(SegFormer's "efficient" attention: the keys and values from a feature map shrunk by a strided
convolution + LayerNorm, or by PVT v2's pooling + 1 x 1 convolution + LayerNorm + GELU in its
linear-attention variant), CvT's (q / k / v from depthwise-convolution projections, the keys
and values strided, a class token in its last stage) and TimeSformer's (a fused q / k / v, over
the frames or the patches of a video).

Each forms the (B, H, Lq, Lk) scores ``q k^T / sqrt(d)``, takes an eager softmax into another
(B, H, Lq, Lk) tensor, drops it out and multiplies by V; no mask. Converted, the same
projections (the reduction as the original computes it) feed ``ff.attention(q, k, v,
dropout_p=the module's p in training, scale=1 / sqrt(d))``: no score tensor, and the backward on
the kernels. Each returns what the original does (MobileViT and CvT the context; PVT, GLPN and
TimeSformer (context,); PVT v2 (its output projection's result,)); ``output_attentions`` and
activations in another dtype than the weights run the original.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..ops.attention import attention
from .hf_written_out import _batch_first_heads, fused_qkv_context


def _attend(module, hidden_states, kv_states, dropout: nn.Dropout):
    """(B, Lq, H * D) context of BERT's attention on ff.attention, keys / values from kv_states."""
    d = module.attention_head_size
    q = _batch_first_heads(module.query(hidden_states), d)
    k, v = _batch_first_heads(module.key(kv_states), d), _batch_first_heads(module.value(kv_states), d)
    p = dropout.p if module.training else 0.0
    context = attention(q, k, v, dropout_p=p, scale=1.0 / math.sqrt(d))
    return context.transpose(1, 2).reshape(*hidden_states.shape[:-1], module.all_head_size)


def _reduced(hidden_states, height, width, conv, norm, pool=None, act=None):
    """The sequence reduction: (B, L, C) as a (B, C, height, width) map through [pool], conv,
    back to (B, L', C), norm, [act]."""
    batch, _, channels = hidden_states.shape
    x = hidden_states.permute(0, 2, 1).reshape(batch, channels, height, width)
    x = conv(pool(x) if pool is not None else x).reshape(batch, channels, -1).permute(0, 2, 1)
    x = norm(x)
    return act(x) if act is not None else x


class MobileViTSelfAttentionMixin:
    _ff_what = "ff.attention (no (B, H, L, L) scores)"

    def forward(self, hidden_states):
        if hidden_states.dtype != self.query.weight.dtype:
            return super().forward(hidden_states)
        return _attend(self, hidden_states, hidden_states, self.dropout)


class CvtSelfAttentionMixin:
    """CvT's attention: q / k / v from depthwise-convolution projections of the feature map (keys
    and values strided), the class token ahead of each in the last stage; the context returned."""
    _ff_what = "ff.attention (no (B, H, Lq, Lk) scores)"

    def forward(self, hidden_state, height, width):
        if hidden_state.dtype != self.projection_query.weight.dtype:
            return super().forward(hidden_state, height, width)
        if self.with_cls_token:
            cls_token, hidden_state = torch.split(hidden_state, [1, height * width], 1)
        batch, _, channels = hidden_state.shape
        feature_map = hidden_state.permute(0, 2, 1).view(batch, channels, height, width)
        heads = []
        for conv, proj in ((self.convolution_projection_query, self.projection_query),
                           (self.convolution_projection_key, self.projection_key),
                           (self.convolution_projection_value, self.projection_value)):
            x = conv(feature_map)
            if self.with_cls_token:
                x = torch.cat((cls_token, x), dim=1)
            heads.append(_batch_first_heads(proj(x), self.embed_dim // self.num_heads))
        p = self.dropout.p if self.training else 0.0
        context = attention(*heads, dropout_p=p, scale=self.scale)
        return context.transpose(1, 2).reshape(batch, -1, self.embed_dim)


class TimesformerSelfAttentionMixin:
    """TimeSformer's attention (timm's ViT form: one fused q / k / v projection), over the frames'
    or the patches' axis as the layer lays them out; (context,)."""
    _ff_what = "ff.attention (no (B, H, L, L) scores)"

    def forward(self, hidden_states, output_attentions=False):
        if output_attentions or hidden_states.dtype != self.qkv.weight.dtype:
            return super().forward(hidden_states, output_attentions)
        return (fused_qkv_context(self.qkv, hidden_states, self.num_heads, self.attn_drop, self.scale),)


class ReducedSelfAttentionMixin:
    """PVT's, PVT v2's and GLPN's sequence-reduction self-attention."""
    _ff_what = "ff.attention (keys / values from the reduced map; no (B, H, Lq, Lk) scores)"

    def forward(self, hidden_states, height, width, output_attentions=False):
        if output_attentions or hidden_states.dtype != self.query.weight.dtype:
            return super().forward(hidden_states, height, width, output_attentions)
        kv_states = self._ff_reduce(hidden_states, height, width)
        if hasattr(self, "proj"):  # PVT v2: the output projection inside the attention module
            return (self.proj_drop(self.proj(_attend(self, hidden_states, kv_states, self.attn_drop))),)
        return (_attend(self, hidden_states, kv_states, self.dropout),)

    def _ff_reduce(self, hidden_states, height, width):
        ratio, conv = self._ff_reduction  # the family's attribute names, set by its converter
        if getattr(self, "linear_attention", False):  # PVT v2's linear variant: pooled to 7 x 7
            return _reduced(hidden_states, height, width, getattr(self, conv), self.layer_norm, self.pool, self.act)
        if getattr(self, ratio) <= 1:
            return hidden_states
        return _reduced(hidden_states, height, width, getattr(self, conv), self.layer_norm)


_BERT_PARTS = ("query", "key", "value")


def _converter(mixin: type, dropout: str, *fields: str, reduction: Optional[tuple] = None):
    """`reduction`: the (ratio, convolution) attribute names of a sequence-reduction form."""
    def convert(m: nn.Module, swap) -> Optional[str]:
        if not all(isinstance(getattr(m, n, None), nn.Linear) for n in _BERT_PARTS) \
                or not isinstance(getattr(m, dropout, None), nn.Dropout) \
                or not all(hasattr(m, f) for f in ("attention_head_size", "all_head_size") + fields):
            return "not BERT's written-out self-attention form (query / key / value linears, its dropout)"
        if reduction is not None:
            m._ff_reduction = reduction
        swap(m, mixin)
        return None
    return convert


def convert_cvt_attention(m: nn.Module, swap) -> Optional[str]:
    names = [f"{kind}_{part}" for kind in ("convolution_projection", "projection")
             for part in ("query", "key", "value")]
    if not all(hasattr(m, n) for n in names + ["with_cls_token", "scale", "embed_dim", "num_heads"]) \
            or not all(isinstance(getattr(m, f"projection_{p}"), nn.Linear) for p in ("query", "key", "value")) \
            or not isinstance(getattr(m, "dropout", None), nn.Dropout):
        return "not CvT's self-attention form (convolution projections, q / k / v linears, its dropout)"
    swap(m, CvtSelfAttentionMixin)
    return None


def convert_timesformer_attention(m: nn.Module, swap) -> Optional[str]:
    if not isinstance(getattr(m, "qkv", None), nn.Linear) or not isinstance(getattr(m, "attn_drop", None), nn.Dropout) \
            or not isinstance(getattr(m, "scale", None), float) or not isinstance(getattr(m, "num_heads", None), int):
        return "not TimeSformer's attention form (a fused qkv linear, a float scale, nn.Dropout attn_drop)"
    swap(m, TimesformerSelfAttentionMixin)
    return None


# class name -> converter(module, swap) -> why not, or None (merged into hf_convert's table)
VISION_ATTENTION = {
    "MobileViTSelfAttention": _converter(MobileViTSelfAttentionMixin, "dropout"),
    "PvtEfficientSelfAttention": _converter(ReducedSelfAttentionMixin, "dropout", "sequences_reduction_ratio",
                                            reduction=("sequences_reduction_ratio", "sequence_reduction")),
    "PvtV2SelfAttention": _converter(ReducedSelfAttentionMixin, "attn_drop", "spatial_reduction_ratio", "proj",
                                     "linear_attention", reduction=("spatial_reduction_ratio", "spatial_reduction")),
    "GLPNEfficientSelfAttention": _converter(ReducedSelfAttentionMixin, "dropout", "sr_ratio",
                                             reduction=("sr_ratio", "sr")),
    "CvtSelfAttention": convert_cvt_attention,
    "TimesformerSelfAttention": convert_timesformer_attention,
}

__all__ = ["VISION_ATTENTION"]
