"""Feed-forward block (ff.ffn, ff.swiglu_ffn, FeedForward, SwiGLU) on every backend vs eager
PyTorch (ARCHITECTURE.md, "Numerical policy"): forward and the gradients of x and every weight
and bias."""
import pytest
import torch
import torch.nn.functional as F
from conftest import backend_params
from oracle import check, row_sum_tol

import fastformer as ff
from fastformer.ops.linear import max_rows
from fastformer.reference.rng import draw_rng_state, keep_mask

ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "silu": F.silu, "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t), "relu2": lambda t: F.relu(t).square()}
LOWP = (torch.float16, torch.bfloat16)
# Every required tokens / d_model / dim_feedforward value appears: tokens {1, 17, 256},
# d_model {64, 384, 1000}, dim_feedforward {128, 1536, 2730}.
SHAPES = [(1, 64, 128), (17, 384, 1536), (256, 1000, 2730), (17, 1000, 128), (256, 64, 1536),
          (1, 384, 2730), (256, 384, 128)]
# Low precision: eager bf16/fp16 matmuls run at ~1 GFLOP/s on CPUs without AVX512-BF16/AMX; the
# largest shape once only.
LOWP_SHAPES = [(1, 64, 128), (17, 384, 1536), (17, 1000, 128), (256, 64, 1536), (1, 384, 2730)]
TRITON_SHAPES = [(1, 64, 128), (17, 64, 128), (33, 96, 200)]  # the interpreter: small shapes


def _params(tokens, d, hidden, dtype, gated, bias, seed=0, lead=None, act=None):
    """(x, w1, b1, w2, b2, w_up, b_up, dy): weights scaled so that every GEMM output is O(1).
    relu2 squares the pre-activation (|pre| up to ~5 made h up to ~29 and its derivative 2 relu
    up to ~10: eager fp32's own dw2 was 2e-4 off the fp64 oracle, dw1 8e-5): its w1, b1 are
    scaled by 1/4, so that h and act' are O(1) as the policy's fixed fp32 tolerances assume
    (relu2 is homogeneous: the scale changes no path through it)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    shape = (tokens, d) if lead is None else (*lead, d)
    x, dy = mk(*shape), mk(*shape)
    w1, w2 = mk(hidden, d) / d ** 0.5, mk(d, hidden) / hidden ** 0.5
    w_up = mk(hidden, d) / d ** 0.5 if gated else None
    b1, b2 = (mk(hidden) * 0.5, mk(d) * 0.5) if bias else (None, None)
    b_up = mk(hidden) * 0.5 if (gated and bias) else None
    if act == "relu2":
        w1, b1 = w1 * 0.25, (None if b1 is None else b1 * 0.25)
    return [t.to(dtype) if t is not None else None for t in (x, w1, b1, w2, b2, w_up, b_up, dy)]


def _eager(x, w1, b1, w2, b2, w_up, b_up, act, keep=None, p=0.0):
    pre = F.linear(x, w1, b1)
    if w_up is not None:
        return F.linear(ACTS[act](pre) * F.linear(x, w_up, b_up), w2, b2)
    h = ACTS[act](pre)
    if keep is not None:
        h = h * keep.to(h.dtype) / (1 - p)
    return F.linear(h, w2, b2)


def _ours(x, w1, b1, w2, b2, w_up, b_up, act, p=0.0):
    if w_up is not None:
        return ff.swiglu_ffn(x, w1, w_up, w2, b1, b_up, b2, activation=act)
    return ff.ffn(x, w1, b1, w2, b2, activation=act, dropout_p=p)


def _run(fn, tensors, dy, *args, **kw):
    """Forward + backward with upstream grad dy; returns (y, grads of the non-None inputs)."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    y = fn(*leaves, *args, **kw)
    needs = [t for t in leaves if t is not None]
    return y.detach(), list(torch.autograd.grad(y, needs, dy))


NAMES = ("dx", "dw1", "db1", "dw2", "db2", "dw_up", "db_up")


def _compare(tensors, dy, act, dtype, tokens):
    y, grads = _run(_ours, tensors, dy, act)
    oracle_dtype = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
    up = [t.to(oracle_dtype) if t is not None else None for t in tensors]
    y_o, grads_o = _run(_eager, up, dy.to(oracle_dtype), act)
    y_l, grads_l = (None, [None] * len(grads))
    if dtype in LOWP:
        y_l, grads_l = _run(_eager, tensors, dy, act)
    check("y", y, y_o, y_l)
    names = [n for n, t in zip(NAMES, tensors) if t is not None]
    for name, g, g_o, g_l in zip(names, grads, grads_o, grads_l):
        # parameter gradients are sums over the tokens (oracle.row_sum_tol)
        tol = 1e-5 if name == "dx" else row_sum_tol(2e-5, tokens)
        check(name, g, g_o, g_l, grad=True, atol=tol, rtol=tol)


