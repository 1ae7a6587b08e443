"""ff.convert for BERT's, ViT's, BART's and GPT-2's attention written out in a family's own code:
TAPAS, RemBERT, Megatron-BERT, VisualBERT, FLAVA, ViLT, LXMERT, RoFormer, BLIP (its text encoder /
decoder and its vision encoder), TrOCR's and LED's decoders, MVP, FSMT, Table Transformer, Bark's
three GPT-style models, OpenAI GPT, XLM and FlauBERT.

These families copy BERT's self-attention from before transformers' attention interface and
were never moved onto it, so ``attn_implementation`` does not reach them: each layer forms the
(B, H, Lq, Lk) scores with ``q k^T / sqrt(d)``, adds the model's additive mask (BERT's
(B, 1, 1, Lk) key padding, or the decoder's (B, 1, Lq, Lk) causal + padding mask the model
built), takes an eager softmax into another (B, H, Lq, Lk) tensor, drops it out and multiplies
by V. Converted, the same projections feed ``ff.attention(q, k, v, attn_mask=that mask,
dropout_p=the module's p in training, scale=1 / sqrt(d))``: no score tensor, and the backward on
the kernels. The decoders (TAPAS, RemBERT, Megatron-BERT with ``is_decoder``; BLIP's text
decoder, which captions with ``generate``) keep the original's cache handling as it is written:
the self-attention's keys appended to the cache, the cross-attention's computed from the encoder
states once and read back after.

BLIP's vision attention (``BlipAttention``) is ViT's: one fused qkv projection, no mask:
``ff.attention(q, k, v, dropout_p, scale=head_dim ** -0.5)``. TrOCR's (``TrOCRAttention``, the
text decoder of the OCR models, on a ViT / DeiT / BEiT encoder through VisionEncoderDecoderModel)
is BART's: q scaled, (B * H, Lq, Lk) bmm scores plus the decoder's causal mask or the encoder's
padding mask, the same cache handling as BLIP's; its layers are BART's post-norm form
(hf_seq2seq_forms.py). LED's decoder attention is the same code returning the cache third
(LED's encoder: hf_longformer.py); MVP's the same with its layers' prompt keys / values ahead of
the keys (always visible: zeros ahead in the mask). FSMT's (``Attention`` of fairseq's WMT
models) is the same on (L, B, E) activations, with the padding as a bool (B, Lk) key mask (True
= padding) and the decoder's causal mask as a float (L, L) one. RoFormer's is BERT's with its
interleaved rotary applied to the self-attention's queries and keys (and values with
``rotary_value``) on ``ff.apply_rotary`` before the cache, from the model's (L, D) table of
sines and cosines; LXMERT's is BERT's with the keys from a ``context`` (the other modality in
its cross-attention). Table Transformer's (``TableTransformerAttention``, DETR's before the
attention interface) adds position embeddings to the queries' and keys' inputs, not the
values'.

Bark's (``BarkSelfAttention``: the semantic and coarse models causal by a lower-triangular
(block, block) buffer sliced bottom-right against the cache, the fine model not) is GPT-2's:
``ff.attention(causal="bottom_right" or False, attn_mask=the padding mask)``; a causal call past
the buffer's length (where the original's slice fails) runs the original. OpenAI GPT's
(``Attention``) is causal by a buffer that sets the masked scores to -1e4 (causal masking: exp
underflows to 0), with the padding mask. XLM's and FlauBERT's (``MultiHeadAttention``) take a
1 / 0 mask over the keys, (B, Lk), or the causal (B, Lq, Lk) one of XLM's language model:
ff.attention's bool mask as it is; their cross-attention (XLM as a decoder of another encoder)
runs the original.

What each returns is the original's: RemBERT, Megatron-BERT, RoFormer, BLIP, TrOCR, MVP, FSMT, Table
Transformer and Bark (output, probabilities) on every call (the converted forward returns (output,
None): the layers read the probabilities only when they are asked for), LED's decoder the cache
third; TAPAS, VisualBERT, FLAVA, ViLT, LXMERT, XLM and FlauBERT (output,), with the cache after it
in a TAPAS decoder; OpenAI GPT [output]. The original forward runs when the probabilities are wanted
(``output_attentions``, or transformers' output recorder collecting them: BLIP) and for activations
in another dtype than the weights.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.attention import attention
from ..ops.rotary import apply_rotary
from .hf_own_attention import _in_dtype, _weights_wanted


def _batch_first_heads(x, head_dim):
    """(B, L, H * D) -> (B, H, L, D), a view."""
    return x.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)


def _time_first_heads(x, head_dim):
    """fairseq's (L, B, H * D) -> (B, H, L, D), a view."""
    return x.view(x.shape[0], x.shape[1], -1, head_dim).permute(1, 2, 0, 3)


