"""The shared host/device math of csrc/common, on CPU, through a small C++ harness
(tests/cpp/common_math_harness.cpp) compiled here with the system C++ compiler: activations and
their derivatives vs torch (autograd), the online softmax vs torch.logsumexp, Philox vs
reference/rng.py, Welford/Chan vs numpy. These headers are what the CUDA kernels compute with,
so this is how their math is tested on a machine without a GPU.
"""
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fastformer.reference import rng

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("c++") or shutil.which("g++")
ACTIVATIONS = {  # code of fastformer::Activation -> torch
    0: F.relu,
    1: F.gelu,
    2: lambda x: F.gelu(x, approximate="tanh"),
    3: F.silu,
    4: lambda x: x * torch.sigmoid(1.702 * x),  # quick_gelu (transformers' QuickGELUActivation)
    5: lambda x: F.relu(x).square(),  # relu2 (transformers' ReLUSquaredActivation)
}


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler (c++/g++) on PATH to build tests/cpp/common_math_harness.cpp")
    exe = tmp_path_factory.mktemp("common_math") / "harness"
    subprocess.run([CXX, "-std=c++17", "-O1", "-I", str(ROOT / "csrc"),
                    str(ROOT / "tests/cpp/common_math_harness.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)

    def run(*commands: str) -> list:
        out = subprocess.run([str(exe)], input="\n".join(commands) + "\n", check=True,
                             capture_output=True, text=True)
        assert out.stderr == "", out.stderr
        return [[float(v) for v in line.split()] for line in out.stdout.splitlines()]

    return run


def _fmt(values) -> str:
    return " ".join(repr(float(v)) for v in values)


def _act_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.5, -0.5, 3.0, -3.0, 10.0, -10.0, 30.0,
                            -30.0, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4])
    return torch.cat([special, torch.randn(200, generator=g, dtype=torch.float64) * 4])


def _torch_value_grad(act: int, x: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = ACTIVATIONS[act](x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    return y.detach(), grad


@pytest.mark.parametrize("act", sorted(ACTIVATIONS), ids=["relu", "gelu", "gelu_tanh", "silu", "quick_gelu", "relu2"])
def test_activations_match_torch(harness, act):
    x = _act_inputs()
    x32 = x.float()
    out = harness(f"act {act} d {len(x)} {_fmt(x)}", f"act {act} f {len(x)} {_fmt(x32)}",
                  f"act {act} v {len(x)} {_fmt(x32)}")
    ours64, ours32, ours_vec = (torch.tensor(o, dtype=torch.float64).reshape(-1, 2) for o in out)

    value64, grad64 = _torch_value_grad(act, x)
    torch.testing.assert_close(ours64[:, 0], value64, atol=1e-14, rtol=1e-13)
    torch.testing.assert_close(ours64[:, 1], grad64, atol=1e-14, rtol=1e-13)
    # float vs the fp64 truth at the same (fp32) inputs: within 1e-6 * max(1, |truth|), which
    # torch's own fp32 gelu_tanh grad misses (1.03e-6 at x = -5.15; ours 5.0e-7)
    value_at32, grad_at32 = _torch_value_grad(act, x32.double())
    for ours, truth in ((ours32[:, 0], value_at32), (ours32[:, 1], grad_at32)):
        assert ((ours - truth).abs() <= 1e-6 * truth.abs().clamp_min(1)).all()
    # a vector type through ActMath<V> computes lane by lane exactly what the float code does
    assert torch.equal(ours_vec, ours32)


@pytest.mark.parametrize("act", sorted(ACTIVATIONS), ids=["relu", "gelu", "gelu_tanh", "silu", "quick_gelu", "relu2"])
def test_activation_grad_is_derivative_of_value(harness, act):
    """d/dx of the header's value (central differences in fp64) equals its grad."""
    x = torch.linspace(-6, 6, 97, dtype=torch.float64)
    x = x[x.abs() > 1e-3]  # relu's kink
    h = 1e-6
    out = harness(*(f"act {act} d {len(x)} {_fmt(x + d)}" for d in (h, -h, 0.0)))
    plus, minus, at = (torch.tensor(o, dtype=torch.float64).reshape(-1, 2) for o in out)
    torch.testing.assert_close((plus[:, 0] - minus[:, 0]) / (2 * h), at[:, 1], atol=1e-7, rtol=1e-7)


def _softmax_rows():
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(37, generator=g, dtype=torch.float64) * 3 for _ in range(3)]
    masked = rows[0].clone()
    masked[::3] = -math.inf                        # some keys masked
    first_block_masked = rows[1].clone()
    first_block_masked[:16] = -math.inf            # a whole first block masked: m stays -inf
    all_masked = torch.full((37,), -math.inf, dtype=torch.float64)
    large = rows[2] * 100                          # naive exp would overflow
    return [rows[0], masked, first_block_masked, all_masked, large]


@pytest.mark.parametrize("block", [1, 5, 16, 64])
def test_online_softmax_matches_logsumexp(harness, block):
    g = torch.Generator().manual_seed(2)
    v = torch.randn(37, generator=g, dtype=torch.float64)
    commands, expected = [], []
    for s in _softmax_rows():
        lse = torch.logsumexp(s, 0)
        empty = bool(torch.isneginf(lse))
        p = torch.zeros_like(s) if empty else torch.exp(s - lse)
        expected.append((math.inf if empty else float(lse), float(p @ v)))
        for ty in "fd":
            for domain in "e2":
                commands.append(f"softmax {ty} {domain} {len(s)} {block} {_fmt(s)} {_fmt(v)}")
    out = harness(*commands)
    for i, (lse, o) in enumerate(expected):
        for j, ty in enumerate("ffdd"):
            ours_lse, ours_out = out[4 * i + j]
            tol = 1e-5 if ty == "f" else 1e-12
            if math.isinf(lse):
                assert ours_lse == math.inf and ours_out == 0.0, (i, j)
            else:
                assert ours_lse == pytest.approx(lse, rel=tol, abs=tol), (i, j)
                assert ours_out == pytest.approx(o, rel=tol, abs=tol), (i, j)


def test_philox_matches_reference_rng(harness):
    g = torch.Generator().manual_seed(3)
    counters = torch.cat([torch.tensor([0, 1, 2**32 - 1, 2**32, 2**32 + 5, 2**62 + 12345]),
                          torch.randint(0, 2**62, (200,), generator=g)])
    seeds = [0, 1, 0x9E3779B97F4A7C15 & (2**62 - 1), 2**62 - 1]
    out = harness(*(f"philox {seed} {len(counters)} {' '.join(map(str, counters.tolist()))}"
                    for seed in seeds))
    for seed, words in zip(seeds, out):
        expected = rng.philox_words(counters, seed)
        assert [int(w) for w in words] == expected.tolist(), f"seed {seed}"


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_batched_philox_matches_reference_rng(tmp_path, isa):
    """cpu/philox_vec.h (what the CPU kernels draw dropout masks with) against reference/rng.py,
    across runs whose low counter word wraps (the carry into the high word)."""
    if CXX is None:
        pytest.skip("no C++ compiler (c++/g++) on PATH to build tests/cpp/common_math_harness.cpp")
    flags = []
    if isa == "avx2":
        if "avx2" not in torch.backends.cpu.get_cpu_capability().lower() and \
                "avx512" not in torch.backends.cpu.get_cpu_capability().lower():
            pytest.skip("this CPU has no AVX2 to run the vector Philox lanes on")
        flags = ["-mavx2", "-DCPU_CAPABILITY=AVX2"]
    if isa == "avx512":
        if "avx512" not in torch.backends.cpu.get_cpu_capability().lower():
            pytest.skip("this CPU has no AVX-512 to run the 16-lane Philox loop on")
        flags = ["-mavx2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-DCPU_CAPABILITY=AVX512"]
    exe = tmp_path / "harness"
    subprocess.run([CXX, "-std=c++17", "-O1", *flags, "-I", str(ROOT / "csrc"),
                    str(ROOT / "tests/cpp/common_math_harness.cpp"), "-o", str(exe)],
                   check=True, capture_output=True, text=True)
    # Four elements per counter: runs starting at each offset mod 4, whole and partial blocks of
    # 64 (AVX-512) and 32 (AVX2) words, counters whose low word wraps inside a block.
    runs = [(0, 0, 37), (7, 2**32 - 13, 40), (2**62 - 1, 2**33 - 3, 17), (12345, 2**62 + 5, 64),
            (1, 2**64 - 20, 19), (99, 1000, 1), (5, 4, 64), (5, 1, 64), (5, 2, 65), (5, 3, 130),
            (5, 6, 31), (11, 2**34 - 9, 100), (11, 2**34 - 64, 200), (3, 2**64 - 70, 70)]
    commands = "\n".join(f"philox_run {seed} {base} {n}" for seed, base, n in runs) + "\n"
    out = subprocess.run([str(exe)], input=commands, check=True, capture_output=True, text=True)
    for (seed, base, n), line in zip(runs, out.stdout.splitlines()):
        counters = torch.tensor([(base + j) % 2**64 - (2**64 if (base + j) % 2**64 >= 2**63 else 0)
                                 for j in range(n)], dtype=torch.int64)
        expected = rng.philox_words(counters, seed)
        assert [int(w) for w in line.split()] == expected.tolist(), (seed, base, n)


def test_dropout_threshold_matches_reference_rng(harness):
    ps = [0.0, 1e-9, 0.1, 0.25, 0.5, 0.9, 0.999999999]
    out = harness(*(f"threshold {p!r}" for p in ps))
    assert [int(o[0]) for o in out] == [rng.threshold(p) for p in ps]


def test_welford_merge_matches_numpy(harness):
    g = np.random.default_rng(4)
    data = g.normal(1e4, 3.0, size=1000)  # large mean: the case sum(x^2) - n m^2 gets wrong
    splits = [0, 1, 7, 500, 501, 999, 1000]
    chunks = [data[a:b] for a, b in zip(splits[:-1], splits[1:])]  # includes an empty chunk
    cmd = f"welford {len(chunks)} " + " ".join(f"{len(c)} {_fmt(c)}" for c in chunks)
    lanes = data[:992].reshape(8, 124)
    eq = f"welford_equal 8 124 {_fmt(lanes.reshape(-1))}"
    (count, mean, m2), (count_eq, mean_eq, m2_eq) = harness(cmd, eq)
    assert count == 1000 and mean == pytest.approx(data.mean(), rel=1e-14)
    assert m2 / count == pytest.approx(data.var(), rel=1e-11)
    assert count_eq == 992 and mean_eq == pytest.approx(lanes.mean(), rel=1e-14)
    assert m2_eq / count_eq == pytest.approx(lanes.var(), rel=1e-11)
