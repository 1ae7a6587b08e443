"""The clamped gate (``swiglu_limit``): DeepSeek-V4's h = act(gate.clamp(max=L)) * up.clamp(-L, L)
in ff.swiglu_ffn and ff.moe_ffn (cpu.onednn's elementwise pass, ffn_elementwise.cpp; reference),
and the DeepSeek-V4 / MiniMax-M3 models that use it, converted. Every case has the clamps active
(L below the projections' scale), so a kernel that ignored the limit would fail."""
import copy

import pytest
import torch
import torch.nn.functional as F
from oracle import assert_model_matches, check, row_sum_tol
from test_convert_hf import _run
from test_moe import _case, _check_against_oracle, _ids, _moe_model, _oracle

import fastformer as ff
from fastformer import _ext
from fastformer.reference import ffn as ref_ffn

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
LIMIT = 0.5  # projections below have scale ~1: a third of the gates and half the ups clamped
ACT_FNS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}


def _eager_swiglu(x, wg, wu, wd, bg, bu, bd, act, limit):
    gate = F.linear(x, wg, bg).clamp(max=limit)
    up = F.linear(x, wu, bu).clamp(min=-limit, max=limit)
    return F.linear(ACT_FNS[act](gate) * up, wd, bd)


def _ffn_case(tokens, d, hidden, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g)
    ws = [torch.randn(hidden, d, generator=g) / d ** 0.5, torch.randn(hidden, d, generator=g) / d ** 0.5,
          torch.randn(d, hidden, generator=g) / hidden ** 0.5]
    bs = [0.1 * torch.randn(n, generator=g) for n in (hidden, hidden, d)] if bias else [None] * 3
    return [None if t is None else t.to(dtype) for t in (x, *ws, *bs)]


def _grads(fn, tensors, dy):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    present = [t for t in leaves if t is not None]
    return y.detach(), torch.autograd.grad(y, present, dy)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("tokens,d,hidden", [(1, 40, 72), (17, 80, 128), (113, 128, 203), (203, 72, 40)])
@pytest.mark.parametrize("act,bias", [("silu", False), ("gelu_tanh", True)])
def test_swiglu_ffn_limit_matches_eager_with_every_gradient(dtype, tokens, d, hidden, act, bias):
    tensors = _ffn_case(tokens, d, hidden, bias, dtype)
    x, wg, wu = tensors[:3]
    pre_g, pre_u = F.linear(x.float(), wg.float()), F.linear(x.float(), wu.float())
    assert (pre_g > LIMIT).any() and (pre_u.abs() > LIMIT).any()  # the clamps act
    dy = torch.randn(tokens, d, generator=torch.Generator().manual_seed(3)).to(dtype)

    def ours(x, wg, wu, wd, bg, bu, bd):
        return ff.swiglu_ffn(x, wg, wu, wd, bg, bu, bd, activation=act, swiglu_limit=LIMIT)

    def eager(*t):
        return _eager_swiglu(*t, act, LIMIT)

    y, grads = _grads(ours, tensors, dy)
    if _ext.C is not None:
        assert ff.last_dispatch().impl == "cpu.onednn", ff.last_dispatch()
    y_o, grads_o = _grads(eager, [None if t is None else t.double() for t in tensors], dy.double())
    y_l, grads_l = _grads(eager, tensors, dy) if dtype == BF16 else (None, [None] * 7)
    check("y", y, y_o, y_l)
    names = [n for n, t in zip(("dx", "dwg", "dwu", "dwd", "dbg", "dbu", "dbd"), tensors) if t is not None]
    for name, g, g_o, g_l in zip(names, grads, grads_o, grads_l):
        tol = 1e-5 if name == "dx" else row_sum_tol(2e-5, tokens)
        check(name, g, g_o, g_l, grad=True, atol=tol, rtol=tol)
    with torch.no_grad():  # the inference route (one GEMM for gate and up, h over the gate)
        check("y (no grad)", ours(*tensors), y_o, y_l)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("tokens,d,hidden", [(17, 64, 128), (33, 96, 200)])  # the interpreter: small