def _cases(shapes, dtypes, per_shape=4):
    """per_shape of the 8 (activation, gated) pairs of relu, gelu, gelu_tanh and silu for each
    shape and dtype, rotating so that consecutive shapes take the next pairs (every pair
    appears), biases on every other case; and one quick_gelu or relu2 case per shape and dtype,
    in turn plain / gated quick_gelu, plain / gated relu2."""
    pairs = [(act, gated) for gated in (False, True) for act in ("relu", "gelu", "gelu_tanh", "silu")]
    out = []
    for i, (tokens, d, hidden) in enumerate(shapes):
        for dtype in dtypes:
            for k in range(per_shape + 1):
                act, gated = (pairs[(i * per_shape + k) % len(pairs)] if k < per_shape
                              else (("quick_gelu", "relu2")[i // 2 % 2], i % 2 == 1))
                bias = (i + k) % 2 == 0
                out.append(pytest.param(tokens, d, hidden, dtype, act, gated, bias,
                                        id=f"{tokens}x{d}x{hidden}-{str(dtype)[6:]}-{act}-"
                                           f"{'glu' if gated else 'ffn'}-{'b' if bias else 'nob'}"))
    return out


CASE_ARGS = "tokens,d,hidden,dtype,act,gated,bias"


@pytest.mark.parametrize(CASE_ARGS, _cases(SHAPES, [torch.float32])
                         + _cases(LOWP_SHAPES, list(LOWP), per_shape=2)
                         + _cases([(256, 1000, 2730)], [torch.bfloat16], per_shape=1))
def test_cpu_matches_eager(tokens, d, hidden, dtype, act, gated, bias):
    _backend_matches_eager("cpu", tokens, d, hidden, dtype, act, gated, bias)


# fp32 takes the packed kernel or torch's GEMMs by the CPU's vendor (ops/cpu_gemm.py,
# torch_fp32_gemm_wins): both, on every machine.
@pytest.mark.parametrize("route", ["packed", "torch"])
@pytest.mark.parametrize(CASE_ARGS, _cases(SHAPES[:4], [torch.float32], per_shape=2))
def test_cpu_fp32_routes_match_eager(monkeypatch, route, tokens, d, hidden, dtype, act, gated, bias):
    from fastformer import backends
    from fastformer.ops import cpu_gemm
    monkeypatch.setenv(cpu_gemm.FP32_GEMM_ENV, route)
    backends.clear_cache()
    try:
        _backend_matches_eager("cpu", tokens, d, hidden, dtype, act, gated, bias)
        if tokens > max_rows(torch.float32):
            assert ff.last_dispatch().impl == ("cpu.onednn" if route == "torch" else "cpu"), \
                ff.last_dispatch()
    finally:
        monkeypatch.undo()
        backends.clear_cache()


# bf16 where torch's bf16 GEMMs are generic code (AVX2-only CPUs; forced here on every machine):
# the packed kernel, except few-row calls, whose projections take ops/linear.py's few-row kernel.
@pytest.mark.parametrize("tokens", [1, 5, 8, 9, 17])
@pytest.mark.parametrize("gated", [False, True])
def test_cpu_bf16_routes_without_fast_bf16_gemms(monkeypatch, tokens, gated):
    from fastformer import backends
    from fastformer.ops import cpu_gemm
    if ff._ext.cpu_level() not in ("avx2", "avx512"):
        pytest.skip("the few-row kernel runs at the avx2 and avx512 levels")
    monkeypatch.setenv(cpu_gemm.LOWP_GEMM_ENV, "kernels")
    backends.clear_cache()
    try:
        _backend_matches_eager("cpu", tokens, 72, 203, torch.bfloat16, "silu" if gated else "gelu", gated, True)
        want = "cpu.onednn" if tokens <= max_rows(torch.bfloat16) else "cpu"
        assert ff.last_dispatch().impl == want, ff.last_dispatch()
    finally:
        monkeypatch.undo()
        backends.clear_cache()


# bf16 on a CPU with AMX (avx512 kernels, AMX on) takes torch's AMX GEMMs (ops/ffn.py,
# cpu.onednn) unless there is dropout; with AMX off, csrc/cpu/ffn.cpp. Both, on every machine
# that has AMX (the cases above take whichever is on).
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "kernel"])
@pytest.mark.parametrize(CASE_ARGS, _cases(LOWP_SHAPES[1:4], [torch.bfloat16], per_shape=3))
def test_cpu_bf16_amx_route_and_kernel(amx, tokens, d, hidden, dtype, act, gated, bias):
    info = ff._ext.cpu_info()
    if amx and not ff._ext.C.use_amx_bf16():
        pytest.skip(f"AMX-BF16 not in use here: {info.get('amx_note') or info.get('capability')}")
    ff._ext.set_cpu_amx(amx)
    try:
        _backend_matches_eager("cpu", tokens, d, hidden, dtype, act, gated, bias)
    finally:
        ff._ext.set_cpu_amx(bool(info.get("amx_bf16")))


@pytest.mark.parametrize("gated,dropout_p", [(False, 0.0), (True, 0.0), (False, 0.3)])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_amx_route_formulas_in_fp64(gated, bias, dropout_p):
    """cpu.onednn's GEMM wiring, saved [gate | up] layout, gradient formulas and dropout mask
    against the reference in fp64 (its torch ops take any dtype), on any machine."""
    from fastformer.ops import ffn as ops
    _vendor_route_matches_reference(ops._CpuOnednn(), gated, bias, dropout_p=dropout_p)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_packed_routes_in_fp64(gated, bias):
    """The packed kernel's whole-block fwd / bwd (the custom-op route) and, gated, its eager
    three-node route (its two layers as separate calls) against the reference in fp64."""
    from fastformer.ops import ffn as ops
    _vendor_route_matches_reference(ops._Cpu(), gated, bias)


def _vendor_route_matches_reference(impl, gated, bias, device="cpu", dropout_p=0.0):
    """An Impl's fwd / inference / bwd and its eager autograd route (where it has one for the
    call) against the reference, fp64 (dropout: the same drawn mask on both)."""
    from fastformer.ops import ffn as ops
    from fastformer.reference import ffn as ref
    *tensors, _ = _params(37, 24, 50, torch.float64, gated, bias)
    x, w1, b1, w2, b2, wu, bu = (t.to(device) if t is not None else None for t in tensors)
    for act in range(4):
        drop = dict(dropout_p=dropout_p, rng_state=draw_rng_state()) if dropout_p else {}
        o = ops.FfnOptions(activation=act, **drop)
        y, s = impl.fwd(x, w1, b1, w2, b2, wu, bu, o)
        yr, sr = ref.ffn_fwd(x, w1, b1, w2, b2, wu, bu, o)
        assert torch.allclose(y, yr) and torch.allclose(s, sr), (act, "forward")
        # no backward to come: h is written over the pre-activation buffer, nothing is kept
        y_inference, kept = impl.inference(x, w1, b1, w2, b2, wu, bu, o)
        assert torch.allclose(y_inference, yr), (act, "forward without a saved pre-activation")
        assert kept.numel() == 0
        dy = torch.randn(37, 24, dtype=torch.float64, device=device)
        g = impl.bwd((dy,), (x, w1, w2, wu, s), o, (True,) * 7)
        gr = ref.ffn_bwd(dy, x, w1, w2, wu, sr, o, (True,) * 7)
        for i, (a, b) in enumerate(zip(g, gr)):
            assert (a is None and b.numel() == 0) or torch.allclose(a, b), (act, i)
        # the eager autograd route (separate nodes) on (tokens, ...) leading dims
        leaves = [t.detach().requires_grad_(True) if t is not None else None
                  for t in (x.reshape(1, 37, 24), w1, b1, w2, b2, wu, bu)]
        y_a = impl.autograd(*leaves, o)
        if y_a is None:  # the call takes the op's shared Function (tested everywhere)
            assert not gated and isinstance(impl, ops._Cpu)
            continue
        y_a = y_a[0]
        assert y_a.shape == (1, 37, 24) and torch.allclose(y_a.reshape(37, 24), yr), act
        wanted = [t for t in leaves if t is not None]
        g_a = iter(torch.autograd.grad(y_a, wanted, dy.reshape(1, 37, 24)))
        for i, (t, b) in enumerate(zip(leaves, gr)):
            if t is not None:
                assert torch.allclose(next(g_a).reshape(b.shape), b), (act, "autograd", i)


# The cpu GEMM's blocking (csrc/cpu/gemm_packed.h) at a shape that crosses every level: K over
# several 256-deep blocks, N over a 2048-column B block (gated: 4096 interleaved columns), and M
# over more rows than one K-partial-sum workspace holds (16 MB / (4 B x columns per thread):
# 2048 or 4096 rows), so row groups and a short last group are exercised. Smooth activations
# only: among 8.6M pre-activations some lie within fp32 rounding of relu's kink, where relu'
# of ours (fp32) and of the fp64 oracle may differ (seen: -6.3e-8 in fp64, +1.5e-8 in fp32).
@pytest.mark.parametrize("act,gated", [("gelu", False), ("silu", True)])
def test_cpu_matches_eager_across_gemm_blocks(act, gated):
    _backend_matches_eager("cpu", 4200, 300, 2048, torch.float32, act, gated, True)


# The reference is the oracle's twin: a few cases check it.
@pytest.mark.parametrize(CASE_ARGS, _cases(SHAPES[:2], [torch.float32], per_shape=8)
                         + _cases(LOWP_SHAPES[:1], list(LOWP), per_shape=2))
def test_reference_matches_eager(tokens, d, hidden, dtype, act, gated, bias):
    _backend_matches_eager("reference", tokens, d, hidden, dtype, act, gated, bias)


# The interpreter costs ~20 ms per program: small shapes.
@pytest.mark.parametrize(CASE_ARGS, _cases(TRITON_SHAPES[:1], [torch.float32], per_shape=8)
                         + _cases(TRITON_SHAPES, list(LOWP), per_shape=2)
                         + _cases(TRITON_SHAPES[1:], [torch.float32], per_shape=3))
def test_triton_matches_eager(tokens, d, hidden, dtype, act, gated, bias):
    _backend_matches_eager("triton", tokens, d, hidden, dtype, act, gated, bias)


def _backend_matches_eager(backend, tokens, d, hidden, dtype, act, gated, bias):
    b = ff.backends.get(backend)
    why = b.availability() or (None if ff.backends.implementations("ffn", backend) else "not built")
    if why or "cpu" not in b.devices():
        pytest.skip(f"{backend}: {why or 'no CPU device'}")
    *tensors, dy = _params(tokens, d, hidden, dtype, gated, bias, act=act)
    with ff.use_backend(backend):
        _compare(tensors, dy, act, dtype, tokens)
        assert ff.last_dispatch().backend == backend


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none present")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize(CASE_ARGS, _cases(SHAPES[:3], [torch.float32, *LOWP], per_shape=8))
def test_gpu_matches_eager(backend, tokens, d, hidden, dtype, act, gated, bias):
    why = ff.backends.get(backend).availability()
    if why:
        pytest.skip(f"{backend}: {why}")
    *tensors, dy = _params(tokens, d, hidden, dtype, gated, bias, act=act)
    tensors = [t.cuda() if t is not None else None for t in tensors]
    with ff.use_backend(backend):
        _compare(tensors, dy.cuda(), act, dtype, tokens)
        assert ff.last_dispatch().backend == backend


@pytest.mark.parametrize("backend", backend_params("ffn"))
@pytest.mark.parametrize("gated", [False, True])
def test_inference_path_matches(backend, gated):
    """Without autograd the first GEMM's epilogue applies the activation (nothing is saved)."""
    *tensors, _ = _params(33, 64, 200, torch.float32, gated, True)
    up = [t.double() if t is not None else None for t in tensors]
    for act in ACTS:
        with ff.use_backend(backend), torch.no_grad():
            y = _ours(*tensors, act)
        check(f"y[{act}]", y, _eager(*up, act))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["gate_first", "up_first", "bias_apart"])
