"""ff.linear_cross_entropy against F.cross_entropy(softcap(x @ W.T + b).float(), t) in fp64 (fp32
inputs: 1e-5 on the loss, 1e-4 on the gradients) and the error-ratio rule for bf16 / fp16
(tests/oracle.py), on every backend that runs here (triton under the interpreter, small shapes):
odd shapes, ignored targets, label smoothing, softcap, bias, each reduction, leading dims,
chunked and not; fp64 gradcheck of the cpu backend."""
import math

import pytest
import torch
import torch.nn.functional as F

import fastformer as ff
from fastformer import backends
from fastformer.reference import linear_cross_entropy as lce_ref
from oracle import LOWP, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule, check

IGNORE = -100

# (N, d, V, bias, label_smoothing, softcap, ignored): N 1, 17, 113, 203; d 40, 72, 80, 128;
# V 1, 7, 1000, 32003 (not a multiple of anything); ignored "none", "some" or "all".
CASES = [
    (1, 40, 7, False, 0.0, None, "none"),
    (17, 72, 1000, True, 0.1, None, "some"),
    (113, 80, 1, True, 0.2, 30.0, "some"),
    (203, 128, 32003, False, 0.0, None, "some"),
    (17, 40, 32003, True, 0.0, 15.0, "none"),
    (113, 128, 7, False, 0.1, None, "some"),
    (203, 72, 1000, True, 0.05, 20.0, "some"),
    (1, 80, 1000, False, 0.0, None, "all"),
    (17, 128, 7, True, 0.1, 5.0, "all"),
]
CPU_BACKENDS = [b for b in ("cpu", "reference") if b in backends.declared("linear_cross_entropy")]


def _case_id(c):
    N, d, V, bias, ls, cap, ign = c
    return f"N{N}-d{d}-V{V}" + ("-bias" if bias else "") + (f"-ls{ls}" if ls else "") + \
        (f"-cap{cap:g}" if cap else "") + f"-ign_{ign}"


def _inputs(N, d, V, bias, ignored, dtype, lead=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = lead if lead is not None else (N,)
    x = torch.randn(*shape, d, generator=g).to(dtype)
    W = (torch.randn(V, d, generator=g) * (2.0 / math.sqrt(d))).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, V, shape, generator=g)
    if ignored == "all":
        t.fill_(IGNORE)
    elif ignored == "some":
        flat = t.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 4)]] = IGNORE
    return x, W, t, b


def _eager(x, W, t, b, reduction, ls, cap):
    """The semantics, in the inputs' dtype: softcap(x @ W.T + b) then .float() into the loss
    (x @ W.T + b as an nn.Linear lm_head computes it: F.linear, one rounding of the sum)."""
    z = F.linear(x, W, b)
    if cap:
        z = cap * torch.tanh(z / cap)
    loss = F.cross_entropy(z.reshape(-1, W.shape[0]).float(), t.reshape(-1), ignore_index=IGNORE,
                           label_smoothing=ls, reduction=reduction)
    return loss.reshape(t.shape) if reduction == "none" else loss


def _loss_and_grads(fn, x, W, t, b, reduction, upstream, dtype=None):
    leaves = [v.detach().to(dtype or v.dtype).requires_grad_(True) if v is not None else None
              for v in (x, W, b)]
    loss = fn(leaves[0], leaves[1], t, leaves[2])
    want = [v for v in leaves if v is not None]
    grads = torch.autograd.grad(loss, want, upstream.to(loss.dtype))
    return loss.detach(), list(grads)


def _upstream(reduction, t, seed=1):
    if reduction == "none":
        return torch.randn(t.shape, generator=torch.Generator().manual_seed(seed))
    return torch.tensor(0.75)


