"""Inference weights kept in oneDNN's blocked layout: ``ff.convert(model, prepack_weights=True)``.

torch's CPU bf16 matmul on AMX is oneDNN's, which reads the weight (its B operand) in a blocked
tile layout: handed a plain (out, in) weight, it reorders the whole matrix on every call. For a
decode step or a prompt of up to ~1000 tokens that reorder is a large share of the call, as the
GEMM reads each weight once or a few times. Reordered once ahead
(``torch.ops.mkldnn._reorder_linear_weight``, the layout inductor's freezing and IPEX's
weight prepacking use) and passed to ``torch.ops.mkldnn._linear_pointwise``, bf16 x W^T on the
2-core AMX Xeon, median of 5-7, one process:

  rows      (2048 -> 5632)    (5632 -> 2048)   (2048 -> 2048)   (2048 -> 32000)
  2..8      0.82-1.03 -> 0.5  0.77-0.81 -> 0.5  0.31-0.39 -> 0.2
  100..256  2.0-5.1 -> 1.3-2.3  2.0-3.9 -> 1.6-3.5  0.75-1.3 -> 0.5-0.95
  1024      12.7 -> 9.4-10.0  12.7 -> 11.9     4.4 -> 4.1-4.2   112 -> 90
  2048+     22.6 -> 22.6      24.3 -> 23.6-24.1  8.0 -> 8.1     (no gain: the reorder is
                                                                   amortized over the rows)

Hence the rule: bf16 calls without a gradient of 2 to 2047 rows on a CPU with AMX, except those
csrc/cpu/linear_rows.cpp takes first (ops/linear.py: up to 64 rows whose in features are a
multiple of 32, read in place at 26-27 GB/s against 22-23 packed; one row always). The
blocked copy was made with a hint of 128 rows; hints of 16 and 1024 read the same within noise,
a hint of 1 up to 1.3x slower from 777 rows. fp32 is not packed: torch's fp32 linear is MKL's,
and oneDNN's fp32 matmul on a reordered weight read the same as plain F.linear (76.9 against
76.4 ms at (1024, 2048 -> 5632)).

A registered weight gets its blocked copy on its first call that takes it, and a new one when
the weight changes (its version counter, storage or dtype: an optimizer step, load_state_dict,
``.data =``, ``model.to``), so the copy never serves stale values; weights made under
``torch.inference_mode`` have no version counter and keep the plain route. The copy costs the
weight's memory a second time, which is why it is opt-in.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import cpu_gemm
from ._opdef import plain_tensor as _plain

MIN_ROWS, MAX_ROWS = 2, 2047
PACK_HINT_ROWS = 128
_NO_POST_OP = ("none", [], "")

# registered weight -> [version, data_ptr, dtype, blocked copy or None]
_REGISTRY: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this torch and CPU run the blocked-weight route (AMX-BF16 and oneDNN's ops)."""
    return (cpu_gemm.amx_bf16() and cpu_gemm.onednn_post_ops()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def register(weight: Tensor) -> None:
    """Mark a (out, in) weight for a blocked copy (made lazily, see the module doc)."""
    if weight not in _REGISTRY:
        _REGISTRY[weight] = [None, None, None, None]


def registered(weight: Tensor) -> bool:
    return weight in _REGISTRY


def takes(x2: Tensor, weights, biases=()) -> bool:
    """Whether the contiguous (rows, in) input x2 times each registered weight (plus its bias)
    takes the blocked copies: no gradient, bf16 on the CPU, MIN_ROWS..MAX_ROWS rows, eager.
    None entries of weights / biases are skipped."""
    if not _REGISTRY or not available() or torch.compiler.is_compiling():
        return False
    if (x2.dtype != torch.bfloat16 or x2.device.type != "cpu" or x2.dim() != 2
            or not MIN_ROWS <= x2.shape[0] <= MAX_ROWS or not _plain(x2) or not x2.is_contiguous()):
        return False
    weights = [w for w in weights if w is not None]
    biases = [b for b in biases if b is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x2, *weights, *biases)):
        return False
    # Inference tensors (made under torch.inference_mode) have no version counter to follow.
    return (all(w in _REGISTRY and _plain(w) and w.dtype == x2.dtype and w.dim() == 2
                and w.device.type == "cpu" and not w.is_inference() for w in weights)
            and all(_plain(b) and b.dtype == x2.dtype and b.dim() == 1 and b.device.type == "cpu"
                    for b in biases))


def _blocked(weight: Tensor) -> Tensor:
    entry = _REGISTRY[weight]
    key = (weight._version, weight.data_ptr(), weight.dtype)
    if entry[3] is None or tuple(entry[:3]) != key:
        entry[3] = None  # drop the stale copy before making the new one
        with torch.no_grad():
            entry[3] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)
        entry[:3] = key
    return entry[3]


def linear(x2: Tensor, weight: Tensor, bias: Optional[Tensor], post_op=_NO_POST_OP) -> Tensor:
    """x2 @ weight.T + bias, then the oneDNN post-op (attr, scalars, algorithm), on the weight's
    blocked copy; takes(x2, (weight,), (bias,)) must hold."""
    return torch.ops.mkldnn._linear_pointwise(x2, _blocked(weight), bias, *post_op)


def copies_bytes() -> int:
    """Memory held by the blocked copies now (for tests and reports)."""
    return sum(e[3].numel() * e[3].element_size() for e in _REGISTRY.values() if e[3] is not None)
