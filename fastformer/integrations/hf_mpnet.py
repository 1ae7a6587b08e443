"""ff.convert for MPNet (transformers' ``MPNetAttention``, ``MPNetEncoder``): its attention in its
own code, its relative-position bias inside the attention kernels.

MPNet (all-mpnet-base-v2 and the sentence-transformers models built on it) has no attention
interface: ``MPNetSelfAttention`` forms the (B, H, L, L) scores with ``q k^T / sqrt(d)``, adds the
relative-position bias and the model's additive (B, 1, 1, L) padding mask, takes an eager softmax,
dropout, and multiplies by V; ``MPNetAttention`` then adds the residual and normalizes
(``LayerNorm(dropout(o) + x)``). The bias is built once per forward by ``MPNetEncoder.
compute_position_bias``: T5's bidirectional buckets of ``j - i`` (32 buckets, max distance 128,
``relative_position_bucket``: the same function as ``T5Attention._relative_position_bucket``)
looked up in an ``nn.Embedding(buckets, H)``, then expanded to a contiguous (B, H, L, L) tensor
(fp32 at 8 x 512 tokens and 12 heads: 100 MB, read by every layer).

Converted, ``compute_position_bias`` returns an ``ff.RelativePositionBias`` over the table's first
32 rows (the buckets the original indexes) and each layer's attention calls ``ff.attention(q, k,
v, attn_mask=the model's mask, position_bias=it)``: the kernels read the bias of (i, j) from an
(H, 2L - 1) gather of the table and return its gradient, which autograd sums into the table; no
(B, H, L, L) tensor is formed. The residual adds + LayerNorms run on ``ff.add_layer_norm`` and
the layer's intermediate -> output MLP on ``ff.ffn`` (``MPNetLayer`` calls no feed-forward chunk,
so BERT's layer conversion does not reach it).
``output_attentions`` and activations in another dtype than the weights run the original
attention, given the bias built from the same table (the same values: a gather of the table by
bucket); an encoder whose layers are not all converted builds the original bias.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops.attention import RelativePositionBias, attention
from ..ops.ffn import ffn
from .hf_mlp_forms import activation_name, same_dtype
from .hf_residual import layer_norm_added

_BUCKETS, _MAX_DISTANCE = 32, 128  # compute_position_bias's defaults (the config's are not read)


def _full_bias(bias: RelativePositionBias, batch: int, length: int) -> torch.Tensor:
    """The (B, H, L, L) tensor the original compute_position_bias returns, from the same table."""
    rel = bias.rel_bias(length, length)                                        # (H, 2L - 1)
    i = torch.arange(length, device=rel.device)
    at = i[None, :] - i[:, None] + length - 1                                  # [i, j] -> j - i + L - 1
    return rel[:, at].unsqueeze(0).expand(batch, -1, -1, -1).contiguous()


class MPNetEncoderMixin:
    _ff_what = "ff.RelativePositionBias (the bias inside the attention kernels; no (B, H, L, L) tensor)"
    _ff_reads = ("relative_attention_bias",)  # read, not called (hf_parts.py); the layers are checked below

    def compute_position_bias(self, x, position_ids=None, num_buckets=_BUCKETS):
        if (position_ids is not None or num_buckets != _BUCKETS
                or not all(isinstance(layer.attention, MPNetAttentionMixin) for layer in self.layer)):
            return super().compute_position_bias(x, position_ids, num_buckets)
        return RelativePositionBias(self.relative_attention_bias.weight[:_BUCKETS], bidirectional=True,
                                    max_distance=_MAX_DISTANCE)


class MPNetAttentionMixin:
    _ff_what = "ff.attention (the relative-position bias in the kernels) + ff.add_layer_norm"

    def forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
        a = self.attn
        batch, length, _ = hidden_states.shape
        if (output_attentions or hidden_states.dtype != a.q.weight.dtype
                or not (position_bias is None or isinstance(position_bias, RelativePositionBias))):
            if isinstance(position_bias, RelativePositionBias):
                position_bias = _full_bias(position_bias, batch, length)
            return super().forward(hidden_states, attention_mask, position_bias, output_attentions, **kwargs)
        q, k, v = (proj(hidden_states).unflatten(-1, (a.num_attention_heads, a.attention_head_size)).transpose(1, 2)
                   for proj in (a.q, a.k, a.v))                                # (B, H, L, D) views
        p = a.dropout.p if self.training else 0.0
        context = attention(q, k, v, attn_mask=attention_mask, position_bias=position_bias, dropout_p=p)
        o = a.o(context.transpose(1, 2).reshape(batch, length, a.all_head_size))
        return (layer_norm_added(self.LayerNorm, self.dropout(o), hidden_states),)


class MPNetLayerMixin:
    _ff_what = "ff.ffn + ff.add_layer_norm (intermediate -> output)"
    _ff_reads = ("intermediate", "intermediate.dense", "intermediate.intermediate_act_fn", "output", "output.dense",
                 "output.LayerNorm")  # read, not called (hf_parts.py)

    def forward(self, hidden_states, attention_mask=None, position_bias=None, output_attentions=False, **kwargs):
        outputs = self.attention(hidden_states, attention_mask, position_bias=position_bias,
                                 output_attentions=output_attentions)
        x, inner, out = outputs[0], self.intermediate.dense, self.output
        if not same_dtype(x, inner.weight, out.dense.weight):
            return (out(self.intermediate(x), x),) + outputs[1:]
        y = ffn(x, inner.weight, inner.bias, out.dense.weight, out.dense.bias, self._ff_act)
        return (layer_norm_added(out.LayerNorm, out.dropout(y), x),) + outputs[1:]


def convert_mpnet_attention(m: nn.Module, swap) -> Optional[str]:
    """Swap an MPNetAttention for MPNetAttentionMixin, or say why not."""
    a = getattr(m, "attn", None)
    if not all(isinstance(getattr(a, n, None), nn.Linear) for n in ("q", "k", "v", "o")) \
            or not isinstance(getattr(m, "LayerNorm", None), nn.LayerNorm):
        return "not the MPNetAttention form (attn.q / k / v / o linears, a LayerNorm)"
    swap(m, MPNetAttentionMixin)
    return None


def convert_mpnet_encoder(m: nn.Module, swap) -> Optional[str]:
    """Swap an MPNetEncoder for MPNetEncoderMixin (its bias as an ff.RelativePositionBias)."""
    table = getattr(getattr(m, "relative_attention_bias", None), "weight", None)
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.shape[0] < _BUCKETS:
        return f"no relative_attention_bias table of at least {_BUCKETS} buckets"
    swap(m, MPNetEncoderMixin)
    return None


def convert_mpnet_layer(m: nn.Module, swap) -> Optional[str]:
    """Swap an MPNetLayer for MPNetLayerMixin, or say why not."""
    inter, out = getattr(m, "intermediate", None), getattr(m, "output", None)
    if not all(isinstance(getattr(o, "dense", None), nn.Linear) for o in (inter, out)) \
            or not isinstance(getattr(out, "LayerNorm", None), nn.LayerNorm):
        return "not the MPNetLayer form (intermediate.dense, output.dense, output.LayerNorm)"
    act = activation_name(getattr(inter, "intermediate_act_fn", None))
    if act is None:
        return f"activation {type(inter.intermediate_act_fn).__name__} has no fused kernel"
    m._ff_act = act
    swap(m, MPNetLayerMixin)
    return None


__all__ = ["convert_mpnet_attention", "convert_mpnet_encoder", "convert_mpnet_layer"]
