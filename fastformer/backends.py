"""The backend registry, implementation selection and its explanations.

Every op runs on one of four backends with one set of semantics:

==========  ============  ===================================================================
name        devices       what it is
==========  ============  ===================================================================
cuda        cuda          CUDA C++ kernels in ``fastformer._C`` (only when built with CUDA)
triton      cuda (+cpu)   ``@triton.jit`` kernels; on CPU tensors only under TRITON_INTERPRET=1
cpu         cpu           C++ kernels in ``fastformer._C`` (OpenMP, AVX2/AVX-512 dispatch)
reference   any           plain PyTorch: the test oracle's twin and the fallback for the rest
==========  ============  ===================================================================

An op family (``fastformer/ops/<family>.py``) defines its implementations beside their code,
each an :class:`Impl` subclass stating what it supports (dtypes, the option fields it knows,
derived features, head dims / hidden sizes), and registers them with its ``OpDef``
(``ops/_opdef.py``), which registers them here. A backend may have more than one
implementation of an op (the FFN's fused kernel and its vendor-GEMM route): they are tried in
registration order and ``ff.last_dispatch()`` names the one that ran.

:func:`select` walks the backends in priority order for the tensors' device (``auto``) and
returns the first implementation that accepts the call, recording why each earlier one was
passed over. An option field an implementation does not list is declined with the field's
name as the reason, so a new option needs no change to the backends that do not take it.
Forcing a backend (:func:`use_backend` or ``FASTFORMER_BACKEND``) that cannot take a call
raises ``ValueError`` listing the reasons; ``auto`` never raises for valid input, it falls
back to ``reference``.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import _ext

BACKENDS = ("cuda", "triton", "cpu", "reference")
CHOICES = ("auto",) + BACKENDS
# Order tried by `auto`, per device type of the inputs.
AUTO_PRIORITY = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
ALL_FLOAT = frozenset({F16, BF16, F32, F64})
GPU_FLOAT = frozenset({F16, BF16, F32})
EVERY_OPTION = None  # Impl.options of an implementation that takes every option (the reference)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Call:
    """What selection looks at for one call of an op (hashable: decisions are cached)."""

    op: str
    device: str                               # torch.device.type of the inputs
    dtype: torch.dtype
    options: frozenset = frozenset()          # option fields set to a non-default value
    features: frozenset = frozenset()         # derived from the inputs, e.g. {"gqa"}
    head_dim: Optional[int] = None            # attention, rotary
    v_head_dim: Optional[int] = None          # attention: v's (Dv; head_dim is q's and k's)
    hidden: Optional[int] = None              # add+norm, FFN


class Impl:
    """One backend's implementation of one op, with what it supports stated beside its code.

    Subclasses set the class attributes and the op family's methods (``fwd``, ``bwd``, and
    optionally ``autograd``: a fused eager autograd entry, and ``inference``: the forward of calls
    without a gradient, eager or traced). :meth:`reasons` explains a decline.
    """

    backend: str = ""                         # one of BACKENDS
    name: str = ""                            # shown by ff.last_dispatch(); default: backend
    dtypes: frozenset = ALL_FLOAT
    options: Optional[frozenset] = frozenset()  # option fields it honours (EVERY_OPTION: all)
    features: frozenset = frozenset()         # derived features it takes; any other declines
    head_dims: Optional[tuple] = None         # (min, max) inclusive, or None for any
    head_dim_set: Optional[frozenset] = None  # an explicit set of head dims, if restricted
    max_hidden: Optional[int] = None
    autograd: Optional[Callable] = None       # (*inputs, o) -> visible outputs, with autograd
    inference: Optional[Callable] = None      # (*inputs, o) -> outputs when no backward follows
                                              #   (what only a backward reads may be left empty)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            cls.name = cls.backend

    def unavailable(self) -> Optional[str]:
        """Why this implementation cannot run in this process now (None if it can)."""
        return None

    def veto(self, call: Call) -> Optional[str]:
        """For ``auto`` only: a reason to skip a call this implementation could run (one where
        it is measured slower than the next candidate)."""
        return None

    def reasons(self, call: Call) -> list:
        why = []
        unavailable = self.unavailable()
        if unavailable:
            return [unavailable]
        if call.dtype not in self.dtypes:
            names = ", ".join(sorted(_dtype_name(d) for d in self.dtypes))
            why.append(f"dtype {_dtype_name(call.dtype)} not in {{{names}}}")
        if self.options is not EVERY_OPTION:
            unknown = call.options - self.options
            if unknown:
                why.append("does not take option " + ", ".join(f"`{n}`" for n in sorted(unknown)))
        extra = call.features - self.features
        if extra:
            why.append("unsupported " + ", ".join(sorted(extra)))
        if call.head_dim is not None:
            if self.head_dims is not None and not self.head_dims[0] <= call.head_dim <= self.head_dims[1]:
                why.append(f"head_dim {call.head_dim} outside {self.head_dims[0]}..{self.head_dims[1]}")
            if self.head_dim_set is not None and call.head_dim not in self.head_dim_set:
                why.append(f"head_dim {call.head_dim} not in {sorted(self.head_dim_set)}")
        if self.max_hidden is not None and call.hidden is not None and call.hidden > self.max_hidden:
            why.append(f"hidden size {call.hidden} > {self.max_hidden}")
        return why


@dataclass
class Backend:
    name: str
    devices: Callable[[], frozenset]           # device types it can take right now
    availability: Callable[[], Optional[str]]  # None if usable, else why not

    def reasons(self, call: Call) -> list:
        unavailable = self.availability()
        if unavailable:
            return [unavailable]
        devices = self.devices()
        if call.device in devices:
            return []
        hint = ""
        if self.name == "triton" and call.device == "cpu":
            hint = " (set TRITON_INTERPRET=1 before importing triton to run it on CPU)"
        return [f"takes {'/'.join(sorted(devices)) or 'no'} tensors, got {call.device}{hint}"]


# ---- availability -----------------------------------------------------------------------------
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_availability() -> Optional[str]:
    return None if _triton_installed() else "triton is not installed (pip install triton)"


def _triton_devices() -> frozenset:
    return frozenset({"cuda", "cpu"}) if triton_interpreter() else frozenset({"cuda"})


def _cpu_availability() -> Optional[str]:
    return None if _ext.has_cpu_kernels() else f"fastformer._C not loaded ({_ext.LOAD_ERROR})"


def _cuda_availability() -> Optional[str]:
    if _ext.C is None:
        return f"fastformer._C not loaded ({_ext.LOAD_ERROR})"
    if not _ext.has_cuda_kernels():
        return "fastformer._C was built without CUDA kernels"
    return None


_BACKENDS = {
    "cuda": Backend("cuda", lambda: frozenset({"cuda"}), _cuda_availability),
    "triton": Backend("triton", _triton_devices, _triton_availability),
    "cpu": Backend("cpu", lambda: frozenset({"cpu"}), _cpu_availability),
    "reference": Backend("reference", lambda: frozenset({"cpu", "cuda", "mps", "xpu", "meta"}),
                         lambda: None),
}
_IMPLS: dict = {}  # op name -> [Impl], registration order


def get(name: str) -> Backend:
    return _BACKENDS[name]


def register(op: str, impl: Impl) -> None:
    """Add an implementation of `op` (called by OpDef.implementation)."""
    if impl.backend not in _BACKENDS:
        raise ValueError(f"{type(impl).__name__}: unknown backend {impl.backend!r}")
    _IMPLS.setdefault(op, []).append(impl)
    _select_cache.clear()


def implementations(op: str, backend: Optional[str] = None) -> list:
    """The implementations of `op` (of one backend, if given), in selection order."""
    return [i for i in _IMPLS.get(op, ()) if backend is None or i.backend == backend]


def declared(op: str) -> dict:
    """{backend name: [Impl]} for an op (what the tests are generated from)."""
    out: dict = {}
    for impl in _IMPLS.get(op, ()):
        out.setdefault(impl.backend, []).append(impl)
    return out


# ---- forcing a backend ----------------------------------------------------------------------
_forced: contextvars.ContextVar = contextvars.ContextVar("fastformer_backend", default=None)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in CHOICES:
        raise ValueError(f"backend must be one of {', '.join(CHOICES)}; got {name!r}")
    return name.lower()


_env_backend: Optional[str] = os.environ.get("FASTFORMER_BACKEND") or None


def reload_env() -> None:
    """Re-read FASTFORMER_BACKEND (and the other FASTFORMER_* switches). They are read once at
    import, because an environment lookup per op call costs ~3 us."""
    global _env_backend
    _env_backend = os.environ.get("FASTFORMER_BACKEND") or None
    clear_cache()
    from .ops import _opdef
    _opdef.reload_env()


def clear_cache() -> None:
    """Forget cached decisions (after something they depend on changed: the CPU kernel level,
    AMX on or off)."""
    _select_cache.clear()


def current_backend() -> str:
    """The forced backend name, or 'auto' (use_backend() wins over FASTFORMER_BACKEND)."""
    forced = _forced.get()
    if forced is not None:
        return forced
    return _check_name(_env_backend) if _env_backend else "auto"


@contextlib.contextmanager
def use_backend(name: str):
    """Force every fastformer op inside the block onto one backend (or 'auto').

    The forward's choice is remembered for its backward, even if the backward runs outside the
    block. Raises ``ValueError`` at the first call the forced backend cannot take.
    """
    token = _forced.set(_check_name(name))
    try:
        yield
    finally:
        _forced.reset(token)


# ---- selection ------------------------------------------------------------------------------
_last = threading.local()


@dataclass(frozen=True)
class Dispatch:
    op: str
    backend: str
    forced: bool
    rejected: dict  # implementation name -> list of reasons
    impl: str = ""  # the implementation that ran (its backend's name unless it has several)

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.impl or self.backend}" + (" (forced)" if self.forced else "")]
        for name, why in self.rejected.items():
            lines.append(f"  skipped {name}: {'; '.join(why)}")
        return "\n".join(lines)


# Decisions are cached per (Call, forced backend): equal calls get equal answers. Cleared by
# reload_env() / clear_cache() and when an implementation registers.
_select_cache: dict = {}


def select(call: Call, backend: Optional[str] = None) -> Impl:
    """The implementation that runs `call` (see the module docstring)."""
    forced = backend if backend is not None else current_backend()
    key = (call, forced)
    hit = _select_cache.get(key)
    if hit is not None:
        _last.value = hit[1]
        return hit[0]
    impl, dispatch = _select(call, forced)
    _last.value = dispatch
    if call.device != "cpu" or impl.backend != "triton":  # TRITON_INTERPRET may change
        if len(_select_cache) > 4096:
            _select_cache.clear()
        _select_cache[key] = (impl, dispatch)
    return impl


def _select(call: Call, forced: str):
    rejected = {}
    names = (forced,) if forced != "auto" else AUTO_PRIORITY.get(call.device, ("reference",))
    for name in names:
        backend_why = _BACKENDS[name].reasons(call)
        impls = implementations(call.op, name)
        if backend_why or not impls:
            rejected[name] = backend_why or [f"no {call.op} implementation"]
            continue
        for impl in impls:
            why = impl.reasons(call)
            if not why and forced == "auto" and name != "reference":
                veto = impl.veto(call)
                why = [veto] if veto else []
            if not why:
                return impl, Dispatch(call.op, name, forced != "auto", rejected, impl.name)
            rejected[impl.name] = why
    if forced != "auto":
        raise ValueError(f"backend '{forced}' cannot run {call.op} on this input: "
                         + "; ".join(f"{n}: {'; '.join(w)}" if n != forced else "; ".join(w)
                                     for n, w in rejected.items()))
    raise ValueError(f"no backend can run {call.op}: {rejected}")  # reference takes everything


def record(dispatch: Optional[Dispatch]) -> None:
    """Make `dispatch` this thread's last_dispatch() (a backward reusing its forward's choice)."""
    _last.value = dispatch


def last_dispatch() -> Optional[Dispatch]:
    """The most recent selection made in this thread: implementation, and why others were
    skipped."""
    return getattr(_last, "value", None)


def explain(call: Call) -> str:
    """Every implementation's verdict on a call, one line each (backends without one too)."""
    lines = []
    for name in BACKENDS:
        backend_why = _BACKENDS[name].reasons(call)
        impls = implementations(call.op, name)
        if backend_why or not impls:
            lines.append(f"{name}: " + "; ".join(backend_why or [f"no {call.op} implementation"]))
            continue
        for impl in impls:
            why = impl.reasons(call)
            lines.append(f"{impl.name}: " + ("ok" if not why else "; ".join(why)))
    return "\n".join(lines)


def available_backends() -> list:
    """Backends usable in this process (installed/built), whatever the device."""
    return [name for name, status in backend_status().items() if status == "available"]


def backend_status() -> dict:
    """{name: 'available' or the reason it is not} for every backend."""
    status = {}
    for name in BACKENDS:
        why = _BACKENDS[name].availability()
        if why is None and name in ("cuda", "triton") and not torch.cuda.is_available():
            if not (name == "triton" and triton_interpreter()):
                why = "no CUDA device" + (" (TRITON_INTERPRET=1 runs it on CPU)" if name == "triton" else "")
        status[name] = "available" if why is None else why
    return status


def ops_of() -> dict:
    """{backend: [op names with an implementation that can run in this process]}."""
    out = {name: set() for name in BACKENDS}
    for op, impls in _IMPLS.items():
        for impl in impls:
            if impl.unavailable() is None:
                out[impl.backend].add(op)
    return {name: sorted(ops) for name, ops in out.items()}