def _cached_keys(module, hidden_states, encoder_hidden_states, cache, kwargs, key, value, head_dim,
                 heads=_batch_first_heads, rotate=None):
    """(k, v) as (B, H, Lk, D) from the projections key / value, through the cache as the
    original's forward handles it: the self-attention's keys appended, the cross-attention's
    computed from the encoder states once and read back after. `heads` splits a projection's
    output into heads; `rotate(k, v)` turns new self-attention keys / values before they are
    cached (RoFormer's rotary)."""
    cross = encoder_hidden_states is not None
    current = encoder_hidden_states if cross else hidden_states
    layer_cache, updated = cache, False
    if cache is not None and hasattr(cache, "self_attention_cache"):  # EncoderDecoderCache
        updated = bool(cache.is_updated.get(module.layer_idx))
        layer_cache = cache.cross_attention_cache if cross else cache.self_attention_cache
    if cross and cache is not None and updated:
        layer = layer_cache.layers[module.layer_idx]
        return layer.keys, layer.values
    k, v = heads(key(current), head_dim), heads(value(current), head_dim)
    if rotate is not None and not cross:
        k, v = rotate(k, v)
    if cache is not None:
        k, v = layer_cache.update(k, v, module.layer_idx, kwargs=kwargs)
        if cross and hasattr(cache, "self_attention_cache"):
            cache.is_updated[module.layer_idx] = True
    return k, v


def _context(module, hidden_states, attention_mask, encoder_hidden_states=None, cache=None, kwargs=None,
             rotary=None):
    """BERT's self-attention context (B, Lq, H * D) on ff.attention. `rotary`: (cos, sin, values
    too) for RoFormer's interleaved rotary of the self-attention's queries and keys (and values)."""
    d = module.attention_head_size
    q = _batch_first_heads(module.query(hidden_states), d)
    rotate = None
    if rotary is not None:
        cos, sin, values_too = rotary
        q = apply_rotary(q, cos, sin, interleaved=True)
        rotate = functools.partial(_rotate_keys, cos=cos, sin=sin, values_too=values_too)
    k, v = _cached_keys(module, hidden_states, encoder_hidden_states, cache, kwargs or {}, module.key, module.value, d,
                        rotate=rotate)
    p = module.dropout.p if module.training else 0.0
    context = attention(q, k, v, attn_mask=_in_dtype(attention_mask, q), dropout_p=p, scale=1.0 / math.sqrt(d))
    return context.transpose(1, 2).reshape(*hidden_states.shape[:-1], module.query.out_features)


def fused_qkv_context(qkv: nn.Linear, hidden_states, num_heads: int, dropout: nn.Dropout, scale: float):
    """ViT's (timm's) attention context (B, L, E) from one fused q / k / v projection, no mask."""
    batch, length, width = hidden_states.shape
    q, k, v = qkv(hidden_states).view(batch, length, 3, num_heads, -1).permute(2, 0, 3, 1, 4)
    p = dropout.p if dropout.training else 0.0
    context = attention(q, k, v, dropout_p=p, scale=scale)
    return context.transpose(1, 2).reshape(batch, length, width)


def _rotate_keys(k, v, *, cos, sin, values_too):
    return apply_rotary(k, cos, sin, interleaved=True), (apply_rotary(v, cos, sin, interleaved=True)
                                                         if values_too else v)


def _runs_original(module, hidden_states, kwargs, output_attentions=False) -> bool:
    return bool(output_attentions) or _weights_wanted(kwargs) or hidden_states.dtype != module.query.weight.dtype