def test_triton_swiglu_ffn_limit_matches_eager(dtype, tokens, d, hidden):
    """The Triton kernels' clamps (_gate, _gate_grads; under the interpreter on CPU): output and
    every gradient, the inference route included."""
    b = ff.backends.get("triton")
    why = b.availability() or (None if "cpu" in b.devices() else "no CPU device")
    if why:
        pytest.skip(f"triton: {why}")
    tensors = _ffn_case(tokens, d, hidden, True, dtype, seed=1)
    dy = torch.randn(tokens, d, generator=torch.Generator().manual_seed(3)).to(dtype)

    def ours(x, wg, wu, wd, bg, bu, bd):
        return ff.swiglu_ffn(x, wg, wu, wd, bg, bu, bd, swiglu_limit=LIMIT)

    def eager(*t):
        return _eager_swiglu(*t, "silu", LIMIT)

    with ff.use_backend("triton"):
        y, grads = _grads(ours, tensors, dy)
        assert ff.last_dispatch().backend == "triton"
        with torch.no_grad():
            y_inference = ours(*tensors)
    y_o, grads_o = _grads(eager, [t.double() for t in tensors], dy.double())
    y_l, grads_l = _grads(eager, tensors, dy) if dtype == BF16 else (None, [None] * 7)
    check("y", y, y_o, y_l)
    check("y (no grad)", y_inference, y_o, y_l)
    for name, g, g_o, g_l in zip(("dx", "dwg", "dwu", "dwd", "dbg", "dbu", "dbd"), grads, grads_o, grads_l):
        tol = 1e-5 if name == "dx" else row_sum_tol(2e-5, tokens)
        check(name, g, g_o, g_l, grad=True, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_values_at_the_limit_pass_the_gradient_as_torch_clamp(dtype):
    """g == L and u == +-L exactly: torch.clamp's backward passes the gradient at its bounds; so
    must the kernel's (identity projections make the pre-activations exactly x)."""
    L = 0.75
    row = torch.tensor([L, -L, 2.0, -2.0, 0.25, L, -0.5, 1.0])
    x = torch.stack([row, row.roll(1), row.roll(3)]).to(dtype)
    eye = torch.eye(8, dtype=dtype)
    wd = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    dy = torch.randn(3, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    tensors = (x, eye, eye.clone(), wd)
    y, grads = _grads(lambda *t: ff.swiglu_ffn(*t, swiglu_limit=L), tensors, dy)
    y_e, grads_e = _grads(lambda x, a, b, c: _eager_swiglu(x.float(), a.float(), b.float(), c.float(),
                                                           None, None, None, "silu", L), tensors, dy.float())
    tol = 1e-6 if dtype == F32 else 2e-2
    assert torch.allclose(y.float(), y_e, atol=tol, rtol=tol)
    for name, g, g_e in zip(("dx", "dwg", "dwu", "dwd"), grads, grads_e):
        assert torch.allclose(g.float(), g_e.float(), atol=tol, rtol=tol), name


class _ActKernel(torch.autograd.Function):
    """The cpu elementwise pass alone: h = act(g') * (u' + shift) (ffn_act_fwd), its gradients
    (ffn_act_bwd)."""

    @staticmethod
    def forward(ctx, g, u, code, limit, shift):
        ctx.save_for_backward(g, u)
        ctx.args = code, limit, shift
        return _ext.C.ffn_act_fwd(g, u, code, False, 0.0, None, limit, shift)

    @staticmethod
    def backward(ctx, dh):
        g, u = ctx.saved_tensors
        code, limit, shift = ctx.args
        d_g, d_u, _ = _ext.C.ffn_act_bwd(dh.clone(), g, u, code, False, 0.0, None, limit, shift)
        return d_g, d_u, None, None, None


def _gpt_oss_gate(g, u, limit):
    """gpt-oss's clamped SwiGLU: (u' + 1) * g' * sigmoid(1.702 g')."""
    g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return (u + 1) * g * torch.sigmoid(1.702 * g)


@pytest.mark.skipif(_ext.C is None, reason="needs the compiled extension (fastformer._C)")
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu2", "gpt_oss"])
def test_cpu_clamped_gate_kernel_gradcheck_fp64(act):
    g = torch.randn(5, 37, dtype=F64, generator=torch.Generator().manual_seed(0))
    u = torch.randn(5, 37, dtype=F64, generator=torch.Generator().manual_seed(1))
    for t in (g, u):  # off the clamps' kinks, where finite differences straddle them
        t[(t.abs() - LIMIT).abs() < 1e-3] += 0.01
    code = ref_ffn.ACTIVATIONS.index("quick_gelu" if act == "gpt_oss" else act)
    shift = 1.0 if act == "gpt_oss" else 0.0  # gpt-oss: quick_gelu(g') * (u' + 1)
    h = _ActKernel.apply(g, u, code, LIMIT, shift)
    expected = _gpt_oss_gate(g, u, LIMIT) if act == "gpt_oss" else ref_ffn.gate_value(g, u, code, LIMIT)
    assert torch.allclose(h, expected, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: _ActKernel.apply(a, b, code, LIMIT, shift),
                                    (g.requires_grad_(), u.requires_grad_()))


@pytest.mark.skipif(_ext.C is None, reason="needs the compiled extension (fastformer._C)")
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_cpu_clamped_gate_kernel_at_each_level(capability_levels, dtype):
    """The elementwise pass at every kernel level this CPU runs (a tail of 5 lanes included):
    h, d gate and d up against the fp64 formulas, bounds and values exactly at them included."""
    g = torch.randn(7, 69, generator=torch.Generator().manual_seed(0)).to(dtype)
    u = torch.randn(7, 69, generator=torch.Generator().manual_seed(1)).to(dtype)
    g[0, :4], u[0, :4] = torch.tensor([LIMIT, -LIMIT, LIMIT, 2.0]), torch.tensor([LIMIT, -LIMIT, -LIMIT, -2.0])
    dh = torch.randn(7, 69, generator=torch.Generator().manual_seed(2)).to(dtype)
    h_o, dg_o, du_o = ref_ffn.gate_terms(g.double(), u.double(), 3, LIMIT)
    tol = 1e-6 if dtype == F32 else 1e-2
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            h = _ext.C.ffn_act_fwd(g, u, 3, False, 0.0, None, LIMIT)
            d_g, d_u, h2 = _ext.C.ffn_act_bwd(dh.clone(), g, u, 3, True, 0.0, None, LIMIT)
            for name, a, ref in (("h", h, h_o), ("h (backward)", h2, h_o), ("d_gate", d_g, dh.double() * dg_o),
                                 ("d_up", d_u, dh.double() * du_o)):
                assert torch.allclose(a.double(), ref, atol=tol, rtol=tol), f"{name} at {level}"
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])


