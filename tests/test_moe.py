"""ff.moe_ffn (ops/moe.py) against an fp64 loop over tokens and experts, and Hugging Face
mixture-of-experts models converted to it (integrations/hf_moe.py) against eager."""
import copy

import pytest
import torch
from oracle import GRAD_FACTOR, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule, assert_model_matches, check
from test_convert_hf import _run

import fastformer as ff
from fastformer.reference import ffn as ref_ffn

transformers = pytest.importorskip("transformers")

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16


def _oracle(x, ids, weights, w_gu, w_d, b_gu, b_d, activation, interleaved=False, alpha=1.702, limit=None,
            weights_on="output", gated=True):
    """sum_j w[n, j] * down_e(h_e(x[n])), token by token, in x's dtype; h = act(gate) * up, or
    gpt-oss's clamped SwiGLU (up + 1) * g * sigmoid(alpha g) with g, up clamped at the limit (None:
    7.0); a limit with another activation clamps gate and up first (DeepSeek-V4); gated=False:
    h = act(up), w_gu the up rows alone (NemotronH).
    weights_on="input": sum_j down_e(h_e(w[n, j] * x[n])) (Llama 4)."""
    F_ = w_d.shape[2]
    rows = []
    for n in range(x.shape[0]):
        acc = torch.zeros_like(x[n])
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            x_in, w_out = (weights[n, j] * x[n], 1) if weights_on == "input" else (x[n], weights[n, j])
            gu = w_gu[e] @ x_in + (0 if b_gu is None else b_gu[e])
            if not gated:
                h = ref_ffn.activation(gu, ref_ffn.ACTIVATIONS.index(activation))
                acc = acc + w_out * (w_d[e] @ h + (0 if b_d is None else b_d[e]))
                continue
            gate, up = (gu[0::2], gu[1::2]) if interleaved else (gu[:F_], gu[F_:])
            if activation == "clamped_swiglu":
                L = 7.0 if limit is None else limit
                g, u = gate.clamp(max=L), up.clamp(min=-L, max=L)
                h = (u + 1) * g * torch.sigmoid(alpha * g)
            elif limit is not None:
                g, u = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
                h = ref_ffn.activation(g, ref_ffn.ACTIVATIONS.index(activation)) * u
            else:
                h = ref_ffn.activation(gate, ref_ffn.ACTIVATIONS.index(activation)) * up
            acc = acc + w_out * (w_d[e] @ h + (0 if b_d is None else b_d[e]))
        rows.append(acc)
    return torch.stack(rows)


def _case(N, D, F_, E, k, bias, dtype, seed=0, skip_expert=None, gated=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype)
    choices = [e for e in range(E) if e != skip_expert]
    ids = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=g)[:k]] for _ in range(N)])
    weights = torch.rand(N, k, generator=g).to(dtype)
    rows = 2 * F_ if gated else F_
    w_gu = (torch.randn(E, rows, D, generator=g) / D ** 0.5).to(dtype)
    w_d = (torch.randn(E, D, F_, generator=g) / F_ ** 0.5).to(dtype)
    b_gu = (0.1 * torch.randn(E, rows, generator=g)).to(dtype) if bias else None
    b_d = (0.1 * torch.randn(E, D, generator=g)).to(dtype) if bias else None
    return x, ids, weights, w_gu, w_d, b_gu, b_d


def _grads(fn, tensors, g):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in tensors]
    out = fn(*leaves)
    present = [t for t in leaves if t is not None]
    return out.detach(), torch.autograd.grad(out, present, g)


SHAPES = [  # N, D, F, E, k, bias, activation
    (17, 40, 37, 4, 2, False, "silu"),
    (113, 72, 64, 8, 2, True, "gelu_tanh"),
    (1, 80, 48, 3, 1, False, "silu"),
    (5, 128, 24, 6, 3, True, "gelu"),
    (9, 32, 16, 3, 2, False, "relu"),
]


_GRAD_NAMES = ("dx", "d_weights", "d_w_gate_up", "d_w_down", "d_b_gate_up", "d_b_down")