class BertPairSelfAttentionMixin:
    """RemBERT's and Megatron-BERT's self-attention: (context, probabilities) on every call."""
    _ff_what = "ff.attention (the model's mask; no (B, H, Lq, Lk) scores)"

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None,
                output_attentions=False, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if _runs_original(self, hidden_states, kwargs, output_attentions):
            return super().forward(hidden_states, attention_mask, encoder_hidden_states, cache,
                                   output_attentions, **kwargs)
        return self._ff_result(_context(self, hidden_states, attention_mask, encoder_hidden_states, cache, kwargs),
                               cache)

    def _ff_result(self, context, cache):
        return context, None


class BertTupleSelfAttentionMixin(BertPairSelfAttentionMixin):
    """TAPAS's self-attention: (context,), then the cache in a decoder."""

    def _ff_result(self, context, cache):
        return (context, cache) if self.is_decoder else (context,)


class BertEncoderSelfAttentionMixin:
    """VisualBERT's, FLAVA's and ViLT's self-attention (no cross-attention, no cache): (context,)."""
    _ff_what = BertPairSelfAttentionMixin._ff_what

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        if _runs_original(self, hidden_states, {}, output_attentions):
            return super().forward(hidden_states, attention_mask, output_attentions)
        return (_context(self, hidden_states, attention_mask),)


class RoFormerSelfAttentionMixin:
    """RoFormer's self- and cross-attention: BERT's, with the self-attention's queries and keys (and
    values, with ``rotary_value``) turned by its interleaved rotary on ff.apply_rotary before the
    cache; (context, probabilities)."""
    _ff_what = "ff.attention + ff.apply_rotary (interleaved; the model's mask; no (B, H, Lq, Lk) scores)"

    def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None, encoder_hidden_states=None,
                cache=None, output_attentions=False, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if _runs_original(self, hidden_states, kwargs, output_attentions) \
                or (sinusoidal_pos is not None and (sinusoidal_pos.dim() != 4 or sinusoidal_pos.shape[:2] != (1, 1))):
            return super().forward(hidden_states, attention_mask, sinusoidal_pos, encoder_hidden_states, cache,
                                   output_attentions, **kwargs)
        rotary = None
        if sinusoidal_pos is not None and encoder_hidden_states is None:
            table = sinusoidal_pos[0, 0].float() if sinusoidal_pos.dtype != torch.float64 else sinusoidal_pos[0, 0]
            sin, cos = table.chunk(2, dim=-1)  # one (L, D / 2) row of angles per position, sines first
            rotary = (cos.contiguous(), sin.contiguous(), self.rotary_value)
        return _context(self, hidden_states, attention_mask, encoder_hidden_states, cache, kwargs, rotary), None


class LxmertAttentionMixin:
    """LXMERT's attention (``LxmertAttention``: the language and vision self-attentions and their
    cross-attention, keys from ``context``): (context,)."""
    _ff_what = BertPairSelfAttentionMixin._ff_what

    def forward(self, hidden_states, context, attention_mask=None, output_attentions=False):
        if output_attentions or hidden_states.dtype != self.query.weight.dtype:
            return super().forward(hidden_states, context, attention_mask, output_attentions)
        return (_context(self, hidden_states, attention_mask, context),)


class BlipTextSelfAttentionMixin:
    """BLIP's text self- and cross-attention: (context, probabilities) on every call."""
    _ff_what = BertPairSelfAttentionMixin._ff_what

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, cache=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if _runs_original(self, hidden_states, kwargs):
            return super().forward(hidden_states, attention_mask, encoder_hidden_states,
                                   encoder_attention_mask, cache, **kwargs)
        mask = encoder_attention_mask if encoder_hidden_states is not None else attention_mask
        return _context(self, hidden_states, mask, encoder_hidden_states, cache, kwargs), None


class BlipVisionAttentionMixin:
    _ff_what = "ff.attention (no (B, H, L, L) scores)"

    def forward(self, hidden_states, **kwargs):
        if _weights_wanted(kwargs) or hidden_states.dtype != self.qkv.weight.dtype:
            return super().forward(hidden_states, **kwargs)
        context = fused_qkv_context(self.qkv, hidden_states, self.num_heads, self.dropout, self.scale)
        return self.projection(context), None


