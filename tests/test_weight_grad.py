"""ops/linear.py's weight gradient on csrc/cpu/weight_grad.cpp (bf16, AMX): P^T Q against the
fp64 product across token counts around the 32-row tiles and the 2048-row passes, column counts
around the 16 / 32-column panels and the 256-column blocks, strided rows, both output layouts and
dtypes; the linear layer's and the FFN's gradients through it; the calls it does not take."""
import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_FACTOR, LOWP_ATOL, assert_lowp_rule

import fastformer as ff
from fastformer.ops import linear as lin

C = ff._ext.C
AMX = C is not None and hasattr(C, "weight_grad") and C.use_amx_bf16()
pytestmark = pytest.mark.skipif(not AMX, reason="weight_grad.cpp runs on AMX-BF16 tiles; this CPU "
                                                "(or FASTFORMER_CPU_ARCH / FASTFORMER_CPU_AMX) has none")

SHAPES = [(1, 1, 1), (17, 40, 72), (113, 203, 80), (203, 128, 17), (64, 257, 33),
          (2049, 300, 129), (4100, 33, 257)]


def _rows(k, cols, gen, pad):
    """(k, cols) bf16 rows with row stride cols + pad (pad > 0: a column slice of a wider matrix)."""
    full = torch.randn(k, cols + pad, generator=gen).bfloat16()
    return full[:, pad // 2: pad // 2 + cols]


@pytest.mark.parametrize("k,m,n", SHAPES)
@pytest.mark.parametrize("transpose_c", [False, True])
@pytest.mark.parametrize("pad", [0, 6])
def test_kernel_matches_fp64_product(k, m, n, transpose_c, pad):
    g = torch.Generator().manual_seed(k * 7 + m * 3 + n + pad)
    p, q = _rows(k, m, g, pad), _rows(k, n, g, pad)
    want = p.double().t() @ q.double()
    got32 = C.weight_grad(p, q, transpose_c, torch.float32)
    got16 = C.weight_grad(p, q, transpose_c, torch.bfloat16)
    if transpose_c:
        assert got32.shape == (n, m)
        got32, got16 = got32.t(), got16.t()
    # fp32 output: sums of exact bf16 products in fp32, k terms each
    torch.testing.assert_close(got32.double(), want, atol=2e-6 * k ** 0.5 * want.abs().max().item(), rtol=0)
    assert got16.dtype == torch.bfloat16
    assert_lowp_rule("P^T Q", got16, want, p.t() @ q, 2.0, LOWP_ATOL[torch.bfloat16])


def test_kernel_rejects_what_it_cannot_read():
    a = torch.randn(8, 4).bfloat16()
    with pytest.raises(RuntimeError, match="bf16 matrices"):
        C.weight_grad(a.float(), a, False, torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16 matrices"):
        C.weight_grad(a, a[:5], False, torch.bfloat16)
    with pytest.raises(RuntimeError, match="bf16 matrices"):
        C.weight_grad(a.t().contiguous().t(), a, False, torch.bfloat16)  # column stride 8
    with pytest.raises(RuntimeError, match="out_dtype"):
        C.weight_grad(a, a, False, torch.float16)
    assert C.weight_grad(a[:0], a[:0], False, torch.float32).abs().sum() == 0  # no tokens: zeros


@pytest.mark.parametrize("shape,out_f", [((4, 300, 256), 384), ((4100, 64), 1024), ((3, 17, 40), 72),
                                         ((2, 300, 256), 384)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_gradients(shape, out_f, bias):
    """ff's linear layer (ops/linear.linear) in bf16 training: its own backward where the kernel
    takes the call, F.linear's otherwise; every gradient by the error-ratio rule."""
    g = torch.Generator().manual_seed(out_f + len(shape))
    x = torch.randn(*shape, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(out_f, shape[-1], generator=g) / shape[-1] ** 0.5).bfloat16().requires_grad_()
    b = torch.randn(out_f, generator=g).bfloat16().requires_grad_() if bias else None
    y = lin.linear(x, w, b)
    takes = x.numel() // shape[-1] >= lin.MIN_WEIGHT_GRAD_TOKENS
    assert (type(y.grad_fn).__name__ == "_LinearBackward") == takes
    dy = torch.randn(y.shape, generator=g).bfloat16()
    params = [t for t in (x, w, b) if t is not None]
    ours = torch.autograd.grad(y, params, dy)
    eager = torch.autograd.grad(F.linear(x, w, b), params, dy)
    ref = [t.detach().double().requires_grad_() for t in params]
    want = torch.autograd.grad(F.linear(*ref, *([None] if not bias else [])), ref, dy.double())
    for name, o, e, r in zip("xwb", ours, eager, want):
        assert_lowp_rule(f"d{name}", o, r, e, GRAD_FACTOR, LOWP_ATOL[torch.bfloat16])


def test_the_kernel_is_skipped_without_amx_or_for_small_calls():
    x = torch.randn(4096, 64).bfloat16()
    dy = torch.randn(4096, 64).bfloat16()
    assert lin.weight_grad_kernel_takes(dy, x)
    assert not lin.weight_grad_kernel_takes(dy[:1000], x[:1000])    # too few tokens to pay
    assert not lin.weight_grad_kernel_takes(dy.float(), x.float())  # fp32: MKL's
    try:
        ff._ext.set_cpu_amx(False)
        assert not lin.weight_grad_kernel_takes(dy, x)
        torch.testing.assert_close(lin.weight_grad(dy, x), dy.t() @ x)
    finally:
        ff._ext.set_cpu_amx(True)


@pytest.mark.parametrize("gated", [False, True])
def test_ffn_weight_gradients_through_the_kernel(gated, monkeypatch):
    """The bf16 FFN (cpu.onednn) takes its weight gradients from the kernel; against the fp64
    oracle by the error-ratio rule (fails if a weight gradient comes from the wrong operands)."""
    calls = []
    real = lin.weight_grad

    def counted(dy, x):
        calls.append(lin.weight_grad_kernel_takes(dy, x))
        return real(dy, x)

    monkeypatch.setattr("fastformer.ops.ffn.weight_grad", counted)  # the down projection's
    monkeypatch.setattr(lin, "weight_grad", counted)                  # the up projections' (_Linear)
    monkeypatch.setattr(lin, "MIN_WEIGHT_GRAD_TOKENS", 1)
    g = torch.Generator().manual_seed(5)
    N, D, Fd = 113, 72, 80
    x = torch.randn(N, D, generator=g).bfloat16().requires_grad_()
    ws = [(torch.randn(*s, generator=g) / s[1] ** 0.5).bfloat16().requires_grad_()
          for s in ((Fd, D), (D, Fd)) + (((Fd, D),) if gated else ())]
    dy = torch.randn(N, D, generator=g).bfloat16()

    def run(x, ws, eager=False):
        if eager:
            pre = F.linear(x, ws[0])
            h = F.silu(pre) * F.linear(x, ws[2]) if gated else F.gelu(pre)
            return F.linear(h, ws[1])
        if gated:
            return ff.swiglu_ffn(x, ws[0], ws[2], ws[1])
        return ff.ffn(x, ws[0], None, ws[1], None, activation="gelu")

    params = [x, *ws]
    ours = torch.autograd.grad(run(x, ws), params, dy)
    assert ff.last_dispatch().impl == "cpu.onednn" and len(calls) == (3 if gated else 2) and all(calls)
    eager = torch.autograd.grad(run(x, ws, eager=True), params, dy)
    ref = [t.detach().double().requires_grad_() for t in params]
    want = torch.autograd.grad(run(ref[0], ref[1:], eager=True), ref, dy.double())
    for i, (o, e, r) in enumerate(zip(ours, eager, want)):
        assert_lowp_rule(f"grad {i}", o, r, e, GRAD_FACTOR, LOWP_ATOL[torch.bfloat16])


def test_linear_under_torch_compile_takes_the_kernel(monkeypatch):
    """Under torch.compile (fullgraph) ff's linear is the custom op fastformer::linear, whose
    backward runs the kernel; gradients as eager's by the error-ratio rule."""
    calls = []
    real = lin.weight_grad

    def counted(dy, x):
        calls.append(lin.weight_grad_kernel_takes(dy, x))
        return real(dy, x)

    monkeypatch.setattr(lin, "weight_grad", counted)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 300, 256, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(384, 256, generator=g) / 16).bfloat16().requires_grad_()
    b = torch.randn(384, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(4, 300, 384, generator=g).bfloat16()
    compiled = torch.compile(lambda x, w, b: lin.linear(x, w, b), fullgraph=True, backend="aot_eager")
    ours = torch.autograd.grad(compiled(x, w, b), (x, w, b), dy)
    assert calls == [True]
    eager = torch.autograd.grad(F.linear(x, w, b), (x, w, b), dy)
    ref = [t.detach().double().requires_grad_() for t in (x, w, b)]
    want = torch.autograd.grad(F.linear(*ref), ref, dy.double())
    for name, o, e, r in zip("xwb", ours, eager, want):
        assert_lowp_rule(f"d{name}", o, r, e, GRAD_FACTOR, LOWP_ATOL[torch.bfloat16])
