"""Test configuration shared by every test file.

Triton kernels run on CPU tensors under Triton's interpreter, which must be switched on before
triton is first imported: that is done here, before anything imports it.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/oracle.py etc.

import fastformer as ff  # noqa: E402
from fastformer import backends  # noqa: E402


def cpu_test_backends(op: str) -> list:
    """Backends with an implementation of `op` that can run here on CPU tensors."""
    out = []
    for name in backends.declared(op):
        b = backends.get(name)
        if b.availability() is None and "cpu" in b.devices():
            out.append(name)
    return out


def backend_params(op: str) -> list:
    """pytest params for every backend implementing `op`; unusable ones skip with the reason."""
    params = []
    for name in backends.declared(op):
        b = backends.get(name)
        reason = b.availability() or (None if "cpu" in b.devices() else "GPU-only backend, no CUDA device")
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        if name == "cuda":
            marks = [pytest.mark.gpu] + marks
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def pytest_configure(config):
    # CI sets this: a missing extension must fail the run, not silently skip the cpu backend.
    if os.environ.get("FASTFORMER_REQUIRE_EXT") == "1" and ff._ext.C is None:
        raise pytest.UsageError(f"fastformer._C is required but not loaded: {ff._ext.LOAD_ERROR}")
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU)")
    config.addinivalue_line("markers", "slow: long-running (large tensors)")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device; none present")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def capability_levels():
    """CPU kernel levels this machine can run (default, avx2, avx512)."""
    info = ff._ext.cpu_info()
    order = ["default", "avx2", "avx512"]
    top = info.get("max_capability")
    if top is None:
        return []
    return order[: order.index(top) + 1]