class TrOCRAttentionMixin:
    """TrOCR's decoder self- and cross-attention (BART's written out): (output, probabilities)."""
    _ff_what = "ff.attention (the model's mask; no (B * H, Lq, Lk) scores)"
    _ff_returns_cache = False

    def forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None,
                output_attentions=False, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if self._ff_runs_original(hidden_states, output_attentions, kwargs):
            return super().forward(hidden_states, key_value_states, cache, attention_mask, output_attentions, **kwargs)
        return self._ff_attend(hidden_states, key_value_states, cache, attention_mask, kwargs)

    def _ff_runs_original(self, hidden_states, output_attentions, kwargs) -> bool:
        return output_attentions or _weights_wanted(kwargs) or hidden_states.dtype != self.q_proj.weight.dtype

    def _ff_attend(self, hidden_states, key_value_states, cache, attention_mask, kwargs, prompt=None):
        batch, length, width = hidden_states.shape
        q = _batch_first_heads(self.q_proj(hidden_states), self.head_dim)
        k, v = _cached_keys(self, hidden_states, key_value_states, cache, kwargs, self.k_proj, self.v_proj,
                            self.head_dim)
        if prompt is not None:  # MVP's prompt keys / values ahead of the others, always visible
            k = torch.cat([prompt[0].expand(batch, -1, -1, -1), k], dim=2)
            v = torch.cat([prompt[1].expand(batch, -1, -1, -1), v], dim=2)
            if attention_mask is not None:
                attention_mask = F.pad(attention_mask, (prompt[0].shape[-2], 0))
        p = self.dropout if self.training else 0.0
        context = attention(q, k, v, attn_mask=_in_dtype(attention_mask, q), dropout_p=p, scale=self.scaling)
        out = self.out_proj(context.transpose(1, 2).reshape(batch, length, width))
        return (out, None, cache) if self._ff_returns_cache else (out, None)


class LEDDecoderAttentionMixin(TrOCRAttentionMixin):
    """LED's decoder attention: TrOCR's code, returning (output, probabilities, cache)."""
    _ff_returns_cache = True


class MvpAttentionMixin(TrOCRAttentionMixin):
    """MVP's attention: TrOCR's code with the layer's prompt keys / values (``attn_prompt``, with
    ``use_prompt``) prepended to the keys, and zeros to the model's additive mask."""

    def forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, attn_prompt=None,
                output_attentions=False, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if self._ff_runs_original(hidden_states, output_attentions, kwargs) \
                or (attn_prompt is not None and attention_mask is not None and not attention_mask.is_floating_point()):
            return super(TrOCRAttentionMixin, self).forward(hidden_states, key_value_states, cache, attention_mask,
                                                            attn_prompt, output_attentions, **kwargs)
        return self._ff_attend(hidden_states, key_value_states, cache, attention_mask, kwargs, attn_prompt)


class FSMTAttentionMixin:
    """FSMT's attention (fairseq's, (L, B, E) activations): the padding as a bool (B, Lk) key mask
    (True = padding), the decoder's causal mask as a float (L, L) one (finfo.min above the
    diagonal); (output, probabilities). A row whose every key is padding gets zeros here where the
    original averages the padding's values."""
    _ff_what = "ff.attention (its key padding and causal masks; no (B * H, Lq, Lk) scores)"

    def forward(self, query, key, key_padding_mask=None, layer_state=None, attn_mask=None, output_attentions=False,
                **kwargs):
        if output_attentions or _weights_wanted(kwargs) or query.dtype != self.q_proj.weight.dtype:
            return super().forward(query, key, key_padding_mask, layer_state, attn_mask, output_attentions, **kwargs)
        length, batch, width = query.shape
        q = _time_first_heads(self.q_proj(query), self.head_dim)
        k, v = _cached_keys(self, query, key if self.encoder_decoder_attention else None, layer_state, kwargs,
                            self.k_proj, self.v_proj, self.head_dim, heads=_time_first_heads)
        if key_padding_mask is not None and key_padding_mask.dim() == 0:  # the original's "no mask"
            key_padding_mask = None
        p = self.dropout if self.training else 0.0
        context = attention(q, k, v, key_padding_mask=key_padding_mask, attn_mask=_in_dtype(attn_mask, q),
                            dropout_p=p, scale=self.scaling)
        return self.out_proj(context.permute(2, 0, 1, 3).reshape(length, batch, width)), None


