"""CausalLM heads whose loss runs on ``ff.linear_cross_entropy`` (hf_convert.py swaps them in).

With labels, the decoder's hidden states go into ff.linear_cross_entropy against the shifted
targets: the (tokens x vocab) logits are never materialized and not returned (as Liger-Kernel);
without labels (logits, generation) the original forward runs.
"""
from __future__ import annotations

import sys

from torch import nn


def _shifted_loss(model: nn.Module, hidden, labels, num_items):
    """The LM loss of hidden's next-token logits (labels shifted left, -100 ignored): a mean over
    the labelled tokens, or their sum / num_items_in_batch (gradient accumulation)."""
    from .. import linear_cross_entropy
    head = model.get_output_embeddings()
    target = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].to(hidden.device)
    softcap = model._ff_softcap
    if num_items is None:
        return linear_cross_entropy(hidden, head.weight, target, head.bias, softcap=softcap)
    return linear_cross_entropy(hidden, head.weight, target, head.bias, softcap=softcap,
                                reduction="sum") / num_items


def decoder_of(model: nn.Module):
    """The base model a CausalLM's forward runs (its base_model_prefix attribute, or `model`:
    Llama 4's prefix names the multimodal model's attribute); None if neither is a module."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    base = base if isinstance(base, nn.Module) else getattr(model, "model", None)
    return base if isinstance(base, nn.Module) else None


def _output(cls, loss, outputs, **extra):
    out = {"loss": loss, "logits": None, "hidden_states": outputs.hidden_states,
           "attentions": outputs.attentions, **extra}
    for name in ("cache", "past_key_values"):  # the cache's field (renamed in transformers 5)
        if name in cls.__dataclass_fields__:
            out[name] = getattr(outputs, name, None)
    return cls(**out)


def _head_path(model: nn.Module) -> tuple:
    """The output embeddings' path: the one child the loss reads (integrations/hf_parts.py); it
    calls the decoder."""
    head = model.get_output_embeddings()
    return tuple(name for name, m in model.named_modules() if m is head and name)[:1]


def _with_labels(self, args, kwargs) -> bool:
    return kwargs.get("labels") is not None


class CausalLMLoss:
    """Llama's form (and every family ff.convert lists): the LM loss."""
    _ff_what = "ff.linear_cross_entropy with labels"
    _ff_reads, _ff_reads_when = _head_path, _with_labels

    def forward(self, *args, labels=None, **kwargs):
        if labels is None or args or kwargs.get("return_dict") is False:
            return super().forward(*args, labels=labels, **kwargs)
        kwargs.pop("logits_to_keep", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        outputs = decoder_of(self)(**kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast
        return _output(CausalLMOutputWithPast, _shifted_loss(self, outputs.last_hidden_state, labels, num_items),
                       outputs)


class MoECausalLMLoss:
    """Mixtral's form (mixture-of-experts CausalLMs): the LM loss, plus router_aux_loss_coef times
    the family's load_balancing_loss_func of the router logits when output_router_logits."""
    _ff_what = "ff.linear_cross_entropy with labels (plus the router's load-balancing loss)"
    _ff_reads, _ff_reads_when = _head_path, _with_labels

    def forward(self, *args, labels=None, output_router_logits=None, **kwargs):
        if labels is None or args or kwargs.get("return_dict") is False:
            return super().forward(*args, labels=labels, output_router_logits=output_router_logits, **kwargs)
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        kwargs.pop("logits_to_keep", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        outputs = decoder_of(self)(output_router_logits=output_router_logits, **kwargs)
        loss = _shifted_loss(self, outputs.last_hidden_state, labels, num_items)
        aux_loss = None
        if output_router_logits:
            family = sys.modules[type(self)._fastformer_original.__module__]
            aux_loss = family.load_balancing_loss_func(outputs.router_logits, self.num_experts,
                                                       self.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast
        return _output(MoeCausalLMOutputWithPast, loss, outputs, aux_loss=aux_loss,
                       router_logits=outputs.router_logits)


__all__ = ["CausalLMLoss", "MoECausalLMLoss", "decoder_of"]
