"""ff.convert for attention modules written in their model's own code, outside transformers'
attention interface (``attn_implementation`` never reaches them): BLOOM's and MPT's, their ALiBi
inside the attention kernels (``alibi_slopes``); Falcon's (its ALiBi as the model's own bias mask,
its rotary forms); GPT-Neo's (unscaled scores, local layers as a window); XGLM's (BART's attention
written out); GPT-NeoX-Japanese's; WavLM's (its gated relative bias as a float mask); DeBERTa's
(hf_deberta.py); MPNet's, its relative-position bias in the kernels (hf_mpnet.py).

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

Falcon (``FalconAttention``) has two forms in one class. With ``alibi`` (Falcon-RW) the model
computes its bias in bf16 whatever the model's dtype (``build_alibi_tensor``: the slopes rounded to
bf16 times the positions, rounded again, as Falcon-RW was trained): at 1024 positions the bias
steps by 0.5, so it is not slope x position and ``alibi_slopes`` would compute another model
(0.10 of the largest logit off the original's on a random-weight 4 x 1024 model). Its sdpa path
hands torch's SDPA the (B, H, Lq, Lk) float mask the model folded that bias into
(``FalconModel.forward``); the converted forward hands the same mask to ``ff.attention``. In
transformers 5.24 the eager path adds the bias twice (itself, and through the folded mask): its
logits differ from sdpa's by ~0.02 on a random-weight model; the conversion computes what sdpa
computes (the bias once). Calls without that mask (the original would skip the bias in its sdpa
path) run the original. Without ``alibi`` (Falcon-7B/40B/180B, Falcon 2: rotary) the forward
rotates q and k (ff.apply_rotary) and calls the kernels with the model's mask, where the
original calls torch's SDPA or its eager softmax. Both keep the original's cache layout (the new
decoder architecture's keys broadcast to every query head, as the original stores them);
``output_attentions`` and mixed dtypes run the original.

GPT-Neo (``GPTNeoSelfAttention``) scores ``q k^T`` without the 1 / sqrt(d) scale, in fp32, masked
by its causal buffer, which in the "local" layers keeps only the last ``window_size`` keys of each
query (key j visible to query i + Lk - Lq iff i + Lk - Lq - window_size < j <= i + Lk - Lq), plus
the model's mask: ``ff.attention(scale=1.0, causal="bottom_right", window=(window_size - 1, 0)
on local layers, attn_mask=the model's mask)``, whose local layers visit only the band's tiles.
``output_attentions`` and mixed dtypes run the original.

XGLM (``XGLMAttention``) is BART's attention in its own eager code: ``q * scaling``, bmm scores
plus the model's additive (B, 1, Lq, Lk) causal mask (clamped at the dtype's minimum), softmax,
dropout, bmm with V, returning the probabilities on every call, which transformers' output
recorder keeps when the attentions are asked for (by argument or by config). The converted self-
attention calls ``ff.attention(causal="bottom_right", attn_mask=the model's mask)`` (the band
bounds the tiles the kernels visit) and returns no probabilities; it runs the original when they
are asked for (the recorder's active collector names them), for cross-attention
(``key_value_states``: XGLM as a decoder of another encoder) and for mixed dtypes.

GPT-NeoX-Japanese (``GPTNeoXJapaneseAttention``) is GPT-NeoX's attention from before the
attention interface: the fused q / k / v split per head, the rotary on the first
``rotary_ndims`` channels (ff.apply_rotary where hf_rotary's fused form takes the call), baddbmm
scores plus the model's additive causal mask; converted, ``ff.attention(attn_mask=that mask,
scale=1 / norm_factor)``, its last layer's output bias returned as the original returns it.

WavLM (``WavLMAttention``) gates a T5-style bucketed relative bias per query row (the gate from
that row's hidden state) into a (B * H, L, L) float mask, then calls torch's
``F.multi_head_attention_forward``, which always forms and head-averages the probabilities. The
converted ``torch_multi_head_self_attention`` (the method that receives the gated bias) runs the
same projections into ``ff.attention(key_padding_mask=the padding, attn_mask=the gated bias as
(B, H, L, L))``: the bias is the only (L, L) tensor left, and its gradient (to the gate and the
bucket table) comes from the kernels' backward. Probabilities wanted, mixed dtypes and bf16 / fp16
with autograd recording on a GPU run the original: there the gradient of the key projection's
bias (0 in exact arithmetic) comes out of a flash-style backward whose delta is the stored,
rounded output's (3.1x bf16 eager's error on a 2-layer model, as torch's own flash SDPA backward
at the op level), and torch's SDPA, which has no flash backward for a bias that needs a
gradient, runs the math path there with eager's error. The CPU kernels' delta reads the fp32
output (ARCHITECTURE.md, Numerical policy): 0.41-0.51x eager's error on that bias, and bf16
training runs the kernels.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
from torch import nn

from ..ops.attention import attention
from .hf_deberta import convert_disentangled_attention
from .hf_mpnet import convert_mpnet_attention, convert_mpnet_encoder, convert_mpnet_layer
from .hf_rotary import fused_rotary


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


class FalconAttentionMixin:
    _ff_what = "ff.attention (ALiBi: the model's bias-folded mask; rotary: ff.apply_rotary)"

    def forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None,
                use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):
        if (output_attentions or hidden_states.dtype != self.query_key_value.weight.dtype
                or (alibi is not None and (attention_mask is None or attention_mask.dim() != 4))):
            return super().forward(hidden_states, alibi, attention_mask, position_ids, layer_past,
                                   use_cache, output_attentions, position_embeddings, **kwargs)
        heads_kv = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
        q, k, v = self._split_heads(self.query_key_value(hidden_states))  # (B, L, heads, D)
        batch, q_length = q.shape[:2]
        q = q.transpose(1, 2).reshape(batch, self.num_heads, q_length, self.head_dim)
        k = k.transpose(1, 2).reshape(batch, heads_kv, q_length, self.head_dim)
        v = v.transpose(1, 2).reshape(batch, heads_kv, q_length, self.head_dim)
        if alibi is None:
            rotate = _module_of(self).apply_rotary_pos_emb
            if not torch.compiler.is_compiling():
                rotate = fused_rotary(rotate)
            q, k = rotate(q, k, *position_embeddings)
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        p = self.attention_dropout.p if self.training and alibi is not None else 0.0
        context = attention(q, k, v, causal="bottom_right", attn_mask=attention_mask, dropout_p=p,
                            scale=self.inv_norm_factor)
        context = context.transpose(1, 2).reshape(batch, q_length, self.num_heads * self.head_dim)
        return self.dense(context), None


class GPTNeoSelfAttentionMixin:
    _ff_what = "ff.attention (unscaled scores; local layers as a window, their band's tiles only)"

    def forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
                output_attentions=False, **kwargs):
        if output_attentions or hidden_states.dtype != self.q_proj.weight.dtype:
            return super().forward(hidden_states, attention_mask, layer_past, use_cache,
                                   output_attentions, **kwargs)
        q, k, v = (self._split_heads(proj(hidden_states), self.num_heads, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # (B, H, L, D) views
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_id)
        p = self.attn_dropout.p if self.training else 0.0
        context = attention(q, k, v, causal="bottom_right", attn_mask=attention_mask, window=self._ff_window,
                            dropout_p=p, scale=1.0)
        out = self.out_proj(self._merge_heads(context, self.num_heads, self.head_dim))
        return self.resid_dropout(out), None


class XGLMAttentionMixin:
    _ff_what = "ff.attention (causal, the model's mask; no (B * H, L, L) scores)"

    def forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
        if (key_value_states is not None or hidden_states.dtype != self.q_proj.weight.dtype
                or _weights_wanted(kwargs)):
            return super().forward(hidden_states, key_value_states, cache, attention_mask, **kwargs)
        batch, q_length, _ = hidden_states.shape
        q, k, v = (proj(hidden_states).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))   # (B, H, L, D) views
        if cache is not None:
            self_cache = getattr(cache, "self_attention_cache", cache)  # EncoderDecoderCache or one cache
            k, v = self_cache.update(k, v, self.layer_idx, kwargs=kwargs)
        p = self.dropout if self.training else 0.0
        context = attention(q, k, v, causal="bottom_right", attn_mask=attention_mask, dropout_p=p,
                            scale=self.scaling)
        return self.out_proj(context.transpose(1, 2).reshape(batch, q_length, self.embed_dim)), None


class GPTNeoXJapaneseAttentionMixin:
    """GPT-NeoX-Japanese's attention: GPT-NeoX's fused q / k / v and partial rotary, the model's
    additive causal mask, the last layer's output bias returned for the block to add;
    (output, probabilities, bias)."""
    _ff_what = "ff.attention + ff.apply_rotary (the model's mask; no (B * H, Lq, Lk) scores)"

    def forward(self, hidden_states, attention_mask, position_ids, layer_past=None, use_cache=False,
                output_attentions=False, position_embeddings=None, **kwargs):
        if output_attentions or _weights_wanted(kwargs) or position_embeddings is None \
                or hidden_states.dtype != self.query_key_value.weight.dtype:
            return super().forward(hidden_states, attention_mask, position_ids, layer_past, use_cache,
                                   output_attentions, position_embeddings, **kwargs)
        batch, length, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(batch, length, self.num_attention_heads, -1).transpose(1, 2)
        q, k, v = qkv.split(self.head_size, dim=-1)
        rotate = _module_of(self).apply_rotary_pos_emb
        if not torch.compiler.is_compiling():
            rotate = fused_rotary(rotate)
        r = self.rotary_ndims
        q_rot, k_rot = rotate(q[..., :r], k[..., :r], *position_embeddings)
        q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        p = self.attention_dropout.p if self.training else 0.0
        context = attention(q, k, v, attn_mask=_in_dtype(attention_mask, q), dropout_p=p, scale=1.0 / self.norm_factor)
        return self.dense(context.transpose(1, 2).reshape(batch, length, -1)), None, self.dense_bias


class WavLMAttentionMixin:
    _ff_what = "ff.attention (the gated relative bias as a float mask; no averaged probabilities)"

    def torch_multi_head_self_attention(self, hidden_states, attention_mask, gated_position_bias):
        if hidden_states.dtype != self.q_proj.weight.dtype or _weights_wanted({}) \
                or (torch.is_grad_enabled() and hidden_states.dtype in (torch.bfloat16, torch.float16)
                    and hidden_states.device.type != "cpu"):
            return super().torch_multi_head_self_attention(hidden_states, attention_mask, gated_position_bias)
        batch, length, width = hidden_states.shape
        q, k, v = (proj(hidden_states).view(batch, length, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        padding = attention_mask.ne(1) if attention_mask is not None else None
        bias = _in_dtype(gated_position_bias.view(batch, self.num_heads, length, length), q)
        p = self.dropout if self.training else 0.0
        context = attention(q, k, v, key_padding_mask=padding, attn_mask=bias, dropout_p=p, scale=self.scaling)
        return self.out_proj(context.transpose(1, 2).reshape(batch, length, width)), None


def _in_dtype(mask, q):
    """The model's additive mask in the activations' dtype (a mixed-dtype mask is refused)."""
    return mask.to(q.dtype) if mask is not None and mask.dtype not in (torch.bool, q.dtype) else mask


def _weights_wanted(kwargs) -> bool:
    """Whether the caller reads the attention probabilities: output_attentions passed down, or
    transformers' output recorder collecting them this call (its active collector; the
    config's output_attentions reaches the modules only that way)."""
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another transformers: no recorder to ask, so assume they are wanted
        return True
    collecting = _active_collector.get()
    return bool(collecting) and ("attentions" in collecting or "cross_attentions" in collecting)


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


