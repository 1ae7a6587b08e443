"""Hugging Face transformers: ``attn_implementation="fastformer"``.

    import fastformer.integrations.transformers as ff_hf
    ff_hf.register()
    model = AutoModel.from_config(config, attn_implementation="fastformer")

:func:`register` (the only setup step) adds :func:`attention_forward` to transformers'
``AttentionInterface`` and :func:`build_mask` to its ``AttentionMaskInterface`` under the same
name, so models that dispatch through them (BERT, GPT-2, Llama, Mistral, Qwen2, Gemma 2/3,
gpt-oss, T5, ... in transformers >= 4.48) call ``ff.attention`` instead of
``F.scaled_dot_product_attention``: grouped-query attention without repeating the kv heads,
dropout without storing a mask, and every variant below computed inside the kernel.

What the attention function maps (the keywords transformers' models pass it):

==================  ===========================================================================
transformers        ``ff.attention``
==================  ===========================================================================
``scaling``         ``scale``
``dropout``         ``dropout_p``
``is_causal``       ``causal`` (the module's ``is_causal`` unless the call overrides it), aligned
                    bottom-right (query i is key i + Lk - Lq: decoding with a KV cache)
``sliding_window``  ``window=(sliding_window - 1, -1)`` with causality (d = Lk - Lq): key j is
                    visible to query i iff ``i + d - sliding_window < j <= i + d``, as
                    masking_utils' ``kv_idx > q_idx - sliding_window`` and FlashAttention's
                    ``window_size=(sliding_window - 1, sliding_window - 1)`` with causal; left
                    out when it holds every key (Lk <= sliding_window)
``softcap``         ``softcap`` (Gemma 2: ``c * tanh(s / c)`` before the mask)
``s_aux``           ``sinks`` (gpt-oss: one logit per head in every softmax denominator; its
                    gradient comes from the backward); ``sinks`` of shape (H,) the same
``position_bias``   a float ``attn_mask`` added to the scores (T5's (1, H, Lq, Lk) bias, which
                    requires grad in training: its gradient comes from the backward), combined
                    with the model's mask: bool -> -inf where masked, float -> added; after
                    ``ff.convert``, T5's bias arrives as relative_bias_placeholder()'s tag and
                    runs as ``ff.attention(position_bias=RelativePositionBias)`` (in-kernel)
==================  ===========================================================================

Any other keyword with a value (Inkling 2's per-query ``sinks``, a head mask, ...), except those
that do not change the result (``position_ids``, ``use_cache``, the packing keywords, ...:
``_NO_EFFECT``), runs the call through the family's own ``eager_attention_forward`` with the mask
converted to eager's additive form; ``ff.last_dispatch()`` names the keyword. A keyword dropped
would be a wrong answer.

Masks. transformers builds one mask per layer type and forward through
``AttentionMaskInterface[name]``; :func:`build_mask` returns one of three forms, and
:func:`attention_forward` reads them:

* **key mask** (the fast path): for transformers' plain causal and sliding-window causal
  patterns (``causal_mask_function``, ``sliding_window_causal_mask_function(w)``, no custom
  overlay, packing or chunking) whose queries are the last ``q_length`` of the keys (no cache,
  a DynamicCache, a sliding-window cache), a bool (B, Lk) tensor of the keys that are not padding
  (True = attend, FlashAttention 2's mask), tagged with the pattern's window and whether any key
  is padding. The kernel applies causality (bottom-right) and the window itself, visiting only the
  tiles of the band, and reads the padding as ``key_padding_mask`` (or nothing when there is
  none): no (Lq, Lk) mask is built. A 2D mask without the tag (e.g. copied to another device) is
  read the same way, the window then coming from ``sliding_window`` (FlashAttention 2's contract).
  Traced (torch.compile, export), where tensors carry no tags and the padding's values cannot
  be inspected, the plain causal pattern is returned as that untagged mask (None without an
  ``attention_mask``), causality coming from the module.
* **4D bool / float**: everything else, complete as transformers' SDPA mask builder makes it
  (``sdpa_mask`` without its ``is_causal`` shortcut: custom ``or``/``and`` overlays, packed
  sequences, chunked attention, static caches, sliding windows when traced) and any 4D mask the user
  passes: it is the whole pattern, no causality or window is added. Bidirectional padding masks
  (encoders, cross-attention) are returned as a broadcast (B, 1, 1, Lk) view expanded to
  (B, 1, Lq, Lk); a bool mask constant over heads and queries is passed as ``key_padding_mask``.
* **None**: no mask (bidirectional without padding); causality from ``is_causal``.

Attention weights are not computed (as with "sdpa"); models asked for them should use
``attn_implementation="eager"``. A query row whose keys are all masked (e.g. a left-padding
query) gets zeros, where eager's finfo.min mask gives the mean of the values: only outputs at
padding positions differ.

transformers is imported only when :func:`register` or :func:`build_mask` is called (it is an
optional dependency).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..ops.attention import attention
from ..ops.varlen import varlen_attention

NAME = "fastformer"

# Set by build_mask() on its (B, Lk) key masks: (window_left, any key is padding).
_KEY_MASK_TAG = "_fastformer_key_mask"
# Set by build_mask() on the (1, T) mask of packed sequences: (window_left, cu_seqlens, longest,
# T).
_PACKED_TAG = "_fastformer_packed"


# Set by relative_bias_placeholder() (T5Attention.compute_bias after ff.convert): (the
# ff.RelativePositionBias, past_seen_tokens, Lq, Lk).
_REL_BIAS_TAG = "_fastformer_rel_bias"


def relative_bias_placeholder(bias, past: int, Lq: int, Lk: int) -> Tensor:
    """What a converted T5Attention.compute_bias returns in place of the (1, H, Lq, Lk) bias:
    a 0-dim tensor tagged with the bias object (T5 only passes position_bias on, from its first
    layer to the others and into the attention function)."""
    placeholder = bias.table.new_zeros(())
    setattr(placeholder, _REL_BIAS_TAG, (bias, past, Lq, Lk))
    return placeholder


# ---- the attention function --------------------------------------------------------------------
def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      s_aux: Optional[Tensor] = None, position_bias: Optional[Tensor] = None,
                      **kwargs) -> tuple:
    """transformers' attention-function contract: query (B, H, Lq, D), key/value (B, Hkv, Lk, D),
    attention_mask None / a (B, Lk) key mask / 4D bool (True = attend) or float (added),
    broadcastable to (B, H, Lq, Lk) (see the module docstring for how each is read). Returns
    (output (B, Lq, H, D), None)."""
    B, H, Lq, _ = query.shape
    Lk = key.shape[2]
    sinks = kwargs.pop("sinks", None)
    if s_aux is None and isinstance(sinks, Tensor) and sinks.dim() == 1 and sinks.shape[0] == H:
        s_aux, sinks = sinks, None
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _NO_EFFECT)
    if sinks is not None:
        unknown.append(f"sinks of shape {tuple(sinks.shape)} (per query)")
        kwargs["sinks"] = sinks
    if unknown:
        return _family_eager(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                             sliding_window, softcap, s_aux, position_bias, unknown, kwargs)
    packed = _packed_sequences(attention_mask, kwargs, B, Lq, Lk)
    if packed is not None:
        return _varlen_forward(module, query, key, value, packed, dropout, scaling, is_causal,
                               sliding_window, softcap, s_aux), None
    key_padding_mask = attn_mask = None
    window_left = -1
    if attention_mask is None or attention_mask.dim() == 2:
        tag = getattr(attention_mask, _KEY_MASK_TAG, None)
        if tag is not None:  # build_mask(): transformers' causal / sliding pattern itself
            causal, (window_left, padded) = True, tag
        else:
            if is_causal is None:
                is_causal = getattr(module, "is_causal", True)
            causal = bool(is_causal)
            padded = attention_mask is not None
            if causal and sliding_window:
                window_left = int(sliding_window) - 1
        if padded:
            keys = attention_mask[:, -Lk:]
            if keys.shape != (B, Lk):
                raise ValueError(f"fastformer attention: the key mask has shape "
                                 f"{tuple(attention_mask.shape)}, expected ({B}, >= {Lk})")
            key_padding_mask = ~keys.bool()
        if window_left >= Lk - 1:  # the band holds every key: no window to apply
            window_left = -1
        causal_arg = ("bottom_right" if Lk != Lq else True) if causal else False
    else:  # 4D: the complete pattern
        causal_arg = False
        key_padding_mask = _as_key_padding(attention_mask, B, Lk)
        if key_padding_mask is None:
            attn_mask = attention_mask
            if attn_mask.dtype != torch.bool:
                attn_mask = attn_mask.to(query.dtype)
    relative = None
    if position_bias is not None:
        relative = getattr(position_bias, _REL_BIAS_TAG, None)
        if relative is not None:
            relative, past, bias_lq, bias_lk = relative
            if (bias_lq, bias_lk) != (Lq, Lk):
                raise ValueError(f"fastformer attention: T5's position bias was computed for "
                                 f"(Lq, Lk) = {(bias_lq, bias_lk)}, the call has {(Lq, Lk)}")
            # The kernels offset the relative positions by the causal alignment's diagonal
            # (Lk - Lq bottom-right, else 0); T5 offsets them by the tokens already cached.
            if past != (Lk - Lq if causal_arg == "bottom_right" else 0):
                position_bias, relative = relative.materialize(Lq, Lk, past), None
        if relative is None:
            attn_mask = _with_bias(position_bias, attn_mask, query.dtype)
    out = attention(query, key, value, causal=causal_arg, key_padding_mask=key_padding_mask,
                    attn_mask=attn_mask, scale=scaling, dropout_p=float(dropout),
                    window=(window_left, -1) if window_left >= 0 else None,
                    softcap=softcap if softcap else None, sinks=s_aux, position_bias=relative)
    # The cpu backend stores (B, H, Lq, D) as (B, Lq, H, D): the transpose is contiguous, no copy.
    # Other backends' outputs are (B, H, Lq, D) contiguous: models .view() the result (AfMoE,
    # JetMoE), so it is made contiguous, as transformers' sdpa function does.
    out = out.transpose(1, 2)
    return (out if out.is_contiguous() else out.contiguous()), None


# Keywords transformers' models pass the attention function that do not change its result (the
# packing keywords are read by _packed_sequences). Any other one with a value runs the family's
# own eager attention function (_family_eager): a keyword ignored is a wrong answer (Inkling 2's
# per-query `sinks` were, before this check).
_NO_EFFECT = frozenset({"position_ids", "use_cache", "output_attentions", "output_hidden_states",
                        "output_router_logits", "return_dict", "cache_position", "cu_seq_lens_q",
                        "cu_seq_lens_k", "max_length_q", "max_length_k", "layer_idx"})


def _family_eager(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                  sliding_window, softcap, s_aux, position_bias, unknown: list, kwargs: dict):
    """The call through the module's family's ``eager_attention_forward``, given the additive
    float mask it expects, for keywords the kernels do not take; the reason in last_dispatch()."""
    import sys
    from .. import backends
    family = sys.modules.get(type(module).__module__)
    eager = getattr(family, "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"fastformer attention: {type(module).__name__} passes {', '.join(unknown)}, "
                         f"which the kernels do not take, and its module has no eager_attention_forward "
                         f"to run instead; use attn_implementation='eager'")
    B, _, Lq, _ = query.shape
    Lk = key.shape[2]
    mask = _additive_mask(attention_mask, module, is_causal, sliding_window, B, Lq, Lk, query.dtype)
    relative = getattr(position_bias, _REL_BIAS_TAG, None)
    if relative is not None:  # a converted T5's placeholder: the (1, H, Lq, Lk) bias itself
        position_bias = relative[0].materialize(Lq, Lk, relative[1])
    named = dict(dropout=dropout, scaling=scaling, sliding_window=sliding_window, softcap=softcap,
                 s_aux=s_aux, position_bias=position_bias)
    out = eager(module, query, key, value, mask, **{k: v for k, v in named.items() if v is not None}, **kwargs)
    backends.record(backends.Dispatch(
        "attention", "reference", False,
        {"fastformer": [f"{type(module).__name__} passes {', '.join(unknown)}: its family's "
                        f"eager_attention_forward ran"]}, impl="eager_attention_forward"))
    return out


def _additive_mask(attention_mask, module, is_causal, sliding_window, B, Lq, Lk, dtype) -> Optional[Tensor]:
    """Any mask build_mask() returns (key mask, 4D bool / float, None) as eager's additive float
    (B or 1, 1, Lq, Lk) mask (0 where attended, the dtype's min elsewhere)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        allowed = attention_mask
    else:
        tag = getattr(attention_mask, _KEY_MASK_TAG, None)
        if tag is not None:
            causal, left = True, tag[0]
        else:
            causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
            left = int(sliding_window) - 1 if causal and sliding_window else -1
        device = attention_mask.device if attention_mask is not None else None
        i = torch.arange(Lq, device=device)[:, None] + (Lk - Lq)
        j = torch.arange(Lk, device=device)[None, :]
        allowed = (j <= i) if causal else torch.ones(Lq, Lk, dtype=torch.bool, device=device)
        if left >= 0:
            allowed = allowed & (j >= i - left)
        allowed = allowed[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, -Lk:].bool()[:, None, None, :]
    if allowed.dtype != torch.bool:
        return allowed.to(dtype)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _packed_sequences(attention_mask, kwargs: dict, B: int, Lq: int, Lk: int):
    """(window_left or None, cu_seqlens_q, cu_seqlens_k, max_q, max_k) of a packed batch of one
    row: from build_mask's tag (transformers detected packing from position_ids) or from the
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` keywords
    (DataCollatorWithFlattening(return_flash_attn_kwargs=True)); None for other calls."""
    if B != 1:
        return None
    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        cu_k = kwargs.get("cu_seq_lens_k", cu_q)
        if int(cu_q[-1]) != Lq or int(cu_k[-1]) != Lk:
            return None  # not this call's rows (e.g. decoding after a packed prefill)
        lengths = lambda cu: int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0  # noqa: E731
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        return (None, cu_q.to(torch.int32), cu_k.to(torch.int32),
                lengths(cu_q) if max_q is None else int(max_q),
                lengths(cu_k) if max_k is None else int(max_k))
    tag = getattr(attention_mask, _PACKED_TAG, None)
    if tag is not None and Lq == Lk == tag[3]:
        left, cu, longest, _ = tag
        return left, cu, cu, longest, longest
    # position_ids that restart (FlashAttention 2's contract in transformers: a packed row under
    # a plain causal mask, e.g. when a cache kept transformers from building the packed mask).
    # Not under torch.compile: finding the restarts is data-dependent (a graph break in every
    # layer of a one-row batch). Compiled calls keep transformers' own rule: its packed mask,
    # built from position_ids when there is no cache, reaches build_mask; with a cache the row
    # is one sequence, as under sdpa.
    positions = kwargs.get("position_ids")
    key_tag = getattr(attention_mask, _KEY_MASK_TAG, None)
    if (positions is None or torch.compiler.is_compiling() or Lq != Lk or Lq < 2 or positions.shape[-1] != Lq
            or not (attention_mask is None or (key_tag is not None and not key_tag[1]))):
        return None
    found = getattr(positions, _PACKED_TAG, None)  # computed once per forward, not per layer
    if found is None:
        found = _restarts(positions.reshape(-1)) if positions.dim() <= 2 and positions.numel() == Lq else False
        setattr(positions, _PACKED_TAG, found)
    if found is False:
        return None
    cu, longest = found
    return (key_tag[0] if key_tag is not None else None), cu, cu, longest, longest


def _restarts(positions: Tensor):
    """(cu_seqlens, longest) of packed position ids (a sequence starts where the position does
    not follow the previous one), or False for one sequence."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] - positions[:-1] != 1
    first = starts.nonzero().reshape(-1)
    if first.numel() < 2:
        return False
    cu = torch.cat([first, first.new_tensor([positions.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _varlen_forward(module, query, key, value, packed, dropout, scaling, is_causal,
                    sliding_window, softcap, s_aux) -> Tensor:
    """A packed (1, H, T, D) call as ff.varlen_attention over its (T, H, D) rows (views)."""
    left, cu_q, cu_k, max_q, max_k = packed
    if left is not None:  # build_mask recognized transformers' causal (sliding) pattern
        causal = True
    else:
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        left = int(sliding_window) - 1 if causal and sliding_window else -1
    rows = lambda t: t[0].transpose(0, 1)  # noqa: E731
    out = varlen_attention(rows(query), rows(key), rows(value), cu_q, cu_k, max_q, max_k,
                           causal=causal, window=(left, -1) if left >= 0 else None,
                           softcap=softcap if softcap else None, sinks=s_aux, scale=scaling,
                           dropout_p=float(dropout))
    return out[None]  # (1, T, H, D)


def _as_key_padding(mask: Tensor, B: int, Lk: int) -> Optional[Tensor]:
    """A 4D bool mask that is the same for every head and query (a padding mask, broadcast or
    expanded) as a (B, Lk) key_padding_mask (True = padding); None for any other mask."""
    if (mask.dim() != 4 or mask.dtype != torch.bool or mask.shape[-1] != Lk
            or mask.shape[0] not in (1, B)):
        return None
    if any(mask.shape[d] != 1 and mask.stride(d) != 0 for d in (1, 2)):
        return None
    return (~mask[:, 0, 0, :]).expand(B, Lk)


def _with_bias(bias: Tensor, mask: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    """position_bias and the model's (4D) mask as one float attn_mask, as eager adds them."""
    if mask is None:
        out = bias
    elif mask.dtype == torch.bool:
        out = torch.where(mask, bias, torch.tensor(float("-inf"), dtype=bias.dtype,
                                                   device=bias.device))
    else:
        out = bias + mask
    return out if out.dtype in (dtype, torch.float32) else out.to(dtype)


# ---- the mask function -------------------------------------------------------------------------
def _closure(fn: Callable) -> dict:
    """The values a function closes over by name; {} when traced (dynamo cannot read a
    function's __closure__: it raised inside a fullgraph torch.compile of a Mistral model)."""
    if _tracing():
        return {}
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return {}


def _causal_window(fn: Callable) -> Optional[int]:
    """The left window of transformers' plain causal patterns: -1 for ``causal_mask_function``,
    w - 1 for ``sliding_window_causal_mask_function(w)``; None for anything else (overlays,
    chunking, packing, bidirectional, custom functions), which is then built as a full mask."""
    from transformers import masking_utils as mu
    if fn is mu.causal_mask_function:
        return -1
    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _closure(fn).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or mu.causal_mask_function not in parts:
        return None
    overlay = parts[0] if parts[1] is mu.causal_mask_function else parts[1]
    if getattr(overlay, "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    w = _closure(overlay).get("sliding_window")
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        return None
    return w - 1


def _packed_pattern(fn: Callable):
    """(left window, sequence ids (B, T)) of transformers' packed-sequence pattern,
    ``and_masks(remap_positions_for_packed_sequence(f, ...), packed_sequence_mask_function(ids))``
    with f a plain causal / sliding-window causal pattern; None for anything else."""
    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _closure(fn).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    remapped, packed = parts
    if (getattr(packed, "__qualname__", "") != "packed_sequence_mask_function.<locals>.inner_mask"
            or getattr(remapped, "__qualname__", "") != "remap_positions_for_packed_sequence.<locals>.inner_mask"):
        return None
    left = _causal_window(_closure(remapped).get("mask_function"))
    ids = _closure(packed).get("packed_sequence_mask")
    if left is None or not isinstance(ids, Tensor):
        return None
    return left, ids


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
               mask_function: Optional[Callable] = None,
               attention_mask: Optional[Tensor] = None, allow_is_causal_skip: bool = True,
               allow_is_bidirectional_skip: bool = False, device="cpu", **kwargs):
    """transformers' mask-interface contract (``sdpa_mask``'s arguments): the (B, Lk) key mask
    for plain causal / sliding-window causal patterns, a broadcast view for bidirectional padding,
    else ``sdpa_mask``'s complete 4D mask (see the module docstring)."""
    from transformers import masking_utils as mu
    if mask_function is None:
        mask_function = mu.causal_mask_function
    tracing = _tracing()
    offsets = isinstance(q_offset, int) and isinstance(kv_offset, int)
    packed = None if tracing else _packed_pattern(mask_function)
    if (packed is not None and batch_size == 1 and q_length == kv_length and attention_mask is None
            and offsets and q_offset == kv_offset == 0):
        # Packed sequences: a (1, T) mask of ones (what FlashAttention 2 would be given) tagged
        # with the sequences' cu_seqlens (one host sync per forward, not per layer).
        left, ids = packed
        lengths = torch.bincount(ids[0].long())
        lengths = lengths[lengths > 0]
        cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=ids.device)
        cu[1:] = lengths.cumsum(0)
        keys = torch.ones(1, kv_length, dtype=torch.bool, device=device)
        setattr(keys, _PACKED_TAG, (left, cu, int(lengths.max()), kv_length))
        return keys
    left = _causal_window(mask_function)
    # The kernel's bottom-right causality is the pattern's when the queries are the last keys
    # (query i at absolute position q_offset + i, key j at kv_offset + j).
    # Traced, a window could not reach the kernel (no tags): those get the full mask below.
    if (left is not None and allow_is_causal_skip and offsets and not (tracing and left >= 0)
            and kv_length >= q_length and q_offset - kv_offset == kv_length - q_length):
        keys = _keys(attention_mask, kv_length, kv_offset)
        if tracing:
            # A traced graph carries no tensor attributes and cannot look at the padding's
            # values: the untagged key mask (None without one), which attention_forward reads
            # as causal from the module. The 4D mask instead made the Llama-style (4 x 2048,
            # L = 1024) bf16 forward under torch.compile take 1013 ms against 834 uncompiled:
            # every tile visited, each through the mask.
            return keys if keys is None or keys.shape[0] == batch_size else keys.expand(batch_size, kv_length)
        padded = keys is not None and not bool(keys.all())
        if not padded:
            keys = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
        elif keys.shape[0] != batch_size:
            keys = keys.expand(batch_size, kv_length)
        setattr(keys, _KEY_MASK_TAG, (left, padded))
        return keys
    if mask_function is mu.bidirectional_mask_function:
        keys = _keys(attention_mask, kv_length, kv_offset)
        if keys is None or (not tracing and bool(keys.all())):
            if allow_is_bidirectional_skip:
                return None
            keys = torch.ones(1, kv_length, dtype=torch.bool, device=device)
        return keys[:, None, None, :].expand(batch_size, 1, q_length, kv_length)
    # No is_causal shortcut: sdpa's None means top-left causality, ours bottom-right.
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                        attention_mask=attention_mask, allow_is_causal_skip=False,
                        allow_is_bidirectional_skip=allow_is_bidirectional_skip, device=device,
                        **kwargs)


def _keys(attention_mask: Optional[Tensor], kv_length: int, kv_offset: int) -> Optional[Tensor]:
    """The 2D padding mask (True = attend) of the keys kv_offset .. kv_offset + kv_length - 1,
    padded with False past its end (static caches' empty slots), as sdpa_mask reads it."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import prepare_padding_mask
    padding = prepare_padding_mask(attention_mask.bool(), kv_length, kv_offset)
    return padding[:, kv_offset:kv_offset + kv_length]


def register(name: str = NAME) -> None:
    """Register fastformer attention and its mask function with transformers under ``name``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError("fastformer.integrations.transformers.register needs transformers "
                          "(pip install transformers)") from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, build_mask)


__all__ = ["register", "attention_forward", "build_mask", "NAME"]
