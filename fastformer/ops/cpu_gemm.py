"""Which of torch's CPU GEMMs run fast on this machine: the measured rules by which the FFN's
cpu.onednn route (ops/ffn.py) takes torch's GEMMs instead of csrc/cpu/ffn.cpp's packed one, and
uses oneDNN's linear with the activation as a post-op."""
from __future__ import annotations

import functools
import os

import torch

from .. import _ext

FP32_GEMM_ENV = "FASTFORMER_CPU_FFN_FP32_GEMM"
LOWP_GEMM_ENV = "FASTFORMER_CPU_LOWP_GEMM"


def torch_fp32_gemm_wins():
    """(whether fp32 FFN calls take torch's GEMMs, why), by the rule measured on three CPUs:
    torch's fp32 GEMM is MKL's, which runs its AVX-512 code at the FMA peak on Intel CPUs and
    generic code elsewhere. FFN suite, fp32, ours against eager in one run each (2 cores):
      * Xeon (AVX-512, AMX): torch.mm 440 GFLOP/s, the packed GEMM 320-360 (73-82%); the packed
        kernel 0.87-0.98x eager, torch's GEMMs with our activation pass 0.98-1.06x (GELU
        (4096, 768, 3072), GeGLU (2048, 2048, 5632), SwiGLU (1024, 1024, 2816), forward and
        forward+backward);
      * Zen 5 (AVX-512): the packed kernel 1.71-2.09x eager; Zen 3 (AVX2): 1.14-1.51x.
    FASTFORMER_CPU_FFN_FP32_GEMM=torch / packed forces either (decisions are cached per call
    signature: backends.clear_cache() after changing it)."""
    forced = os.environ.get(FP32_GEMM_ENV, "auto").strip().lower()
    if forced in ("torch", "packed"):
        return forced == "torch", f"{FP32_GEMM_ENV}={forced}"
    if forced != "auto":
        raise ValueError(f"{FP32_GEMM_ENV} must be 'torch', 'packed' or 'auto', got {forced!r}")
    if mkl_on_intel():
        return True, "torch's fp32 GEMM is MKL on an Intel CPU"
    return False, f"the packed kernel is faster than torch's fp32 GEMM on this CPU ({_vendor() or 'unknown vendor'})"


@functools.lru_cache(maxsize=None)
def _vendor() -> str:
    """The CPU's vendor string, read once: this rule runs on every linear call of more rows than
    the few-row kernel takes (_ext.cpu_info() copies the extension's dict: ~10 us a call)."""
    return _ext.cpu_info().get("vendor", "")


@functools.lru_cache(maxsize=None)
def mkl_on_intel() -> bool:
    """Whether torch's fp32 GEMMs are MKL's on an Intel CPU (its AVX-512 code paths)."""
    return _vendor() == "GenuineIntel" and torch.backends.mkl.is_available()


# ff's activation -> (attr, scalars, algorithm) of torch.ops.mkldnn._linear_pointwise. quick_gelu
# (x * sigmoid(1.702 x)) has none: oneDNN's swish has that scale, but torch's op ignores the
# scalars it is given for "swish" (torch 2.13: x * sigmoid(x) whatever they are).
ONEDNN_POST_OPS = {"relu": ("relu", [], ""), "gelu": ("gelu", [], "none"),
                    "gelu_tanh": ("gelu", [], "tanh"), "silu": ("swish", [], "")}


@functools.lru_cache(maxsize=None)
def onednn_post_ops() -> bool:
    """Whether torch has its mkldnn linear with post-ops and runs bf16 on dot-product
    instructions here (AMX or AVX512-BF16: measured faster on both, ops/ffn.py's _CpuOnednn.fwd)."""
    return (torch.backends.mkldnn.is_available() and fast_bf16_gemm()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.lru_cache(maxsize=None)
def fast_bf16_gemm() -> bool:
    """Whether torch's CPU bf16 matmuls run on bf16 dot-product instructions here."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool((probe and probe()) or amx_bf16())


@functools.lru_cache(maxsize=None)
def fast_fp16_gemm() -> bool:
    """Whether torch's CPU fp16 matmuls run on fp16 instructions here (AVX512-FP16 or AMX-FP16)."""
    amx = getattr(torch.cpu, "_is_amx_fp16_supported", None)
    if amx and amx():
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_fp16" in f.read()
    except OSError:
        return True  # unknown: keep torch's GEMMs


def fast_lowp_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's CPU GEMMs in dtype (bf16 / fp16) run on instructions of that type. Where
    not (AVX2-only CPUs such as Zen 2 / 3) they are generic code: 19 GFLOP/s in bf16 against 160
    in fp32 for (2048 x 1024) x (1024 x 1024) on a 2-core Zen 3, and ops/linear.py takes such
    calls on its fp32-accumulating kernels (AVX-512 CPUs without AVX512-BF16 follow the same
    rule, not measured there: oneDNN converts bf16 to fp32 on them as the kernels do).
    FASTFORMER_CPU_LOWP_GEMM=torch / kernels forces torch's GEMMs or the kernels."""
    forced = os.environ.get(LOWP_GEMM_ENV)
    if forced:
        if forced not in ("torch", "kernels", "auto"):
            raise ValueError(f"{LOWP_GEMM_ENV} must be 'torch', 'kernels' or 'auto', got {forced!r}")
        if forced != "auto":
            return forced == "torch"
    return fast_fp16_gemm() if dtype == torch.float16 else fast_bf16_gemm()


def amx_bf16() -> bool:
    """Whether torch's CPU bf16 matmuls run on AMX tiles here."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx and amx())
