"""Norms of transformers models and the residual adds before them, on the fused kernels: shared
by the layer converters (hf_convert.py, hf_seq2seq_forms.py).

A residual block ``norm(x + residual)`` written eagerly reads and writes the stream three times
(the add, the norm's statistics, its output); ``ff.add_layer_norm`` / ``ff.rms_norm(...,
residual=)`` read x and the residual once and write the output (and, for a pre-norm block,
the sum) once. Calls these kernels do not take (weights in another dtype than the stream, a
LayerNorm over more than one dimension) run as eager.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.norm import add_layer_norm, rms_norm
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


def layer_norm_added(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """norm(x + residual) for a LayerNorm, fused."""
    if isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1 and \
            same_dtype(x, norm.weight, norm.bias):
        return add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps)
    return norm(x + residual)


__all__ = ["RMSNormMixin", "add_norm", "layer_norm_added"]