def convert_trocr_attention(m: nn.Module, swap, mixin: type = TrOCRAttentionMixin) -> Optional[str]:
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "out_proj")) \
            or not isinstance(getattr(m, "scaling", None), float) or not isinstance(getattr(m, "dropout", None), float):
        return "not BART's attention form written out (q / k / v / out projections, a float scaling and dropout)"
    swap(m, mixin)
    return None


class DetrAttentionMixin:
    """Table Transformer's attention (DETR's before transformers' attention interface): position
    embeddings added to the queries' and keys' inputs (``object_queries``, and
    ``spatial_position_embeddings`` for the cross-attention's keys), the values from the inputs
    without them; the model's additive (B, 1, Lq, Lk) mask; (output, probabilities)."""
    _ff_what = TrOCRAttentionMixin._ff_what

    def forward(self, hidden_states, attention_mask=None, object_queries=None, key_value_states=None,
                spatial_position_embeddings=None, output_attentions=False):
        cross = key_value_states is not None
        if output_attentions or hidden_states.dtype != self.q_proj.weight.dtype \
                or (attention_mask is not None and attention_mask.dtype == torch.bool) \
                or (spatial_position_embeddings if cross else object_queries) is None:
            # (the original reads the inputs it saved before adding those embeddings: without
            # them it raises, and so does this)
            return super().forward(hidden_states, attention_mask, object_queries, key_value_states,
                                   spatial_position_embeddings, output_attentions)
        batch, length, width = hidden_states.shape
        queries = hidden_states + object_queries if object_queries is not None else hidden_states
        keys = key_value_states + spatial_position_embeddings if cross else queries
        values = key_value_states if cross else hidden_states
        q, k, v = (_batch_first_heads(proj(x), self.head_dim)
                   for proj, x in ((self.q_proj, queries), (self.k_proj, keys), (self.v_proj, values)))
        p = self.dropout if self.training else 0.0
        context = attention(q, k, v, attn_mask=_in_dtype(attention_mask, q), dropout_p=p, scale=self.scaling)
        return self.out_proj(context.transpose(1, 2).reshape(batch, length, width)), None


