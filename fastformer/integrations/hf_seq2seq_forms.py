"""Encoder and decoder layers of BART and Whisper form on the fused kernels: the feed-forward
block on ``ff.ffn`` and every residual add fused into the norm that reads it.

transformers writes the layers of its encoder-decoder (and some decoder-only) families inline,
``fc1`` / ``fc2`` and the LayerNorms as attributes of the layer, with no MLP module to convert.
Two forms cover most of them; a layer qualifies when its forward is one of them instruction for
instruction (hf_rotary.class_form):

  post-norm (BART)    x = LN_a(x + drop(attn(x))); [x = LN_c(x + drop(cross(x)))];
                      x = LN_f(x + drop(fc2(drop_act(act(fc1(x))))))
                      BART, Marian, PLBart, BlenderbotSmall, Informer, TimeSeriesTransformer;
                      TrOCR's decoder (by name: it returns a tuple); FSMT's layers (by name
                      and module: fairseq's (L, B, E) activations and masks)
  pre-norm (Whisper)  x = x + drop(attn(LN_a(x))); [x = x + drop(cross(LN_c(x)))];
                      x = x + drop(fc2(drop_act(act(fc1(LN_f(x))))))
                      encoders of Whisper, mBART, Pegasus, M2M100 / NLLB, Blenderbot,
                      Speech2Text, Qwen2-Audio, Voxtral, AudioFlamingo3; decoders of Whisper,
                      Speech2Text, MusicGen, XGLM and (passing hidden_states by keyword, the
                      same computation) mBART, Pegasus, M2M100, Blenderbot

Converted, a post-norm layer runs ``ff.add_layer_norm(drop(h), x)`` for each block (one pass
over the stream instead of the add's and the norm's three) and a pre-norm layer
``ff.add_layer_norm(..., return_residual=True)`` for the norm after each branch, which also
writes the stream; fc1 -> act -> dropout -> fc2 is one ``ff.ffn`` call (bias and activation in
the GEMM epilogue, the activation dropout fused). The attention modules run through the
fastformer attention backend as in every converted model. A call the kernels do not cover runs
the original forward: float16 (the originals clamp the stream to float16's range), attention
weights requested, an activation without a kernel (the feed-forward then runs as written).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ..ops.dropout import dropout
from .hf_mlp_forms import activation_name, model_ffn, same_dtype
from .hf_residual import add_norm, layer_norm_added


def _drop(layer, h: torch.Tensor) -> torch.Tensor:
    """F.dropout(h, layer.dropout, layer.training) on the kernels' Philox mask."""
    return dropout(h, layer.dropout) if layer.training and layer.dropout > 0 else h


def _feed_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """drop(fc2(drop_act(act(fc1(x))))): ff.ffn where the activation has a kernel."""
    fc1, fc2 = layer.fc1, layer.fc2
    p_act = layer.activation_dropout if layer.training else 0.0
    if layer._ff_act is None or not same_dtype(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias):
        h = layer.activation_fn(fc1(x))
        h = torch.nn.functional.dropout(h, p=layer.activation_dropout, training=layer.training)
        return _drop(layer, fc2(h))
    return _drop(layer, model_ffn(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias, layer._ff_act, p_act))


# the children the layers read (integrations/hf_parts.py; those a layer lacks are skipped): not the
# attention modules, which they call
_READS = ("fc1", "fc2", "activation_fn", "self_attn_layer_norm", "encoder_attn_layer_norm", "final_layer_norm")


def _runs_original(hidden_states: torch.Tensor, kwargs: dict) -> bool:
    return hidden_states.dtype == torch.float16 or bool(kwargs.get("output_attentions"))


class _EncoderLayerForm:
    """The converted forward's signature and the calls it leaves to the original."""
    _ff_reads = _READS

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if _runs_original(hidden_states, kwargs):
            return super().forward(hidden_states, attention_mask, **kwargs)
        return self._ff_layer(hidden_states, attention_mask, kwargs)