def _compare(x, W, t, b, reduction, ls, cap, backend):
    dtype = x.dtype
    upstream = _upstream(reduction, t)

    def ours(x_, W_, t_, b_):
        with ff.use_backend(backend):
            return ff.linear_cross_entropy(x_, W_, t_, b_, ignore_index=IGNORE, label_smoothing=ls,
                                           reduction=reduction, softcap=cap)

    def eager(x_, W_, t_, b_):
        return _eager(x_, W_, t_, b_, reduction, ls, cap)

    loss, grads = _loss_and_grads(ours, x, W, t, b, reduction, upstream)
    oracle_dtype = torch.float32 if dtype in LOWP else torch.float64
    o_loss, o_grads = _loss_and_grads(eager, x, W, t, b, reduction, upstream, oracle_dtype)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert loss.shape == o_loss.shape
    names = ["dx", "dweight", "dbias"][: len(grads)]
    for g, ref_g, name in zip(grads, o_grads, names):
        assert g.dtype == dtype and g.shape == ref_g.shape, name
    if dtype in LOWP:
        l_loss, l_grads = _loss_and_grads(eager, x, W, t, b, reduction, upstream)
        if reduction == "none":
            assert_lowp_rule("loss", loss, o_loss, l_loss, OUT_FACTOR, LOWP_ATOL[dtype])
        else:
            _check_lowp_scalar_loss(loss, o_loss, l_loss, x, W, t, b, reduction, ls, cap)
        for g, ref_g, low_g, name in zip(grads, o_grads, l_grads, names):
            check(name, g, ref_g, low_g, grad=True, atol=1e-4, rtol=1e-4)
    else:
        check("loss", loss, o_loss)
        for g, ref_g, name in zip(grads, o_grads, names):
            check(name, g, ref_g, grad=True, atol=1e-4, rtol=1e-4)
    return loss, grads


def _check_lowp_scalar_loss(loss, o_loss, l_loss, x, W, t, b, reduction, ls, cap):
    """The error-ratio rule on a low-precision "mean" / "sum" loss, with eager's error taken as
    the larger of its actual error and the reduction of its per-token absolute errors: a
    scalar's error is a sum of per-token errors (one bf16 rounding of the logits each) whose
    cancellation is luck, and one lucky eager scalar (measured 3e-4 against ours 1.1e-3 on a
    loss of 10 with 0.03 per-token errors) would fail a kernel as accurate as eager."""
    rows = lambda dtype: _eager(x.to(dtype), W.to(dtype), t, b.to(dtype) if b is not None else None,  # noqa: E731
                                "none", ls, cap).double()
    valid = (t != IGNORE)
    row_err = ((rows(x.dtype) - rows(torch.float32)).abs() * valid).sum()
    if reduction == "mean":
        row_err = row_err / valid.sum()
    eager_err = max(float((l_loss.double() - o_loss.double()).abs()), float(row_err))
    err = float((loss.double() - o_loss.double()).abs())
    if math.isnan(float(o_loss)):
        assert math.isnan(float(loss))
        return
    bound = OUT_FACTOR * eager_err + LOWP_ATOL[x.dtype]
    assert err <= bound, f"loss: |ours - oracle| = {err:.4g} > {OUT_FACTOR} * {eager_err:.4g} + atol"


def _chunks_of(monkeypatch, rows, V):
    """Make the chunk rule give `rows` tokens per chunk."""
    monkeypatch.setattr(lce_ref, "CHUNK_BYTES", rows * V * 4)


