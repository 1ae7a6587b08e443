"""Glue shared by the op families: eager-vs-custom-op routing and small tensor helpers.

Each op family is one ``torch.library`` custom op pair (forward, backward) with a fake
implementation and registered autograd, so it works under ``torch.compile(fullgraph=True)``
and ``torch.export``. In plain eager mode the public functions call the same forward/backward
implementations through a ``torch.autograd.Function`` instead of the dispatcher: on this
machine a Python custom op call costs ~36 us (59 us with autograd) against ~16 us for
``Function.apply``, which is a large share of a small kernel. Both routes run the same backend
selection and the same kernels; ``FASTFORMER_EAGER_VIA_OPS=1`` forces the dispatcher route
(the tests run both).
"""
from __future__ import annotations

import os

import torch

_via_ops = False


def reload_env() -> None:
    """Re-read FASTFORMER_EAGER_VIA_OPS (fastformer.backends.reload_env() calls this)."""
    global _via_ops
    _via_ops = os.environ.get("FASTFORMER_EAGER_VIA_OPS", "0") == "1"


reload_env()
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_is_compiling = torch.compiler.is_compiling


def via_custom_op(*tensors) -> bool:
    """True when the call must go through torch.ops (tracing, compiling, tensor subclasses)."""
    if _via_ops or _is_compiling():
        return True
    for t in tensors:
        if t is not None and type(t) is not _Tensor and type(t) is not _Parameter:
            return True
    return False


def needs_grad(*tensors) -> bool:
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)


def rowwise(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose last dim is contiguous; copies only when it is not.

    Used on incoming *gradients* only: autograd may hand a kernel an expanded (stride-0) grad,
    e.g. from ``y.sum().backward()``. Activations never go through here.
    """
    if t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1:
        return t
    return t.contiguous()


class LazyLaunchers:
    """A backend implementation whose ``fwd``/``bwd`` are functions of a launcher module imported
    on first call (the Triton launchers: importing them imports triton)."""

    def __init__(self, module: str, fwd: str, bwd: str):
        self._where = (module, fwd, bwd)

    def _get(self, i: int):
        import importlib
        module = importlib.import_module(self._where[0], package=__package__)
        return getattr(module, self._where[i])

    def fwd(self, *args):
        return self._get(1)(*args)

    def bwd(self, *args):
        return self._get(2)(*args)
