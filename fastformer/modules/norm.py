"""ff.LayerNorm and ff.RMSNorm: nn.LayerNorm / nn.RMSNorm with fused kernels.

They subclass the torch.nn modules, so constructor arguments, parameters, state_dict keys and
``isinstance(m, nn.LayerNorm)`` are all unchanged; only ``forward`` runs fastformer.
"""
from __future__ import annotations

import torch
from torch import nn

from ..ops.norm import add_layer_norm, rms_norm


def _flatten_normalized(x: torch.Tensor, normalized_shape: tuple, fn: str) -> torch.Tensor:
    k = len(normalized_shape)
    if tuple(x.shape[-k:]) != tuple(normalized_shape):
        raise ValueError(f"{fn}: input's last {k} dims must be {tuple(normalized_shape)}, "
                         f"got shape {tuple(x.shape)}")
    return x.reshape(*x.shape[:-k], -1) if k > 1 else x


class LayerNorm(nn.LayerNorm):
    """Drop-in ``nn.LayerNorm``; ``forward(x, residual=None)`` optionally fuses ``x + residual``."""

    def forward(self, input: torch.Tensor, residual: torch.Tensor = None) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        x = _flatten_normalized(input, shape, "LayerNorm")
        if residual is not None:
            residual = _flatten_normalized(residual, shape, "LayerNorm")
        weight = self.weight.reshape(-1) if self.weight is not None else None
        bias = self.bias.reshape(-1) if self.bias is not None else None
        y = add_layer_norm(x, residual, weight, bias, self.eps)
        return y.reshape(input.shape) if len(shape) > 1 else y


class RMSNorm(nn.RMSNorm):
    """Drop-in ``nn.RMSNorm`` (eps=None means ``torch.finfo(dtype).eps``, as in torch)."""

    def forward(self, input: torch.Tensor, residual: torch.Tensor = None) -> torch.Tensor:
        shape = tuple(self.normalized_shape)
        x = _flatten_normalized(input, shape, "RMSNorm")
        if residual is not None:
            residual = _flatten_normalized(residual, shape, "RMSNorm")
        weight = self.weight.reshape(-1) if self.weight is not None else None
        eps = self.eps if self.eps is not None else torch.finfo(input.dtype).eps
        y = rms_norm(x, weight, eps, residual=residual)
        return y.reshape(input.shape) if len(shape) > 1 else y