# ---- against the oracle ------------------------------------------------------------------------
# 2 chunks: d weight's first chunk and its last (no lo in the bf16 pair); 3: a middle one too
@pytest.mark.parametrize("n_chunks", [2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_matches_oracle_in_several_chunks(backend, dtype, case, reduction, n_chunks, monkeypatch):
    N, d, V, bias, ls, cap, ignored = case
    _chunks_of(monkeypatch, max(1, -(-N // n_chunks)), V)  # the last chunk may be shorter
    x, W, t, b = _inputs(N, d, V, bias, ignored, dtype)
    _compare(x, W, t, b, reduction, ls, cap, backend)
    assert ff.last_dispatch().impl == backend


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]], ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_matches_oracle_with_the_default_chunks(backend, dtype, case):
    N, d, V, bias, ls, cap, ignored = case
    x, W, t, b = _inputs(N, d, V, bias, ignored, dtype)
    for reduction in ("mean", "none"):
        _compare(x, W, t, b, reduction, ls, cap, backend)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_leading_dims_and_strided_x(backend, reduction, monkeypatch):
    _chunks_of(monkeypatch, 7, 300)
    x, W, t, b = _inputs(None, 72, 300, True, "some", torch.float32, lead=(3, 11))
    loss, _ = _compare(x, W, t, b, reduction, 0.1, 10.0, backend)
    assert loss.shape == ((3, 11) if reduction == "none" else ())
    # x a strided view (every other feature of a wider tensor, batch-major transposed)
    wide = torch.randn(11, 3, 144).transpose(0, 1)
    _compare(wide[..., ::2], W, t, b, reduction, 0.0, None, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_target_ignored(backend):
    x, W, t, b = _inputs(5, 16, 9, True, "all", torch.float32)
    for reduction, want in (("mean", math.nan), ("sum", 0.0)):
        leaves = [v.clone().requires_grad_(True) for v in (x, W, b)]
        with ff.use_backend(backend):
            loss = ff.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], reduction=reduction,
                                           label_smoothing=0.1)
        assert (math.isnan(loss.item()) if math.isnan(want) else loss.item() == want)
        loss.backward()
        for v in leaves:
            assert torch.equal(v.grad, torch.zeros_like(v)), reduction  # as torch: zeros
    with ff.use_backend(backend):
        loss = ff.linear_cross_entropy(x, W, t, b, reduction="none")
    assert torch.equal(loss, torch.zeros(5))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_no_tokens(backend):
    x, W = torch.randn(0, 8, requires_grad=True), torch.randn(5, 8, requires_grad=True)
    t = torch.zeros(0, dtype=torch.int64)
    with ff.use_backend(backend):
        mean = ff.linear_cross_entropy(x, W, t)
        total = ff.linear_cross_entropy(x, W, t, reduction="sum")
        rows = ff.linear_cross_entropy(x, W, t, reduction="none")
    assert math.isnan(mean.item()) and total.item() == 0.0 and rows.shape == (0,)
    total.backward()
    assert x.grad.shape == (0, 8) and torch.equal(W.grad, torch.zeros(5, 8))


# ---- gradients: which, how often, with what upstream gradient ------------------------------
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_only_some_inputs_require_grad(backend, reduction):
    x, W, t, b = _inputs(17, 40, 50, True, "some", torch.float32)
    ref_loss, ref_grads = _loss_and_grads(lambda *a: _eager(*a, reduction, 0.0, None), x, W, t, b,
                                          reduction, _upstream(reduction, t))
    for which in ((0,), (1,), (2,), (1, 2)):
        leaves = [v.clone().requires_grad_(i in which) for i, v in enumerate((x, W, b))]
        with ff.use_backend(backend):
            loss = ff.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], reduction=reduction)
        grads = torch.autograd.grad(loss, [leaves[i] for i in which], _upstream(reduction, t))
        for i, g in zip(which, grads):
            torch.testing.assert_close(g, ref_grads[i], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_no_grad_forward_matches_and_backward_twice_accumulates(backend):
    x, W, t, b = _inputs(33, 24, 70, True, "some", torch.float32)
    leaves = [v.clone().requires_grad_(True) for v in (x, W, b)]
    with ff.use_backend(backend):
        with torch.no_grad():
            plain = ff.linear_cross_entropy(x, W, t, b)
        loss = ff.linear_cross_entropy(*leaves[:2], t, leaves[2])
    torch.testing.assert_close(plain, loss.detach(), atol=0, rtol=0)
    loss.backward(retain_graph=True)  # upstream 1: the forward's gradients themselves
    first = [v.grad.clone() for v in leaves]
    loss.backward()
    for v, g in zip(leaves, first):
        torch.testing.assert_close(v.grad, 2 * g, atol=0, rtol=0)


def test_fp64_gradcheck_cpu(monkeypatch):
    if "cpu" not in CPU_BACKENDS:
        pytest.skip("no cpu backend")
    _chunks_of(monkeypatch, 3, 11)
    x, W, t, b = _inputs(7, 5, 11, True, "some", torch.float64)
    leaves = [v.clone().requires_grad_(True) for v in (x, W, b)]
    for reduction in ("mean", "sum", "none"):
        for ls, cap in ((0.0, None), (0.1, 3.0)):
            def fn(x_, W_, b_):
                with ff.use_backend("cpu"):
                    return ff.linear_cross_entropy(x_, W_, t, b_, reduction=reduction,
                                                   label_smoothing=ls, softcap=cap)
            assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("gemms", ["torch", "packed"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]], ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_cpu_gemm_routes_match_oracle(dtype, case, reduction, gemms, monkeypatch):
    """The cpu backend's chunk loop on torch's GEMMs and on the packed GEMM, each forced (as on
    an Intel CPU, and an AVX2-only one whose torch GEMMs in bf16 / fp16 are generic code): 3
    chunks, vocab slices of 64 rows (d weight added slice by slice after a first chunk)."""
    if "cpu" not in CPU_BACKENDS:
        pytest.skip("no cpu backend")
    if gemms == "packed" and (ff._ext.C is None or not hasattr(ff._ext.C, "ffn_linear_fwd")
                              or ff._ext.cpu_level() not in ("avx2", "avx512")):
        pytest.skip("the packed GEMM needs fastformer._C at the avx2 or avx512 level")
    from fastformer.ops import linear as ops_linear
    monkeypatch.setattr(ops_linear, "packed_gemm_wins", lambda dt: gemms == "packed")
    calls = []
    if gemms == "packed":
        real = ff._ext.C.ffn_linear_fwd
        monkeypatch.setattr(ff._ext.C, "ffn_linear_fwd", lambda *a: calls.append(1) or real(*a))
    N, d, V, bias, ls, cap, ignored = case
    _chunks_of(monkeypatch, -(-N // 3), V)
    monkeypatch.setattr(lce_ref, "SLICE_ELEMENTS", 64 * d)
    x, W, t, b = _inputs(N, d, V, bias, ignored, dtype)
    _compare(x, W, t, b, reduction, ls, cap, "cpu")
    assert len(calls) == (0 if gemms == "torch" else 3 * (1 + (reduction == "none")))


def test_bf16_weight_grad_accumulates_without_a_rounding_per_chunk(monkeypatch):
    """d weight over 32 chunks: the compensated (hi, lo) accumulation stays near eager bf16's
    single-GEMM error, where rounding the running sum to bf16 once per chunk would not."""
    N, d, V = 512, 64, 500
    _chunks_of(monkeypatch, 16, V)
    x, W, t, _ = _inputs(N, d, V, False, "none", torch.bfloat16)
    up = torch.tensor(1.0)
    ours = _loss_and_grads(lambda a, w, t_, b: ff.linear_cross_entropy(a, w, t_), x, W, t, None,
                           "mean", up)[1][1]
    eager_fn = lambda a, w, t_, b: _eager(a, w, t_, None, "mean", 0.0, None)  # noqa: E731
    oracle = _loss_and_grads(eager_fn, x, W, t, None, "mean", up, torch.float32)[1][1]
    eager = _loss_and_grads(eager_fn, x, W, t, None, "mean", up)[1][1]
    err = (ours.float() - oracle).abs().max().item()
    eager_err = (eager.float() - oracle).abs().max().item()
    assert err <= 1.5 * eager_err, (err, eager_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_isa_level(capability_levels, dtype, monkeypatch):
    """The cpu row pass at every kernel level this machine runs (default, avx2, avx512), with
    a softcap on both sides of the fast tanh's polynomial range, smoothing, a bias and a tail."""
    if "cpu" not in CPU_BACKENDS:
        pytest.skip("no cpu backend")
    _chunks_of(monkeypatch, 20, 1003)
    x, W, t, b = _inputs(57, 72, 1003, True, "some", dtype)
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            for reduction in ("mean", "none"):
                _compare(x, W, t, b, reduction, 0.1, 3.0, "cpu")
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])


def test_chunk_rule():
    assert lce_ref.chunk_rows(4096, 32000, 4) == 512
    assert lce_ref.chunk_rows(4096, 32000, 2) == 512   # bf16: as many tokens, half the bytes
    assert lce_ref.chunk_rows(4096, 32000, 8) == 256   # fp64: the bytes
    assert lce_ref.chunk_rows(1000, 32000, 4) == 500   # evened out: 2 chunks of 500, not 524 + 476
    assert lce_ref.chunk_rows(17, 7, 4) == 17
    assert lce_ref.chunk_rows(0, 7, 4) == 1
    assert lce_ref.chunk_rows(5, 10 ** 9, 4) == 1


# ---- triton (under the interpreter on CPU) --------------------------------------------------
TRITON_CASES = [(17, 40, 1000, True, 0.1, None, "some"), (33, 72, 7, False, 0.0, 20.0, "some"),
                (1, 80, 1, True, 0.2, 5.0, "none"), (9, 40, 300, False, 0.0, None, "all")]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_oracle(dtype, case, reduction, monkeypatch):
    if "triton" not in ff.available_backends():
        pytest.skip("triton is not usable here (needs the interpreter or a GPU)")
    N, d, V, bias, ls, cap, ignored = case
    _chunks_of(monkeypatch, max(1, -(-N // 2)), V)
    x, W, t, b = _inputs(N, d, V, bias, ignored, dtype)
    _compare(x, W, t, b, reduction, ls, cap, "triton")
    assert ff.last_dispatch().backend == "triton"
