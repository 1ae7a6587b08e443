"""pytest-benchmark suites (not part of the default test run, which collects tests/ only):

    pip install pytest-benchmark
    pytest benchmarks/test_bench_kernels.py --benchmark-group-by=param:case

Each kernel is timed next to its eager PyTorch counterpart on the same inputs; the
fastformer-bench CLI (fastformer/bench.py) is the main, interleaved measurement.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import fastformer as ff

pytest.importorskip("pytest_benchmark")

NORM_CASES = [(512, 768), (4096, 1024)]
ATTN_CASES = [(8, 12, 128, 64), (4, 8, 512, 64)]


@pytest.mark.parametrize("impl", ["fastformer", "eager"])
@pytest.mark.parametrize("case", NORM_CASES, ids=str)
def test_add_layer_norm(benchmark, impl, case):
    x, r = torch.randn(*case), torch.randn(*case)
    w, b = torch.randn(case[1]), torch.randn(case[1])
    if impl == "fastformer":
        benchmark(ff.add_layer_norm, x, r, w, b)
    else:
        benchmark(lambda: F.layer_norm(x + r, (case[1],), w, b))


@pytest.mark.parametrize("impl", ["fastformer", "sdpa", "eager"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ATTN_CASES, ids=str)
def test_attention_forward(benchmark, impl, causal, case):
    q, k, v = (torch.randn(*case) for _ in range(3))
    if impl == "fastformer":
        benchmark(ff.attention, q, k, v, causal=causal)
    elif impl == "sdpa":
        benchmark(F.scaled_dot_product_attention, q, k, v, is_causal=causal)
    else:
        def eager():
            s = q @ k.transpose(-1, -2) / math.sqrt(case[-1])
            if causal:
                s = s.masked_fill(torch.ones(case[2], case[2], dtype=torch.bool).triu(1), float("-inf"))
            return torch.softmax(s, -1) @ v
        benchmark(eager)
