"""The op definitions (fastformer/ops/_opdef.py): torch.compile (fullgraph, dynamic shapes),
torch.export, torch.library.opcheck of every custom-op pair, the eager-via-ops route, and the
backward running on the forward's implementation on both routes."""
import pytest
import torch

import fastformer as ff
from fastformer import backends
from fastformer.ops import attention as attn_ops
from fastformer.ops import ffn as ffn_ops
from fastformer.ops import linear_cross_entropy as lce_ops
from fastformer.ops import norm as norm_ops
from fastformer.ops import rotary as rotary_ops


# ---- one function per op family, and its inputs ----------------------------------------------
def _attention(q, k, v):
    return ff.attention(q, k, v, causal=True)


def _attention_masked(q, k, v, kpm):
    return ff.attention(q, k, v, key_padding_mask=kpm, scale=0.3)


def _attention_t5_bias(q, k, v, table):
    bias = ff.RelativePositionBias(table, bidirectional=False, max_distance=16)
    return ff.attention(q, k, v, causal=True, position_bias=bias)


def _norm(x, r, w, b):
    y, res = ff.add_layer_norm(x, r, w, b, return_residual=True)
    return y * 2 + res


def _norm_no_stream(x, r, w, b):  # saves x and r as they came (the stream is not returned)
    return ff.add_layer_norm(x, r, w, b)


def _rms(x, w):
    return ff.rms_norm(x, w)


def _swiglu(x, wg, wu, wd):
    return ff.swiglu_ffn(x, wg, wu, wd)


def _ffn(x, w1, b1, w2, b2):
    return ff.ffn(x, w1, b1, w2, b2, activation="gelu_tanh")


def _rotary(x, cos, sin):
    return ff.apply_rotary(x, cos, sin)


def _lce_none(x, w, b, t):
    return ff.linear_cross_entropy(x, w, t, b, reduction="none", label_smoothing=0.1, softcap=5.0)


def _lce_mean(x, w, b, t):
    return ff.linear_cross_entropy(x, w, t, b).reshape(1)  # the gradients from the forward


