"""Triton kernels of fastformer, installed as ``fastformer.triton_kernels``.

Only ``@triton.jit`` kernels and their launch configurations live here; the launchers (tensor
allocation, grids, autograd) are in ``fastformer/ops/<op>.py``. Importing this package imports
triton; ``fastformer`` itself only does so on the first Triton call.

Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (tests). The interpreter's
``tl.dot`` on bfloat16 is wrong (triton-lang/triton#11584), so kernels upcast bf16 tiles to fp32
before ``tl.dot`` when ``INTERPRET`` is set, and only then: on GPUs they keep bf16 tensor-core dots.
"""
import os


def interpreter_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