def convert_falcon_attention(m: nn.Module, swap) -> Optional[str]:
    """Swap a FalconAttention for FalconAttentionMixin, or say why not."""
    if getattr(sys.modules.get(type(m).__module__), "apply_rotary_pos_emb", None) is None:
        return "its module has no apply_rotary_pos_emb (another Falcon version)"
    if not isinstance(getattr(m, "query_key_value", None), nn.Linear) or not hasattr(m, "inv_norm_factor"):
        return "not the FalconAttention form (no fused query_key_value linear or inv_norm_factor)"
    swap(m, FalconAttentionMixin)
    return None


def convert_gpt_neo_attention(m: nn.Module, swap) -> Optional[str]:
    """Swap a GPTNeoSelfAttention for GPTNeoSelfAttentionMixin, or say why not."""
    kind, bias = getattr(m, "attention_type", None), getattr(m, "bias", None)
    window = getattr(getattr(m, "config", None), "window_size", None)
    if kind not in ("global", "local") or not isinstance(bias, torch.Tensor) or bias.dim() != 4:
        return "not the GPTNeoSelfAttention form (attention_type, causal buffer)"
    if kind == "local" and not (isinstance(window, int) and window >= 1):
        return f"a local layer without a window_size >= 1 (got {window!r})"
    # The buffer is what the original masks by: check it is the band the window describes.
    n = bias.shape[-1]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    band = (j <= i) & ((i - j < window) if kind == "local" else True)
    if not torch.equal(bias[0, 0].cpu(), band):
        return "its causal buffer is not the causal (local: window) band"
    m._ff_window = (window - 1, 0) if kind == "local" else None
    swap(m, GPTNeoSelfAttentionMixin)
    return None