def _cases():
    """(name, fn, make(B, L) -> inputs, indices of the inputs that get gradients,
    {input index: (batch dim, sequence dim)})."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    D = 16
    return [
        ("attention", _attention, lambda B, L: [rnd(B, 4, L, D), rnd(B, 2, L, D), rnd(B, 2, L, D)],
         (0, 1, 2), {0: (0, 2), 1: (0, 2), 2: (0, 2)}),
        ("attention_masked", _attention_masked,
         lambda B, L: [rnd(B, 2, L, D), rnd(B, 2, L, D), rnd(B, 2, L, D),
                       torch.arange(L).expand(B, L) >= L - 2],
         (0, 1, 2), {0: (0, 2), 1: (0, 2), 2: (0, 2), 3: (0, 1)}),
        ("attention_t5_bias", _attention_t5_bias,
         lambda B, L: [rnd(B, 2, L, D), rnd(B, 2, L, D), rnd(B, 2, L, D), rnd(32, 2)],
         (0, 1, 2, 3), {0: (0, 2), 1: (0, 2), 2: (0, 2)}),
        ("add_layer_norm", _norm, lambda B, L: [rnd(B, L, 40), rnd(B, L, 40), rnd(40), rnd(40)],
         (0, 1, 2, 3), {0: (0, 1), 1: (0, 1)}),
        ("rms_norm", _rms, lambda B, L: [rnd(B, L, 40), rnd(40)], (0, 1), {0: (0, 1)}),
        # channels-strided x and residual (SigLIP's stream): the cpu kernels on contiguous copies,
        # which the custom op's backward makes from the saved inputs too
        ("add_layer_norm_strided", _norm_no_stream,
         lambda B, L: [rnd(B, 40, L).transpose(1, 2), rnd(B, 40, L).transpose(1, 2), rnd(40), rnd(40)],
         (0, 1, 2, 3), {0: (0, 1), 1: (0, 1)}),
        # Weights at the 1/sqrt(fan-in) scale of an initialized layer: with eager autograd the
        # cpu route runs gated calls as three nodes (ffn.py, _Cpu.autograd) and sums dx from
        # two GEMMs, where the one custom-op node takes one GEMM over K = 2F; the two agree to
        # fp32 rounding of the values' scale (2 eps), which unscaled randn weights (outputs
        # ~400) would push past the absolute tolerance.
        ("swiglu", _swiglu,
         lambda B, L: [rnd(B, L, 24), rnd(40, 24) / 24 ** 0.5, rnd(40, 24) / 24 ** 0.5,
                       rnd(24, 40) / 40 ** 0.5],
         (0, 1, 2, 3), {0: (0, 1)}),
        ("ffn", _ffn, lambda B, L: [rnd(B, L, 24), rnd(40, 24), rnd(40), rnd(24, 40), rnd(24)],
         (0, 1, 2, 3, 4), {0: (0, 1)}),
        ("rotary", _rotary, lambda B, L: [rnd(B, 3, L, D), rnd(L, 4), rnd(L, 4)], (0,),
         {0: (0, 2), 1: (None, 0), 2: (None, 0)}),
        ("lce_none", _lce_none,
         lambda B, L: [rnd(B, L, 24), rnd(40, 24), rnd(40), torch.randint(0, 40, (B, L), generator=g)],
         (0, 1, 2), {0: (0, 1), 3: (0, 1)}),
        ("lce_mean", _lce_mean,
         lambda B, L: [rnd(B, L, 24), rnd(40, 24), rnd(40), torch.randint(0, 40, (B, L), generator=g)],
         (0, 1, 2), {0: (0, 1), 3: (0, 1)}),
    ]


CASES = {c[0]: c for c in _cases()}


def _loss_and_grads(fn, inputs, grad_idx):
    leaves = [t.detach().clone().requires_grad_(i in grad_idx) for i, t in enumerate(inputs)]
    out = fn(*leaves)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1])).sum(),
                                [leaves[i] for i in grad_idx])
    return out.detach(), grads


def _assert_matches_eager(compiled, fn, inputs, grad_idx):
    out_c, grads_c = _loss_and_grads(compiled, inputs, grad_idx)
    out_e, grads_e = _loss_and_grads(fn, inputs, grad_idx)
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)


# ---- torch.compile ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", ["attention", "attention_t5_bias", "add_layer_norm", "add_layer_norm_strided",
                                  "swiglu", "lce_mean"])
def test_compile_fullgraph_matches_eager(name, backend):
    torch._dynamo.reset()
    _, fn, make, grad_idx, _ = CASES[name]
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    _assert_matches_eager(compiled, fn, make(2, 17), grad_idx)


@pytest.mark.parametrize("name", list(CASES))
def test_compile_dynamic_shapes_matches_eager(name):
    """dynamic=True: one graph for several batch sizes and lengths, every op fullgraph."""
    torch._dynamo.reset()
    _, fn, make, grad_idx, _ = CASES[name]
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for B, L in ((2, 17), (3, 9), (1, 30)):
        _assert_matches_eager(compiled, fn, make(B, L), grad_idx)


@pytest.mark.parametrize("name", ["attention", "rms_norm", "ffn", "rotary", "lce_none"])
def test_compile_mark_dynamic_every_dim(name):
    """mark_dynamic on every dim of every input (head dims and hidden sizes included): the
    checks and the fake implementations trace with symbolic sizes."""
    torch._dynamo.reset()
    _, fn, make, grad_idx, _ = CASES[name]
    inputs = make(2, 17)
    for t in inputs:
        for d in range(t.dim()):
            if t.shape[d] > 1:
                torch._dynamo.mark_dynamic(t, d)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    _assert_matches_eager(compiled, fn, inputs, grad_idx)


# ---- torch.export ----------------------------------------------------------------------------
class _AsModule(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


@pytest.mark.parametrize("name", list(CASES))
def test_export_with_dynamic_batch_and_sequence(name):
    _, fn, make, _, dims = CASES[name]
    inputs = make(2, 17)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=512)
    shapes = []
    for i, t in enumerate(inputs):
        b_dim, s_dim = dims.get(i, (None, None))
        spec = {}
        if b_dim is not None:
            spec[b_dim] = batch
        if s_dim is not None:
            spec[s_dim] = seq
        shapes.append(spec or None)
    program = torch.export.export(_AsModule(fn), tuple(inputs),
                                  dynamic_shapes={"inputs": tuple(shapes)})
    for B, L in ((2, 17), (5, 33)):
        other = make(B, L)
        torch.testing.assert_close(program.module()(*other), fn(*other))


# ---- opcheck of every custom-op pair ---------------------------------------------------------
def _opcheck_pair(op, inputs, o, grads_of):
    args = op.op_args(tuple(inputs), o)
    torch.library.opcheck(op.fwd_op, args)
    outputs = op.fwd_op(*args)
    saved = op.save(tuple(inputs), o, tuple(outputs[:-1]))
    grads = [torch.randn_like(outputs[i]) for i in grads_of]
    needs = [t is not None for t in inputs] + [False] * len(o.differentiable)
    torch.library.opcheck(op.bwd_op, (grads, list(saved), *o.flat(), needs, outputs[-1]))


def test_opcheck_every_op():
    x, r, w, b = torch.randn(5, 24), torch.randn(5, 24), torch.randn(24), torch.randn(24)
    _opcheck_pair(norm_ops.ADD_NORM, [x, r, w, b],
                  norm_ops.NormOptions(eps=1e-5, return_residual=True), (0, 1))
    _opcheck_pair(norm_ops.ADD_NORM, [x, None, w, None],
                  norm_ops.NormOptions(eps=1e-6, rms=True), (0,))
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
    kpm = torch.zeros(2, 11, dtype=torch.bool)
    kpm[1, -3:] = True
    _opcheck_pair(attn_ops.ATTENTION, [q, k, v],
                  attn_ops.AttentionOptions(causal=2, key_padding_mask=kpm), (0,))
    xf, w1, w2, wu = torch.randn(5, 8), torch.randn(12, 8), torch.randn(8, 12), torch.randn(12, 8)
    _opcheck_pair(ffn_ops.FFN, [xf, w1, torch.randn(12), w2, None, wu, None],
                  ffn_ops.FfnOptions(activation=3), (0,))
    xr = torch.randn(2, 3, 7, 16)
    _opcheck_pair(rotary_ops.ROTARY, [xr],
                  rotary_ops.RotaryOptions(cos=torch.randn(7, 8), sin=torch.randn(7, 8)), (0,))
    xl, wl, bl = torch.randn(9, 16), torch.randn(30, 16), torch.randn(30)
    tl = torch.randint(0, 30, (9,))
    tl[2] = -100
    for reduction in (0, 1, 2):  # none, mean, sum
        _opcheck_pair(lce_ops.LINEAR_CROSS_ENTROPY, [xl, wl, bl],
                      lce_ops.LinearCrossEntropyOptions(
                          target=tl, reduction=reduction, label_smoothing=0.1, softcap=4.0,
                          grad_x=True, grad_weight=True, grad_bias=True), (0,))


# ---- routes --------------------------------------------------------------------------------
@pytest.fixture
def via_ops(monkeypatch):
    monkeypatch.setenv("FASTFORMER_EAGER_VIA_OPS", "1")
    backends.reload_env()
    yield
    monkeypatch.delenv("FASTFORMER_EAGER_VIA_OPS")
    backends.reload_env()


@pytest.mark.parametrize("name", list(CASES))
def test_eager_via_ops_route_matches_the_function_route(name, request):
    """FASTFORMER_EAGER_VIA_OPS=1 sends eager calls through torch.ops: same results."""
    _, fn, make, grad_idx, _ = CASES[name]
    inputs = make(2, 17)
    base = _loss_and_grads(fn, inputs, grad_idx)
    request.getfixturevalue("via_ops")
    out, grads = _loss_and_grads(fn, inputs, grad_idx)
    torch.testing.assert_close(out, base[0])
    for a, b in zip(grads, base[1]):
        torch.testing.assert_close(a, b)


def _counting_bwd(monkeypatch, op: str, backend: str) -> list:
    """Counts the calls of `backend`'s backward of `op` (its first implementation)."""
    impl = backends.implementations(op, backend)[0]
    calls = []
    original = impl.bwd
    monkeypatch.setattr(impl, "bwd", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("route", ["function", "custom_op", "compile"])
@pytest.mark.parametrize("name,op", [("attention", "attention"), ("rms_norm", "add_norm"),
                                     ("ffn", "ffn"), ("lce_none", "linear_cross_entropy"),
                                     ("lce_mean", "linear_cross_entropy")])
def test_backward_runs_on_the_forwards_backend(route, name, op, monkeypatch, request):
    """``with ff.use_backend("triton"): y = f(x)`` then ``y.backward()`` outside the block runs
    Triton's backward (not a second selection's cpu backward), on every route."""
    if "triton" not in ff.available_backends():
        pytest.skip("triton is not usable here (needs the interpreter or a GPU)")
    if route == "custom_op":
        request.getfixturevalue("via_ops")
    _, fn, make, grad_idx, _ = CASES[name]
    f = fn
    if route == "compile":
        torch._dynamo.reset()
        f = torch.compile(fn, fullgraph=True, backend="aot_eager")
    triton_calls = _counting_bwd(monkeypatch, op, "triton")
    cpu_calls = _counting_bwd(monkeypatch, op, "cpu") if backends.implementations(op, "cpu") else []
    leaves = [t.detach().clone().requires_grad_(i in grad_idx) for i, t in enumerate(make(2, 17))]
    with ff.use_backend("triton"):
        out = f(*leaves)
    out.sum().backward()
    assert triton_calls and not cpu_calls, (len(triton_calls), len(cpu_calls))
    d = ff.last_dispatch()
    assert d.backend == "triton" and d.forced
    torch.testing.assert_close(out.detach(), fn(*[t.detach() for t in leaves]), atol=1e-4,
                               rtol=1e-4)
