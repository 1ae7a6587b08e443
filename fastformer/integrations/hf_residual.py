"""Norms of transformers models and the residual adds before them, on the fused kernels: shared
by the layer converters (hf_convert.py, hf_seq2seq_forms.py).

A residual block ``norm(x + residual)`` written eagerly reads and writes the stream three times
(the add, the norm's statistics, its output); ``ff.add_layer_norm`` / ``ff.rms_norm(...,
residual=)`` read x and the residual once and write the output (and, for a pre-norm block,
the sum) once. Calls these kernels do not take (weights in another dtype than the stream, a
LayerNorm over more than one dimension) run as eager. The layer mixins at the end (Llama's,
Gemma 2's sandwich, Llama 4's and CLIP's encoder layer forms) are what ff.convert swaps into
layers for it.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.norm import add_layer_norm, layer_norm, rms_norm
from .hf_mlp_forms import same_dtype


class RMSNormMixin:
    """Llama-style ``w * x_hat`` (T5LayerNorm too), Gemma's ``x_hat * (1 + w)``: the forward
    of a converted RMSNorm (its eps in _ff_eps, the form in _ff_offset)."""
    _ff_what = "ff.rms_norm"

    def _ff_weight(self):
        w = self.weight
        return 1.0 + w.float() if self._ff_offset else w

    def forward(self, hidden_states):
        if not (self._ff_offset or same_dtype(hidden_states, self.weight)):
            return super().forward(hidden_states)
        return rms_norm(hidden_states, self._ff_weight(), self._ff_eps)


class LayerNorm1PMixin:
    """Nemotron's LayerNorm1P: F.layer_norm with weight + 1 (added in the weight's dtype, as
    Nemotron does), on ff.layer_norm; under autocast, or weights in another dtype, as before."""
    _ff_what = "ff.layer_norm (weight + 1)"

    def forward(self, input):
        if (torch.is_autocast_enabled(input.device.type) or len(self.normalized_shape) != 1
                or not same_dtype(input, self.weight, self.bias)):
            return super().forward(input)
        return layer_norm(input, self.weight + 1.0, self.bias, self.eps)


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor):
    """(norm(x + residual), x + residual) in one pass where the norm is a converted RMSNorm or a
    LayerNorm; else as eager."""
    if isinstance(norm, RMSNormMixin) and (norm._ff_offset or same_dtype(x, norm.weight)):
        return rms_norm(x, norm._ff_weight(), norm._ff_eps, residual=residual, return_residual=True)
    if isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1 and \
            same_dtype(x, norm.weight, norm.bias):
        return add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps, return_residual=True)
    total = x + residual
    return norm(total), total


def layer_norm_params(norm: nn.Module):
    """(weight, bias, eps) of a LayerNorm over the last dimension: nn.LayerNorm, or DeBERTa's
    own DebertaLayerNorm (the same function; it rounds x_hat to the input dtype before the
    affine, which in fp32 changes nothing and in bf16 is one rounding the fused kernel skips);
    None for any other module."""
    if isinstance(norm, nn.LayerNorm):
        return (norm.weight, norm.bias, norm.eps) if len(norm.normalized_shape) == 1 else None
    if type(norm).__name__ == "DebertaLayerNorm" and type(norm).__module__.startswith("transformers."):
        return norm.weight, norm.bias, float(norm.variance_epsilon)
    return None


def layer_norm_added(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """norm(x + residual) for a LayerNorm (layer_norm_params), fused."""
    params = layer_norm_params(norm)
    if params is not None and same_dtype(x, params[0], params[1]):
        return add_layer_norm(x, residual, *params)
    return norm(x + residual)


# ---- layers whose residual adds go into their next norm (hf_convert.py swaps them in) -----------
class PreNormDecoderLayer:
    """residual + mlp(norm2(residual + attn(norm1(x)))) with norm2's add fused."""
    _ff_what = "residual add fused into post_attention_layernorm"
    _ff_reads = ("post_attention_layernorm",)  # read, not called (hf_parts.py)

    def forward(self, hidden_states, *args, **kwargs):
        if args or kwargs.get("output_attentions"):
            return super().forward(hidden_states, *args, **kwargs)
        residual = hidden_states
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h, residual = add_norm(self.post_attention_layernorm, h, residual)
        return residual + self._ff_mlp(h)

    def _ff_mlp(self, h):
        return self.mlp(h)


class Llama4DecoderLayer(PreNormDecoderLayer):
    """Llama 4's: the MLP is feed_forward, and a MoE block's returns (flattened rows, logits)."""

    def _ff_mlp(self, h):
        out = self.feed_forward(h)
        return (out[0] if self.is_moe_layer else out).view(h.shape)


class SandwichDecoderLayer:
    """Gemma 2/3: the attention and MLP outputs normed before their residual adds; the add of the
    attention branch fused into the MLP's pre-norm."""
    _ff_what = "residual add fused into pre_feedforward_layernorm"
    _ff_reads = ("pre_feedforward_layernorm",)  # read, not called (hf_parts.py)

    def forward(self, hidden_states, *args, **kwargs):
        if args or kwargs.get("output_attentions"):
            return super().forward(hidden_states, *args, **kwargs)
        residual = hidden_states
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h, residual = add_norm(self.pre_feedforward_layernorm, self.post_attention_layernorm(h), residual)
        return residual + self.post_feedforward_layernorm(self.mlp(h))


class PreNormEncoderLayer:
    """CLIP's and SigLIP's encoder layer (and the vision towers written from it: Idefics 2/3,
    SmolVLM, OWL-ViT, GIT, Janus, ...; BLIP's, whose attention takes no mask and ignores the
    keyword): layer_norm2's residual add fused. The stream it returns
    is written contiguous: SigLIP's starts channels-strided (its patch embedding's conv output
    transposed), a layout every eager residual add after it keeps."""
    _ff_what = "residual add fused into layer_norm2"
    _ff_reads = ("layer_norm2",)  # read, not called (hf_parts.py)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if kwargs.get("output_attentions"):
            return super().forward(hidden_states, attention_mask=attention_mask, **kwargs)
        residual = hidden_states
        h, _ = self.self_attn(hidden_states=self.layer_norm1(hidden_states), attention_mask=attention_mask, **kwargs)
        h, residual = add_norm(self.layer_norm2, h, residual)
        return residual + self.mlp(h)


class BarkBlock:
    """Bark's block (GPT-2's pre-norm form, returning a tuple): layernorm_2's residual add fused."""
    _ff_what = "residual add fused into layernorm_2"
    _ff_reads = ("layernorm_2",)  # read, not called (hf_parts.py)

    def forward(self, hidden_states, cache=None, attention_mask=None, use_cache=False, output_attentions=False,
                **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if output_attentions:
            return super().forward(hidden_states, cache, attention_mask, use_cache, output_attentions, **kwargs)
        attn = self.attn(self.layernorm_1(hidden_states), cache=cache, attention_mask=attention_mask,
                         use_cache=use_cache, output_attentions=False, **kwargs)
        h, stream = add_norm(self.layernorm_2, attn[0], hidden_states)
        return (stream + self.mlp(h),) + tuple(attn[1:])


__all__ = ["BarkBlock", "LayerNorm1PMixin", "Llama4DecoderLayer", "PreNormDecoderLayer", "PreNormEncoderLayer",
           "RMSNormMixin", "SandwichDecoderLayer", "add_norm", "layer_norm_added"]
