"""ff.convert for Hugging Face transformers models: the layers around the attention on fused kernels.

``ff.convert(model)`` calls :func:`convert_transformers` for a transformers ``PreTrainedModel``
(then converts the remaining ``nn.LayerNorm`` s as for any model). It registers and selects the
fastformer attention backend (integrations/transformers.py) and, module by module:

==========================  =====================================================================
transformers modules        fused
==========================  =====================================================================
RMSNorm of Llama, Mistral,  ``ff.rms_norm`` (Gemma's ``x_hat * (1 + w)`` with 1 + w in fp32, as
Qwen2/3, Gemma 1/2/3, T5,   Gemma computes it; T5LayerNorm)
any family's in their form
decoder layers of those     the residual add into the next norm: ``ff.rms_norm(h, w,
                            residual=r, return_residual=True)`` (one pass instead of three)
their MLPs                  ``ff.swiglu_ffn`` (SwiGLU; GeGLU for Gemma's tanh GELU), biases if any
their attention modules     the rotary embedding of q and k on ``ff.apply_rotary``
                            (integrations/hf_rotary.py)
the same in other families  where a module's forward is Llama's (Gemma's, BERT's) instruction
                            for instruction (``_forms``): Mixtral, Qwen-MoE, DeepSeek-V3,
                            Phi-3, SmolLM3, OLMoE, GLM, XLM-RoBERTa, ELECTRA, ...
experts modules of MoE      ``ff.moe_ffn`` as transformers' experts implementation "fastformer"
models (Mixtral, Qwen-MoE,  (integrations/hf_moe.py): gated experts, gate / up rows concatenated
OLMoE, gpt-oss, DeepSeek,   or interleaved, the default gate or gpt-oss's clamped SwiGLU, and
NemotronH, ...)             experts without a gate (up_proj only); others named in the report
                            with the reason
Llama 4's MoE blocks        ``ff.moe_ffn(weights_on="input")`` on the top-k experts (transformers
                            runs all of them); its RMSNorms, layers and loss as Llama's
CLIP / SigLIP encoder       layer_norm2 with its residual add (by form: the vision towers
layers                      written from them too)
BART / Whisper-form         every residual add fused into its LayerNorm, fc1 -> act -> fc2 on
encoder and decoder layers  ``ff.ffn`` (integrations/hf_seq2seq_forms.py): BART, Marian,
                            mBART, Pegasus, M2M100 / NLLB, Blenderbot, Whisper, Speech2Text,
                            MusicGen, XGLM, Qwen2-Audio, Voxtral, ...
any other family's MLP      ``ff.ffn`` / ``ff.swiglu_ffn`` where its traced forward is one of
                            the forms of integrations/hf_mlp_forms.py: CLIP, SigLIP, GPT-NeoX,
                            Phi, Starcoder2, GPT-J, DINOv2, Phi-3, GLM-4, ModernBERT, Llama 4,
                            ... (fused gate / up projections read as two row views)
BERT / RoBERTa layers       self-output and output: ``ff.add_layer_norm(dropout(dense(h)), x)``;
                            intermediate + output: ``ff.ffn`` then the fused add + LayerNorm
DistilBERT blocks           both add + LayerNorms; the FFN on ``ff.ffn``
GPT-2 blocks                ``ln_2`` with its residual add; the Conv1D MLP on ``ff.ffn``
                            (tanh GELU), Conv1D's (in, out) weights read transposed (views)
ViT layers                  ``layernorm_after`` with its residual add; the MLP on ``ff.ffn``
T5 feed-forward             DenseReluDense on ``ff.ffn`` (dropout fused); the gated one on
                            ``ff.swiglu_ffn`` when no dropout runs
T5 attention's bias         ``ff.RelativePositionBias`` on the layer's table, computed inside the
                            attention kernels (no (1, H, Lq, Lk) bias tensor)
BLOOM / MPT / Falcon /      ``ff.attention`` with the model's ALiBi slopes and mask, no score
GPT-Neo / XGLM attention    tensor; Falcon's rotary form on ``ff.apply_rotary`` and
                            ``ff.attention``; GPT-Neo's local layers as a window; XGLM's causal
                            self-attention (integrations/hf_own_attention.py)
DeBERTa v1 / v2 / v3, SEW-D ``ff.attention`` with the two relative terms gathered into its bias
attention                   in one pass (ops/relative_bias.py; integrations/hf_deberta.py);
                            v1's DebertaLayerNorm with its residual add as BERT's LayerNorm
MPNet attention and layers  ``ff.attention`` with the encoder's relative-position table as an
                            ``ff.RelativePositionBias`` (no (B, H, L, L) bias); the residual adds
                            on ``ff.add_layer_norm``, the MLP on ``ff.ffn`` (hf_mpnet.py)
BERT / ViT / BART / GPT-2   ``ff.attention`` with the model's mask, the decoders' cache kept
attention written out       (hf_written_out.py); their BERT layers' feed-forward chunks as
(TAPAS, RemBERT, Megatron-  BERT's, BLIP's vision layers as CLIP's, TrOCR's decoder layers as
BERT, VisualBERT, FLAVA,    BART's (by name: they return a tuple), Bark's blocks with
ViLT, BLIP, TrOCR, LED's    layernorm_2's residual add fused
decoder, Bark, OpenAI GPT,
XLM, FlauBERT)
Longformer / LED encoder    ``ff.attention`` with the window and global tokens as one bool mask
attention                   (the band's and global columns' tiles only), the global rows in a
                            second call (hf_longformer.py); Longformer's layers as BERT's
nn.Embedding (every one)    ops/embedding.py: under torch.compile the backward is aten's
                            kernel (inductor's own scatter-add took 200 ms of a compiled bf16
                            Mistral-style training step, aten's ~30); eager calls unchanged
GPT-2's Conv1D             as nn.Linear below, on the weight's transpose (a view)
Falcon's FalconLinear       as nn.Linear below (its x @ W.T + b, the bias added in the GEMM)
nn.Dropout (every one)      ops/dropout.py in training: the kernels' Philox mask, one pass,
                            regenerated in the backward (torch's bernoulli_ ~5 ns per element)
nn.Linear (every one)       ops/linear.py: calls of 1-8 rows without autograd (decode steps) on
                            its kernel, which reads the weights at up to 3x torch's GEMV rate;
                            bf16 weight gradients on AMX tiles from 1024 tokens (1.1-2.0x
                            torch's mm there)
CausalLM heads              with ``labels``: ``ff.linear_cross_entropy`` on the hidden states
                            (the logits are not materialized and not returned, as Liger-Kernel);
                            Mixtral's form adds the router's load-balancing loss when asked
                            (integrations/hf_lm_loss.py)
==========================  =====================================================================

How: each module's class is swapped (``module.__class__``) for a subclass of it, same name,
whose forward calls the kernels on the module's own parameters: no parameter is copied, moved or
renamed, so ``state_dict`` keys and values, optimizers, ``save_pretrained`` and loading into the
unconverted class are unchanged. A converted forward runs the original one (``super().forward``)
for a call it does not cover (e.g. weights in another dtype than the activations, a GPT-2 block
with cross-attention, output_attentions). Modules with an unknown activation are left, with the
reason in the report.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Callable, Optional

import torch
from torch import nn

from ..ops.dropout import dropout
from ..ops.embedding import embedding
from ..ops.ffn import ffn
from ..ops.linear import linear
from . import hf_moe, hf_parts
from .hf_own_attention import OWN_ATTENTION, convert_mpt_block
from .hf_lm_loss import CausalLMLoss as _CausalLMLoss
from .hf_lm_loss import MoECausalLMLoss as _MoECausalLMLoss
from .hf_lm_loss import decoder_of
from .hf_longformer import LONGFORMER_ATTENTION
from .hf_mlp_forms import activation_name as _activation
from .hf_mlp_forms import convert_mlp_by_form, mlp_candidate, model_ffn, model_swiglu_ffn
from .hf_mlp_forms import same_dtype as _same_dtype
from .hf_residual import BarkBlock as _BarkBlock
from .hf_residual import RMSNormMixin as _RMSNorm
from .hf_residual import LayerNorm1PMixin
from .hf_residual import Llama4DecoderLayer as _Llama4DecoderLayer
from .hf_residual import PreNormDecoderLayer as _PreNormDecoderLayer
from .hf_residual import PreNormEncoderLayer as _PreNormEncoderLayer
from .hf_residual import SandwichDecoderLayer as _SandwichDecoderLayer
from .hf_residual import add_norm as _add_norm
from .hf_residual import layer_norm_added as _layer_norm_added
from .hf_residual import layer_norm_params
from .hf_rotary import calls_attention_interface, class_form, convert_rotary_attention, rotary_mixin
from .hf_seq2seq_forms import seq2seq_forms, seq2seq_named
from .hf_vision_attention import VISION_ATTENTION
from .hf_written_out import WRITTEN_OUT_ATTENTION

_SWAPPED: dict = {}


def is_transformers_model(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel"
               for c in type(model).__mro__)


def _swap(module: nn.Module, mixin: type) -> None:
    """module.__class__ -> a subclass of it with mixin's methods first (same name). Each method
    of cls the mixin overrides runs cls's own where the parts it reads changed after the
    conversion (hf_parts.py: a LoRA layer in place of a linear, hooks). The subclass pickles as
    a recipe (_unpickle): pickle finds a class by its module and name, which are cls's."""
    cls = type(module)
    new = _SWAPPED.get((cls, mixin))
    if new is None:
        recipe = (cls, "rotary" if getattr(mixin, "_ff_rotary", False) else mixin)
        body = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "_fastformer_original": cls,
                "_ff_parts": (), "_ff_reads_when": getattr(mixin, "_ff_reads_when", None),
                "__reduce_ex__": lambda self, protocol: (_unpickle, recipe, self.__dict__)}
        for name in _overridden(mixin, cls):
            method = getattr(mixin, name)
            if name == "forward" and _passes_keywords_on(method):
                method = _with_signature_of(method, cls.forward)
            body[name] = hf_parts.guarded(method, getattr(cls, name))
        new = type(cls.__name__, (mixin, cls), body)
        _SWAPPED[(cls, mixin)] = new
    module.__class__ = new