def _check_against_oracle(ours, oracle, tensors, g, dtype):
    """ours(*tensors) and every gradient against the fp64 oracle (bf16: the error-ratio rule
    against the oracle run in bf16); returns (names, grads, ref, ref_grads, low, low_grads) of
    the tensors present."""
    out, grads = _grads(ours, tensors, g.to(dtype))
    ref, ref_grads = _grads(oracle, [None if t is None else t.double() for t in tensors], g.double())
    low, low_grads = _grads(oracle, tensors, g.to(dtype)) if dtype == BF16 else (None, [None] * 6)
    check("out", out, ref, low)
    names = [n for n, t in zip(_GRAD_NAMES, tensors) if t is not None]
    for name, a, r, lo in zip(names, grads, ref_grads, low_grads):
        check(name, a, r, lo, grad=True, atol=2e-5 * max(1.0, r.abs().max().item()))
    return names, grads, ref, ref_grads, low, low_grads


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_moe_ffn_matches_oracle_with_every_gradient(dtype, shape):
    N, D, F_, E, k, bias, act = shape
    x, ids, weights, w_gu, w_d, b_gu, b_d = _case(N, D, F_, E, k, bias, dtype, skip_expert=E - 1)
    tensors = (x, weights, w_gu, w_d, b_gu, b_d)
    g = torch.randn(N, D, generator=torch.Generator().manual_seed(5))

    def ours(x, w, gu, d, bgu, bd):
        return ff.moe_ffn(x, ids, w, gu, d, bgu, bd, activation=act)

    def oracle(x, w, gu, d, bgu, bd):
        return _oracle(x, ids, w, gu, d, bgu, bd, act)

    names, grads, ref, ref_grads, low, low_grads = _check_against_oracle(ours, oracle, tensors, g, dtype)
    # the expert no token chose gets zero weight gradients
    assert not grads[2][E - 1].any() and not grads[3][E - 1].any()
    with torch.no_grad():
        check("out (no grad)", ours(*tensors), ref, low)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("activation,alpha", [("silu", 1.702), ("clamped_swiglu", 1.702), ("clamped_swiglu", 1.5)])
