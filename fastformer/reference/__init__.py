"""Plain-PyTorch implementations of every op: the ``reference`` backend.

They compute what the kernels compute, with the same saved state (statistics, log-sum-exp) and
explicit backward formulas, in fp32 (fp64 for fp64 inputs). They are the fallback for inputs
no kernel backend takes and the twin of the test oracle (the tests compare every backend,
this one included, against eager PyTorch autograd in fp32/fp64).
"""
from . import norm  # noqa: F401
