"""ops/linear.py's fp32 route on the packed GEMM (csrc/cpu/ffn.cpp's first layer alone), taken
where torch's fp32 GEMM is generic code: the output and every gradient against the fp64
product, across row counts (the packed GEMM's row panels and their tails), odd feature counts,
biases, strided inputs and in-major weights (a transposed view: GPT-2's Conv1D); and the rule
that decides which calls take it. The rule is forced on (as on an AMD CPU) so that the route is
tested on every CPU. fp64 is not a dtype the route takes (torch's GEMM runs it): no gradcheck."""
import pytest
import torch
import torch.nn.functional as F

import fastformer as ff
from fastformer.ops import cpu_gemm
from fastformer.ops import linear as lin

pytestmark = pytest.mark.skipif(ff._ext.C is None or not hasattr(ff._ext.C, "ffn_linear_fwd")
                                or ff._ext.cpu_level() not in ("avx2", "avx512"),
                                reason="needs fastformer._C at the avx2 or avx512 level")


@pytest.fixture
def packed_rule(monkeypatch):
    """The rule as on a CPU whose torch fp32 GEMM is generic code, and a count of the calls."""
    monkeypatch.setattr(cpu_gemm, "torch_fp32_gemm_wins", lambda: (False, "forced by the test"))
    calls = {"fwd": 0, "bwd": 0}
    real_fwd, real_bwd = ff._ext.C.ffn_linear_fwd, ff._ext.C.ffn_linear_bwd

    def fwd(*a):
        calls["fwd"] += 1
        return real_fwd(*a)

    def bwd(*a):
        calls["bwd"] += 1
        return real_bwd(*a)
    monkeypatch.setattr(ff._ext.C, "ffn_linear_fwd", fwd, raising=False)
    monkeypatch.setattr(ff._ext.C, "ffn_linear_bwd", bwd, raising=False)
    return calls


def _close(name, got, want, scale_of):
    """fp32 against fp64 at 1e-5 of the reference's scale (the fp32 policy)."""
    err = (got.double() - want).abs().max().item()
    scale = max(scale_of.abs().max().item(), 1.0)
    assert err <= 1e-5 * scale, f"{name}: max error {err:.3g} over 1e-5 x scale {scale:.3g}"


@pytest.mark.parametrize("rows", [65, 100, 203, 1030])
@pytest.mark.parametrize("in_f,out_f", [(40, 113), (128, 72), (203, 17)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "strided_x", "in_major_w"])
def test_packed_linear_matches_fp64_with_every_gradient(packed_rule, rows, in_f, out_f, bias, layout):
    g = torch.Generator().manual_seed(rows * 1000 + in_f)
    x = torch.randn(rows, 2 * in_f if layout == "strided_x" else in_f, generator=g)
    x = (x[:, ::2] if layout == "strided_x" else x).requires_grad_()
    w_store = torch.randn(in_f, out_f, generator=g) if layout == "in_major_w" else torch.randn(out_f, in_f, generator=g)
    w_store.requires_grad_()
    w = w_store.t() if layout == "in_major_w" else w_store
    b = torch.randn(out_f, generator=g, requires_grad=True) if bias else None
    y = lin.linear(x.unflatten(0, (1, rows)), w, b)  # leading dims kept
    assert y.shape == (1, rows, out_f)
    dy = torch.randn(1, rows, out_f, generator=g)
    y.backward(dy)
    assert packed_rule == {"fwd": 1, "bwd": 1}
    x64, w64 = x.detach().double(), w.detach().double()
    want = F.linear(x64, w64, b.detach().double() if bias else None)
    _close("y", y[0], want, want)
    dy64 = dy[0].double()
    _close("dx", x.grad, dy64 @ w64, dy64 @ w64)
    dw = dy64.t() @ x64
    _close("dw", w_store.grad, dw.t() if layout == "in_major_w" else dw, dw)
    if bias:
        _close("db", b.grad, dy64.sum(0), dy64.sum(0))


def test_only_the_gradients_asked_for(packed_rule):
    x = torch.randn(80, 48)
    w = torch.randn(24, 48, requires_grad=True)
    lin.linear(x, w).sum().backward()
    assert x.grad is None and w.grad is not None
    torch.testing.assert_close(w.grad, torch.ones(80, 24).t() @ x, atol=1e-4, rtol=1e-5)
    x.requires_grad_()
    w_frozen = w.detach()
    lin.linear(x, w_frozen).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(80, 24) @ w_frozen, atol=1e-4, rtol=1e-5)
    assert packed_rule == {"fwd": 2, "bwd": 2}


def test_which_calls_take_the_packed_gemm(packed_rule, monkeypatch):
    w = torch.randn(64, 128)
    most = lin.max_rows(torch.float32)  # the few-row kernel takes up to here (without a gradient)
    with torch.no_grad():
        lin.linear(torch.randn(most, 128), w)
        assert packed_rule["fwd"] == 0
        lin.linear(torch.randn(most + 1, 128), w)
        assert packed_rule["fwd"] == 1
    x = torch.randn(most + 1, 128, requires_grad=True)
    lin.linear(x, w)
    assert packed_rule["fwd"] == 2
    lin.linear(torch.randn(most, 128, requires_grad=True), w)
    lin.linear(x.bfloat16(), w.bfloat16())
    lin.linear(x.double(), w.double())
    assert packed_rule["fwd"] == 2  # fewer rows with a gradient, other dtypes: torch's GEMM
    monkeypatch.setattr(cpu_gemm, "torch_fp32_gemm_wins", lambda: (True, "MKL on an Intel CPU"))
    lin.linear(x, w)
    assert packed_rule["fwd"] == 2


def test_compiled_linear_takes_the_packed_gemm(packed_rule, monkeypatch):
    """Under torch.compile (fullgraph) fp32 calls go through the custom op fastformer::linear,
    whose body and backward run the packed GEMM: output and gradients against fp64. (The rule
    under compile is read at import; forced here as the fixture forces the eager one.)"""
    monkeypatch.setattr(lin, "_COMPILE_FP32_MIN_ROWS", lin.max_rows(torch.float32) + 1)
    torch._dynamo.reset()
    try:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(2, 50, 72, generator=g, requires_grad=True)
        w = torch.randn(40, 72, generator=g, requires_grad=True)
        b = torch.randn(40, generator=g, requires_grad=True)
        fn = torch.compile(lambda x, w, b: lin.linear(x, w, b), fullgraph=True)
        y = fn(x, w, b)
        dy = torch.randn(y.shape, generator=g)
        y.backward(dy)
        assert packed_rule["fwd"] >= 1 and packed_rule["bwd"] >= 1, packed_rule
        x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double().reshape(-1, 40)
        want = F.linear(x64, w64, b.detach().double())
        _close("y", y, want, want)
        _close("dx", x.grad.reshape(-1, 72), dy64 @ w64, dy64 @ w64)
        _close("dw", w.grad, dy64.t() @ x64.reshape(-1, 72), dy64.t() @ x64.reshape(-1, 72))
        _close("db", b.grad, dy64.sum(0), dy64.sum(0))
    finally:
        torch._dynamo.reset()