@pytest.mark.parametrize("interleaved", [True, False])
def test_moe_ffn_interleaved_and_clamped_swiglu(dtype, activation, alpha, interleaved):
    """Gate and up rows interleaved (gpt-oss's layout) or halves (MiniMax-M3's), gpt-oss's
    clamped SwiGLU (its alpha on the fused pass as quick_gelu, another in torch ops), its clamps
    active (limit 1.5 on projections of scale ~2): output and every gradient."""
    x, ids, weights, w_gu, w_d, b_gu, b_d = _case(29, 48, 40, 4, 2, True, dtype, seed=7)
    w_gu = (w_gu.float() * 2).to(dtype)
    limit = 1.5 if activation == "clamped_swiglu" else None  # silu with a limit: test_clamped_gate.py
    kw = dict(activation=activation, interleaved=interleaved, swiglu_alpha=alpha, swiglu_limit=limit)
    tensors = (x, weights, w_gu, w_d, b_gu, b_d)
    g = torch.randn(29, 48, generator=torch.Generator().manual_seed(5))

    def ours(*t):
        return ff.moe_ffn(t[0], ids, *t[1:], **kw)

    def oracle(*t):
        return _oracle(t[0], ids, *t[1:], activation, interleaved=interleaved, alpha=alpha, limit=limit)

    _check_against_oracle(ours, oracle, tensors, g, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("shape", [(17, 40, 37, 4, 1, False, "silu"), (113, 72, 64, 8, 2, True, "gelu")],
                         ids=lambda s: "-".join(map(str, s)))
def test_moe_ffn_weights_on_input(dtype, shape):
    """Llama 4's form: each expert reads its routing weight times x (weights_on="input"); output
    and every gradient, the routing weights' included, against the fp64 oracle."""
    N, D, F_, E, k, bias, act = shape
    x, ids, weights, w_gu, w_d, b_gu, b_d = _case(N, D, F_, E, k, bias, dtype, seed=3, skip_expert=0)
    tensors = (x, weights, w_gu, w_d, b_gu, b_d)
    g = torch.randn(N, D, generator=torch.Generator().manual_seed(5))

    def ours(*t):
        return ff.moe_ffn(t[0], ids, *t[1:], activation=act, weights_on="input")

    def oracle(*t):
        return _oracle(t[0], ids, *t[1:], act, weights_on="input")

    names, grads, ref, ref_grads, low, low_grads = _check_against_oracle(ours, oracle, tensors, g, dtype)
    assert not grads[2][0].any() and not grads[3][0].any()
    # only x's or only the weights' gradient asked for
    for i in (0, 1):
        leaves = [None if t is None else t.detach().requires_grad_(j == i) for j, t in enumerate(tensors)]
        (only,) = torch.autograd.grad(ours(*leaves), leaves[i], g.to(dtype))
        check(names[i] + " alone", only, ref_grads[i], low_grads[i], grad=True,
              atol=2e-5 * max(1.0, ref_grads[i].abs().max().item()))
    with torch.no_grad():
        check("out (no grad)", ours(*tensors), ref, low)


@pytest.mark.parametrize("weights_on", ["output", "input"])
def test_moe_ffn_fp64_gradcheck(weights_on):
    x, ids, weights, w_gu, w_d, b_gu, b_d = _case(6, 8, 5, 3, 2, True, F64, seed=3)
    tensors = [t.requires_grad_() for t in (x, weights, w_gu, w_d, b_gu, b_d)]
    assert torch.autograd.gradcheck(
        lambda *t: ff.moe_ffn(t[0], ids, *t[1:], activation="gelu", weights_on=weights_on), tensors)


@pytest.mark.parametrize("weights_on", ["output", "input"])
def test_moe_custom_op_pair_opcheck(weights_on):
    """torch.library.opcheck of fastformer::moe_ffn / moe_ffn_bwd (the route under torch.compile):
    schemas, fake shapes and strides (transposed weights' gradients in their layout), autograd."""
    from fastformer.ops import moe
    x, ids, weights, w_gu, w_d, b_gu, b_d = _case(11, 16, 12, 3, 2, True, F32, seed=2)
    w_gu_t = w_gu.transpose(1, 2).contiguous().transpose(1, 2)
    on_input = weights_on == "input"
    tensors = [t.requires_grad_() for t in (x, weights, w_gu_t, w_d, b_gu, b_d)]
    args = (tensors[0], ids, *tensors[1:], "silu", False, 1.702, 7.0, True, on_input)
    torch.library.opcheck(moe._moe_op, (*args, True))
    torch.library.opcheck(moe._moe_op, (*[a.detach() if isinstance(a, torch.Tensor) else a for a in args], False))
    out, gu, ys = moe._moe_op(*args, True)
    assert gu.shape == (22, 24) and ys.shape == ((0,) if on_input else (22, 16))
    needs = [True, True, True, True, True, True]
    bwd_args = (torch.randn_like(out), x.detach(), ids, weights.detach(), w_gu_t.detach(), w_d.detach(),
                gu.detach(), ys.detach(), "silu", False, 1.702, 7.0, True, on_input)
    torch.library.opcheck(moe._moe_bwd_op, (*bwd_args, needs))
    torch.library.opcheck(moe._moe_bwd_op, (*bwd_args, [True, False, False, True, False, False]))
    grads = moe._moe_bwd_op(*bwd_args, needs)
    assert grads[2].stride() == w_gu_t.stride()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("form", ["silu", "bias", "gpt_oss", "input"])
def test_moe_ffn_decode_rows_without_autograd(monkeypatch, dtype, rows, form):
    """Decode steps (few rows per expert, no autograd): bf16 on the few-row linear kernel, fp32
    as one grouped GEMM per projection (taken: counted), biases, gpt-oss's gate and Llama 4's
    input weights included: the answer of the oracle."""
    x, ids, weights, w_gu, w_d, b_gu, b_d = _case(rows, 256, 96, 4, 2, form in ("bias", "gpt_oss"), dtype,
                                                  seed=rows)
    kw = dict(activation="silu")
    if form == "gpt_oss":
        kw = dict(activation="clamped_swiglu", interleaved=True, swiglu_limit=0.5)
    elif form == "input":
        kw["weights_on"] = "input"
    grouped_calls = []
    grouped_mm = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm",
                        lambda *a, **k: grouped_calls.append(1) or grouped_mm(*a, **k))
    with torch.no_grad():
        out = ff.moe_ffn(x, ids, weights, w_gu, w_d, b_gu, b_d, **kw)
    assert len(grouped_calls) == (2 if dtype == F32 else 0)
    up = [None if t is None else t.double() for t in (x, weights, w_gu, w_d, b_gu, b_d)]
    ref = _oracle(up[0], ids, *up[1:], kw["activation"], interleaved=form == "gpt_oss",
                  limit=kw.get("swiglu_limit"), weights_on=kw.get("weights_on", "output"))
    low = None if dtype == F32 else _oracle(x, ids, weights, w_gu, w_d, b_gu, b_d, kw["activation"],
                                            interleaved=form == "gpt_oss", limit=kw.get("swiglu_limit"),
                                            weights_on=kw.get("weights_on", "output"))
    check("out", out, ref, low)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("activation", ["relu2", "gelu"])