def convert_xglm_attention(m: nn.Module, swap) -> Optional[str]:
    """Swap an XGLMAttention for XGLMAttentionMixin, or say why not."""
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "out_proj")) \
            or not isinstance(getattr(m, "scaling", None), float):
        return "not the XGLMAttention form (q / k / v / out projections, a float scaling)"
    swap(m, XGLMAttentionMixin)
    return None


def convert_gpt_neox_japanese_attention(m: nn.Module, swap) -> Optional[str]:
    if not isinstance(getattr(m, "query_key_value", None), nn.Linear) \
            or not isinstance(getattr(m, "attention_dropout", None), nn.Dropout) \
            or not all(hasattr(m, f) for f in ("rotary_ndims", "norm_factor", "head_size", "dense_bias")):
        return "not GPT-NeoX-Japanese's attention form (a fused query_key_value, rotary_ndims, norm_factor)"
    swap(m, GPTNeoXJapaneseAttentionMixin)
    return None


def convert_wavlm_attention(m: nn.Module, swap) -> Optional[str]:
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "out_proj")) \
            or not isinstance(getattr(m, "scaling", None), float) \
            or not callable(getattr(m, "torch_multi_head_self_attention", None)):
        return "not WavLM's attention form (q / k / v / out projections, torch_multi_head_self_attention)"
    swap(m, WavLMAttentionMixin)
    return None


# The attention classes converted here (and MPNet's modules around its attention), by class name:
# converter(module, swap) -> why not, or None.
OWN_ATTENTION = {"BloomAttention": convert_bloom_attention, "MptAttention": convert_mpt_attention,
                 "FalconAttention": convert_falcon_attention, "GPTNeoSelfAttention": convert_gpt_neo_attention,
                 "XGLMAttention": convert_xglm_attention, "WavLMAttention": convert_wavlm_attention,
                 "GPTNeoXJapaneseAttention": convert_gpt_neox_japanese_attention,
                 "DisentangledSelfAttention": convert_disentangled_attention,  # DeBERTa: hf_deberta.py
                 # MPNet: its attention, and the encoder and layer around it (hf_mpnet.py)
                 "MPNetAttention": convert_mpnet_attention, "MPNetEncoder": convert_mpnet_encoder,
                 "MPNetLayer": convert_mpnet_layer}

__all__ = ["OWN_ATTENTION", "convert_mpt_block"]
