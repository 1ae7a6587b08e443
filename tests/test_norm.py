"""add + LayerNorm / RMSNorm on every backend vs eager PyTorch (ARCHITECTURE.md, "Numerical
policy")."""
import pytest
import torch
import torch.nn.functional as F
from conftest import backend_params
from oracle import check, row_sum_tol

import fastformer as ff

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Every required hidden size (1, 7, 384, 1000, 3000, 8192) and row count (0, 1, 17, 4096)
# appears, without the full product (the interpreter's cost is per element).
SHAPES = [(0, 384), (1, 1), (1, 7), (17, 1), (17, 1000), (17, 3000), (4096, 384), (1, 8192),
          (17, 8192), (4096, 1000)]
MODES = ["add_layer_norm", "layer_norm", "add_rms_norm", "rms_norm"]


def _eager(mode, x, r, w, b, eps):
    """What a PyTorch user writes; returns (y, residual stream or None)."""
    z = x + r if r is not None else x
    if "rms" in mode:
        y = F.rms_norm(z, (x.shape[-1],), w, eps)
    else:
        y = F.layer_norm(z, (x.shape[-1],), w, b, eps)
    return y, (z if r is not None else None)


def _ours(mode, x, r, w, b, eps):
    if mode == "add_layer_norm":
        return ff.add_layer_norm(x, r, w, b, eps, return_residual=True)
    if mode == "layer_norm":
        return ff.layer_norm(x, w, b, eps), None
    if mode == "add_rms_norm":
        return ff.rms_norm(x, w, eps, residual=r, return_residual=True)
    return ff.rms_norm(x, w, eps), None


