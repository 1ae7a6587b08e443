"""DeBERTa's disentangled relative-position bias: its op definition and backends.

One call, top to bottom:
  relative_bias (checks, below; integrations/hf_deberta.py calls it)
    -> RELATIVE_BIAS((c2p, p2c), RelativeBiasOptions(...))   ops/_opdef.py
    -> backends.select(Call("relative_bias", ...))             the first Impl below that takes it
    -> _C.relative_bias_fwd/_bwd (cpu: csrc/cpu/relative_bias.cpp) | reference/relative_bias.py

The math is in reference/relative_bias.py: a gather of one c2p and one p2c entry per
(query, key), masked to -inf, and its scatter-add backward. The reference is torch.gather /
scatter_add_, which on CPU ran ~28 ms per (4, 12, 512, 512) bf16 gather on 2 Zen 5 cores (it
copies the expanded index); the cpu kernel reads each entry once and writes the bias once. GPUs
run the reference (gather is fast there). Nothing is saved for the backward but the tables
and the inputs' shapes: the backward reads only the output's gradient.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _checks, backends
from ..backends import EVERY_OPTION, Impl
from ..reference import relative_bias as ref
from ._opdef import OpDef, Options, compiled, options


@options
class RelativeBiasOptions(Options):
    """The options of one call (csrc/options.h mirrors the fields)."""

    c2p_index: Optional[Tensor] = None   # (Lq, Lk) int64 contiguous: c2p's column per (i, j)
    p2c_index: Optional[Tensor] = None   # (Lq, Lk) int64 contiguous: p2c's column (row j) per (i, j)
    visible: Optional[Tensor] = None     # (1 or B, Lq, Lk) bool contiguous, True = attend


def _call(inputs, o: RelativeBiasOptions) -> backends.Call:
    like = inputs[0] if inputs[0] is not None else inputs[1]
    return backends.Call("relative_bias", like.device.type, like.dtype, o.set_fields())


def _shape(inputs, o):
    like = inputs[0] if inputs[0] is not None else inputs[1]
    index = o.c2p_index if o.c2p_index is not None else o.p2c_index
    return (*like.shape[:2], *index.shape)


def _save(inputs, o, outputs):
    # the backward reads only the inputs' shapes and dtype: one-element stand-ins expanded to them
    return tuple(t.new_zeros(1).expand(t.shape) if t is not None else None for t in inputs)


RELATIVE_BIAS = OpDef(
    "relative_bias", inputs=("c2p?", "p2c?"), options=RelativeBiasOptions, outputs=("out",),
    visible=1, save=_save,
    fake_fwd=lambda c2p, p2c, o: ((c2p if c2p is not None else p2c).new_empty(_shape((c2p, p2c), o)),),
    fake_bwd=lambda grads, saved, o, needs: tuple(
        t.new_empty(t.shape) if t is not None and need else None for t, need in zip(saved, needs)),
    call=_call)


@RELATIVE_BIAS.implementation
class _Cpu(Impl):
    backend = "cpu"
    options = frozenset(RelativeBiasOptions.fields)
    fwd_kernel = compiled("relative_bias_fwd")
    bwd_kernel = compiled("relative_bias_bwd")

    def unavailable(self):
        return None if self.fwd_kernel is not None else "fastformer._C has no relative_bias kernels"

    def fwd(self, c2p, p2c, o):
        return (self.fwd_kernel(c2p, p2c, o),)

    def bwd(self, grads, saved, o, needs):
        c2p, p2c = (t if t is not None and need else None for t, need in zip(saved, needs))
        return self.bwd_kernel(grads[0].contiguous(), c2p, p2c, o)


@RELATIVE_BIAS.implementation
class _Reference(Impl):
    backend = "reference"
    options = EVERY_OPTION

    def fwd(self, c2p, p2c, o):
        return (ref.relative_bias_fwd(c2p, p2c, o.c2p_index, o.p2c_index, o.visible),)

    def bwd(self, grads, saved, o, needs):
        c2p, p2c = (t if t is not None and need else None for t, need in zip(saved, needs))
        return ref.relative_bias_bwd(grads[0], c2p, p2c, o.c2p_index, o.p2c_index, o.visible)


# ---- entry --------------------------------------------------------------------------------
def relative_bias(c2p: Optional[Tensor], p2c: Optional[Tensor], c2p_index: Optional[Tensor] = None,
                  p2c_index: Optional[Tensor] = None, visible: Optional[Tensor] = None) -> Tensor:
    """DeBERTa's disentangled attention bias, (B, H, Lq, Lk) in the inputs' dtype (math:
    fastformer/reference/relative_bias.py), differentiable in c2p and p2c.

    Args:
        c2p: (B, H, Lq, W) float, or None: each query row's scores against the W relative
            positions' keys. Taken with ``c2p_index``.
        p2c: (B, H, Lk, W) float, or None: each key row's scores against their queries. Taken
            with ``p2c_index``. One of c2p, p2c is needed; both are contiguous.
        c2p_index, p2c_index: (Lq, Lk) int64 in [0, W): the column read per (query, key).
        visible: bool (1 or B, Lq, Lk), True = attend; the bias is -inf elsewhere.
    """
    fn = "relative_bias"
    if c2p is None and p2c is None:
        raise ValueError(f"{fn}: `c2p` or `p2c` is needed, got neither")
    like = c2p if c2p is not None else p2c
    _checks.tensor(fn, "c2p" if c2p is not None else "p2c", like, dims=(4,), dtypes=_checks.FLOAT_DTYPES)
    B, H, _, W = like.shape
    if W >= 1 << 24:  # the cpu kernels' gathers take 32-bit offsets
        raise ValueError(f"{fn}: W (the last dim of c2p / p2c) must be below 2^24, got {W}")
    for name, t, index in (("c2p", c2p, c2p_index), ("p2c", p2c, p2c_index)):
        if t is None:
            continue
        _checks.tensor(fn, name, t, dims=(4,), dtypes=(like.dtype,))
        if t.shape[:2] != (B, H) or t.shape[3] != W or not t.is_contiguous():
            raise ValueError(f"{fn}: `{name}` must be contiguous (B, H, L, W) = ({B}, {H}, L, {W}), "
                             f"got {tuple(t.shape)} with strides {t.stride()}")
        if not isinstance(index, Tensor) or index.dtype != torch.int64 or index.dim() != 2:
            raise TypeError(f"{fn}: `{name}_index` must be a 2-D int64 tensor, got "
                            f"{getattr(index, 'dtype', type(index).__name__)}")
        # (traced calls: the cpu kernel checks the range itself, a RuntimeError)
        if not torch.compiler.is_compiling() and index.numel() and not 0 <= int(index.min()) <= int(index.max()) < W:
            raise ValueError(f"{fn}: `{name}_index` must hold columns of {name} (0 <= index < {W}), got "
                             f"{int(index.min())}..{int(index.max())}")
    Lq, Lk = (c2p_index if c2p is not None else p2c_index).shape
    if c2p is not None and (c2p.shape[2] != Lq or (p2c is not None and p2c_index.shape != (Lq, Lk))):
        raise ValueError(f"{fn}: `c2p` has {c2p.shape[2]} rows and `c2p_index` is {(Lq, Lk)}: "
                         f"need c2p (B, H, Lq, W) and both tables (Lq, Lk)")
    if p2c is not None and p2c.shape[2] != Lk:
        raise ValueError(f"{fn}: `p2c` must have Lk = {Lk} rows (the tables' second dim), got {p2c.shape[2]}")
    if visible is not None:
        if not isinstance(visible, Tensor) or visible.dtype != torch.bool or visible.dim() != 3 \
                or visible.shape[0] not in (1, B) or tuple(visible.shape[1:]) != (Lq, Lk):
            raise ValueError(f"{fn}: `visible` must be a bool (1 or {B}, {Lq}, {Lk}) tensor, got "
                             f"{getattr(visible, 'dtype', None)} {tuple(getattr(visible, 'shape', ()))}")
    _checks.same_device(fn, "c2p" if c2p is not None else "p2c", like, p2c=p2c, c2p_index=c2p_index,
                        p2c_index=p2c_index, visible=visible)
    o = RelativeBiasOptions(c2p_index=c2p_index.contiguous() if c2p is not None else None,
                            p2c_index=p2c_index.contiguous() if p2c is not None else None,
                            visible=visible.contiguous() if visible is not None else None)
    return RELATIVE_BIAS((c2p, p2c), o)[0]


__all__ = ["relative_bias"]
