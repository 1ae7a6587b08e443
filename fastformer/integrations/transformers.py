"""Hugging Face transformers: ``attn_implementation="fastformer"``.

    import fastformer.integrations.transformers as ff_hf
    ff_hf.register()
    model = AutoModel.from_config(config, attn_implementation="fastformer")

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
transformers' SDPA mask builder to its ``AttentionMaskInterface`` under the same name, so models
that dispatch through them (BERT, GPT-2, Llama, ... in transformers >= 4.48) build the same masks
as for ``"sdpa"`` (bool, True = attend, or None) and call ``ff.attention`` instead of
``F.scaled_dot_product_attention``: grouped-query attention without repeating the kv heads,
padding and causal masks read blockwise, dropout without storing a mask.

transformers is imported only when :func:`register` is called (it is an optional dependency).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..ops.attention import attention

NAME = "fastformer"


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      **kwargs) -> tuple:
    """transformers' attention-function contract: query (B, H, Lq, D), key/value (B, Hkv, Lk, D),
    attention_mask None / bool (True = attend) / float (added), broadcastable to
    (B, H, Lq, Lk). Returns (output (B, Lq, H, D), None): attention weights are not computed
    (as with "sdpa"); models asked for them should use attn_implementation="eager".

    Causality follows transformers' SDPA integration: the module's ``is_causal`` unless the
    call overrides it, applied only when no mask was built and Lq > 1 (top-left aligned, as
    ``is_causal`` in torch SDPA)."""
    for unsupported in ("softcap", "sliding_window", "position_bias", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"fastformer attention: `{unsupported}` is not supported; use "
                             "attn_implementation='eager' or 'sdpa' for this model")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(is_causal) and attention_mask is None and query.shape[2] > 1
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.to(query.dtype)
    out = attention(query, key, value, causal=causal, attn_mask=attention_mask, scale=scaling,
                    dropout_p=float(dropout))
    # (B, H, Lq, D) stored as (B, Lq, H, D): the transpose is the contiguous tensor, no copy.
    return out.transpose(1, 2), None


def register(name: str = NAME) -> None:
    """Register fastformer attention with transformers under ``name`` ("fastformer")."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise ImportError("fastformer.integrations.transformers.register needs transformers "
                          "(pip install transformers)") from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)


__all__ = ["register", "attention_forward", "NAME"]
