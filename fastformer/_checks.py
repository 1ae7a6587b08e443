"""Input validation shared by the public functions.

Every failure is a ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, device,
range) whose message starts with the function name, names the argument, says what it got and
what it needs. Nothing here copies or converts a tensor.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def tensor(fn: str, name: str, t, *, dims: Optional[Sequence[int]] = None,
           dtypes=FLOAT_DTYPES, optional: bool = False) -> None:
    """`t` is a tensor of a floating dtype (and one of `dims` ranks, if given)."""
    if t is None:
        if optional:
            return
        raise TypeError(f"{fn}: `{name}` must be a tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{fn}: `{name}` must have a floating dtype "
                        f"({', '.join(_dt(d) for d in dtypes)}), got {_dt(t.dtype)}")
    if dims is not None and t.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{fn}: `{name}` must be {want}, got {t.dim()}-D with shape {tuple(t.shape)}")


def same_device(fn: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{fn}: `{name}` is on {t.device} but `{ref_name}` is on {ref.device}; "
                             "all tensors must be on one device")


def same_dtype(fn: str, ref_name: str, ref: torch.Tensor, **others) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != ref.dtype:
            raise TypeError(f"{fn}: `{name}` has dtype {_dt(t.dtype)} but `{ref_name}` has "
                            f"{_dt(ref.dtype)}; they must match")


def param_dtype(fn: str, name: str, p: Optional[torch.Tensor], x: torch.Tensor) -> None:
    """A weight/bias may be x's dtype or float32 (mixed precision)."""
    if p is not None and p.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{fn}: `{name}` has dtype {_dt(p.dtype)}; it must be {_dt(x.dtype)} "
                        "(the dtype of `x`) or float32")


def shape(fn: str, name: str, t: Optional[torch.Tensor], want: tuple, why: str = "") -> None:
    if t is not None and tuple(t.shape) != tuple(want):
        raise ValueError(f"{fn}: `{name}` must have shape {tuple(want)}{why}, got {tuple(t.shape)}")


def number(fn: str, name: str, v, *, lo: float = -math.inf, hi: float = math.inf,
           lo_open: bool = False, hi_open: bool = False, finite: bool = False) -> float:
    """`v` as a float in the range (NaN is never in one; ``finite``: neither is +-inf).

    Only comparisons, no math.isnan / isfinite: under torch.compile with dynamic shapes the
    value may be symbolic, and comparisons of it trace (as guards) where math functions do not.
    """
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{fn}: `{name}` must be a number, got {type(v).__name__}")
    v = float(v)
    inside = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not inside:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        raise ValueError(f"{fn}: `{name}` must be in {left}{lo}, {hi}{right}, got {v}")
    if finite and not abs(v) < math.inf:
        raise ValueError(f"{fn}: `{name}` must be finite, got {v}")
    return v


def flag(fn: str, name: str, v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{fn}: `{name}` must be a bool, got {type(v).__name__}")
    return v


def choice(fn: str, name: str, v, options: Sequence[str]) -> str:
    if not isinstance(v, str) or v not in options:
        raise ValueError(f"{fn}: `{name}` must be one of {', '.join(map(repr, options))}; got {v!r}")
    return v