def test_limit_off_the_kernels_falls_back_with_the_reason():
    """float16 on cpu: cpu.onednn takes bf16 / fp32 and no other cpu route clamps the gate."""
    x, wg, wu, wd, *_ = _ffn_case(9, 40, 72, False, torch.float16)
    y = ff.swiglu_ffn(x, wg, wu, wd, swiglu_limit=LIMIT)
    d = ff.last_dispatch()
    assert d.impl == "reference" and "swiglu_limit" in str(d), d
    ref = _eager_swiglu(*(t.double() for t in (x, wg, wu, wd)), None, None, None, "silu", LIMIT)
    check("y", y, ref, _eager_swiglu(x.float(), wg.float(), wu.float(), wd.float(), None, None, None,
                                     "silu", LIMIT).half())


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "7"])
def test_bad_limit_names_the_argument(bad):
    x, wg, wu, wd, *_ = _ffn_case(3, 8, 16, False, F32)
    with pytest.raises((ValueError, TypeError), match="swiglu_limit"):
        ff.swiglu_ffn(x, wg, wu, wd, swiglu_limit=bad)
    xm, ids, w, w_gu, w_d, _, _ = _case(3, 8, 16, 2, 1, False, F32)
    with pytest.raises((ValueError, TypeError), match="swiglu_limit"):
        ff.moe_ffn(xm, ids, w, w_gu, w_d, activation="silu", swiglu_limit=bad)


def test_swiglu_ffn_limit_under_torch_compile():
    x, wg, wu, wd, *_ = _ffn_case(17, 40, 72, False, F32)
    fn = torch.compile(lambda *t: ff.swiglu_ffn(*t, swiglu_limit=LIMIT), fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    y = fn(*leaves)
    y.sum().backward()
    y_e, grads_e = _grads(lambda *t: _eager_swiglu(*t, None, None, None, "silu", LIMIT),
                          [t.double() for t in (x, wg, wu, wd)], torch.ones(17, 40, dtype=F64))
    assert (y.double() - y_e).abs().max() <= 1e-5 * y_e.abs().max()
    for t, g in zip(leaves, grads_e):
        assert (t.grad.double() - g).abs().max() <= 1e-5 * g.abs().max()


# ---- ff.moe_ffn ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("shape", [(17, 40, 37, 4, 2, False, "silu"), (113, 72, 64, 8, 2, True, "gelu_tanh"),
                                   (1, 80, 48, 3, 1, False, "silu")], ids=lambda s: "-".join(map(str, s)))