def _inputs(rows, hidden, dtype, mode, *, affine=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    x = mk(rows, hidden) * 2 + 0.5
    r = mk(rows, hidden) if mode.startswith("add") else None
    w = (mk(hidden) * 0.5 + 1) if affine else None
    b = mk(hidden) * 0.1 if (affine and "rms" not in mode) else None
    gy = mk(rows, hidden)
    gr = mk(rows, hidden) if r is not None else None
    return [t.to(dtype) if t is not None else None for t in (x, r, w, b, gy, gr)]


def _run(fn, mode, x, r, w, b, gy, gr, eps):
    """Forward + backward with upstream grads (gy, gr); returns outputs and input grads."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, r, w, b)]
    y, res = fn(mode, *leaves, eps)
    loss = (y.double() * gy.double()).sum()
    if res is not None:
        loss = loss + (res.double() * gr.double()).sum()
    needs = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(loss, needs) if y.numel() else [torch.zeros_like(t) for t in needs]
    it = iter(grads)
    return y.detach(), (res.detach() if res is not None else None), [next(it) if t is not None else None for t in leaves]


def _compare(mode, dtype, x, r, w, b, gy, gr, eps=1e-5):
    y, res, grads = _run(_ours, mode, x, r, w, b, gy, gr, eps)
    oracle_dtype = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
    up = lambda t: t.to(oracle_dtype) if t is not None else None  # noqa: E731
    y_o, res_o, grads_o = _run(_eager, mode, *map(up, (x, r, w, b, gy, gr)), eps)
    lowp = (None, None, [None] * 4)
    if dtype in (torch.float16, torch.bfloat16):
        lowp = _run(_eager, mode, x, r, w, b, gy, gr, eps)
    check("y", y, y_o, lowp[0])
    if res is not None:
        check("residual_out", res, res_o, lowp[1])
    for name, g, g_o, g_l in zip(("dx", "dresidual", "dweight", "dbias"), grads, grads_o, lowp[2]):
        if g is None:
            continue
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        tol = row_sum_tol(2e-5, rows) if name in ("dweight", "dbias") else 1e-5
        check(name, g, g_o, g_l, grad=True, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", backend_params("add_norm"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_matches_eager(backend, dtype, rows, hidden, mode):
    tensors = _inputs(rows, hidden, dtype, mode)
    with ff.use_backend(backend):
        _compare(mode, dtype, *tensors)


@pytest.mark.parametrize("backend", backend_params("add_norm"))
@pytest.mark.parametrize("mode", ["add_layer_norm", "add_rms_norm"])
def test_no_affine_and_leading_dims(backend, mode):
    x, r, _, _, gy, gr = _inputs(6 * 5, 96, torch.float32, mode, affine=False)
    shape = (2, 3, 5, 96)
    with ff.use_backend(backend):
        _compare(mode, torch.float32, *(t.reshape(shape) if t is not None else None
                                        for t in (x, r)), None, None,
                 *(t.reshape(shape) if t is not None else None for t in (gy, gr)))


@pytest.mark.parametrize("backend", backend_params("add_norm"))
def test_fp32_params_with_bf16_input(backend):
    x, r, w, b, gy, gr = _inputs(33, 200, torch.bfloat16, "add_layer_norm")
    w32, b32 = w.float(), b.float()
    with ff.use_backend(backend):
        y, res = ff.add_layer_norm(x, r, w32, b32, return_residual=True)
    assert y.dtype == torch.bfloat16 and res.dtype == torch.bfloat16
    oracle = F.layer_norm((x + r).float(), (200,), w32, b32)
    lowp = F.layer_norm(x + r, (200,), w, b)  # what a bf16 model computes
    check("y", y, oracle, lowp)


def _view(t, layout):
    if layout == "transposed":
        return t.transpose(0, 1)                    # leading dims: no single row stride
    if layout == "strided_slice":
        return t[:, ::2, :200]                      # row stride != hidden
    return t[..., :128].transpose(-1, -2)           # the normalized dim itself is strided


@pytest.mark.parametrize("backend", backend_params("add_norm"))
@pytest.mark.parametrize("layout", ["transposed", "strided_slice", "last_dim_strided"])
def test_non_contiguous_inputs(backend, layout):
    base, base_r = torch.randn(12, 10, 256), torch.randn(12, 10, 256)
    x, r = _view(base, layout), _view(base_r, layout)
    hidden = x.shape[-1]
    w, b = torch.randn(hidden), torch.randn(hidden)
    # cpu: the last dim strided on contiguous copies (ops/norm.py _CpuStridedRows)
    unsupported = (layout == "last_dim_strided" and backend not in ("cpu", "reference")) or \
        (layout == "transposed" and backend != "cpu")
    if unsupported and backend != "reference":
        with ff.use_backend(backend), pytest.raises(ValueError, match="unsupported"):
            ff.add_layer_norm(x, r, w, b)
        y = ff.add_layer_norm(x, r, w, b)  # auto falls back and records why
        assert ff.last_dispatch().backend in ("cpu", "reference")
    else:
        with ff.use_backend(backend):
            y = ff.add_layer_norm(x, r, w, b)
    expected = F.layer_norm(x.double() + r.double(), (hidden,), w.double(), b.double())
    check("y", y, expected)


def test_fallback_reason_is_recorded():
    x = torch.randn(64, 8).t()  # last dim strided
    ff.layer_norm(x, None, None)
    d = ff.last_dispatch()
    assert "last_dim_strided" in str(d)  # why the plain cpu kernels skipped it
    assert d.backend == "reference" or "copied to contiguous" in str(d)


@pytest.mark.skipif(ff._ext.C is None, reason="the cpu backend (fastformer._C) is not built")
def test_channels_strided_stream_on_cpu_with_gradients():
    """A residual stream whose hidden dim is strided (SigLIP's: its conv patch embedding
    transposed) runs on the cpu kernels via contiguous copies; gradients reach the strided
    inputs."""
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(2, 48, 17, generator=g).transpose(1, 2).requires_grad_() for _ in range(2))
    w, b = (torch.randn(48, generator=g).requires_grad_() for _ in range(2))
    with ff.use_backend("cpu"):
        y, stream = ff.add_layer_norm(x, r, w, b, return_residual=True)
    assert "copied to contiguous" in str(ff.last_dispatch())
    gy, gs = torch.randn(y.shape, generator=g), torch.randn(y.shape, generator=g)
    grads = torch.autograd.grad((y * gy).sum() + (stream * gs).sum(), (x, r, w, b))
    exact = [t.detach().double().requires_grad_() for t in (x, r, w, b)]
    z = exact[0] + exact[1]
    expected = F.layer_norm(z, (48,), exact[2], exact[3])
    want = torch.autograd.grad((expected * gy.double()).sum() + (z * gs.double()).sum(), exact)
    check("y", y, expected)
    check("stream", stream, z)
    for name, got, ref in zip("xrwb", grads, want):
        check(f"d{name}", got, ref, grad=True)
    with ff.use_backend("cpu"):
        ff.layer_norm(x.detach().bfloat16(), w.detach().bfloat16(), b.detach().bfloat16())
    assert "copied to contiguous" in str(ff.last_dispatch())


@pytest.mark.parametrize("mode", ["add_layer_norm", "add_rms_norm", "layer_norm"])
def test_gradcheck_fp64_cpu(mode):
    x, r, w, b, _, _ = _inputs(5, 13, torch.float64, mode)
    args = [t.requires_grad_(True) if t is not None else None for t in (x, r, w, b)]

    def fn(x, r, w, b):
        y, res = _ours(mode, x, r, w, b, 1e-5)
        return (y, res) if res is not None else y

    with ff.use_backend("cpu"):
        assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_cpu_capability_levels_agree(capability_levels):
    """The default (scalar), AVX2 and AVX-512 builds of the CPU kernels give the same answers."""
    x, r, w, b, gy, gr = _inputs(37, 1003, torch.float32, "add_layer_norm")
    xb, rb = x.bfloat16(), r.bfloat16()
    results = {}
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            with ff.use_backend("cpu"):
                results[level] = (_run(_ours, "add_layer_norm", x, r, w, b, gy, gr, 1e-5),
                                  ff.add_layer_norm(xb, rb, w.bfloat16(), b.bfloat16()))
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])
    assert len(results) >= 1
    ref_level = capability_levels[0]
    for level, ((y, res, grads), ybf) in results.items():
        (y0, res0, grads0), ybf0 = results[ref_level]
        check(f"y[{level}]", y, y0)
        check(f"res[{level}]", res, res0)
        for g, g0 in zip(grads, grads0):
            check(f"grad[{level}]", g, g0, atol=2e-5, rtol=2e-5)
        # bf16 outputs may differ by one rounding step where fp32 sums differ in the last bit
        assert (ybf.float() - ybf0.float()).abs().max() <= 0.02


def test_modules_match_torch_and_share_state_dict():
    torch_ln = torch.nn.LayerNorm(64)
    torch.nn.init.normal_(torch_ln.weight)
    torch.nn.init.normal_(torch_ln.bias)
    ours = ff.LayerNorm(64)
    ours.load_state_dict(torch_ln.state_dict())
    torch_ln.load_state_dict(ours.state_dict())
    x = torch.randn(3, 7, 64)
    check("LayerNorm", ours(x), torch_ln(x))
    assert isinstance(ours, torch.nn.LayerNorm)

    multi = torch.nn.LayerNorm((4, 16), elementwise_affine=True, bias=False)
    ours_multi = ff.LayerNorm((4, 16), bias=False)
    ours_multi.load_state_dict(multi.state_dict())
    x = torch.randn(5, 4, 16)
    check("LayerNorm(4,16)", ours_multi(x), multi(x))

    rms = torch.nn.RMSNorm(48)
    torch.nn.init.normal_(rms.weight)
    ours_rms = ff.RMSNorm(48)
    ours_rms.load_state_dict(rms.state_dict())
    x = torch.randn(9, 48)
    check("RMSNorm", ours_rms(x), rms(x))
    assert set(ours_rms.state_dict()) == set(rms.state_dict())


def test_rows_zero_gives_empty_outputs_and_zero_param_grads():
    x = torch.randn(0, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    y = ff.layer_norm(x, w, b)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(32)) and torch.equal(b.grad, torch.zeros(32))


# ---- bad input --------------------------------------------------------------------------------
def _bad_calls():
    x = torch.randn(4, 16)
    return [
        (lambda: ff.add_layer_norm(x, x, torch.randn(15), None), ValueError, "weight"),
        (lambda: ff.add_layer_norm(x, x, None, torch.randn(16, 1)), ValueError, "bias"),
        (lambda: ff.add_layer_norm(x, torch.randn(4, 8), None, None), ValueError, "residual"),
        (lambda: ff.add_layer_norm(x, x.double(), None, None), TypeError, "residual"),
        (lambda: ff.add_layer_norm(x, x.to("meta"), None, None), ValueError, "residual"),
        (lambda: ff.add_layer_norm(x.long(), None, None, None), TypeError, "x"),
        (lambda: ff.add_layer_norm(x, None, torch.ones(16, dtype=torch.int32), None), TypeError, "weight"),
        (lambda: ff.add_layer_norm(x, None, torch.ones(16, dtype=torch.float16), None), TypeError, "weight"),
        (lambda: ff.add_layer_norm([1.0], None, None, None), TypeError, "x"),
        (lambda: ff.add_layer_norm(x, None, None, None, eps=-1.0), ValueError, "eps"),
        (lambda: ff.add_layer_norm(x, None, None, None, return_residual=1), TypeError, "return_residual"),
        (lambda: ff.layer_norm(torch.randn(4, 0), None, None), ValueError, "x"),
        (lambda: ff.rms_norm(x, torch.randn(3)), ValueError, "weight"),
        (lambda: ff.rms_norm(x, None, residual=torch.randn(4, 16, dtype=torch.bfloat16)), TypeError, "residual"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_names_the_argument(case):
    call, exc, name = _bad_calls()[case]
    with pytest.raises(exc, match=f"`{name}`"):
        call()
