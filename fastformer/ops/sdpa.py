"""ff.scaled_dot_product_attention and ff.patch_sdpa: torch's SDPA contract on fastformer kernels.

``scaled_dot_product_attention`` takes exactly torch.nn.functional.scaled_dot_product_attention's
arguments and semantics (bool mask True = attend, float mask added, broadcasting, inputs of
shape (..., L, E), ``enable_gqa``, ``is_causal`` top-left aligned, the mask and ``is_causal``
combined when both are given, as torch 2.13 does on CPU). Inputs fastformer's op covers run
on it; anything else (5-D+ inputs with broadcast batch dims, dropout_p == 1, ...) runs torch's
own implementation, and ``ff.last_dispatch()`` says why. Errors are raised where torch raises,
as ``SDPAError``, which is both a ValueError and the RuntimeError torch raises.

One documented difference: torch returns zeros for a fully masked query row on CPU, as we do;
some torch backends return NaN there. fastformer always returns zeros and zero gradients.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import backends
from .attention import CAUSAL_NONE, CAUSAL_TOP_LEFT, AttentionOptions, _check, run

_torch_sdpa = F.scaled_dot_product_attention  # the original, kept before any patching


class SDPAError(ValueError, RuntimeError):
    """Bad input to scaled_dot_product_attention (a RuntimeError, like torch's)."""


def _fallback(reason: str, *args, **kwargs) -> Tensor:
    backends.record(backends.Dispatch("attention", "torch", False, {"fastformer": [reason]}))
    return _torch_sdpa(*args, **kwargs)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """Same contract as ``torch.nn.functional.scaled_dot_product_attention``."""
    fn = "scaled_dot_product_attention"
    args = (query, key, value)
    kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                  enable_gqa=enable_gqa)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: `{name}` must be a tensor, got {type(t).__name__}")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise SDPAError(f"{fn}: `dropout_p` must be between 0 and 1, got {dropout_p}")
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise SDPAError(f"{fn}: `query`, `key`, `value` must have the same rank >= 2, got "
                        f"{query.dim()}, {key.dim()}, {value.dim()}")
    if query.dim() > 4:
        return _fallback("inputs of rank > 4", *args, **kwargs)
    if dropout_p >= 1.0:
        return _fallback("dropout_p == 1", *args, **kwargs)
    # View as (B, H, L, E).
    lead = (1,) * (4 - query.dim())
    q = query.reshape(lead + tuple(query.shape)) if lead else query
    k = key.reshape(lead + tuple(key.shape)) if lead else key
    v = value.reshape(lead + tuple(value.shape)) if lead else value
    B, H, Lq, E = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[1] != v.shape[1]:
        if k.shape[0] in (1, B) and v.shape[0] in (1, B):
            return _fallback("broadcast batch dims", *args, **kwargs)
        raise SDPAError(f"{fn}: batch dims of `query` {tuple(query.shape)}, `key` "
                        f"{tuple(key.shape)} and `value` {tuple(value.shape)} do not match")
    Hkv = k.shape[1]
    if Hkv != H:
        if Hkv == 1 and not enable_gqa:
            pass  # broadcasts like any size-1 dim, as in torch
        elif not enable_gqa or H % Hkv:
            raise SDPAError(f"{fn}: `query` has {H} heads but `key` has {Hkv}: pass "
                            "enable_gqa=True with a number of query heads divisible by key heads")
    if k.shape[2] != v.shape[2] or k.shape[3] != E:
        raise SDPAError(f"{fn}: shapes do not match: query {tuple(query.shape)}, key "
                        f"{tuple(key.shape)}, value {tuple(value.shape)}")
    mask = attn_mask
    if mask is not None:
        if mask.dtype != torch.bool and mask.dtype != query.dtype:
            raise SDPAError(f"{fn}: `attn_mask` dtype {mask.dtype} must be bool or match the "
                            f"query dtype {query.dtype}")
        try:
            torch.broadcast_shapes(mask.shape, query.shape[:-1] + (key.shape[-2],))
        except RuntimeError as exc:
            raise SDPAError(f"{fn}: `attn_mask` of shape {tuple(mask.shape)} does not broadcast "
                            f"to {tuple(query.shape[:-1]) + (key.shape[-2],)}") from exc
        if mask.dim() > 4:
            return _fallback("attn_mask of rank > 4", *args, **kwargs)
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return _fallback(f"dtype {query.dtype}", *args, **kwargs)
    o = AttentionOptions(causal=CAUSAL_TOP_LEFT if is_causal else CAUSAL_NONE, scale=scale,
                         dropout_p=float(dropout_p), attn_mask=mask)
    out = run(q, k, v, _check(fn, q, k, v, o))[0]
    return out.reshape(tuple(query.shape[:-1]) + (value.shape[-1],)) if lead else out


class patch_sdpa:
    """Route torch.nn.functional.scaled_dot_product_attention to fastformer.

    ``with ff.patch_sdpa(): ...`` patches for the block; ``ff.patch_sdpa()`` (or
    ``ff.patch_sdpa(enable=True)``) patches until ``ff.patch_sdpa(enable=False)``. Calls
    fastformer cannot take go to torch's original function. Existing models that call SDPA
    (nn.MultiheadAttention's fast path, Hugging Face's "sdpa" attention) pick it up unchanged.
    """

    def __init__(self, enable: bool = True):
        self._previous = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = scaled_dot_product_attention if enable else _torch_sdpa

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._previous
        return False


__all__ = ["scaled_dot_product_attention", "patch_sdpa", "SDPAError"]
