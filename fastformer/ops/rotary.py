"""Rotary position embedding: ff.apply_rotary, its op definition and backends.

One call, top to bottom:
  ff.apply_rotary (checks, below) / ff.RotaryEmbedding (modules/positional.py)
    -> ROTARY((x,), RotaryOptions(cos, sin, ...))    ops/_opdef.py (eager Function or the
                                                     custom ops fastformer::rotary_fwd/_bwd)
    -> backends.select(Call("rotary", ...))           the first Impl below that takes it
    -> _C.rotary (cpu: csrc/cpu/rotary.cpp) | triton_kernels/rotary.py | reference/rotary.py

The math is in reference/rotary.py. Nothing is saved for the backward but the tables: the
rotation is orthogonal, so dx is the same kernel run on dy with the opposite angle (conj).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from .. import _checks, backends
from ..backends import EVERY_OPTION, GPU_FLOAT, Impl
from ..reference import rotary as ref
from ._opdef import OpDef, Options, compiled, options, rowwise


@options
class RotaryOptions(Options):
    """The options of one rotary call (csrc/options.h mirrors the fields)."""

    cos: Optional[Tensor] = None   # (L, R/2) contiguous, fp32 (fp64 for fp64 x)
    sin: Optional[Tensor] = None
    interleaved: bool = False      # pairs (2i, 2i+1) instead of (i, i + R/2)


def _call(inputs, o: RotaryOptions) -> backends.Call:
    x, = inputs
    features = frozenset({"last_dim_strided"}) if x.shape[-1] > 1 and x.stride(-1) != 1 else frozenset()
    return backends.Call("rotary", x.device.type, x.dtype, o.set_fields(), features,
                         head_dim=x.shape[-1])


def _fake_fwd(x, o):
    B, H, L, D = x.shape
    return (x.new_empty((B, L, H, D)).transpose(1, 2),)


ROTARY = OpDef("rotary", inputs=("x",), options=RotaryOptions, outputs=("out",), visible=1,
               save=lambda inputs, o, outputs: (), fake_fwd=_fake_fwd,
               fake_bwd=lambda grads, saved, o, needs: _fake_fwd(grads[0], o), call=_call)
# every kernel takes both pair layouts and partial rotation (R < D)
_OPTIONS = frozenset({"cos", "sin", "interleaved"})


class _Rotation(Impl):
    """fwd(x, o) = run(x, o, conj=False); the backward is the rotation by the opposite angle
    (conj=True)."""

    options = _OPTIONS

    def fwd(self, x, o):
        return (self.run(x, o, False),)

    def bwd(self, grads, saved, o, needs):
        return (self.run(rowwise(grads[0]), o, True),)


@ROTARY.implementation
class _Triton(_Rotation):
    backend = "triton"
    dtypes = GPU_FLOAT

    def run(self, x, o, conj):
        import triton

        from ..triton_kernels import rotary as tk
        B, H, L, D = x.shape
        out = x.new_empty((B, L, H, D)).transpose(1, 2)
        rows = B * H * L
        if rows == 0 or D == 0:
            return out
        cfg = tk.config(D)
        tk.rotary_kernel[(triton.cdiv(rows, cfg["BLOCK_ROWS"]),)](
            x, x.stride(0), x.stride(1), x.stride(2), out, out.stride(0), out.stride(1),
            out.stride(2), o.cos, o.sin, rows, H, L, D, o.cos.shape[1],
            INTERLEAVED=o.interleaved, CONJ=conj, **cfg)
        return out


@ROTARY.implementation
class _Cpu(_Rotation):
    backend = "cpu"
    run = compiled("rotary")


@ROTARY.implementation
class _Reference(_Rotation):
    backend = "reference"
    options = EVERY_OPTION
    features = frozenset({"last_dim_strided"})

    def run(self, x, o, conj):
        return ref.rotary(x, o.cos, o.sin, o.interleaved, conj)


# ---- public API ---------------------------------------------------------------------------
def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotary position embedding of ``x`` in one pass (RoPE; math in fastformer/reference/rotary.py).

    Args:
        x: (B, H, L, D) float16/bfloat16/float32/float64, any strides with a contiguous last
            dim (e.g. the heads viewed out of a fused QKV projection; nothing is copied).
        cos, sin: (L, R/2) tables of the angles of positions 0..L-1 of ``x``'s rows, R <= D
            even; float32 (float64 for float64 ``x``). Channels R..D-1 pass through unchanged.
            ``ff.RotaryEmbedding`` builds them. They are constants: no gradient reaches them.
        interleaved: rotate pairs (2i, 2i+1) (GPT-J, RoFormer) instead of (i, i + R/2)
            (GPT-NeoX, Llama: the "rotate_half" form, the default).

    Returns:
        (B, H, L, D) in x's dtype (stored as (B, L, H, D)), computed in fp32 and rounded once.
    """
    fn = "apply_rotary"
    _checks.tensor(fn, "x", x, dims=(4,))
    _checks.flag(fn, "interleaved", interleaved)
    acc = ref.acc_dtype(x.dtype)
    for name, t in (("cos", cos), ("sin", sin)):
        _checks.tensor(fn, name, t, dims=(2,), dtypes=(acc,))
    _checks.same_device(fn, "x", x, cos=cos, sin=sin)
    _checks.shape(fn, "sin", sin, tuple(cos.shape), " (the shape of `cos`)")
    L, D = x.shape[2], x.shape[3]
    if cos.shape[0] != L or not 0 < 2 * cos.shape[1] <= D:
        raise ValueError(f"{fn}: `cos` and `sin` must be (L, R/2) = ({L}, R/2) with 0 < R <= "
                         f"D = {D} (x is (B, H, L, D) = {tuple(x.shape)}); got "
                         f"{tuple(cos.shape)}")
    # The tables are (L, R/2), small next to x: copied only if a caller passes strided views.
    cos, sin = cos.contiguous(), sin.contiguous()
    return ROTARY((x,), RotaryOptions(cos=cos, sin=sin, interleaved=interleaved))[0]


__all__ = ["apply_rotary"]