@pytest.mark.parametrize("grad", [False, True])
def test_gate_and_up_as_one_tensors_halves(dtype, order, grad):
    """w_gate / w_up as the row halves of one fused gate_up weight (Phi-3's, GLM-4's): one GEMM
    over both when they (and their biases) are adjacent, the same result and gradients as two
    separate tensors; biases that are not adjacent take the two GEMMs."""
    g = torch.Generator().manual_seed(0)
    tokens, d, hidden = 113, 40, 72
    x = torch.randn(tokens, d, generator=g, dtype=dtype)
    fused_w = (torch.randn(2 * hidden, d, generator=g) / d ** 0.5).to(dtype)
    fused_b = torch.randn(2 * hidden, generator=g).to(dtype)
    w_down = (torch.randn(d, hidden, generator=g) / hidden ** 0.5).to(dtype)
    leaves = [t.clone().requires_grad_(grad) for t in (x, fused_w, fused_b, w_down)]
    xl, wl, bl, wd = leaves
    halves = (slice(0, hidden), slice(hidden, None))
    gate, up = halves if order != "up_first" else halves[::-1]
    b_gate, b_up = bl[gate], (bl[up] if order != "bias_apart" else bl[up].clone())
    from fastformer.ops.ffn import _joined_rows
    joined = _joined_rows(wl[gate], wl[up], b_gate, b_up) or _joined_rows(wl[up], wl[gate], b_up, b_gate)
    assert (joined is None) == (order == "bias_apart")
    with torch.set_grad_enabled(grad):
        y = ff.swiglu_ffn(xl, wl[gate], wl[up], wd, b_gate, b_up)
    exact = [t.detach().double().requires_grad_(grad) for t in leaves]
    xe, we, be, wde = exact
    with torch.set_grad_enabled(grad):
        ref = (F.silu(F.linear(xe, we[gate], be[gate])) * F.linear(xe, we[up], be[up])) @ wde.T
        low = None
        if dtype == torch.bfloat16:
            low = (F.silu(F.linear(x, fused_w[gate], fused_b[gate])) * F.linear(x, fused_w[up], fused_b[up])) @ w_down.T
    check("y", y, ref, low)
    if grad:
        weights = torch.randn(y.shape, generator=g, dtype=torch.float64)
        got = torch.autograd.grad((y.double() * weights).sum(), leaves)
        want = torch.autograd.grad((ref * weights).sum(), exact)
        for name, a, b in zip(("x", "w_gate_up", "b_gate_up", "w_down"), got, want):
            if dtype == torch.float32:
                check(f"d{name}", a, b, grad=True, atol=1e-4, rtol=1e-4)
            else:  # bf16: within the rule's absolute floor of the gradient's scale
                assert (a.double() - b).abs().max().item() <= 2e-2 * b.abs().max().item(), name