@pytest.mark.parametrize("bias,weights_on", [(False, "output"), (True, "output"), (False, "input")])
def test_moe_ffn_without_a_gate(dtype, activation, bias, weights_on):
    """Experts with an up projection alone (gated=False, NemotronH's relu2 experts): output and
    every gradient against the fp64 oracle, an expert no token chose included, without autograd
    too; the custom-op pair (torch.compile's route) with opcheck."""
    from fastformer.ops import moe
    x, ids, weights, w_u, w_d, b_u, b_d = _case(37, 48, 40, 5, 2, bias, dtype, seed=11, skip_expert=2, gated=False)
    kw = dict(activation=activation, weights_on=weights_on, gated=False)
    tensors = (x, weights, w_u, w_d, b_u, b_d)
    g = torch.randn(37, 48, generator=torch.Generator().manual_seed(5))

    def ours(*t):
        return ff.moe_ffn(t[0], ids, *t[1:], **kw)

    def oracle(*t):
        return _oracle(t[0], ids, *t[1:], activation, weights_on=weights_on, gated=False)

    names, grads, ref, ref_grads, low, low_grads = _check_against_oracle(ours, oracle, tensors, g, dtype)
    assert not grads[2][2].any() and not grads[3][2].any()
    with torch.no_grad():
        check("out (no grad)", ours(*tensors), ref, low)
    if dtype == F32:
        leaves = [None if t is None else t.detach().requires_grad_() for t in tensors]
        args = (leaves[0], ids, *leaves[1:], activation, False, 1.702, 0.0, False, weights_on == "input")
        torch.library.opcheck(moe._moe_op, (*args, True))


def test_moe_ffn_without_a_gate_fp64_gradcheck_and_decode():
    x, ids, weights, w_u, w_d, b_u, b_d = _case(6, 8, 5, 3, 2, True, F64, seed=3, gated=False)
    tensors = [t.requires_grad_() for t in (x, weights, w_u, w_d, b_u, b_d)]
    assert torch.autograd.gradcheck(
        lambda *t: ff.moe_ffn(t[0], ids, *t[1:], activation="relu2", gated=False), tensors)
    for dtype in (F32, BF16):  # decode rows: fp32 on torch's grouped GEMM, bf16 on the few-row kernel
        x, ids, weights, w_u, w_d, b_u, b_d = _case(3, 256, 96, 4, 2, False, dtype, seed=1, gated=False)
        with torch.no_grad():
            out = ff.moe_ffn(x, ids, weights, w_u, w_d, activation="relu2", gated=False)
        up = [None if t is None else t.double() for t in (x, weights, w_u, w_d, b_u, b_d)]
        ref = _oracle(up[0], ids, *up[1:], "relu2", gated=False)
        low = None if dtype == F32 else _oracle(x, ids, weights, w_u, w_d, b_u, b_d, "relu2", gated=False)
        check("out", out, ref, low)


@pytest.mark.parametrize("weights_on", ["output", "input"])
def test_moe_ffn_zero_tokens(weights_on):
    x, ids, weights, w_gu, w_d, _, _ = _case(3, 16, 12, 3, 2, False, F32)
    x, ids, weights = x[:0].requires_grad_(), ids[:0], weights[:0].requires_grad_()
    w_gu.requires_grad_()
    out = ff.moe_ffn(x, ids, weights, w_gu, w_d, weights_on=weights_on)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert x.grad.shape == (0, 16) and weights.grad.shape == (0, 2) and not w_gu.grad.any()


@pytest.fixture
def packed_experts(monkeypatch):
    """The experts' GEMMs on the packed GEMM, as on a CPU whose torch bf16 GEMM is generic code
    (ops/moe.py's _ExpertGemms; forced so that the route is tested on every CPU), and a count of
    its forward and backward calls."""
    from fastformer.ops import cpu_gemm
    if ff._ext.C is None or ff._ext.cpu_level() not in ("avx2", "avx512"):
        pytest.skip("the packed GEMM needs fastformer._C at the avx2 or avx512 level")
    monkeypatch.setattr(cpu_gemm, "fast_lowp_gemm", lambda dtype: False)
    calls = {"fwd": 0, "bwd": 0}
    for name, key in (("ffn_linear_fwd", "fwd"), ("ffn_linear_bwd", "bwd")):
        real = getattr(ff._ext.C, name)
        monkeypatch.setattr(ff._ext.C, name, lambda *a, _real=real, _key=key: calls.__setitem__(_key, calls[_key] + 1)
                            or _real(*a))
    return calls