class BarkSelfAttentionMixin:
    """Bark's attention (GPT-2's written out): one fused q / k / v projection; its causal models
    (semantic, coarse) mask by a lower-triangular buffer, bottom-right aligned to the cache."""
    _ff_what = "ff.attention (causal layers bottom-right; the model's padding mask; no (B, H, Lq, Lk) scores)"

    def forward(self, hidden_states, attention_mask=None, cache=None, use_cache=False,
                output_attentions=False, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if (output_attentions or _weights_wanted(kwargs) or hidden_states.dtype != self.att_proj.weight.dtype
                or (self.is_causal and cache is not None
                    and cache.get_seq_length(self.layer_idx) + hidden_states.shape[1] > self.bias.shape[-1])):
            return super().forward(hidden_states, attention_mask, cache, use_cache, output_attentions, **kwargs)
        q, k, v = (self._split_heads(t, self.num_heads, self.head_dim)
                   for t in self.att_proj(hidden_states).split(self.embed_dim, dim=2))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        p = self.attn_dropout.p if self.training else 0.0
        context = attention(q, k, v, causal="bottom_right" if self.is_causal else False,
                            attn_mask=_in_dtype(attention_mask, q), dropout_p=p, scale=1.0 / math.sqrt(self.head_dim))
        out = self.out_proj(self._merge_heads(context, self.num_heads, self.head_dim))
        return self.resid_dropout(out), None


def convert_bark_attention(m: nn.Module, swap) -> Optional[str]:
    if not isinstance(getattr(m, "att_proj", None), nn.Linear) \
            or not isinstance(getattr(m, "attn_dropout", None), nn.Dropout):
        return "not Bark's attention form (a fused att_proj linear, nn.Dropout attn_dropout)"
    if m.is_causal:
        n = m.bias.shape[-1]
        if not torch.equal(m.bias.reshape(n, n).cpu(), torch.tril(torch.ones(n, n, dtype=torch.bool))):
            return "its causal buffer is not lower-triangular"
    swap(m, BarkSelfAttentionMixin)
    return None


class OpenAIGPTAttentionMixin:
    """OpenAI GPT's attention (``Attention`` in its module): its causal buffer sets the masked
    scores to -1e4 (exp underflows to 0 past any row's visible score: causal masking), the
    model's additive padding mask, the 1 / sqrt(d) scale only with ``scale``; [output] returned."""
    _ff_what = "ff.attention (causal, the model's padding mask; no (B, H, L, L) scores)"

    def forward(self, x, attention_mask=None, output_attentions=False):
        if output_attentions or x.dtype != self.c_attn.weight.dtype or x.shape[1] > self.bias.shape[-1]:
            return super().forward(x, attention_mask, output_attentions)
        batch, length, width = x.shape
        q, k, v = (t.view(batch, length, self.n_head, -1).transpose(1, 2)
                   for t in self.c_attn(x).split(self.split_size, 2))
        p = self.attn_dropout.p if self.training else 0.0
        scale = 1.0 / math.sqrt(q.shape[-1]) if self.scale else 1.0
        context = attention(q, k, v, causal=True, attn_mask=_in_dtype(attention_mask, q), dropout_p=p, scale=scale)
        return [self.resid_dropout(self.c_proj(context.transpose(1, 2).reshape(batch, length, width)))]


def convert_openai_gpt_attention(m: nn.Module, swap) -> Optional[str]:
    if not type(m).__module__.startswith("transformers.models.openai."):
        return "not OpenAI GPT's Attention"
    bias = getattr(m, "bias", None)
    if not isinstance(bias, torch.Tensor) or not isinstance(getattr(m, "attn_dropout", None), nn.Dropout):
        return "not OpenAI GPT's attention form (a causal buffer, nn.Dropout attn_dropout)"
    n = bias.shape[-1]
    if not torch.equal(bias.reshape(n, n).cpu(), torch.tril(torch.ones(n, n, dtype=bias.dtype))):
        return "its causal buffer is not lower-triangular"
    swap(m, OpenAIGPTAttentionMixin)
    return None


class XLMAttentionMixin:
    """XLM's and FlauBERT's self-attention (``MultiHeadAttention``): their mask is 1 / 0 over the
    keys, (B, Lk), or (B, Lq, Lk) causal for a language model, and becomes ff.attention's bool
    mask as it is; (output,) returned."""
    _ff_what = "ff.attention (the model's 0 / 1 mask as a bool mask; no (B, H, Lq, Lk) scores)"

    def forward(self, input, mask, kv=None, cache=None, output_attentions=False, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if output_attentions or kv is not None or input.dtype != self.q_lin.weight.dtype:
            return super().forward(input, mask, kv, cache, output_attentions, **kwargs)
        batch, length, width = input.shape

        def heads(x):
            return x.view(batch, -1, self.n_heads, self.head_dim).transpose(1, 2)
        q, k, v = heads(self.q_lin(input)), heads(self.k_lin(input)), heads(self.v_lin(input))
        if cache is not None:
            k, v = getattr(cache, "self_attention_cache", cache).update(k, v, self.layer_id, kwargs=kwargs)
        visible = (mask != 0).view((batch, 1, length, -1) if mask.dim() == 3 else (batch, 1, 1, -1))
        p = self.dropout if self.training else 0.0
        context = attention(q, k, v, attn_mask=visible, dropout_p=p, scale=1.0 / math.sqrt(self.head_dim))
        return (self.out_lin(context.transpose(1, 2).reshape(batch, length, width)),)


def convert_xlm_attention(m: nn.Module, swap) -> Optional[str]:
    if not type(m).__module__.startswith(("transformers.models.xlm.", "transformers.models.flaubert.")):
        return "not XLM's or FlauBERT's MultiHeadAttention"
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_lin", "k_lin", "v_lin", "out_lin")) \
            or not isinstance(getattr(m, "dropout", None), float):
        return "not XLM's attention form (q / k / v / out linears, a float dropout)"
    swap(m, XLMAttentionMixin)
    return None


_BERT_FIELDS = ("query", "key", "value", "dropout", "attention_head_size")


def _bert_form(m: nn.Module, *fields: str) -> Optional[str]:
    missing = [f for f in _BERT_FIELDS + fields if not hasattr(m, f)]
    if missing:
        return f"not BERT's written-out self-attention (no {', '.join(missing)})"
    if not all(isinstance(getattr(m, f), nn.Linear) for f in _BERT_FIELDS[:3]) or not isinstance(m.dropout, nn.Dropout):
        return "its query / key / value are not nn.Linear, or its dropout not nn.Dropout"
    width = getattr(m, "all_head_size", getattr(m, "head_size", None))  # LXMERT's: head_size
    if m.query.out_features != width or width % m.attention_head_size:
        return "its projections' widths are not heads x head size"
    return None


def _converter(mixin: type, *fields: str):
    def convert(m: nn.Module, swap) -> Optional[str]:
        why = _bert_form(m, *fields)
        if why is None:
            swap(m, mixin)
        return why
    return convert


def convert_blip_vision_attention(m: nn.Module, swap) -> Optional[str]:
    if not isinstance(getattr(m, "qkv", None), nn.Linear) or not isinstance(getattr(m, "dropout", None), nn.Dropout) \
            or not isinstance(getattr(m, "scale", None), float):
        return "not BLIP's vision attention form (a fused qkv linear, a float scale, nn.Dropout)"
    swap(m, BlipVisionAttentionMixin)
    return None


_FSMT = "transformers.models.fsmt."


def convert_fsmt_attention(m: nn.Module, swap) -> Optional[str]:
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "out_proj")) \
            or not isinstance(getattr(m, "scaling", None), float) or not isinstance(getattr(m, "dropout", None), float) \
            or not isinstance(getattr(m, "encoder_decoder_attention", None), bool):
        return "not FSMT's attention form (q / k / v / out projections, a float scaling and dropout)"
    swap(m, FSMTAttentionMixin)
    return None