@pytest.mark.parametrize("tokens,d,hidden", [(1, 64, 128), (17, 40, 72), (113, 80, 203)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_inference_takes_the_onednn_post_op(tokens, d, hidden, bias):
    """bf16 without autograd, not gated: cpu.onednn's up projection, bias and activation as one
    oneDNN call (ops/ffn.py, _CpuOnednn.fwd) for every activation with a post-op; one-row calls
    stay on linear_rows.cpp. Every activation against the fp64 oracle by the error-ratio rule."""
    from fastformer.ops import cpu_gemm
    if not cpu_gemm.onednn_post_ops():
        pytest.skip("the route is taken where torch's bf16 GEMMs have AMX / AVX512-BF16 dot products "
                    "and mkldnn is built in: neither here")
    *tensors, _ = _params(tokens, d, hidden, torch.bfloat16, False, bias)
    exact = [t.double() if t is not None else None for t in tensors]
    for act in ACTS:
        with torch.no_grad(), torch.profiler.profile() as prof:
            y = _ours(*tensors, act)
        assert ff.last_dispatch().impl == "cpu.onednn"
        took = any(e.name == "mkldnn::_linear_pointwise" for e in prof.events())
        assert took == (tokens > 1 and act in cpu_gemm.ONEDNN_POST_OPS), act  # quick_gelu, relu2: none
        check(f"y[{act}]", y, _eager(*exact, act), _eager(*tensors, act))


def test_onednn_post_ops_are_the_activations():
    """The post-op table of that route, in fp32 (where exact and tanh GELU differ by ~1e-4,
    beyond bf16's resolution of the test above): each entry computes its activation."""
    from fastformer.ops import cpu_gemm
    if not cpu_gemm.onednn_post_ops():
        pytest.skip("the route is taken where torch's bf16 GEMMs have AMX / AVX512-BF16 dot products "
                    "and mkldnn is built in: neither here")
    x, w, b, *_ = _params(17, 40, 72, torch.float32, False, True)
    assert set(cpu_gemm.ONEDNN_POST_OPS) == set(ACTS) - {"quick_gelu", "relu2"}  # "swish" has no scale
    for act, post_op in cpu_gemm.ONEDNN_POST_OPS.items():
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, *post_op)
        torch.testing.assert_close(got, ACTS[act](F.linear(x, w, b)), atol=2e-6, rtol=2e-6)


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x (B, L, d) as a view of another layout holding the same values."""
    if layout == "transposed":      # (L, B, d) storage: no single row stride
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "strided_rows":    # one row stride, 2 * d
        return torch.stack([x, x], 2)[:, :, 0]
    if layout == "last_dim_strided":
        return torch.stack([x, x], -1)[..., 0]
    return x


@pytest.mark.parametrize("backend", backend_params("ffn"))
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided_rows", "last_dim_strided"])
@pytest.mark.parametrize("gated", [False, True])
def test_leading_dims_and_non_contiguous_x(backend, layout, gated):
    x, w1, b1, w2, b2, w_up, b_up, dy = _params(0, 48, 96, torch.float32, gated, True, lead=(3, 5))
    xv = _layout(x, layout)
    assert torch.equal(xv, x) and (layout == "contiguous") == xv.is_contiguous()
    with ff.use_backend("auto" if backend == "triton" and layout == "transposed" else backend):
        y, grads = _run(_ours, (xv, w1, b1, w2, b2, w_up, b_up), dy, "gelu")
    assert y.shape == (3, 5, 48)
    up = [t.double() if t is not None else None for t in (x, w1, b1, w2, b2, w_up, b_up)]
    y_o, grads_o = _run(_eager, up, dy.double(), "gelu")
    check("y", y, y_o)
    for g, g_o in zip(grads, grads_o):
        check("grad", g, g_o, grad=True, atol=2e-5, rtol=2e-5)


def test_triton_rejects_rows_without_one_stride():
    x = _layout(torch.randn(3, 5, 16), "transposed")
    w1, w2 = torch.randn(32, 16), torch.randn(16, 32)
    with ff.use_backend("triton"), pytest.raises(ValueError, match="rows_strided"):
        ff.ffn(x, w1, None, w2, None)


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("variant", ["ffn", "ffn_dropout", "gated"])
def test_gradcheck_fp64_cpu(act, variant):
    gated = variant == "gated"
    x, w1, b1, w2, b2, w_up, b_up, _ = _params(5, 7, 9, torch.float64, gated, True)
    args = [t.requires_grad_(True) for t in (x, w1, b1, w2, b2, w_up, b_up) if t is not None]
    p = 0.3 if variant == "ffn_dropout" else 0.0

    def fn(*a):
        torch.manual_seed(1234)  # the same dropout mask at every evaluation
        if gated:
            return ff.swiglu_ffn(a[0], a[1], a[5], a[3], a[2], a[6], a[4], activation=act)
        return ff.ffn(*a, activation=act, dropout_p=p)

    with ff.use_backend("cpu"):
        assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, rtol=1e-6)


# ---- dropout --------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", backend_params("ffn"))
def test_dropout_uses_the_documented_mask_and_its_gradients(backend):
    tokens, d, hidden, p = 19, 40, 72, 0.25
    *tensors, dy = _params(tokens, d, hidden, torch.float32, False, True)
    x, w1, b1, w2, b2, _, _ = tensors
    torch.manual_seed(7)
    rng_state = draw_rng_state()
    keep = keep_mask(rng_state, (tokens, hidden), p)
    assert 0.6 < keep.float().mean() < 0.9
    torch.manual_seed(7)
    with ff.use_backend(backend):
        y, grads = _run(_ours, tensors[:5] + [None, None], dy, "gelu", p)
    up = [t.double() for t in tensors[:5]]
    y_o, grads_o = _run(lambda *a: _eager(*a, None, None, "gelu", keep, p), up, dy.double())
    check("y", y, y_o)
    for name, g, g_o in zip(NAMES, grads, grads_o):
        tol = 1e-5 if name == "dx" else row_sum_tol(2e-5, tokens)
        check(name, g, g_o, grad=True, atol=tol, rtol=tol)


def test_dropout_is_reproducible_with_manual_seed():
    x, w1, b1, w2, b2, *_ = _params(8, 16, 32, torch.float32, False, True)
    outs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        outs.append(ff.ffn(x, w1, b1, w2, b2, dropout_p=0.5))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert torch.equal(ff.ffn(x, w1, b1, w2, b2, dropout_p=0.0), ff.ffn(x, w1, b1, w2, b2))


# ---- autograd bookkeeping ---------------------------------------------------------------------
def _saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves while fn() runs."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("gated", [False, True])
def test_saves_the_pre_activation_not_the_activation(gated):
    tokens, d, hidden = 64, 32, 128
    x, w1, b1, w2, b2, w_up, b_up, _ = _params(tokens, d, hidden, torch.float32, gated, True)
    params = [t.requires_grad_(True) for t in (x, w1, b1, w2, b2, w_up, b_up) if t is not None]
    inputs = sum(t.numel() * 4 for t in params if t.dim() == 2)  # x and the weights
    ours = _saved_bytes(lambda: _ours(x, w1, b1, w2, b2, w_up, b_up, "silu"))
    eager = _saved_bytes(lambda: _eager(x, w1, b1, w2, b2, w_up, b_up, "silu"))
    hidden_bytes = tokens * hidden * 4
    assert ours - inputs == (2 if gated else 1) * hidden_bytes
    assert eager - inputs >= (4 if gated else 2) * hidden_bytes


def test_frozen_weights_and_partial_gradients():
    x, w1, b1, w2, b2, w_up, b_up, dy = _params(20, 24, 40, torch.float32, True, True)
    w1.requires_grad_(True)
    b_up.requires_grad_(True)
    y = ff.swiglu_ffn(x, w1, w_up, w2, None, b_up, b2)
    g_w1, g_bu = torch.autograd.grad(y, (w1, b_up), dy)
    w1d, bud = w1.detach().double().requires_grad_(True), b_up.detach().double().requires_grad_(True)
    y_o = _eager(x.double(), w1d, None, w2.double(), b2.double(), w_up.double(), bud, "silu")
    e_w1, e_bu = torch.autograd.grad(y_o, (w1d, bud), dy.double())
    check("y", y, y_o)
    check("dw_gate", g_w1, e_w1, atol=4e-5, rtol=4e-5)
    check("db_up", g_bu, e_bu, atol=4e-5, rtol=4e-5)


def test_zero_tokens():
    x, w1, b1, w2, b2, *_ = _params(0, 16, 32, torch.float32, False, True)
    params = [t.requires_grad_(True) for t in (x, w1, b1, w2, b2)]
    y = ff.ffn(*params)
    assert y.shape == (0, 16)
    y.sum().backward()
    for t in params[1:]:
        assert torch.equal(t.grad, torch.zeros_like(t))


def test_cpu_capability_levels_agree(capability_levels):
    *tensors, dy = _params(37, 100, 203, torch.float32, True, True)
    results = {}
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            with ff.use_backend("cpu"):
                results[level] = _run(_ours, tensors, dy, "gelu")
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])
    y0, g0 = results[capability_levels[0]]
    for level, (y, g) in results.items():
        check(f"y[{level}]", y, y0)
        for a, b in zip(g, g0):
            check(f"grad[{level}]", a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("act", list(ACTS))
def test_cpu_activation_math_over_the_whole_range(capability_levels, act):
    """The cpu kernels' vector activations (csrc/cpu/vec_math.h: inline e^x, erf, tanh at the
    AVX2 / AVX-512 levels) on pre-activations from -120 to 120, where e^x over- and underflows,
    and on +-inf and NaN, at every CPU level: act(g) and act'(g) through the elementwise pass of
    the vendor-GEMM route, against fp64, with fp32's output tolerance; non-finite results where
    the fp64 ones are, with the same values."""
    from fastformer import _ext
    from fastformer.reference.ffn import ACTIVATIONS
    code = ACTIVATIONS.index(act)
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 88.72, 88.73,
                            -87.33, -87.34, -103.9, -104.1, 1e-30, -1e-30])
    g = torch.cat([torch.linspace(-120, 120, 48001), special]).reshape(1, -1)
    fn = ACTS[act]
    g64 = g.double().requires_grad_(True)
    fn(g64).sum().backward()
    want, want_grad = fn(g.double()), g64.grad
    try:
        for level in capability_levels:
            _ext.set_cpu_capability(level)
            h = _ext.C.ffn_act_fwd(g, None, code, False)
            dg, _, h2 = _ext.C.ffn_act_bwd(torch.ones_like(g), g, None, code, True)
            for name, ours, ref in (("h", h, want), ("dg", dg, want_grad), ("h (bwd)", h2, want)):
                if act == "relu" and name == "dg":  # relu'(NaN): 0 (reference/ffn.py), torch 1
                    ours, ref = ours[~g.isnan()], ref[~g.isnan()]
                fin = torch.isfinite(ref)
                assert torch.equal(ours[~fin].double().nan_to_num(7.0), ref[~fin].nan_to_num(7.0)), \
                    (level, name, ours[~fin], ref[~fin])
                check(f"{name}[{level}]", ours[fin], ref[fin], atol=1e-5, rtol=1e-5)
    finally:
        _ext.set_cpu_capability(capability_levels[-1])


def test_eager_via_ops_route_and_compile(monkeypatch):
    *tensors, dy = _params(9, 24, 40, torch.float32, False, True)
    base = _run(_ours, tensors, dy, "gelu_tanh", 0.0)
    monkeypatch.setenv("FASTFORMER_EAGER_VIA_OPS", "1")
    ff.backends.reload_env()
    try:
        via_ops = _run(_ours, tensors, dy, "gelu_tanh", 0.0)
    finally:
        monkeypatch.delenv("FASTFORMER_EAGER_VIA_OPS")
        ff.backends.reload_env()
    torch._dynamo.reset()
    compiled = _run(torch.compile(_ours, fullgraph=True, backend="aot_eager"), tensors, dy,
                    "gelu_tanh", 0.0)
    for y, grads in (via_ops, compiled):
        torch.testing.assert_close(y, base[0])
        for a, b in zip(grads, base[1]):
            torch.testing.assert_close(a, b)


def test_opcheck_ffn_ops():
    from fastformer.ops import ffn as ffn_ops
    op = ffn_ops.FFN
    x, w1, b1, w2, b2, w_up, b_up, dy = _params(5, 8, 12, torch.float32, True, True)
    o = ffn_ops.FfnOptions(activation=3)
    args = op.op_args((x, w1, b1, w2, b2, w_up, b_up), o)
    torch.library.opcheck(op.fwd_op, args)
    torch.library.opcheck(op.inference_op, args)  # calls without a gradient: nothing saved
    _, saved, token = op.fwd_op(*args)
    torch.library.opcheck(op.bwd_op, ([dy], [x, w1, w2, w_up, saved], *o.flat(), [True] * 7,
                                      token))


# ---- modules --------------------------------------------------------------------------------
def test_feed_forward_module_matches_torch_layers():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, activation="gelu",
                                             batch_first=True)
    ours = ff.FeedForward(32, 64, activation="gelu", dropout=0.1)
    ours.load_state_dict({k: v for k, v in layer.state_dict().items() if k.startswith("linear")})
    assert set(ours.state_dict()) == {"linear1.weight", "linear1.bias", "linear2.weight", "linear2.bias"}
    ours.eval()
    layer.eval()
    x = torch.randn(2, 7, 32)
    check("FeedForward", ours(x), layer.linear2(F.gelu(layer.linear1(x))))
    ours.train()
    torch.manual_seed(5)
    a = ours(x)
    torch.manual_seed(5)
    assert torch.equal(a, ours(x)) and not torch.equal(a, ours.eval()(x))
    no_bias = ff.FeedForward(16, 24, bias=False)
    assert set(no_bias.state_dict()) == {"linear1.weight", "linear2.weight"}


def test_swiglu_module():
    m = ff.SwiGLU(24, 40)
    assert set(m.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    x = torch.randn(3, 4, 24)
    expected = m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
    check("SwiGLU", m(x), expected.double(), atol=2e-5, rtol=2e-5)
    assert ff.SwiGLU(8, 16, bias=True, activation="gelu")(torch.randn(2, 8)).shape == (2, 8)
    with pytest.raises(ValueError, match="'relu', 'gelu', 'gelu_tanh', 'silu', 'quick_gelu', 'relu2'"):
        ff.SwiGLU(8, 16, activation="swish")


# ---- bad input --------------------------------------------------------------------------------
def _bad_calls():
    x, w1, b1, w2, b2 = torch.randn(4, 16), torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16)
    return [
        (lambda: ff.ffn(x, torch.randn(32, 15), b1, w2, b2), ValueError, "w1"),
        (lambda: ff.ffn(x, w1, torch.randn(31), w2, b2), ValueError, "b1"),
        (lambda: ff.ffn(x, w1, b1, torch.randn(16, 31), b2), ValueError, "w2"),
        (lambda: ff.ffn(x, w1, b1, w2, torch.randn(15)), ValueError, "b2"),
        (lambda: ff.ffn(x, w1.double(), b1, w2, b2), TypeError, "w1"),
        (lambda: ff.ffn(x, w1, b1, w2.bfloat16(), b2), TypeError, "w2"),
        (lambda: ff.ffn(x.long(), w1, b1, w2, b2), TypeError, "x"),
        (lambda: ff.ffn(x, w1.to("meta"), b1, w2, b2), ValueError, "w1"),
        (lambda: ff.ffn([1.0], w1, b1, w2, b2), TypeError, "x"),
        (lambda: ff.ffn(x, w1, b1, w2, b2, activation="swish"), ValueError, "activation"),
        (lambda: ff.ffn(x, w1, b1, w2, b2, dropout_p=1.0), ValueError, "dropout_p"),
        (lambda: ff.ffn(x, w1[0], b1, w2, b2), ValueError, "w1"),
        (lambda: ff.ffn(torch.randn(4, 0), w1, b1, w2, b2), ValueError, "x"),
        (lambda: ff.swiglu_ffn(x, w1, torch.randn(31, 16), w2), ValueError, "w_up"),
        (lambda: ff.swiglu_ffn(x, w1, w1, w2, b_up=torch.randn(32).half()), TypeError, "b_up"),
        (lambda: ff.swiglu_ffn(x, w1, w1, w2, activation=None), ValueError, "activation"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_input_names_the_argument(case):
    call, exc, name = _bad_calls()[case]
    with pytest.raises(exc, match=f"`{name}`"):
        call()


def test_unknown_activation_lists_the_valid_ones():
    x, w1, w2 = torch.randn(2, 8), torch.randn(16, 8), torch.randn(8, 16)
    with pytest.raises(ValueError, match="'relu', 'gelu', 'gelu_tanh', 'silu', 'quick_gelu', 'relu2'; got 'tanh'"):
        ff.ffn(x, w1, None, w2, None, activation="tanh")


def test_cuda_backend_wiring_with_stand_in_epilogues(monkeypatch):
    """The cuda FFN path (cuBLAS GEMMs + fused epilogues) checked on CPU: the epilogue kernels
    are replaced by plain-PyTorch functions with their contracts (csrc/cuda/cuda_bindings.h),
    so the GEMM wiring, the saved [gate | up] layout and the gradient formulas are tested here."""
    from fastformer import _ext
    from fastformer.ops import ffn as ops
    from fastformer.reference import ffn as ref

    class StandIn:
        def cuda_ffn_bias_act_fwd(x, b, act):
            return ref.activation(x + (0 if b is None else b), act)

        def cuda_ffn_bias_act_bwd(dy, x, b, act, need):
            return [dy * ref.activation_grad(x, act), None]

        def cuda_ffn_gated_act_fwd(g, u, act):
            return ref.activation(g, act) * u

        def cuda_ffn_gated_act_bwd(dh, g, u, act):
            return [dh * u * ref.activation_grad(g, act), dh * ref.activation(g, act)]
    monkeypatch.setattr(_ext, "C", StandIn)
    torch.manual_seed(0)
    for gated in (False, True):
        for bias in (False, True):
            _vendor_route_matches_reference(ops._CudaCublas(), gated, bias)


@pytest.mark.parametrize("traced", [False, True])
def test_calls_without_a_gradient_keep_no_preactivation(monkeypatch, traced):
    """A call without a gradient runs the implementation's `inference` (eager, and under
    torch.compile the op fastformer::ffn_inference): no pre-activation kept; with a gradient,
    `fwd` keeps it for the backward."""
    from fastformer.reference import ffn as ref
    kept = []
    real = ref.ffn_fwd
    monkeypatch.setattr(ref, "ffn_fwd", lambda *args, keep=True: kept.append(keep) or real(*args, keep=keep))
    x, w1, b1, w2, b2, *_ = _params(9, 8, 12, torch.float32, False, True)
    run = lambda x: ff.ffn(x, w1, b1, w2, b2, "gelu")  # noqa: E731
    if traced:
        torch._dynamo.reset()
        run = torch.compile(run, backend="eager", fullgraph=True)
    with ff.use_backend("reference"):
        with torch.no_grad():
            y = run(x)
        assert kept == [False]
        run(x.requires_grad_()).sum().backward()
    assert kept == [False, True] and x.grad is not None
    from fastformer.ops.ffn import FfnOptions
    torch.testing.assert_close(y, real(x.detach(), w1, b1, w2, b2, None, None, FfnOptions(activation=1))[0])