@pytest.mark.parametrize("form", ["halves-bias", "interleaved-clamped", "weights-on-input", "transposed", "no-gate"])
def test_moe_ffn_bf16_experts_on_the_packed_gemm(packed_experts, form):
    """bf16 experts on the packed GEMM (forward, the input and weight gradients): output and every
    gradient against the fp64 oracle by the error-ratio rule, in the experts' forms."""
    N, D, F_, E, k = 67, 72, 40, 5, 2
    bias = form in ("halves-bias", "interleaved-clamped")
    x, ids, weights, w_gu, w_d, b_gu, b_d = _case(N, D, F_, E, k, bias, BF16, seed=9, gated=form != "no-gate")
    act = {"interleaved-clamped": "clamped_swiglu", "no-gate": "relu"}.get(form, "silu")
    kw = dict(activation=act, interleaved=form == "interleaved-clamped", gated=form != "no-gate",
              weights_on="input" if form == "weights-on-input" else "output")
    oracle_kw = dict(interleaved=kw["interleaved"], gated=kw["gated"], weights_on=kw["weights_on"])
    g = torch.randn(N, D, generator=torch.Generator().manual_seed(5))
    if form == "transposed":  # stored (E, D, 2F) / (E, F, D), passed as transposed views
        def ours(x, w, gu, d, bgu, bd):
            return ff.moe_ffn(x, ids, w, gu.transpose(1, 2).contiguous().transpose(1, 2),
                              d.transpose(1, 2).contiguous().transpose(1, 2), bgu, bd, **kw)
    else:
        def ours(x, w, gu, d, bgu, bd):
            return ff.moe_ffn(x, ids, w, gu, d, bgu, bd, **kw)

    def oracle(x, w, gu, d, bgu, bd):
        return _oracle(x, ids, w, gu, d, bgu, bd, act, **oracle_kw)

    _check_against_oracle(ours, oracle, (x, weights, w_gu, w_d, b_gu, b_d), g, BF16)
    used = len(set(ids.reshape(-1).tolist()))
    assert packed_experts["fwd"] == 2 * used and packed_experts["bwd"] >= 4 * used, packed_experts


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
def test_expert_gemms_packed_products_round_once(packed_experts, dtype):
    """Each of _ExpertGemms' packed products (forward with a bias into a buffer's rows, input and
    weight gradients, a transposed weight) against the fp64 product of the same low-precision
    operands: within one rounding to the dtype plus fp32 accumulation (the model-level rule above
    does not see a few percent on a weight gradient)."""
    from fastformer.ops import moe
    g = torch.Generator().manual_seed(2)
    n, d_in, d_out = 37, 72, 40
    a, dy = torch.randn(n, d_in, generator=g).to(dtype), torch.randn(n, d_out, generator=g).to(dtype)
    w, b = torch.randn(d_out, d_in, generator=g).to(dtype), torch.randn(d_out, generator=g).to(dtype)
    gemms = moe._ExpertGemms(a, w, b)
    assert gemms.packed

    def close(name, got, want):
        bound = torch.finfo(dtype).eps * want.abs() + 1e-5 * want.abs().max()
        assert ((got.double() - want).abs() <= bound).all(), name

    buf = torch.empty(n + 4, d_out, dtype=dtype)
    gemms.mm(a, w, b, buf[2:n + 2])
    close("mm", buf[2:n + 2], a.double() @ w.double().t() + b.double())
    w_t = w.t().contiguous().t()  # a transposed expert stack's slice
    close("mm transposed", gemms.mm(a, w_t, None, None), a.double() @ w.double().t())
    close("input grad", gemms.input_grad(dy, w, a), dy.double() @ w.double())
    dw = torch.empty(d_in, d_out, dtype=dtype).t()  # (out, in) in a transposed buffer
    gemms.weight_grad_into(dw, dy, a)
    close("weight grad", dw, dy.double().t() @ a.double())
    assert packed_experts == {"fwd": 2, "bwd": 2}


def test_moe_ffn_reads_transposed_weights():
    """Weights stored (E, D, 2F) / (E, F, D) (transformers' is_transposed) passed as views."""
    x, ids, weights, w_gu, w_d, _, _ = _case(11, 48, 20, 3, 2, False, F32, seed=4)
    w_gu_t = w_gu.transpose(1, 2).contiguous().requires_grad_()
    w_d_t = w_d.transpose(1, 2).contiguous().requires_grad_()
    out = ff.moe_ffn(x, ids, weights, w_gu_t.transpose(1, 2), w_d_t.transpose(1, 2))
    out.sum().backward()
    w_gu64, w_d64 = w_gu.double().requires_grad_(), w_d.double().requires_grad_()
    ref = _oracle(x.double(), ids, weights.double(), w_gu64, w_d64, None, None, "silu")
    ref.sum().backward()
    check("out", out, ref)
    check("d_w_gate_up", w_gu_t.grad, w_gu64.grad.transpose(1, 2), grad=True)
    check("d_w_down", w_d_t.grad, w_d64.grad.transpose(1, 2), grad=True)