def _unpickle(cls: type, mixin) -> nn.Module:
    """A converted module from its pickle (its state follows): cls swapped for mixin, or for the
    rotary mixin hf_rotary makes for cls (a class of its own per attention class). The
    attention and experts implementations the converted model names are registered here (a
    process that loads a pickled model may not have converted one)."""
    from . import transformers as ff_hf
    ff_hf.register()
    hf_moe.register()
    module = cls.__new__(cls)
    _swap(module, rotary_mixin(cls)[0] if mixin == "rotary" else mixin)
    return module


def _overridden(mixin: type, cls: type) -> list:
    """The names of cls's methods that mixin (or a base of it) defines again."""
    names = {n for base in mixin.__mro__[:-1] for n, v in vars(base).items()
             if inspect.isfunction(v) and not n.startswith("__")}
    return sorted(n for n in names if inspect.isfunction(getattr(cls, n, None)))


def _passes_keywords_on(fn: Callable) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _with_signature_of(forward: Callable, original: Callable) -> Callable:
    """A forward that takes ``**kwargs`` on to the original's, advertising the original's
    signature (and name, docs), which it accepts: transformers reads the
    forward's parameters (generate passes ``logits_to_keep`` only to a forward that names it;
    without it the converted Llama-style model's prefill built the logits of all 2048 prompt
    positions, 250 MiB, instead of the last one's), and so does the Trainer's column filter."""
    def converted_forward(self, *args, **kwargs):
        return forward(self, *args, **kwargs)
    return functools.update_wrapper(converted_forward, original)


