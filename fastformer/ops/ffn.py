"""ff.ffn and ff.swiglu_ffn: temporary stub, replaced by the ffn branch.

Plain PyTorch with the signatures of DESIGN.md §3 (weights in nn.Linear layout: (out, in)), so
that the Transformer layers can call the FFN op before the fused kernels are merged:

    ffn(x)        = linear2(dropout(act(linear1(x))))
    swiglu_ffn(x) = ((act(x W_gate^T + b_gate) * (x W_up^T + b_up)) W_down^T + b_down
"""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}


def _activation(fn: str, activation: str):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{fn}: `activation` must be one of {', '.join(map(repr, _ACTIVATIONS))}; "
                         f"got {activation!r}")
    return _ACTIVATIONS[activation]


def ffn(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
        activation: str = "relu", dropout_p: float = 0.0) -> Tensor:
    """``linear2(dropout(act(linear1(x))))``; dropout is applied whenever ``dropout_p > 0``."""
    act = _activation("ffn", activation)
    h = act(F.linear(x, w1, b1))
    if dropout_p > 0:
        h = F.dropout(h, dropout_p, training=True)
    return F.linear(h, w2, b2)


def swiglu_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
               b_gate: Optional[Tensor] = None, b_up: Optional[Tensor] = None,
               b_down: Optional[Tensor] = None, activation: str = "silu") -> Tensor:
    """``(act(x W_gate^T + b_gate) * (x W_up^T + b_up)) W_down^T + b_down``."""
    act = _activation("swiglu_ffn", activation)
    return F.linear(act(F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up), w_down, b_down)


__all__ = ["ffn", "swiglu_ffn"]
