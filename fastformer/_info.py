"""fastformer.info(): versions, built backends, CPU features, in one place."""
from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from . import _ext, backends


def _version(pkg: str):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


class Info(dict):
    def __str__(self) -> str:
        width = max(len(k) for k in self)
        lines = []
        for key, value in self.items():
            if isinstance(value, dict):
                lines.append(f"{key}:")
                for k, v in value.items():
                    lines.append(f"  {k:<{width}} {v}")
            else:
                lines.append(f"{key:<{width}} {value}")
        return "\n".join(lines)


def _amx_status(cpu: dict) -> str:
    if cpu.get("amx_in_use"):
        return "used"
    if cpu.get("amx_note"):
        return f"off ({cpu['amx_note']})"
    if cpu.get("amx_bf16"):
        return f"off (only the avx512 kernels use it; these are {cpu.get('capability')})"
    return "off (_C not loaded)"


def info() -> Info:
    """Versions, which backends are usable and why not, the CPU kernel level in use."""
    from . import __version__
    cpu = _ext.cpu_info()
    return Info({
        "fastformer": __version__,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
        "_C": "loaded" if _ext.C is not None else f"missing: {_ext.LOAD_ERROR}",
        "backends": backends.backend_status(),
        "ops": {name: ", ".join(ops) or "-" for name, ops in backends.ops_of().items()},
        "cpu": {
            "kernels": cpu.get("capability"),
            "best supported": cpu.get("max_capability"),
            "built levels": ", ".join(cpu.get("built") or []) or "-",
            "note": cpu.get("note") or "-",
            "amx bf16": _amx_status(cpu),
            "bf16 attention GEMMs": cpu.get("bf16_attention_gemm", "-"),
            "torch capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
        },
        "forced backend": backends.current_backend(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("FASTFORMER_", "TRITON_INTERPRET"))},
    })