def test_moe_ffn_limit_matches_oracle_with_every_gradient(dtype, shape):
    N, D, F_, E, k, bias, act = shape
    x, ids, weights, w_gu, w_d, b_gu, b_d = _case(N, D, F_, E, k, bias, dtype, seed=3)
    tensors = (x, weights, w_gu, w_d, b_gu, b_d)
    g = torch.randn(N, D, generator=torch.Generator().manual_seed(5))

    def ours(*t):
        return ff.moe_ffn(t[0], ids, *t[1:], activation=act, swiglu_limit=LIMIT)

    def oracle(*t):
        return _oracle(t[0], ids, *t[1:], act, limit=LIMIT)

    _, _, ref, _, low, _ = _check_against_oracle(ours, oracle, tensors, g, dtype)
    with torch.no_grad():  # the decode route (few rows per expert) too
        check("out (no grad)", ours(*tensors), ref, low)
    plain = ff.moe_ffn(x, ids, weights, w_gu, w_d, b_gu, b_d, activation=act)  # None: no clamp
    assert (plain.double() - ref).abs().max() > 1e-2 * ref.abs().max()


def test_moe_ffn_limit_defaults():
    """swiglu_limit=None: gpt-oss's 7.0 for "clamped_swiglu", no clamp for the others."""
    x, ids, weights, w_gu, w_d, _, _ = _case(9, 16, 12, 3, 2, False, F32)
    w_gu = w_gu * 40  # projections up to ~100: 7.0 clamps
    for act, default in (("clamped_swiglu", 7.0), ("silu", 1e30)):
        a = ff.moe_ffn(x, ids, weights, w_gu, w_d, activation=act)
        b = ff.moe_ffn(x, ids, weights, w_gu, w_d, activation=act, swiglu_limit=default)
        assert torch.equal(a, b), act


# ---- models ---------------------------------------------------------------------------------------
def _deepseek_v4(dtype=F32):
    return _moe_model("deepseek_v4", dtype, swiglu_limit=0.05)


def test_deepseek_v4_mlp_and_experts_converted_and_matching_fp32():
    """DeepSeek-V4: its dense MLP (a gated form with clamps) on ff.swiglu_ffn and its experts on
    ff.moe_ffn, both with swiglu_limit; logits and every parameter's gradient against eager in fp64,
    with the clamps active."""
    model = _deepseek_v4()
    report = ff.convert(model, inplace=False)
    kinds = [kind for _, typ, kind in report.replaced if typ in ("DeepseekV4MLP", "DeepseekV4Experts")]
    assert sum("ff.moe_ffn" in k for k in kinds) == 2 and sum("swiglu_ffn" in k for k in kinds) >= 1, str(report)
    assert not [entry for entry in report.left if "DeepseekV4" in entry[1]], str(report)
    out, grads = _run(report.model, _ids())
    ref, ref_grads = _run(copy.deepcopy(model).double(), _ids())
    assert_model_matches(out, grads, ref, ref_grads)
    # the clamps matter at this size: the same model with a larger limit gives other logits
    loose = copy.deepcopy(model).double()
    for m in loose.modules():
        if hasattr(m, "limit"):
            m.limit = 1e4
    with torch.no_grad():
        assert (loose(**_ids()).logits - ref).abs().max() > 1e-3 * ref.abs().max()


def test_minimax_m3_experts_converted_and_matching_fp32():
    """MiniMax-M3: gpt-oss's clamped SwiGLU on concatenated gate / up halves; its dense MLP (the
    same gate, which ff.swiglu_ffn does not have) is left with the reason."""
    model = _moe_model("minimax_m3_vl_text", swiglu_limit=0.3, noise=0.3)
    report = ff.convert(model, inplace=False)
    assert sum("ff.moe_ffn" in kind for _, typ, kind in report.replaced if typ == "MiniMaxM3VLExperts") >= 1, \
        str(report)
    out, grads = _run(report.model, _ids())
    ref, ref_grads = _run(copy.deepcopy(model).double(), _ids())
    assert_model_matches(out, grads, ref, ref_grads)