def test_moe_ffn_bad_input():
    x, ids, weights, w_gu, w_d, _, _ = _case(4, 16, 8, 3, 2, False, F32)
    with pytest.raises(ValueError, match="`expert_ids` must be in \\[0, 3\\)"):
        ff.moe_ffn(x, ids + 1, weights, w_gu, w_d)
    with pytest.raises(ValueError, match="`weights_on` must be 'output' or 'input', got 'inputs'"):
        ff.moe_ffn(x, ids, weights, w_gu, w_d, weights_on="inputs")
    with pytest.raises(TypeError, match="`expert_ids` must be an int64 or int32 tensor"):
        ff.moe_ffn(x, ids.float(), weights, w_gu, w_d)
    with pytest.raises(ValueError, match="`w_down` must be \\(E, D, F\\)"):
        ff.moe_ffn(x, ids, weights, w_gu, w_d[:, :, :4])
    with pytest.raises(ValueError, match="`w_gate_up` must be \\(E, 2F, D\\)"):
        ff.moe_ffn(x, ids, weights, w_gu[:, :, :8], w_d)
    with pytest.raises(ValueError, match="`expert_weights` must have `expert_ids`'s shape"):
        ff.moe_ffn(x, ids, weights[:, :1], w_gu, w_d)
    with pytest.raises(ValueError, match="`activation` must be one of"):
        ff.moe_ffn(x, ids, weights, w_gu, w_d, activation="tanh")
    with pytest.raises(ValueError, match="`swiglu_limit`"):
        ff.moe_ffn(x, ids, weights, w_gu, w_d, activation="clamped_swiglu", swiglu_limit=0.0)
    with pytest.raises(TypeError, match="`interleaved` must be a bool"):
        ff.moe_ffn(x, ids, weights, w_gu, w_d, interleaved=1)
    with pytest.raises(TypeError, match="`w_down`"):
        ff.moe_ffn(x, ids, weights, w_gu, w_d.double())
    w_u = w_gu[:, :8]  # gated=False: (E, F, D)
    with pytest.raises(ValueError, match="`w_down` must be \\(E, D, F\\) = \\(3, 16, 16\\)"):
        ff.moe_ffn(x, ids, weights, w_gu, w_d, gated=False)
    with pytest.raises(ValueError, match="neither `interleaved` nor `swiglu_limit`"):
        ff.moe_ffn(x, ids, weights, w_u, w_d, gated=False, swiglu_limit=3.0)
    with pytest.raises(ValueError, match="with gated=False"):
        ff.moe_ffn(x, ids, weights, w_u, w_d, gated=False, activation="clamped_swiglu")
    with pytest.raises(TypeError, match="`gated` must be a bool"):
        ff.moe_ffn(x, ids, weights, w_u, w_d, gated=0)


# ---- Hugging Face mixture-of-experts models --------------------------------------------------
_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=97, max_position_embeddings=64,
              num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
              shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
              tie_word_embeddings=False, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0,
              n_group=1, topk_group=1)
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def _moe_model(name, dtype=F32, experts="eager", noise=0.05, **config_values):
    """A small random-weight `name` CausalLM (_SMALL, then config_values) on eager attention and
    the `experts` implementation (None: transformers' default), its weights perturbed by `noise`."""
    config = transformers.AutoConfig.for_model(name)
    for key, value in _SMALL.items():
        if hasattr(config, key):
            setattr(config, key, value)
    for key, value in config_values.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    kw = {} if experts is None else dict(experts_implementation=experts)
    model = transformers.AutoModelForCausalLM.from_config(config, **kw)
    if noise:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise)
    return model.to(dtype)


def _ids():
    return dict(input_ids=torch.randint(2, 97, (2, 13), generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_moe_family_converted_and_matching_fp32(name):
    model = _moe_model(name)
    report = ff.convert(model, inplace=False)
    assert sum("ff.moe_ffn" in kind for _, _, kind in report.replaced) == 2, str(report)
    assert sum("residual add fused" in kind for _, _, kind in report.replaced) == 2, str(report)
    out, grads = _run(report.model, _ids())
    ref, ref_grads = _run(copy.deepcopy(model).double(), _ids())
    assert_model_matches(out, grads, ref, ref_grads)


@pytest.mark.parametrize("name", ["granitemoe", "glm4_moe", "minimax", "phimoe", "dots1", "hunyuan_v1_moe"])
def test_more_moe_families_logits_and_loss_match_eager(name):
    """Other families whose experts take the interface: both layers' experts on ff.moe_ffn, the
    logits and (eval mode: PhiMoE's training routing is random) the LM loss match eager's."""
    model = _moe_model(name).eval()
    report = ff.convert(model, inplace=False)
    assert sum("ff.moe_ffn" in kind for _, _, kind in report.replaced) == 2, str(report)
    ref_model = copy.deepcopy(model).double()
    with torch.no_grad():
        out, ref = report.model(**_ids()).logits, ref_model(**_ids()).logits
        loss = report.model(**_ids(), labels=_ids()["input_ids"]).loss
        ref_loss = ref_model(**_ids(), labels=_ids()["input_ids"]).loss
    assert (out.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())


def _model(name):
    return _llama4() if name == "llama4" else _moe_model(name)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "llama4"])