# class name -> converter(module, swap) -> why not, or None (registered in hf_own_attention.OWN_ATTENTION)
WRITTEN_OUT_ATTENTION = {
    "RemBertSelfAttention": _converter(BertPairSelfAttentionMixin, "layer_idx"),
    "MegatronBertSelfAttention": _converter(BertPairSelfAttentionMixin, "layer_idx"),
    "TapasSelfAttention": _converter(BertTupleSelfAttentionMixin, "layer_idx", "is_decoder"),
    "VisualBertSelfAttention": _converter(BertEncoderSelfAttentionMixin),
    "FlavaSelfAttention": _converter(BertEncoderSelfAttentionMixin),
    "ViltSelfAttention": _converter(BertEncoderSelfAttentionMixin),
    "BlipTextSelfAttention": _converter(BlipTextSelfAttentionMixin, "layer_idx"),
    "BlipAttention": convert_blip_vision_attention,
    "TrOCRAttention": convert_trocr_attention,
    "LEDDecoderAttention": lambda m, swap: convert_trocr_attention(m, swap, LEDDecoderAttentionMixin),
    "BarkSelfAttention": convert_bark_attention,
    "MultiHeadAttention": convert_xlm_attention,  # XLM's and FlauBERT's (CTRL's is another form)
    "RoFormerSelfAttention": _converter(RoFormerSelfAttentionMixin, "layer_idx", "rotary_value"),
    "LxmertAttention": _converter(LxmertAttentionMixin),
    "MvpAttention": lambda m, swap: convert_trocr_attention(m, swap, MvpAttentionMixin),
    "TableTransformerAttention": lambda m, swap: convert_trocr_attention(m, swap, DetrAttentionMixin),
    "Attention": lambda m, swap: (convert_fsmt_attention(m, swap) if type(m).__module__.startswith(_FSMT)
                                  else convert_openai_gpt_attention(m, swap)),  # FSMT's or OpenAI GPT's
}

__all__ = ["WRITTEN_OUT_ATTENTION"]
