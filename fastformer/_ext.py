"""Loads the optional compiled extension ``fastformer._C``.

``import fastformer`` must work without it (pure-Python install, a failed build, a torch ABI
mismatch): the reference and Triton backends still run and ``fastformer.info()`` says why the
extension is missing. Loading it does no GPU work.
"""
from __future__ import annotations

import torch  # noqa: F401  (the extension links against torch's libraries)

C = None
LOAD_ERROR: str | None = None
try:
    from . import _C as C  # type: ignore[attr-defined,no-redef]
except Exception as exc:  # ImportError, OSError (undefined symbol), ...
    C = None
    LOAD_ERROR = f"{type(exc).__name__}: {exc}"


CUDA_BUILT = bool(C.cpu_info()["cuda"]) if C is not None else False


def cpu_info() -> dict:
    if C is None:
        return {"capability": None, "built": [], "max_capability": None, "note": LOAD_ERROR,
                "cuda": False}
    return dict(C.cpu_info())


def has_cpu_kernels() -> bool:
    return C is not None


def has_cuda_kernels() -> bool:
    return CUDA_BUILT


_cpu_state: tuple | None = None  # (capability, amx_in_use), cached: cpu_info() takes ~18 us


def _state() -> tuple:
    global _cpu_state
    if _cpu_state is None:
        info = C.cpu_info() if C is not None else {}
        _cpu_state = (info.get("capability"), bool(info.get("amx_in_use")),
                      info.get("bf16_attention_gemm") == "avx512_bf16")
    return _cpu_state


def cpu_level() -> str | None:
    """The CPU kernels' level in use ("default", "avx2", "avx512"; None without the extension),
    for routing rules read on every call."""
    return _state()[0]


def amx_in_use() -> bool:
    """Whether the kernels in use run bf16 on AMX tiles (the avx512 level, AMX on)."""
    return _state()[1]


def bf16_dot_in_use() -> bool:
    """Whether the kernels in use run bf16 on AVX512-BF16 dot products (the avx512 level, AMX not
    in use, AVX512-BF16 on)."""
    return _state()[2]


def set_cpu_capability(level: str) -> None:
    """Select the default|avx2|avx512 CPU kernels (tests, benchmarks); cached backend
    decisions are dropped, since implementations may depend on the level."""
    global _cpu_state
    from . import backends
    C.set_cpu_capability(level)
    _cpu_state = None
    backends.clear_cache()


def set_cpu_amx(enable: bool) -> None:
    """Run bf16 on AMX tiles at the avx512 level where the CPU has AMX-BF16 (tests)."""
    global _cpu_state
    from . import backends
    C.set_cpu_amx(enable)
    _cpu_state = None
    backends.clear_cache()


def set_cpu_avx512_bf16(enable: bool) -> None:
    """Run the bf16 attention GEMMs on AVX512-BF16 at the avx512 level where the CPU has it and
    AMX is not used (tests, benchmarks)."""
    global _cpu_state
    from . import backends
    C.set_cpu_avx512_bf16(enable)
    _cpu_state = None
    backends.clear_cache()