# ---- norms -------------------------------------------------------------------------------------
def _norm_eps(m: nn.Module) -> Optional[float]:
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _convert_rms(m: nn.Module, offset: bool) -> Optional[str]:
    eps = _norm_eps(m)
    if eps is None or not isinstance(getattr(m, "weight", None), nn.Parameter):
        return "no eps / weight attribute"
    m._ff_eps, m._ff_offset = eps, offset
    _swap(m, _RMSNorm)
    return None


class _GatedMLP:
    _ff_what = "ff.swiglu_ffn"

    def forward(self, x):
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        if not _same_dtype(x, g.weight, u.weight, d.weight):
            return super().forward(x)
        return model_swiglu_ffn(x, g.weight, u.weight, d.weight, g.bias, u.bias, d.bias,
                                activation=self._ff_act)


def _convert_act(m: nn.Module, act, mixin: type) -> Optional[str]:
    """Swap m for mixin with its activation's ff name in m._ff_act, or say why not."""
    name = _activation(act)
    if name is None:
        return f"activation {type(act).__name__} has no fused kernel"
    m._ff_act = name
    _swap(m, mixin)
    return None


def _convert_gated_mlp(m: nn.Module) -> Optional[str]:
    if not all(isinstance(getattr(m, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        return "not gate_proj / up_proj / down_proj linears"
    return _convert_act(m, getattr(m, "act_fn", None), _GatedMLP)


# ---- encoders (BERT, RoBERTa, DistilBERT, ViT) and GPT-2 ------------------------------------------
class _BertAddNorm:
    """BertSelfOutput / BertOutput: LayerNorm(dropout(dense(h)) + x)."""
    _ff_what = "ff.add_layer_norm (dense -> dropout -> add + LayerNorm)"
    _ff_reads = ("LayerNorm",)  # read, not called (hf_parts.py)

    def forward(self, hidden_states, input_tensor):
        return _layer_norm_added(self.LayerNorm, self.dropout(self.dense(hidden_states)), input_tensor)


def _bert_ff_chunk(layer, attention_output, original):
    """BERT's feed-forward chunk: ff.ffn over intermediate.dense and output.dense, then the fused
    add + LayerNorm (`original` where the dtypes differ)."""
    inner, out = layer.intermediate.dense, layer.output.dense
    if not _same_dtype(attention_output, inner.weight, out.weight):
        return original(attention_output)
    y = ffn(attention_output, inner.weight, inner.bias, out.weight, out.bias, layer._ff_act)
    return _layer_norm_added(layer.output.LayerNorm, layer.output.dropout(y), attention_output)


class _BertLayer:
    _ff_what = "ff.ffn + ff.add_layer_norm (feed-forward chunk)"
    _ff_reads = ("intermediate", "intermediate.dense", "intermediate.intermediate_act_fn", "output", "output.dense",
                 "output.LayerNorm")  # read, not called (hf_parts.py)

    def feed_forward_chunk(self, attention_output):
        return _bert_ff_chunk(self, attention_output, super().feed_forward_chunk)


class _LongformerLayer:
    """Longformer's layer: BERT's feed-forward chunk under the name ff_chunk."""
    _ff_what, _ff_reads = _BertLayer._ff_what, _BertLayer._ff_reads

    def ff_chunk(self, attn_output):
        return _bert_ff_chunk(self, attn_output, super().ff_chunk)


def _convert_bert_layer(m: nn.Module, mixin: type = _BertLayer) -> Optional[str]:
    inter = getattr(m, "intermediate", None)
    if not isinstance(getattr(inter, "dense", None), nn.Linear):
        return "no intermediate.dense linear"
    return _convert_act(m, getattr(inter, "intermediate_act_fn", None), mixin)


class _DistilBertBlock:
    _ff_what = "ff.add_layer_norm x2 + ff.ffn"
    _ff_reads = ("sa_layer_norm", "ffn", "ffn.lin1", "ffn.lin2", "ffn.activation",
                 "output_layer_norm")  # read, not called (hf_parts.py)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if kwargs.get("output_attentions"):
            return super().forward(hidden_states, attention_mask, **kwargs)
        attn, _ = self.attention(hidden_states, attention_mask=attention_mask, **kwargs)
        attn = _layer_norm_added(self.sa_layer_norm, attn, hidden_states)
        f = self.ffn
        if not _same_dtype(attn, f.lin1.weight, f.lin2.weight):
            return self.output_layer_norm(f(attn) + attn)
        y = f.dropout(ffn(attn, f.lin1.weight, f.lin1.bias, f.lin2.weight, f.lin2.bias, self._ff_act))
        return _layer_norm_added(self.output_layer_norm, y, attn)


def _convert_distilbert_block(m: nn.Module) -> Optional[str]:
    f = getattr(m, "ffn", None)
    if getattr(f, "chunk_size_feed_forward", 0):
        return "the FFN is chunked (chunk_size_feed_forward)"
    return _convert_act(m, getattr(f, "activation", None), _DistilBertBlock)


class _LinearMLP:
    """fc1 -> act -> fc2 (ViT's MLP: fc1 / fc2 linears)."""
    _ff_what = "ff.ffn"

    def forward(self, hidden_states):
        if not _same_dtype(hidden_states, self.fc1.weight, self.fc2.weight):
            return super().forward(hidden_states)
        return ffn(hidden_states, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self._ff_act)


class _ViTLayer:
    _ff_what = "residual add fused into layernorm_after"
    _ff_reads = ("layernorm_after",)  # read, not called (hf_parts.py)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if kwargs.get("output_attentions"):
            return super().forward(hidden_states, attention_mask, **kwargs)
        h, _ = self.attention(self.layernorm_before(hidden_states), attention_mask, **kwargs)
        h, residual = _add_norm(self.layernorm_after, self.dropout(h), hidden_states)
        return self.dropout(self.mlp(h)) + residual


class _GPT2MLP:
    """Conv1D weights are (in, out): their transposes are the (out, in) linears ff.ffn takes."""
    _ff_what = "ff.ffn (Conv1D weights transposed)"

    def forward(self, hidden_states):
        fc, proj = self.c_fc, self.c_proj
        if not _same_dtype(hidden_states, fc.weight, proj.weight):
            return super().forward(hidden_states)
        return self.dropout(model_ffn(hidden_states, fc.weight.t(), fc.bias, proj.weight.t(), proj.bias, self._ff_act))


class _GPT2Block:
    _ff_what = "residual add fused into ln_2"
    _ff_reads = ("ln_2",)  # read, not called (hf_parts.py)

    def forward(self, hidden_states, *args, **kwargs):
        if args or kwargs.get("encoder_hidden_states") is not None or kwargs.get("output_attentions"):
            return super().forward(hidden_states, *args, **kwargs)
        kwargs.pop("encoder_attention_mask", None)
        kwargs.pop("encoder_hidden_states", None)
        attn, _ = self.attn(self.ln_1(hidden_states), **kwargs)
        h, residual = _add_norm(self.ln_2, attn, hidden_states)
        return residual + self.mlp(h)


# ---- T5 feed-forward -------------------------------------------------------------------------------
class _T5DenseActDense:
    _ff_what = "ff.ffn (dropout fused)"

    def forward(self, hidden_states):
        if not _same_dtype(hidden_states, self.wi.weight, self.wo.weight):
            return super().forward(hidden_states)
        p = self.dropout.p if self.training else 0.0
        return model_ffn(hidden_states, self.wi.weight, self.wi.bias, self.wo.weight, self.wo.bias, self._ff_act, p)


class _T5DenseGatedActDense:
    _ff_what = "ff.swiglu_ffn"

    def forward(self, hidden_states):
        wg, wu, wo = self.wi_0, self.wi_1, self.wo
        if (self.training and self.dropout.p > 0) or not _same_dtype(hidden_states, wg.weight, wu.weight, wo.weight):
            return super().forward(hidden_states)
        return model_swiglu_ffn(hidden_states, wg.weight, wu.weight, wo.weight, wg.bias, wu.bias, wo.bias,
                                activation=self._ff_act)


# ---- linear layers ---------------------------------------------------------------------------------
class _FewRowsLinear:
    """nn.Linear on ops/linear.py's linear: few-row calls without autograd (decode steps) read
    the weights with its kernel, bf16 training takes its weight gradient from the AMX kernel;
    every other call is F.linear, as before."""
    _ff_what = "ff linear (decode-time rows on the few-row kernel, bf16 weight gradients on AMX)"

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class _FastDropout:
    """nn.Dropout in training on ops/dropout.py (the Philox mask, regenerated in the backward);
    eval, p = 0, inplace and compiled calls run nn.Dropout's forward."""
    _ff_what = "ops/dropout.py (fastformer's Philox mask)"

    def forward(self, input):
        if not self.training or self.p == 0.0 or self.inplace or torch.compiler.is_compiling():
            return super().forward(input)
        return dropout(input, self.p)


class _CompiledEmbedding:
    """nn.Embedding on ops/embedding.py: the same lookup; under torch.compile its backward is
    aten's kernel, not inductor's generated scatter-add (3x slower on a bf16 vocab table).
    max_norm (renormalizes the weight in place) and sparse gradients run nn.Embedding's forward."""
    _ff_what = "ops/embedding.py (aten's embedding backward under torch.compile)"

    def forward(self, input):
        if self.max_norm is not None or self.sparse:
            return super().forward(input)
        return embedding(input, self.weight, self.padding_idx, self.scale_grad_by_freq)


class _Conv1DLinear:
    """GPT-2's Conv1D (weight (in, out), y = x W + b) as ops/linear.py's linear on the weight's
    transpose (a view): bf16 training takes the weight gradient from the AMX kernel."""
    _ff_what = "ff linear (weight read transposed; bf16 weight gradients on AMX)"

    def forward(self, x):
        if x.dtype != self.weight.dtype:
            return super().forward(x)
        return linear(x, self.weight.t(), self.bias)


# ---- T5's relative-position bias ------------------------------------------------------------------
class _T5RelativeBias:
    """compute_bias returns a placeholder that carries an ff.RelativePositionBias over the
    layer's own table: the attention function (integrations/transformers.py) hands it to the
    kernels, which read the bias of (i, j) from an (H, Lq + Lk - 1) gather of the table and
    return its gradient, instead of T5 building and adding a (1, H, Lq, Lk) tensor per call
    (and its gradient in training). Under another attention implementation: the original."""
    _ff_what = "ff.RelativePositionBias (the bias inside the attention kernels)"
    _ff_reads = ("relative_attention_bias",)  # read, not called (hf_parts.py)

    def compute_bias(self, query_length, key_length, device=None, past_seen_tokens=0):
        from . import transformers as ff_hf
        if self.config._attn_implementation != ff_hf.NAME:
            return super().compute_bias(query_length, key_length, device, past_seen_tokens)
        from ..ops.attention import RelativePositionBias
        table = self.relative_attention_bias.weight
        bias = RelativePositionBias(table, bidirectional=not self.is_decoder,
                                    max_distance=self.relative_attention_max_distance)
        return ff_hf.relative_bias_placeholder(bias, int(past_seen_tokens), query_length,
                                               key_length)


def _convert_t5_attention(m: nn.Module) -> Optional[str]:
    if not getattr(m, "has_relative_attention_bias", False):
        return "no relative-position table (the layers that reuse the first layer's bias)"
    if m.relative_attention_num_buckets != m.relative_attention_bias.weight.shape[0]:
        return "the table's rows differ from relative_attention_num_buckets"
    _swap(m, _T5RelativeBias)
    return None


# ---- the LM head and its loss (the mixins: integrations/hf_lm_loss.py) ---------------------------
def _convert_causal_lm(m: nn.Module, softcap_from_config: bool = True, mixin: type = _CausalLMLoss) -> Optional[str]:
    """softcap_from_config: the family's forward caps the logits by the config's
    final_logit_softcapping (Gemma 2/3); a forward in Llama's form does not, whatever its
    config holds."""
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or decoder_of(m) is None:
        return "no nn.Linear LM head over a base model"
    m._ff_softcap = getattr(m.config, "final_logit_softcapping", None) if softcap_from_config else None
    _swap(m, mixin)
    return None


def _convert_llama_form_lm(m: nn.Module) -> Optional[str]:
    return _convert_causal_lm(m, softcap_from_config=False)


def _convert_moe_form_lm(m: nn.Module) -> Optional[str]:
    """Mixtral's CausalLM form (Qwen2/3-MoE, OLMoE, PhiMoE, MiniMax, ...): the router's
    load-balancing loss added when asked for."""
    return _convert_causal_lm(m, softcap_from_config=False, mixin=_MoECausalLMLoss)


# ---- the table -------------------------------------------------------------------------------------
_RMS_FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2", "Gemma3", "Gemma3Text")
_CONVERTERS: dict = {}
for _f in _RMS_FAMILIES:
    _CONVERTERS[f"{_f}RMSNorm"] = lambda m, gemma=_f.startswith("Gemma"): _convert_rms(m, gemma)
    _CONVERTERS[f"{_f}MLP"] = _convert_gated_mlp
    _CONVERTERS[f"{_f}DecoderLayer"] = (
        (lambda m: _swap(m, _SandwichDecoderLayer)) if _f.startswith(("Gemma2", "Gemma3"))
        else (lambda m: _swap(m, _PreNormDecoderLayer)))
    _CONVERTERS[f"{_f}ForCausalLM"] = _convert_causal_lm
    _CONVERTERS[f"{_f}Attention"] = lambda m: convert_rotary_attention(m, _swap)
for _f in ("Bert", "Roberta"):
    _CONVERTERS[f"{_f}SelfOutput"] = lambda m: _swap(m, _BertAddNorm)
    _CONVERTERS[f"{_f}Output"] = lambda m: _swap(m, _BertAddNorm)
    _CONVERTERS[f"{_f}Layer"] = _convert_bert_layer
_CONVERTERS.update({
    "T5LayerNorm": lambda m: _convert_rms(m, False),
    "NemotronLayerNorm1P": lambda m: _swap(m, LayerNorm1PMixin) if m.elementwise_affine else "no weight",
    "DistilBertTransformerBlock": _convert_distilbert_block,
    "ViTLayer": lambda m: _swap(m, _ViTLayer),
    "ViTMLP": lambda m: _convert_act(m, getattr(m, "activation_fn", None), _LinearMLP),
    "GPT2Block": lambda m: _swap(m, _GPT2Block),
    "GPT2MLP": lambda m: _convert_act(m, getattr(m, "act", None), _GPT2MLP),
    "T5DenseActDense": lambda m: _convert_act(m, getattr(m, "act", None), _T5DenseActDense),
    "T5DenseGatedActDense": lambda m: _convert_act(m, getattr(m, "act", None), _T5DenseGatedActDense),
    "GPT2LMHeadModel": _convert_causal_lm,
    "T5Attention": _convert_t5_attention,
    "FalconLinear": lambda m: (_swap(m, _FewRowsLinear) if type(m).__module__.startswith("transformers.")
                               else "not transformers' FalconLinear"),
    "MptBlock": lambda m: convert_mpt_block(m, _swap),
    "Linear": lambda m: _swap(m, _FewRowsLinear) if type(m) is nn.Linear else "a subclass of nn.Linear",
    "Dropout": lambda m: _swap(m, _FastDropout) if type(m) is nn.Dropout else "a subclass of nn.Dropout",
    "Embedding": (lambda m: _swap(m, _CompiledEmbedding) if type(m) is nn.Embedding
                  else "a subclass of nn.Embedding"),
    "Conv1D": lambda m: (_swap(m, _Conv1DLinear) if type(m).__module__.startswith("transformers.")
                         else "not transformers' Conv1D"),
})
# attention modules in their model's own code: BLOOM, MPT, Falcon, GPT-Neo, XGLM, GPT-NeoX-Japanese,
# WavLM, DeBERTa, MPNet (hf_own_attention.py); BERT's, ViT's, BART's and GPT-2's written out (TAPAS, RemBERT,
# Megatron-BERT, VisualBERT, FLAVA, ViLT, LXMERT, RoFormer, BLIP, TrOCR, LED's and MVP's decoders,
# FSMT, Table Transformer, Bark, OpenAI GPT, XLM, FlauBERT: hf_written_out.py); Longformer's and
# LED's window with global tokens (hf_longformer.py); MobileViT's, PVT's, PVT v2's, GLPN's,
# CvT's and TimeSformer's (hf_vision_attention.py)
_OWN_ATTENTION = {**OWN_ATTENTION, **WRITTEN_OUT_ATTENTION, **LONGFORMER_ATTENTION, **VISION_ATTENTION}
_CONVERTERS.update({name: (lambda m, convert=convert: convert(m, _swap)) for name, convert in _OWN_ATTENTION.items()})
_CONVERTERS.update(seq2seq_named(_swap))
_CONVERTERS["BarkBlock"] = lambda m: (_swap(m, _BarkBlock) if type(m).__module__.startswith("transformers.")
                                      else "not transformers' BarkBlock")




# Modules of any other family whose forward is, instruction for instruction, Llama's (Gemma's,
# BERT's) get the same conversion: transformers writes most decoder models from Llama's modules
# ("modular" files), so Mixtral's, Qwen-MoE's, DeepSeek-V3's, gpt-oss's and Phi-3's RMSNorms,
# SmolLM3's and OLMoE's MLPs and decoder layers, ... run the code the families above run. The
# test is the forward's bytecode, names and local names, and those of the family's functions and
# the class's methods it calls (hf_rotary.class_form): the same attributes, called in the same
# order, with the same arithmetic.
def _convert_bert_form_layer(m: nn.Module, chunk: str = "feed_forward_chunk",
                             mixin: type = _BertLayer) -> Optional[str]:
    """A layer converted as BertLayer where its feed-forward chunk (the method `chunk`: BERT's
    code, with its local names where they are BERT's), intermediate and output are BERT's."""
    from transformers.models.bert import modeling_bert as bert
    forms = [(getattr(m, "intermediate", None), "forward", bert.BertIntermediate),
             (getattr(m, "output", None), "forward", bert.BertOutput)]
    if any(getattr(type(obj), name, None) is None or class_form(type(obj), name) != class_form(bert_cls, name)
           for obj, name, bert_cls in forms):
        return "its intermediate or output is not BERT's"
    method, bert_method = getattr(type(m), chunk, None), bert.BertLayer.feed_forward_chunk
    if method is None or method.__code__.co_code != bert_method.__code__.co_code \
            or method.__code__.co_names != bert_method.__code__.co_names:
        return f"its {chunk} is not BERT's feed-forward chunk"
    return _convert_bert_layer(m, mixin)


def _convert_bert_form_add_norm(m: nn.Module) -> Optional[str]:
    if layer_norm_params(getattr(m, "LayerNorm", None)) is None:
        return "its LayerNorm is not an nn.LayerNorm over the last dimension (or DeBERTa's)"
    _swap(m, _BertAddNorm)
    return None


# The layers around the written-out BERT attention (hf_written_out.py: TAPAS, RemBERT, VisualBERT,
# BLIP's text decoder, RoFormer; Longformer's, hf_longformer.py): their forwards are not
# BertLayer's (cross-attention, rotary tables, their own outputs), their feed-forward chunks are
# (Longformer's named ff_chunk), converted where the chunk, intermediate and output are BERT's.
_CONVERTERS.update({name: _convert_bert_form_layer for name in ("TapasLayer", "RemBertLayer", "VisualBertLayer",
                                                                "BlipTextLayer", "RoFormerLayer")})
_CONVERTERS["LongformerLayer"] = lambda m: _convert_bert_form_layer(m, "ff_chunk", _LongformerLayer)


@functools.lru_cache(maxsize=None)
def _forms() -> dict:
    from transformers.models.bert import modeling_bert as bert
    from transformers.models.blip import modeling_blip as blip
    from transformers.models.gemma import modeling_gemma
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.llama4 import modeling_llama4 as l4
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.siglip import modeling_siglip as siglip
    return {
        **seq2seq_forms(class_form, _swap),
        class_form(siglip.SiglipEncoderLayer): lambda m: _swap(m, _PreNormEncoderLayer),
        class_form(blip.BlipEncoderLayer): lambda m: _swap(m, _PreNormEncoderLayer),
        class_form(bert.BertSelfOutput): _convert_bert_form_add_norm,
        class_form(bert.BertOutput): _convert_bert_form_add_norm,
        class_form(bert.BertLayer): _convert_bert_form_layer,
        class_form(llama.LlamaRMSNorm): lambda m: _convert_rms(m, False),
        class_form(modeling_gemma.GemmaRMSNorm): lambda m: _convert_rms(m, True),
        class_form(llama.LlamaMLP): _convert_gated_mlp,
        class_form(llama.LlamaDecoderLayer): lambda m: _swap(m, _PreNormDecoderLayer),
        class_form(modeling_gemma2.Gemma2DecoderLayer): lambda m: _swap(m, _SandwichDecoderLayer),
        class_form(llama.LlamaForCausalLM): _convert_llama_form_lm,
        class_form(modeling_mixtral.MixtralForCausalLM): _convert_moe_form_lm,
        # Llama's layer but for the keywords it passes to self_attn (no use_cache): Mixtral, ...
        class_form(modeling_mixtral.MixtralDecoderLayer): lambda m: _swap(m, _PreNormDecoderLayer),
        class_form(l4.Llama4TextRMSNorm): lambda m: _convert_rms(m, False),
        class_form(l4.Llama4TextDecoderLayer): lambda m: _swap(m, _Llama4DecoderLayer),
        class_form(l4.Llama4TextMoe): lambda m: hf_moe.convert_input_weighted_moe(m, _swap),
        class_form(l4.Llama4ForCausalLM): _convert_llama_form_lm,
    }


@functools.lru_cache(maxsize=None)
def _converter_by_form(cls: type) -> Optional[Callable]:
    """The converter of a module class outside the table whose forward has a Llama form (an
    attention module: its module's apply_rotary_pos_emb, hf_rotary.rotary_mixin), else None."""
    if not cls.__module__.startswith("transformers.") or not hasattr(cls, "forward"):
        return None
    convert = _forms().get(class_form(cls))
    if convert is None and cls.__name__.endswith("Attention") and rotary_mixin(cls)[0] is not None:
        convert = lambda m: convert_rotary_attention(m, _swap)  # noqa: E731
    return convert


_MLP_NAME = re.compile(r"MLP|Mlp|FeedForward|FFN|Ffn")  # modules the report names when left


def _convert_mlp_by_form(m: nn.Module) -> Optional[str]:
    return convert_mlp_by_form(m, _swap)


def _key(m: nn.Module) -> str:
    name = type(m).__name__
    if name == "TransformerBlock" and type(m).__module__.endswith("distilbert.modeling_distilbert"):
        return "DistilBertTransformerBlock"
    return name


# Families transformers runs as eager only (no sdpa or attention-backend flag) whose attention
# calls the attention interface with the mask eager builds: our attention function takes them
# (each checked against eager by tests/test_hf_sweep_models.py; Splinter was not: 2.5e-2 off
# without an attention mask).
_EAGER_ONLY_INTERFACE = frozenset({"markuplm", "longt5", "switch_transformers", "nllb-moe",
                                   "pegasus_x", "speech_to_text"})


def convert_transformers(model: nn.Module, replaced: list, left: list, loss: bool = True) -> None:
    """Swap the modules of a transformers model listed above (in place); append
    (path, type, what) to ``replaced`` and (path, type, reason) to ``left``."""
    from . import transformers as ff_hf
    ff_hf.register()
    # Our attention function stands in for sdpa: a model transformers runs only as eager keeps it
    # (GIT's text attention adds the mask built for config._attn_implementation itself: 0.08 of
    # its largest output off), but for the families in _EAGER_ONLY_INTERFACE.
    takes_sdpa = bool(getattr(model, "_supports_sdpa", False) or getattr(model, "_supports_attention_backend", False)
                      or getattr(getattr(model, "config", None), "model_type", None) in _EAGER_ONLY_INTERFACE)
    interface = any(calls_attention_interface(type(m)) for m in model.modules())
    if takes_sdpa and interface:
        model.set_attn_implementation(ff_hf.NAME)
        replaced.append(("", type(model).__name__, f"attention: attn_implementation={ff_hf.NAME!r}"))
    elif not interface:
        own = [m for m in model.modules() if type(m).__name__ in _OWN_ATTENTION]
        left.append(("", type(model).__name__, "its attention modules do not call transformers' attention "
                     "interface (their own code or torch's SDPA): attn_implementation left as it was"
                     + ("; the ones listed as replaced run on ff.attention" if own else "")))
    else:
        left.append(("", type(model).__name__, "transformers runs its attention as eager only (no sdpa, no "
                     "attention backend): attn_implementation left as it was"))
    experts = []
    for path, m in model.named_modules():
        if hf_moe.is_experts(m):
            why = hf_moe.convert_experts(m)
            if why:
                left.append((path, type(m).__name__, why))
            else:
                experts.append(m)
                replaced.append((path, type(m).__name__, "ff.moe_ffn (experts_implementation='fastformer')"))
            continue
        if getattr(type(m), "_fastformer_original", None) is not None:
            continue  # converted already
        convert: Optional[Callable] = _CONVERTERS.get(_key(m)) or _converter_by_form(type(m))
        if convert is None and mlp_candidate(m):
            convert = _convert_mlp_by_form
        if convert is None or (not loss and convert in (_convert_causal_lm, _convert_llama_form_lm, _convert_moe_form_lm)):
            continue
        name = type(m).__name__
        why = convert(m)  # the module's hooks keep firing: it is the same object
        if why:
            if convert is not _convert_mlp_by_form or _MLP_NAME.search(name):
                left.append((path, name, why))
        else:
            replaced.append((path, name, type(m).__mro__[1]._ff_what))
    hf_moe.select(experts)


__all__ = ["convert_transformers", "is_transformers_model"]