def test_moe_family_bf16_error_ratio(name):
    model = _model(name)
    ours = ff.convert(copy.deepcopy(model).to(BF16)).model
    out, grads = _run(ours, _ids())
    low, low_grads = _run(copy.deepcopy(model).to(BF16), _ids())
    ref, ref_grads = _run(copy.deepcopy(model).double(), _ids())
    atol = LOWP_ATOL[BF16]
    assert_lowp_rule("out", out, ref, low, OUT_FACTOR, atol * ref.abs().max().item())
    for n, r in ref_grads.items():
        if r is not None:
            assert_lowp_rule(f"d{n}", grads[n], r, low_grads[n], GRAD_FACTOR, atol * r.abs().max().item())


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "llama4"])
def test_moe_family_greedy_generate_matches_eager(name):
    model = _model(name).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    ours = ff.convert(model, inplace=False).model
    ids = _ids()["input_ids"][:, :9]
    kw = dict(input_ids=ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(**kw), model.generate(**kw))


def _gpt_oss(dtype=F32):
    # the clamps active at this size (limit 0.5)
    return _moe_model("gpt_oss", dtype, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                      swiglu_limit=0.5)


def test_gpt_oss_experts_converted_and_matching_fp32():
    """gpt-oss: interleaved gate / up rows stored transposed, biases, its clamped SwiGLU, attention
    sinks and alternating sliding-window layers: the converted model's logits and every parameter's
    gradient against eager's in fp64."""
    model = _gpt_oss()
    report = ff.convert(model, inplace=False)
    assert sum("ff.moe_ffn" in kind for _, _, kind in report.replaced) == 2, str(report)
    out, grads = _run(report.model, _ids())
    ref, ref_grads = _run(copy.deepcopy(model).double(), _ids())
    assert_model_matches(out, grads, ref, ref_grads)


def test_moe_experts_left_with_reason_and_fallbacks():
    """Experts with another _apply_gate stay on their implementation, named in the report; a
    converted module's call that the kernels do not take (expert parallelism) runs the
    implementation it had."""
    model = _gpt_oss()

    def other_gate(self, gate_up):
        return gate_up[..., ::2] * gate_up[..., 1::2]
    experts_cls = type(model.model.layers[0].mlp.experts)
    original = experts_cls._apply_gate
    experts_cls._apply_gate = other_gate
    try:
        report = ff.convert(model)
    finally:
        experts_cls._apply_gate = original
    left = [why for _, typ, why in report.left if typ == "GptOssExperts"]
    assert len(left) == 2 and all("_apply_gate" in why for why in left), str(report)

    mixtral = _moe_model("mixtral")
    ff.convert(mixtral)
    experts = mixtral.model.layers[0].mlp.experts
    assert mixtral.config._experts_implementation == "fastformer"
    x = torch.randn(5, 64)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]])
    w = torch.rand(5, 2)
    with torch.no_grad():
        eager = type(experts).forward.__wrapped__(experts, x, ids, w)
        fused = experts(x, ids, w)
        experts._is_expert_parallel = True  # sentinel ids: the implementation it had ("eager")
        fallback = experts(x, ids, w)
    assert torch.equal(fallback, eager)
    assert (fused - eager).abs().max().item() <= 1e-5 * eager.abs().max().item()
    assert not torch.equal(fused, eager)  # the fused path did run


@pytest.mark.parametrize("name", ["mixtral", "olmoe"])
@pytest.mark.parametrize("router_loss", [False, True], ids=["lm_loss", "with_router_loss"])
def test_moe_causal_lm_loss_on_linear_cross_entropy(name, router_loss):
    """With labels, a converted MoE CausalLM (Mixtral's form) returns the loss of
    ff.linear_cross_entropy (no logits), plus the router's load-balancing loss when asked for:
    the loss and every parameter's gradient match eager's in fp64."""
    model = _moe_model(name)
    report = ff.convert(model, inplace=False)
    assert any("linear_cross_entropy" in kind for _, _, kind in report.replaced), str(report)
    inputs = dict(_ids(), output_router_logits=router_loss)
    inputs["labels"] = inputs["input_ids"].clone()
    inputs["labels"][0, :3] = -100

    def loss_and_grads(m):
        out = m(**inputs)
        params = dict((n, p) for n, p in m.named_parameters() if p.requires_grad)
        grads = torch.autograd.grad(out.loss, list(params.values()), allow_unused=True)
        return out, dict(zip(params, grads))

    out, grads = loss_and_grads(report.model)
    assert out.logits is None and (out.aux_loss is not None) == router_loss
    ref, ref_grads = loss_and_grads(copy.deepcopy(model).double())
    assert_model_matches(out.loss.reshape(1), grads, ref.loss.reshape(1), ref_grads)


