"""ops/linear.py's route on the packed GEMM (csrc/cpu/ffn.cpp's first layer alone), taken where
torch's GEMM in the call's dtype is generic code (fp32 off Intel's MKL; bf16 / fp16 without
bf16 / fp16 instructions): the output and every gradient against the fp64 product (fp32 at
1e-5 of the scale, bf16 / fp16 by the error-ratio rule against torch's own), across row counts
(the packed GEMM's row panels and their tails), odd feature counts, biases, strided inputs and
in-major weights (a transposed view: GPT-2's Conv1D); and the rule that decides which calls take
it. The rule is forced on (as on an AMD CPU, an AVX2-only one for bf16 / fp16) so that the route
is tested on every CPU. fp64 is not a dtype the route takes (torch's GEMM runs it): no gradcheck."""
import pytest
import torch
import torch.nn.functional as F

from oracle import GRAD_FACTOR, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule

import fastformer as ff
from fastformer.ops import cpu_gemm
from fastformer.ops import linear as lin

pytestmark = pytest.mark.skipif(ff._ext.C is None or not hasattr(ff._ext.C, "ffn_linear_fwd")
                                or ff._ext.cpu_level() not in ("avx2", "avx512"),
                                reason="needs fastformer._C at the avx2 or avx512 level")


