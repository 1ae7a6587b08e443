"""ff.FeedForward and ff.SwiGLU: feed-forward blocks whose forward is one fused op.

Parameters are ordinary ``nn.Linear`` submodules, so initialisation, ``state_dict`` keys and
weight tying work as in PyTorch:

* ``FeedForward``: ``linear1`` (d_model -> dim_feedforward) and ``linear2`` (dim_feedforward ->
  d_model): the names ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` use for
  their feed-forward block, so a layer's ``linear1.*`` / ``linear2.*`` state_dict entries load
  as they are. Its ``dropout`` is the dropout between them (a layer's ``self.dropout``).
* ``SwiGLU``: ``gate_proj`` and ``up_proj`` (d_model -> hidden) and ``down_proj`` (hidden ->
  d_model), the names of Hugging Face's ``LlamaMLP``, whose state_dict loads as is. Mapped onto
  a Transformer layer, ``down_proj`` takes ``linear2``'s place and the (gate_proj, up_proj) pair
  ``linear1``'s.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.ffn import ACTIVATIONS, ffn, swiglu_ffn


def _activation(cls: str, activation) -> str:
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{cls}: `activation` must be one of {', '.join(map(repr, ACTIVATIONS))}; "
                         f"got {activation!r}")
    return activation


class FeedForward(nn.Module):
    """``linear2(dropout(act(linear1(x))))`` in one fused op (:func:`fastformer.ffn`).

    Args:
        d_model, dim_feedforward: feature sizes.
        activation: ``"relu"``, ``"gelu"`` (exact), ``"gelu_tanh"``, ``"silu"``, ``"quick_gelu"``,
            ``"relu2"``.
        dropout: probability on the hidden activation, applied in training mode only.
        bias: whether ``linear1`` and ``linear2`` have biases.
    """

    def __init__(self, d_model: int, dim_feedforward: int, activation: str = "relu",
                 dropout: float = 0.0, bias: bool = True, device=None, dtype=None):
        super().__init__()
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"FeedForward: `dropout` must be in [0, 1), got {dropout}")
        factory = dict(device=device, dtype=dtype)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.activation = _activation("FeedForward", activation)
        self.dropout = float(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ffn(x, self.linear1.weight, self.linear1.bias, self.linear2.weight,
                   self.linear2.bias, self.activation, self.dropout if self.training else 0.0)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, dropout={self.dropout}"


class SwiGLU(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` in one fused op (:func:`swiglu_ffn`);
    ``activation="silu"`` is SwiGLU, ``"gelu"``/``"gelu_tanh"`` GeGLU, ``"relu"`` ReGLU."""

    def __init__(self, d_model: int, hidden: int, bias: bool = False, activation: str = "silu",
                 device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias, **factory)
        self.up_proj = nn.Linear(d_model, hidden, bias=bias, **factory)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias, **factory)
        self.activation = _activation("SwiGLU", activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_ffn(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                          self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias,
                          self.activation)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