def test_gpt_oss_greedy_generate_matches_eager():
    model = _gpt_oss().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    ours = ff.convert(model, inplace=False).model
    kw = dict(input_ids=_ids()["input_ids"][:, :9], max_new_tokens=10, min_new_tokens=10, do_sample=False,
              pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(**kw), model.generate(**kw))


@pytest.mark.parametrize("name", ["mixtral", "llama4"])
def test_moe_model_compiles_fullgraph(name, monkeypatch):
    """Under torch.compile the converted experts are the custom-op pair fastformer::moe_ffn /
    moe_ffn_bwd: fullgraph forward and backward, matching eager (Mixtral's default experts,
    grouped_mm; Llama 4's all-experts block)."""
    from fastformer.ops import moe
    calls = []
    for fn in ("_forward", "_backward"):
        original = getattr(moe, fn)
        monkeypatch.setattr(moe, fn, lambda *a, _f=original, _n=fn, **k: calls.append(_n) or _f(*a, **k))
    torch._dynamo.reset()
    model = _llama4() if name == "llama4" else _moe_model(name, experts=None, noise=0.0)
    ours = ff.convert(model, inplace=False).model
    out, grads = _run(torch.compile(ours, fullgraph=True), _ids())
    assert calls.count("_forward") == 2 and calls.count("_backward") == 2, calls
    reference = copy.deepcopy(model).double()
    if name == "mixtral":
        reference.set_experts_implementation("eager")
    ref, ref_grads = _run(reference, _ids())
    assert_model_matches(out, grads, ref, ref_grads, "_orig_mod.")


def test_deepseek_v3_moe_layers_converted_and_matching_fp32():
    """DeepSeek-V3's MoE layers (routed experts with group-limited routing, a shared expert) and
    its multi-head latent attention: logits and every parameter's gradient against eager."""
    config = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM._from_config(config, experts_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    report = ff.convert(model, inplace=False)
    assert sum("ff.moe_ffn" in kind for _, _, kind in report.replaced) == 2, str(report)
    out, grads = _run(report.model, _ids())
    ref, ref_grads = _run(copy.deepcopy(model).double(), _ids())
    assert_model_matches(out, grads, ref, ref_grads)


def _llama4(dtype=F32, top_k=1):
    """Llama 4 text: MoE blocks on layers 1 and 3 (every token through every expert, the input
    scaled by the router's sigmoid score), chunked attention (chunks of 8) and NoPE layers."""
    return _moe_model("llama4_text", dtype, experts=None, num_hidden_layers=4, moe_layers=[1, 3],
                      intermediate_size_mlp=80, attention_chunk_size=8, num_experts_per_tok=top_k)


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_moe_converted_and_matching_fp32(top_k):
    """Llama 4's MoE blocks run ff.moe_ffn(weights_on="input") on the top-k experts only (the
    others' score is 0): logits and every parameter's gradient (the router's included) against
    eager's all-experts forward in fp64; the norms, residual adds and LM loss converted too."""
    model = _llama4(top_k=top_k)
    report = ff.convert(model, inplace=False)
    kinds = [kind for _, _, kind in report.replaced]
    assert sum("ff.moe_ffn on the top-k" in k for k in kinds) == 2, str(report)
    assert sum("residual add fused" in k for k in kinds) == 4 and "ff.rms_norm" in kinds, str(report)
    assert any("linear_cross_entropy" in k for k in kinds) and not report.left, str(report)
    out, grads = _run(report.model, _ids())
    ref, ref_grads = _run(copy.deepcopy(model).double(), _ids())
    assert_model_matches(out, grads, ref, ref_grads)
    labels = _ids()["input_ids"]
    with torch.no_grad():
        loss, ref_loss = report.model(**_ids(), labels=labels).loss, copy.deepcopy(model).double()(
            **_ids(), labels=labels).loss
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())


def test_nemotron_h_experts_without_a_gate_converted_and_matching_fp32():
    """NemotronH's experts (up_proj only, relu2) on ff.moe_ffn(gated=False): the logits and the
    gradient of every parameter against the fp64 model."""
    model = _moe_model("nemotron_h")
    report = ff.convert(model, inplace=False)
    converted = [path for path, _, kind in report.replaced if "ff.moe_ffn" in kind]
    assert converted and not [why for _, typ, why in report.left if typ == "NemotronHExperts"], str(report)
    out, grads = _run(report.model, _ids())
    ref, ref_grads = _run(copy.deepcopy(model).double(), _ids())
    assert_model_matches(out, grads, ref, ref_grads)
