"""ff.convert for BERT's, ViT's, BART's and GPT-2's attention written out in a family's own code:
TAPAS, RemBERT, Megatron-BERT, VisualBERT, FLAVA, ViLT, BLIP (its text encoder / decoder and its
vision encoder), TrOCR's and LED's decoders, Bark's three GPT-style models, OpenAI GPT, XLM and
FlauBERT.

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
(LED's encoder: hf_longformer.py).

Bark's (``BarkSelfAttention``: the semantic and coarse models causal by a lower-triangular
(block, block) buffer sliced bottom-right against the cache, the fine model not) is GPT-2's:
``ff.attention(causal="bottom_right" or False, attn_mask=the padding mask)``; a causal call past
the buffer's length (where the original's slice fails) runs the original. OpenAI GPT's
(``Attention``) is causal by a buffer that sets the masked scores to -1e4 (causal masking: exp
underflows to 0), with the padding mask. XLM's and FlauBERT's (``MultiHeadAttention``) take a
1 / 0 mask over the keys, (B, Lk), or the causal (B, Lq, Lk) one of XLM's language model:
ff.attention's bool mask as it is; their cross-attention (XLM as a decoder of another encoder)
runs the original.

What each returns is the original's: RemBERT, Megatron-BERT, BLIP, TrOCR and Bark (output,
probabilities) on every call (the converted forward returns (output, None): the layers read the
probabilities only when they are asked for), LED's decoder the cache third; TAPAS, VisualBERT,
FLAVA, ViLT, XLM and FlauBERT (output,), with the cache after it in a TAPAS decoder; OpenAI GPT
[output]. The
original forward runs when the probabilities are wanted (``output_attentions``, or transformers'
output recorder collecting them: BLIP) and for activations in another dtype than the weights.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..ops.attention import attention
from .hf_own_attention import _weights_wanted


def _cached_keys(module, hidden_states, encoder_hidden_states, cache, kwargs, key, value, head_dim):
    """(k, v) as (B, H, Lk, D) from the projections key / value, through the cache as the
    original's forward handles it: the self-attention's keys appended, the cross-attention's
    computed from the encoder states once and read back after."""
    cross = encoder_hidden_states is not None
    current = encoder_hidden_states if cross else hidden_states
    layer_cache, updated = cache, False
    if cache is not None and hasattr(cache, "self_attention_cache"):  # EncoderDecoderCache
        updated = bool(cache.is_updated.get(module.layer_idx))
        layer_cache = cache.cross_attention_cache if cross else cache.self_attention_cache
    if cross and cache is not None and updated:
        layer = layer_cache.layers[module.layer_idx]
        return layer.keys, layer.values
    shape = (*current.shape[:-1], -1, head_dim)
    k, v = key(current).view(shape).transpose(1, 2), value(current).view(shape).transpose(1, 2)
    if cache is not None:
        k, v = layer_cache.update(k, v, module.layer_idx, kwargs=kwargs)
        if cross and hasattr(cache, "self_attention_cache"):
            cache.is_updated[module.layer_idx] = True
    return k, v


def _context(module, hidden_states, attention_mask, encoder_hidden_states=None, cache=None, kwargs=None):
    """BERT's self-attention context (B, Lq, H * D) on ff.attention."""
    d = module.attention_head_size
    q = module.query(hidden_states).view(*hidden_states.shape[:-1], -1, d).transpose(1, 2)
    k, v = _cached_keys(module, hidden_states, encoder_hidden_states, cache, kwargs or {}, module.key, module.value, d)
    p = module.dropout.p if module.training else 0.0
    context = attention(q, k, v, attn_mask=_in_dtype(attention_mask, q), dropout_p=p, scale=1.0 / math.sqrt(d))
    return context.transpose(1, 2).reshape(*hidden_states.shape[:-1], module.all_head_size)


def _in_dtype(mask, q):
    """The model's additive mask in the activations' dtype (a mixed-dtype mask is refused)."""
    return mask.to(q.dtype) if mask is not None and mask.dtype not in (torch.bool, q.dtype) else mask


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
        batch, length, width = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(batch, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        p = self.dropout.p if self.training else 0.0
        context = attention(q, k, v, dropout_p=p, scale=self.scale)
        return self.projection(context.transpose(1, 2).reshape(batch, length, width)), None


class TrOCRAttentionMixin:
    """TrOCR's decoder self- and cross-attention (BART's written out): (output, probabilities)."""
    _ff_what = "ff.attention (the model's mask; no (B * H, Lq, Lk) scores)"
    _ff_returns_cache = False

    def forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None,
                output_attentions=False, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if output_attentions or _weights_wanted(kwargs) or hidden_states.dtype != self.q_proj.weight.dtype:
            return super().forward(hidden_states, key_value_states, cache, attention_mask, output_attentions, **kwargs)
        batch, length, width = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, length, -1, self.head_dim).transpose(1, 2)
        k, v = _cached_keys(self, hidden_states, key_value_states, cache, kwargs, self.k_proj, self.v_proj,
                            self.head_dim)
        p = self.dropout if self.training else 0.0
        context = attention(q, k, v, attn_mask=_in_dtype(attention_mask, q), dropout_p=p, scale=self.scaling)
        out = self.out_proj(context.transpose(1, 2).reshape(batch, length, width))
        return (out, None, cache) if self._ff_returns_cache else (out, None)


class LEDDecoderAttentionMixin(TrOCRAttentionMixin):
    """LED's decoder attention: TrOCR's code, returning (output, probabilities, cache)."""
    _ff_returns_cache = True



def convert_trocr_attention(m: nn.Module, swap, mixin: type = TrOCRAttentionMixin) -> Optional[str]:
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "out_proj")) \
            or not isinstance(getattr(m, "scaling", None), float) or not isinstance(getattr(m, "dropout", None), float):
        return "not BART's attention form written out (q / k / v / out projections, a float scaling and dropout)"
    swap(m, mixin)
    return None


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


_BERT_FIELDS = ("query", "key", "value", "dropout", "attention_head_size", "all_head_size")


def _bert_form(m: nn.Module, *fields: str) -> Optional[str]:
    missing = [f for f in _BERT_FIELDS + fields if not hasattr(m, f)]
    if missing:
        return f"not BERT's written-out self-attention (no {', '.join(missing)})"
    if not all(isinstance(getattr(m, f), nn.Linear) for f in _BERT_FIELDS[:3]) or not isinstance(m.dropout, nn.Dropout):
        return "its query / key / value are not nn.Linear, or its dropout not nn.Dropout"
    if m.query.out_features != m.all_head_size or m.all_head_size % m.attention_head_size:
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
    "Attention": convert_openai_gpt_attention,  # OpenAI GPT's
}

__all__ = ["WRITTEN_OUT_ATTENTION"]
