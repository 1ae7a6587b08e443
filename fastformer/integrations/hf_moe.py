"""Mixture-of-experts blocks of Hugging Face models on ``ff.moe_ffn``.

transformers (5.x) writes the routed experts of Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss, DeepSeek-V2/V3,
GLM-4-MoE, Granite-MoE, ... as one module holding stacked weights (``gate_up_proj`` (E, 2F, D),
``down_proj`` (E, D, F)) whose forward(hidden_states, top_k_index, top_k_weights) is chosen by
``config._experts_implementation`` among the functions registered in its ``ExpertsInterface``
(``@use_experts_implementation``). :func:`register` adds :func:`experts_forward` there as
``"fastformer"``; ``ff.convert`` selects it for every experts module it takes
(:func:`convert_experts`) and names the others, with the reason, in its report.

Taken: gated experts, gate and up rows concatenated or interleaved, stored either way round (the
transposed (E, D, 2F) layout is read through views), with or without biases, with transformers'
default gate (``act_fn(gate) * up``, an activation of the fused kernels), gpt-oss's clamped
SwiGLU (interleaved; MiniMax-M3's on halves) or DeepSeek-V4's clamped ``act(gate) * up`` (each
``_apply_gate`` recognized by its bytecode), and experts without a gate (``up_proj`` only:
NemotronH's relu2 experts, ``gated=False``). Not taken: any other ``_apply_gate``, a norm after
each expert. A call the kernels do not take (activations in
another dtype than the weights, expert parallelism's sentinel ids) runs the implementation the
module had before conversion. Under
torch.compile ff.moe_ffn is a custom-op pair: a converted model compiles fullgraph on it.

Llama 4 writes its MoE block outside that interface (``Llama4TextMoe``): every token runs
through every expert, its input scaled by the router's sigmoid score, which is 0 for the experts
outside the top k (and an expert without biases maps 0 to 0). :func:`convert_input_weighted_moe`
runs the block's forward on ``ff.moe_ffn(..., weights_on="input")`` over the top-k experts only
(Llama 4 Scout: 1 of 16 experts' FLOPs), for every block whose forward, router and experts are
Llama 4's instruction for instruction.

Against transformers' default on CPU (``grouped_mm``), a Mixtral-style block (8 experts of
1024 -> 3584, top 2, 1024 tokens) on the 2-core AMX Xeon: see benchmarks/RESULTS.md (Whole
models, mixture of experts).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from ..ops.moe import moe_ffn
from .hf_mlp_forms import activation_name
from .hf_rotary import class_form

NAME = "fastformer"
_FALLBACK_ATTR = "_ff_experts_fallback"


def is_experts(m: nn.Module) -> bool:
    """m is a transformers experts module with a selectable implementation."""
    return (hasattr(m, "has_gate") and hasattr(m, "is_concatenated") and hasattr(m, "is_transposed")
            and hasattr(m, "config") and getattr(type(m).forward, "__wrapped__", None) is not None)


def _gate_of(m: nn.Module):
    """(ff.moe_ffn's gate keywords for m, None) or (None, why not)."""
    from transformers.integrations.moe import _default_apply_gate
    if getattr(m, "has_post_expert_norm", False):
        return None, "a norm after each expert: not in ff.moe_ffn"
    if not m.has_gate:  # up_proj only (NemotronH): down(act(up(x)))
        act = activation_name(getattr(m, "act_fn", None))
        if act is None:
            return None, f"activation {type(getattr(m, 'act_fn', None)).__name__} has no fused kernel"
        return dict(activation=act, gated=False), None
    interleaved = not m.is_concatenated
    apply_gate = getattr(type(m), "_apply_gate", _default_apply_gate)
    limit = None
    if apply_gate is not _default_apply_gate:
        form = class_form(type(m), "_apply_gate")
        if form is None:
            return None, f"{type(m).__name__}._apply_gate: its form could not be read"
        if form == _gate_form("gpt_oss", "GptOssExperts"):  # interleaved columns
            return dict(activation="clamped_swiglu", interleaved=True, swiglu_alpha=float(m.alpha),
                        swiglu_limit=float(m.limit)), None
        if form == _gate_form("minimax_m3_vl", "MiniMaxM3VLExperts"):  # gpt-oss's, halves
            return dict(activation="clamped_swiglu", interleaved=False, swiglu_alpha=float(m.swiglu_alpha),
                        swiglu_limit=float(m.swiglu_limit)), None
        if form != _gate_form("deepseek_v4", "DeepseekV4Experts"):
            return None, (f"{type(m).__name__}._apply_gate is none of act(gate) * up, gpt-oss's or "
                          f"MiniMax-M3's clamped SwiGLU, DeepSeek-V4's clamped act(gate) * up")
        interleaved, limit = False, float(m.limit)  # act(gate.clamp(max=L)) * up.clamp(-L, L), halves
    act = activation_name(getattr(m, "act_fn", None))
    if act is None:
        return None, f"activation {type(getattr(m, 'act_fn', None)).__name__} has no fused kernel"
    return dict(activation=act, interleaved=interleaved, swiglu_limit=limit), None


@functools.lru_cache(maxsize=None)
def _gate_form(family: str, experts_class: str):
    """The form of a transformers family's experts' _apply_gate (None where this transformers
    has no such family)."""
    import importlib
    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return None
    cls = getattr(module, experts_class, None)
    return None if cls is None else class_form(cls, "_apply_gate")


def _weights(m: nn.Module):
    """(w_gate_up (E, 2F, D) or, without a gate, w_up (E, F, D), w_down (E, D, F), their biases)
    as ff.moe_ffn reads them."""
    w_gu, w_d = (m.gate_up_proj if m.has_gate else m.up_proj), m.down_proj
    if m.is_transposed:  # stored (E, D, 2F) and (E, F, D)
        w_gu, w_d = w_gu.transpose(1, 2), w_d.transpose(1, 2)
    if not m.has_bias:
        return w_gu, w_d, None, None
    return w_gu, w_d, (m.gate_up_proj_bias if m.has_gate else m.up_proj_bias), m.down_proj_bias


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ExpertsInterface function "fastformer": ff.moe_ffn, or the module's previous
    implementation for a call it does not take (see the module docstring)."""
    w_gu, w_d, b_gu, b_d = _weights(self)
    if (getattr(self, "_ff_gate", None) is None or getattr(self, "_is_expert_parallel", False)
            or hidden_states.dtype != w_gu.dtype
            or hidden_states.dim() != 2):
        return _fallback(self)(self, hidden_states, top_k_index, top_k_weights)
    return moe_ffn(hidden_states, top_k_index, top_k_weights, w_gu, w_d, b_gu, b_d, **self._ff_gate)


def _fallback(m: nn.Module):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    original = type(m).forward.__wrapped__
    name = getattr(m, _FALLBACK_ATTR, "eager")
    if name in (None, "eager", NAME):
        return original
    return ALL_EXPERTS_FUNCTIONS.get_interface(name, original)


class InputWeightedMoE:
    """Llama 4's MoE block: the shared expert plus the top-k routed experts, each reading its
    sigmoid router score times x (the others' score is 0, their output 0); returns (out, the
    router logits) as the block does. A call with weights in another dtype than the activations
    runs the block's own forward (all experts)."""
    _ff_what = "ff.moe_ffn on the top-k experts (weights on the input)"

    def forward(self, hidden_states):
        experts = self.experts
        w_gu, w_d = experts.gate_up_proj, experts.down_proj
        if not hidden_states.dtype == w_gu.dtype == w_d.dtype == self.router.weight.dtype:
            return super().forward(hidden_states)
        x = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = nn.functional.linear(x, self.router.weight)
        top_logits, top_ids = torch.topk(router_logits, self.top_k, dim=1)
        scores = torch.sigmoid(top_logits.float()).to(router_logits.dtype)
        routed = moe_ffn(x, top_ids, scores, w_gu.transpose(1, 2), w_d.transpose(1, 2),
                         weights_on="input", **self._ff_gate)
        return self.shared_expert(x) + routed, router_logits


@functools.lru_cache(maxsize=None)
def _llama4_forms():
    from transformers.models.llama4 import modeling_llama4 as l4
    return class_form(l4.Llama4Router), class_form(l4.Llama4TextExperts)


def convert_input_weighted_moe(m: nn.Module, swap) -> Optional[str]:
    """Swap m (a block in Llama4TextMoe's form) for InputWeightedMoE, or say why not."""
    router_form, experts_form = _llama4_forms()
    router, experts = getattr(m, "router", None), getattr(m, "experts", None)
    if (not isinstance(router, nn.Linear) or router.bias is not None
            or class_form(type(router)) != router_form):
        return "its router is not Llama 4's (a linear without bias, sigmoid of the top-k logits)"
    if experts is None or class_form(type(experts)) != experts_form:
        return "its experts are not Llama 4's (stacked (E, D, 2F) gate / up and (E, F, D) down weights)"
    act = activation_name(getattr(experts, "act_fn", None))
    if act is None:
        return f"activation {type(getattr(experts, 'act_fn', None)).__name__} has no fused kernel"
    m._ff_gate = dict(activation=act)
    swap(m, InputWeightedMoE)
    return None


def register() -> None:
    """Add experts_forward to transformers' ExpertsInterface as "fastformer"."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(NAME, experts_forward)


def convert_experts(m: nn.Module) -> Optional[str]:
    """Prepare m for "fastformer": record the implementation its config names now (its fallback,
    also for a module ff.moe_ffn cannot run, whose config another module may switch) and its
    activation; the reason when ff.moe_ffn cannot run m. :func:`select` then switches the configs."""
    current = m.config._experts_implementation
    if current != NAME:
        setattr(m, _FALLBACK_ATTR, current)
    gate, why = _gate_of(m)
    if gate is not None:
        m._ff_gate = gate
    return why


def select(converted: list) -> None:
    """Name "fastformer" in the configs of the experts modules convert_experts took."""
    if not converted:
        return
    register()
    for m in converted:
        m.config._experts_implementation = NAME


__all__ = ["NAME", "InputWeightedMoE", "convert_experts", "convert_input_weighted_moe", "experts_forward",
           "is_experts", "register", "select"]