class _DecoderLayerForm:
    """The same for decoder layers (called with hidden_states, attention_mask and
    encoder_hidden_states positional, the rest by keyword)."""
    _ff_reads = _READS

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, cache=None, use_cache=True, **kwargs):
        cache = _cache(cache, kwargs)
        if _runs_original(hidden_states, kwargs):
            return super().forward(hidden_states, attention_mask, encoder_hidden_states,
                                   encoder_attention_mask, cache, use_cache, **kwargs)
        return self._ff_layer(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                              cache, kwargs)


class _BartFormEncoderLayer(_EncoderLayerForm):
    _ff_what = "ff.add_layer_norm x2 + ff.ffn (post-norm encoder layer)"

    def _ff_layer(self, hidden_states, attention_mask, kwargs):
        h, _ = self.self_attn(hidden_states, attention_mask=attention_mask, **kwargs)
        x = layer_norm_added(self.self_attn_layer_norm, _drop(self, h), hidden_states)
        return layer_norm_added(self.final_layer_norm, _feed_forward(self, x), x)


class _BartFormDecoderLayer(_DecoderLayerForm):
    _ff_what = "ff.add_layer_norm x3 + ff.ffn (post-norm decoder layer)"

    def _ff_layer(self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, cache, kwargs):
        h, _ = self.self_attn(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        x = layer_norm_added(self.self_attn_layer_norm, _drop(self, h), hidden_states)
        if encoder_hidden_states is not None:
            h, _ = self.encoder_attn(x, key_value_states=encoder_hidden_states,
                                     attention_mask=encoder_attention_mask, cache=cache, **kwargs)
            x = layer_norm_added(self.encoder_attn_layer_norm, _drop(self, h), x)
        return layer_norm_added(self.final_layer_norm, _feed_forward(self, x), x)


class _WhisperFormEncoderLayer(_EncoderLayerForm):
    _ff_what = "residual add fused into final_layer_norm + ff.ffn (pre-norm encoder layer)"

    def _ff_layer(self, hidden_states, attention_mask, kwargs):
        h, _ = self.self_attn(self.self_attn_layer_norm(hidden_states), attention_mask=attention_mask, **kwargs)
        h, stream = add_norm(self.final_layer_norm, _drop(self, h), hidden_states)
        return stream + _feed_forward(self, h)


class _WhisperFormDecoderLayer(_DecoderLayerForm):
    _ff_what = ("residual adds fused into encoder_attn_layer_norm and final_layer_norm + ff.ffn "
                "(pre-norm decoder layer)")

    def _ff_layer(self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask, cache, kwargs):
        h, _ = self.self_attn(self.self_attn_layer_norm(hidden_states), cache=cache,
                              attention_mask=attention_mask, **kwargs)
        stream = hidden_states
        if encoder_hidden_states is not None:
            h, stream = add_norm(self.encoder_attn_layer_norm, _drop(self, h), stream)
            h, _ = self.encoder_attn(h, key_value_states=encoder_hidden_states,
                                     attention_mask=encoder_attention_mask, cache=cache, **kwargs)
        h, stream = add_norm(self.final_layer_norm, _drop(self, h), stream)
        return stream + _feed_forward(self, h)


class _TupleBartFormDecoderLayer(_BartFormDecoderLayer):
    """TrOCR's decoder layer: BART's post-norm computation with output_attentions a parameter
    and the stream returned in a tuple (its decoder reads layer_outputs[0])."""

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, cache=None, output_attentions=False, use_cache=True, **kwargs):
        cache = _cache(cache, kwargs)
        if output_attentions or hidden_states.dtype == torch.float16:
            return self._fastformer_original.forward(self, hidden_states, attention_mask, encoder_hidden_states,
                                                     encoder_attention_mask, cache, output_attentions, use_cache,
                                                     **kwargs)
        return (self._ff_layer(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                               cache, kwargs),)