@pytest.fixture
def packed_rule(monkeypatch):
    """The rule as on a CPU whose torch fp32, bf16 and fp16 GEMMs are generic code, and a count of
    the calls."""
    monkeypatch.setattr(cpu_gemm, "torch_fp32_gemm_wins", lambda: (False, "forced by the test"))
    monkeypatch.setattr(cpu_gemm, "fast_lowp_gemm", lambda dtype: False)
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
    with torch.no_grad():  # without autograd the kernel is called straight: the same values
        y_inference = lin.linear(x.unflatten(0, (1, rows)), w, b)
    assert packed_rule["fwd"] == 2 and y_inference.shape == (1, rows, out_f)
    assert torch.equal(y_inference, y.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,in_f,out_f", [(203, 40, 113), (1030, 128, 72), (100, 203, 17)])
@pytest.mark.parametrize("layout", ["contiguous", "strided_x", "in_major_w"])
def test_low_precision_packed_linear_matches_fp64_with_every_gradient(packed_rule, dtype, rows, in_f,
                                                                      out_f, layout):
    """bf16 / fp16 on the packed GEMM (operands converted to fp32 as packed, one rounding of the
    output and of each gradient): at or below torch's own low-precision error (OUT_FACTOR for the
    output, GRAD_FACTOR for the gradients)."""
    g = torch.Generator().manual_seed(rows + in_f)
    x = torch.randn(rows, 2 * in_f if layout == "strided_x" else in_f, generator=g).to(dtype)
    x = (x[:, ::2] if layout == "strided_x" else x).requires_grad_()
    w_shape = (in_f, out_f) if layout == "in_major_w" else (out_f, in_f)
    w_store = (torch.randn(w_shape, generator=g) / in_f ** 0.5).to(dtype).requires_grad_()
    w = w_store.t() if layout == "in_major_w" else w_store
    b = torch.randn(out_f, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(rows, out_f, generator=g).to(dtype)
    y = lin.linear(x, w, b)
    y.backward(dy)
    assert packed_rule == {"fwd": 1, "bwd": 1} and y.dtype == dtype
    ours = y.detach(), x.grad, w_store.grad, b.grad
    x.grad = w_store.grad = b.grad = None
    torch_y = F.linear(x, w, b)
    torch_y.backward(dy)
    eager = torch_y.detach(), x.grad, w_store.grad, b.grad
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    dw = dy64.t() @ x64
    want = (F.linear(x64, w64, b.detach().double()), dy64 @ w64,
            dw.t() if layout == "in_major_w" else dw, dy64.sum(0))
    for name, got, exact, theirs in zip(("y", "dx", "dw", "db"), ours, want, eager):
        assert got.dtype == dtype, name
        assert_lowp_rule(name, got, exact, theirs, OUT_FACTOR if name == "y" else GRAD_FACTOR,
                         LOWP_ATOL[dtype])


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
    lin.linear(x.double(), w.double())
    assert packed_rule["fwd"] == 2  # fewer rows with a gradient, fp64: torch's GEMM
    monkeypatch.setattr(cpu_gemm, "torch_fp32_gemm_wins", lambda: (True, "MKL on an Intel CPU"))
    lin.linear(x, w)
    assert packed_rule["fwd"] == 2
    for dtype in (torch.bfloat16, torch.float16):
        most = lin.max_rows(dtype)
        with torch.no_grad():
            lin.linear(torch.randn(most, 128, dtype=dtype), w.to(dtype))  # the few-row kernel
            lin.linear(torch.randn(most + 1, 128, dtype=dtype), w.to(dtype))
        assert packed_rule["fwd"] == 3
        monkeypatch.setattr(cpu_gemm, "fast_lowp_gemm", lambda dtype: True)  # torch's GEMM is fast
        lin.linear(torch.randn(most + 1, 128, dtype=dtype), w.to(dtype))
        monkeypatch.setattr(cpu_gemm, "fast_lowp_gemm", lambda dtype: False)
        assert packed_rule["fwd"] == 3
        packed_rule["fwd"] = 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_linear_takes_the_packed_gemm(packed_rule, monkeypatch, dtype):
    """Under torch.compile (fullgraph) calls the packed GEMM takes go through the custom op
    fastformer::linear, whose body and backward run it: output and gradients against fp64. (The
    rule under compile is read at import; forced here as the fixture forces the eager one.)"""
    monkeypatch.setattr(lin, "_COMPILE_MIN_ROWS", {dtype: lin.max_rows(dtype) + 1})
    torch._dynamo.reset()
    try:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(2, 50, 72, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(40, 72, generator=g) / 8).to(dtype).requires_grad_()
        b = torch.randn(40, generator=g).to(dtype).requires_grad_()
        fn = torch.compile(lambda x, w, b: lin.linear(x, w, b), fullgraph=True)
        y = fn(x, w, b)
        dy = torch.randn(y.shape, generator=g).to(dtype)
        y.backward(dy)
        assert packed_rule["fwd"] >= 1 and packed_rule["bwd"] >= 1, packed_rule
        ours = y.detach().reshape(-1, 40), x.grad.reshape(-1, 72), w.grad, b.grad
        x64, w64, dy64 = x.detach().double().reshape(-1, 72), w.detach().double(), dy.double().reshape(-1, 40)
        want = F.linear(x64, w64, b.detach().double()), dy64 @ w64, dy64.t() @ x64, dy64.sum(0)
        if dtype == torch.float32:
            for name, got, exact in zip(("y", "dx", "dw", "db"), ours, want):
                _close(name, got, exact, exact)
            return
        x.grad = w.grad = b.grad = None
        torch_y = F.linear(x, w, b)
        torch_y.backward(dy)
        eager = torch_y.detach().reshape(-1, 40), x.grad.reshape(-1, 72), w.grad, b.grad
        for name, got, exact, theirs in zip(("y", "dx", "dw", "db"), ours, want, eager):
            assert_lowp_rule(name, got, exact, theirs, OUT_FACTOR if name == "y" else GRAD_FACTOR,
                             LOWP_ATOL[dtype])
    finally:
        torch._dynamo.reset()


def test_low_precision_rule_can_be_forced(monkeypatch):
    """FASTFORMER_CPU_LOWP_GEMM=torch / kernels forces the bf16 / fp16 rule either way; another
    value is a ValueError naming the variable."""
    monkeypatch.setenv(cpu_gemm.LOWP_GEMM_ENV, "torch")
    assert cpu_gemm.fast_lowp_gemm(torch.bfloat16) and cpu_gemm.fast_lowp_gemm(torch.float16)
    assert not lin.packed_gemm_wins(torch.bfloat16)
    monkeypatch.setenv(cpu_gemm.LOWP_GEMM_ENV, "kernels")
    assert not cpu_gemm.fast_lowp_gemm(torch.bfloat16) and not cpu_gemm.fast_lowp_gemm(torch.float16)
    assert lin.packed_gemm_wins(torch.bfloat16)
    monkeypatch.setenv(cpu_gemm.LOWP_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="FASTFORMER_CPU_LOWP_GEMM"):
        cpu_gemm.fast_lowp_gemm(torch.bfloat16)
