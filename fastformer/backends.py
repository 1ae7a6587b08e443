"""Backend declarations and selection.

Every op runs on one of four backends with one set of semantics:

==========  ============  ===================================================================
name        devices       what it is
==========  ============  ===================================================================
cuda        cuda          CUDA C++ kernels in ``fastformer._C`` (only when built with CUDA)
triton      cuda (+cpu)   ``@triton.jit`` kernels; on CPU tensors only under TRITON_INTERPRET=1
cpu         cpu           C++ kernels in ``fastformer._C`` (OpenMP, AVX2/AVX-512 dispatch)
reference   any           plain PyTorch: the test oracle's twin and the fallback for the rest
==========  ============  ===================================================================

A backend *declares* what it supports per op (:class:`OpSupport`: dtypes, features, head dims,
hidden sizes). :func:`select` walks the priority list for the tensors' device and returns the
first backend that accepts the call, recording why each earlier one was passed over
(:func:`last_dispatch`). Forcing a backend (:func:`use_backend` or ``FASTFORMER_BACKEND``) that
cannot take a call raises ``ValueError`` listing the reasons; ``auto`` never raises for valid
input, it falls back to ``reference``.

Ops register their implementations with :func:`register_impl`; a backend with a declaration but
no implementation for an op is skipped with that reason.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from . import _ext

BACKENDS = ("cuda", "triton", "cpu", "reference")
CHOICES = ("auto",) + BACKENDS
# Order tried by `auto`, per device type of the inputs.
AUTO_PRIORITY = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
_ALL_FLOAT = frozenset({F16, BF16, F32, F64})


@dataclass(frozen=True)
class Call:
    """What :func:`select` needs to know about one call of an op."""

    op: str
    device: str                               # torch.device.type of the inputs
    dtype: torch.dtype
    features: frozenset = frozenset()         # op-specific, e.g. {"dropout", "rows_strided"}
    head_dim: Optional[int] = None            # attention
    hidden: Optional[int] = None              # add+norm, FFN
    size: int = 0                             # elements of the main input (for auto vetoes)


@dataclass(frozen=True)
class OpSupport:
    """What one backend supports for one op."""

    dtypes: frozenset
    features: frozenset = frozenset()         # features it handles; any other is rejected
    head_dims: Optional[tuple] = None         # (min, max) inclusive, or None for any
    head_dim_set: Optional[frozenset] = None  # explicit set of head dims, if restricted
    max_hidden: Optional[int] = None
    # For `auto` only: return a reason to skip this backend for a call it *could* run (for
    # example a shape where it is measured slower than the next backend).
    auto_veto: Optional[Callable[[Call], Optional[str]]] = None

    def reasons(self, call: Call) -> list:
        why = []
        if call.dtype not in self.dtypes:
            names = ", ".join(sorted(str(d).replace("torch.", "") for d in self.dtypes))
            why.append(f"dtype {str(call.dtype).replace('torch.', '')} not in {{{names}}}")
        extra = call.features - self.features
        if extra:
            why.append("unsupported " + ", ".join(sorted(extra)))
        if call.head_dim is not None:
            if self.head_dims is not None and not (self.head_dims[0] <= call.head_dim <= self.head_dims[1]):
                why.append(f"head_dim {call.head_dim} outside {self.head_dims[0]}..{self.head_dims[1]}")
            if self.head_dim_set is not None and call.head_dim not in self.head_dim_set:
                why.append(f"head_dim {call.head_dim} not in {sorted(self.head_dim_set)}")
        if self.max_hidden is not None and call.hidden is not None and call.hidden > self.max_hidden:
            why.append(f"hidden size {call.hidden} > {self.max_hidden}")
        return why


@dataclass
class Backend:
    name: str
    devices: Callable[[], frozenset]          # device types it can take right now
    availability: Callable[[], Optional[str]]  # None if usable, else why not
    ops: dict = field(default_factory=dict)   # op name -> OpSupport
    impls: dict = field(default_factory=dict)  # op name -> implementation object

    def reasons(self, call: Call) -> list:
        unavailable = self.availability()
        if unavailable:
            return [unavailable]
        support = self.ops.get(call.op)
        if support is None:
            return [f"no {call.op} kernel"]
        if call.op not in self.impls:
            return [f"{call.op} not implemented"]
        why = []
        devices = self.devices()
        if call.device not in devices:
            hint = ""
            if self.name == "triton" and call.device == "cpu":
                hint = " (set TRITON_INTERPRET=1 before importing triton to run it on CPU)"
            why.append(f"takes {'/'.join(sorted(devices)) or 'no'} tensors, got {call.device}{hint}")
        return why + support.reasons(call)


# ---- availability -----------------------------------------------------------------------------
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_availability() -> Optional[str]:
    if not _triton_installed():
        return "triton is not installed (pip install triton)"
    return None


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


# ---- declarations ---------------------------------------------------------------------------
_NORM_FEATURES = frozenset({"residual", "weight", "bias", "rms", "return_residual"})


_ATTN_FEATURES = frozenset({"causal_top_left", "causal_bottom_right", "key_padding_mask",
                            "attn_mask_bool", "attn_mask_float", "dropout", "gqa"})
_ATTN_CUDA_FEATURES = frozenset({"causal_top_left", "causal_bottom_right", "key_padding_mask",
                                 "gqa"})


# Rotary embedding: every kernel takes both pair layouts and partial rotation (R < D).
_ROTARY_FEATURES = frozenset({"interleaved"})
# Feed-forward: "ffn" (Linear -> act -> dropout -> Linear) and "swiglu" (the gated variant, no
# dropout). Activations are arguments every backend takes; features are what varies per call.
_FFN_FEATURES = frozenset({"bias", "dropout"})
_FFN_STRIDES = frozenset({"last_dim_strided", "rows_strided"})  # rows_strided: no single row stride


_REGISTRY = {
    "cuda": Backend(
        "cuda", lambda: frozenset({"cuda"}), _cuda_availability,
        ops={
            "add_norm": OpSupport(frozenset({F16, BF16, F32}), _NORM_FEATURES, max_hidden=None),
            # fp32, other head dims, masks and dropout fall back to triton
            "attention": OpSupport(frozenset({F16, BF16}), _ATTN_CUDA_FEATURES,
                                   head_dim_set=frozenset({64, 128})),
            # cuBLAS GEMMs + fused epilogue kernels; dropout falls back to triton
            "ffn": OpSupport(frozenset({F16, BF16, F32}), frozenset({"bias"})),
            "swiglu": OpSupport(frozenset({F16, BF16, F32}), frozenset({"bias"})),
        }),
    "triton": Backend(
        "triton", _triton_devices, _triton_availability,
        ops={
            "add_norm": OpSupport(frozenset({F16, BF16, F32}), _NORM_FEATURES, max_hidden=16384),
            "attention": OpSupport(frozenset({F16, BF16, F32}), _ATTN_FEATURES, head_dims=(16, 256)),
            "rotary": OpSupport(frozenset({F16, BF16, F32}), _ROTARY_FEATURES),
            "ffn": OpSupport(frozenset({F16, BF16, F32}), _FFN_FEATURES | {"last_dim_strided"}),
            "swiglu": OpSupport(frozenset({F16, BF16, F32}), _FFN_FEATURES | {"last_dim_strided"}),
        }),
    "cpu": Backend(
        "cpu", lambda: frozenset({"cpu"}), _cpu_availability,
        ops={
            "add_norm": OpSupport(_ALL_FLOAT, _NORM_FEATURES | {"rows_strided"}),
            "attention": OpSupport(_ALL_FLOAT, _ATTN_FEATURES, head_dims=(1, 256)),
            "rotary": OpSupport(_ALL_FLOAT, _ROTARY_FEATURES),
            "ffn": OpSupport(_ALL_FLOAT, _FFN_FEATURES | _FFN_STRIDES),
            "swiglu": OpSupport(_ALL_FLOAT, _FFN_FEATURES | _FFN_STRIDES),
        }),
    "reference": Backend(
        "reference", lambda: frozenset({"cpu", "cuda", "mps", "xpu", "meta"}), lambda: None,
        ops={
            "add_norm": OpSupport(_ALL_FLOAT, _NORM_FEATURES | {"rows_strided", "last_dim_strided"}),
            "attention": OpSupport(_ALL_FLOAT, _ATTN_FEATURES | {"v_head_dim_differs",
                                                                "last_dim_strided"}),
            "rotary": OpSupport(_ALL_FLOAT, _ROTARY_FEATURES | {"last_dim_strided"}),
            "ffn": OpSupport(_ALL_FLOAT, _FFN_FEATURES | _FFN_STRIDES),
            "swiglu": OpSupport(_ALL_FLOAT, _FFN_FEATURES | _FFN_STRIDES),
        }),
}


def get(name: str) -> Backend:
    return _REGISTRY[name]


def register_impl(op: str, backend: str, impl) -> None:
    """Attach the implementation of `op` on `backend` (called by fastformer/ops/*)."""
    _REGISTRY[backend].impls[op] = impl


def declared(op: str) -> dict:
    """{backend name: OpSupport} for an op: what tests are generated from."""
    return {name: b.ops[op] for name, b in _REGISTRY.items() if op in b.ops}


# ---- forcing a backend ----------------------------------------------------------------------
_forced: contextvars.ContextVar = contextvars.ContextVar("fastformer_backend", default=None)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or name.lower() not in CHOICES:
        raise ValueError(f"backend must be one of {', '.join(CHOICES)}; got {name!r}")
    return name.lower()


_env_backend: Optional[str] = os.environ.get("FASTFORMER_BACKEND") or None


def reload_env() -> None:
    """Re-read FASTFORMER_BACKEND (and the other FASTFORMER_* switches). They are read once at
    import, because an environment lookup per op call costs ~3 us here."""
    global _env_backend
    env = os.environ.get("FASTFORMER_BACKEND")
    _env_backend = env or None
    _select_cache.clear()
    from .ops import _common
    _common.reload_env()


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
# Decisions are cached per (Call, forced backend): Call is a small frozen dataclass of what
# select() looks at, so equal calls get equal answers; the cache is cleared by reload_env().
_last = threading.local()


@dataclass(frozen=True)
class Dispatch:
    op: str
    backend: str
    forced: bool
    rejected: dict  # backend name -> list of reasons

    def __str__(self) -> str:
        lines = [f"{self.op}: {self.backend}" + (" (forced)" if self.forced else "")]
        for name, why in self.rejected.items():
            lines.append(f"  skipped {name}: {'; '.join(why)}")
        return "\n".join(lines)


_select_cache: dict = {}


def select(call: Call, backend: Optional[str] = None) -> Backend:
    """Return the backend that runs `call` (see module docstring)."""
    forced = backend if backend is not None else current_backend()
    key = (call, forced)
    hit = _select_cache.get(key)
    if hit is not None:
        _last.value = hit[1]
        return hit[0]
    chosen = _select(call, forced)
    if call.device != "cpu" or "triton" != chosen.name:  # TRITON_INTERPRET may change
        if len(_select_cache) > 4096:
            _select_cache.clear()
        _select_cache[key] = (chosen, _last.value)
    return chosen


def _select(call: Call, forced: str) -> Backend:
    if forced != "auto":
        chosen = _REGISTRY[forced]
        why = chosen.reasons(call)
        if why:
            raise ValueError(f"backend '{forced}' cannot run {call.op} on this input: "
                             + "; ".join(why))
        _last.value = Dispatch(call.op, forced, True, {})
        return chosen
    rejected = {}
    for name in AUTO_PRIORITY.get(call.device, ("reference",)):
        cand = _REGISTRY[name]
        why = cand.reasons(call)
        if not why and name != "reference":
            veto = cand.ops[call.op].auto_veto
            reason = veto(call) if veto is not None else None
            if reason:
                why = [reason]
        if not why:
            _last.value = Dispatch(call.op, name, False, rejected)
            return cand
        rejected[name] = why
    raise ValueError(f"no backend can run {call.op}: {rejected}")  # reference takes everything


def record(dispatch: Optional[Dispatch]) -> None:
    """Make `dispatch` this thread's last_dispatch() (a backward reusing its forward's choice)."""
    _last.value = dispatch


def last_dispatch() -> Optional[Dispatch]:
    """The most recent selection made in this thread: backend, and why others were skipped."""
    return getattr(_last, "value", None)


def explain(call: Call) -> str:
    """Every backend's verdict on a call, one line each."""
    lines = []
    for name in BACKENDS:
        why = _REGISTRY[name].reasons(call)
        lines.append(f"{name}: " + ("ok" if not why else "; ".join(why)))
    return "\n".join(lines)


def available_backends() -> list:
    """Backends usable in this process (installed/built), whatever the device."""
    out = []
    for name in BACKENDS:
        if _REGISTRY[name].availability() is not None:
            continue
        if name in ("cuda",) and not torch.cuda.is_available():
            continue
        if name == "triton" and not (torch.cuda.is_available() or triton_interpreter()):
            continue
        out.append(name)
    return out


def backend_status() -> dict:
    """{name: 'available' or the reason it is not} for every backend."""
    status = {}
    for name in BACKENDS:
        why = _REGISTRY[name].availability()
        if why is None and name in ("cuda", "triton") and not torch.cuda.is_available():
            if name == "triton" and triton_interpreter():
                why = None
            else:
                why = "no CUDA device" + (" (TRITON_INTERPRET=1 runs it on CPU)" if name == "triton" else "")
        status[name] = "available" if why is None else why
    return status


def ops_of(names: Iterable[str] = BACKENDS) -> dict:
    return {n: sorted(set(_REGISTRY[n].ops) & set(_REGISTRY[n].impls)) for n in names}