class _FSMTEncoderLayer(_BartFormEncoderLayer):
    """FSMT's encoder layer: BART's post-norm computation on fairseq's (L, B, E) activations, the
    padding as a bool key mask; returns (x, None)."""

    def forward(self, x, encoder_padding_mask, output_attentions=False):
        if output_attentions or x.dtype == torch.float16:
            return self._fastformer_original.forward(self, x, encoder_padding_mask, output_attentions)
        h, _ = self.self_attn(query=x, key=x, key_padding_mask=encoder_padding_mask)
        x = layer_norm_added(self.self_attn_layer_norm, _drop(self, h), x)
        return layer_norm_added(self.final_layer_norm, _feed_forward(self, x), x), None


class _FSMTDecoderLayer(_BartFormDecoderLayer):
    """FSMT's decoder layer: BART's post-norm computation on (L, B, E), the cache as layer_state;
    returns (x, None, None)."""

    def forward(self, x, encoder_hidden_states, encoder_attn_mask=None, layer_state=None, causal_mask=None,
                decoder_padding_mask=None, output_attentions=False, **kwargs):
        if output_attentions or x.dtype == torch.float16:
            return self._fastformer_original.forward(self, x, encoder_hidden_states, encoder_attn_mask, layer_state,
                                                     causal_mask, decoder_padding_mask, output_attentions, **kwargs)
        h, _ = self.self_attn(query=x, key=x, layer_state=layer_state, key_padding_mask=decoder_padding_mask,
                              attn_mask=causal_mask)
        x = layer_norm_added(self.self_attn_layer_norm, _drop(self, h), x)
        h, _ = self.encoder_attn(query=x, key=encoder_hidden_states, key_padding_mask=encoder_attn_mask,
                                 layer_state=layer_state)
        x = layer_norm_added(self.encoder_attn_layer_norm, _drop(self, h), x)
        return layer_norm_added(self.final_layer_norm, _feed_forward(self, x), x), None, None


def _cache(cache, kwargs: dict):
    """The cache under its deprecated name too (the originals' decorator renames
    past_key_values to cache before their body runs; the converted forward is not decorated)."""
    old = kwargs.pop("past_key_values", None)
    return old if cache is None else cache


def _converter(mixin: type, swap: Callable) -> Callable:
    def convert(m) -> Optional[str]:
        if not all(isinstance(getattr(m, n, None), (int, float)) for n in ("dropout", "activation_dropout")):
            return "its dropout / activation_dropout are not probabilities"
        m._ff_act = activation_name(getattr(m, "activation_fn", None))
        swap(m, mixin)
        return None
    return convert


@functools.lru_cache(maxsize=None)
def _form_mixins() -> tuple:
    from transformers.models.bart import modeling_bart as bart
    from transformers.models.mbart import modeling_mbart as mbart
    from transformers.models.whisper import modeling_whisper as whisper
    return ((bart.BartEncoderLayer, _BartFormEncoderLayer), (bart.BartDecoderLayer, _BartFormDecoderLayer),
            (whisper.WhisperEncoderLayer, _WhisperFormEncoderLayer),
            (whisper.WhisperDecoderLayer, _WhisperFormDecoderLayer), (mbart.MBartDecoderLayer, _WhisperFormDecoderLayer))


def seq2seq_forms(class_form: Callable, swap: Callable) -> dict:
    """{code form of a layer's forward: its converter} for hf_convert's table of forms."""
    return {class_form(cls): _converter(mixin, swap) for cls, mixin in _form_mixins()}


def seq2seq_named(swap: Callable) -> dict:
    """{class name: its converter}: layers of a BART form whose forward differs in its signature
    or what it returns (TrOCR's: a tuple; FSMT's: (L, B, E) activations, fairseq's masks)."""
    def fsmt(mixin):
        def convert(m) -> Optional[str]:
            if not type(m).__module__.startswith("transformers.models.fsmt."):
                return "not FSMT's layer"
            return _converter(mixin, swap)(m)
        return convert
    return {"TrOCRDecoderLayer": _converter(_TupleBartFormDecoderLayer, swap),
            "EncoderLayer": fsmt(_FSMTEncoderLayer), "DecoderLayer": fsmt(_FSMTDecoderLayer)}


__all__ = ["seq2seq_forms", "seq2seq_named"]
