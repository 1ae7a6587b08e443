"""DeBERTa's disentangled relative-position bias (fastformer/ops/relative_bias.py): the cpu kernel
against the fp64 reference (outputs and both gradients) over dtypes, odd shapes, one or both
terms, shared or per-row visibility masks and the tables DeBERTa builds; fp64 gradcheck; the
custom-op pair (opcheck, torch.compile fullgraph); every CPU capability level; bad input."""
import pytest
import torch

import fastformer as ff
from fastformer.ops import relative_bias as rb_ops
from fastformer.ops.relative_bias import relative_bias
from fastformer.reference import relative_bias as ref
from oracle import LOWP_ATOL, OUT_FACTOR, assert_close_tol, assert_lowp_rule


def _inputs(B, H, Lq, Lk, W, dtype, terms=("c2p", "p2c"), visible="per_row", seed=0):
    g = torch.Generator().manual_seed(seed)
    c2p = torch.randn(B, H, Lq, W, generator=g, dtype=torch.float64).to(dtype) if "c2p" in terms else None
    p2c = torch.randn(B, H, Lk, W, generator=g, dtype=torch.float64).to(dtype) if "p2c" in terms else None
    ci = torch.randint(0, W, (Lq, Lk), generator=g)
    pi = torch.randint(0, W, (Lq, Lk), generator=g)
    vis = None
    if visible is not None:
        vis = torch.rand(B if visible == "per_row" else 1, Lq, Lk, generator=g) > 0.25
    return c2p, p2c, ci, pi, vis


def _run(c2p, p2c, ci, pi, vis, dout):
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (c2p, p2c)]
    out = relative_bias(*leaves, ci, pi, vis)
    wanted = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out, wanted, dout.to(out.dtype)))
    return out.detach(), [next(grads) if t is not None else None for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 3, 17, 17, 10), (1, 2, 113, 113, 64),
                                   (2, 1, 203, 203, 512), (1, 2, 17, 40, 16)])
@pytest.mark.parametrize("terms", [("c2p", "p2c"), ("c2p",), ("p2c",)])
def test_cpu_matches_the_fp64_reference(dtype, shape, terms):
    B, H, Lq, Lk, W = shape
    c2p, p2c, ci, pi, vis = _inputs(B, H, Lq, Lk, W, dtype, terms)
    dout = torch.randn(B, H, Lq, Lk, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out, grads = _run(c2p, p2c, ci, pi, vis, dout)
    assert ff.last_dispatch().backend == "cpu"
    wide = [t.double() if t is not None else None for t in (c2p, p2c)]
    want, want_grads = _run(*wide, ci, pi, vis, dout)
    assert torch.equal(out.isinf(), want.isinf()) and (out[out.isinf()] < 0).all()
    finite = ~want.isinf()
    if dtype in (torch.float32, torch.float64):
        assert_close_tol("out", out.double()[finite], want[finite], 1e-6, 1e-6)
        for name, g, w in zip(("dc2p", "dp2c"), grads, want_grads):
            if w is not None:
                assert_close_tol(name, g.double(), w, 1e-5 * w.abs().max().item(), 1e-5)
        return
    with ff.use_backend("reference"):  # torch's gather in the low dtype
        eager = ref.relative_bias_fwd(*(t.to(dtype) if t is not None else None for t in (c2p, p2c)),
                                      ci, pi, vis)
    atol = LOWP_ATOL[dtype]
    assert_lowp_rule("out", out.double()[finite], want[finite], eager.double()[finite], OUT_FACTOR,
                     atol * want[finite].abs().max().item() if finite.any() else atol)
    for name, g, w in zip(("dc2p", "dp2c"), grads, want_grads):
        if w is not None:  # a sum of low-precision terms, accumulated in fp32 and rounded once
            assert (g.double() - w).abs().max() <= torch.finfo(dtype).eps * w.abs().max() + atol, name


@pytest.mark.parametrize("visible", ["per_row", "shared", None])
def test_visibility_masks_and_their_gradients(visible):
    c2p, p2c, ci, pi, vis = _inputs(2, 2, 13, 13, 8, torch.float64, visible=visible)
    dout = torch.randn(2, 2, 13, 13, dtype=torch.float64)
    out, grads = _run(c2p, p2c, ci, pi, vis, dout)
    with ff.use_backend("reference"):
        want, want_grads = _run(c2p, p2c, ci, pi, vis, dout)
    assert torch.equal(out, want)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)
    if vis is not None:  # masked entries: -inf forward, no gradient back
        hidden = ~vis[:, None].expand(out.shape)
        assert out[hidden].eq(float("-inf")).all() and not out[~hidden].isinf().any()
        _, (dc2p, _) = _run(c2p, None, ci, None, vis, dout.masked_fill(~hidden, 0))
        assert not dc2p.any()


def test_deberta_tables_match_torch_gather():
    """The tables DeBERTa-v2 builds (log-bucketed relative positions, span 8 over 23 tokens):
    out equals the model's own gather + transpose + add."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position
    B, H, L, S = 2, 3, 23, 8
    q = torch.randn(B, H, L, 4, dtype=torch.float64)
    rel = build_relative_position(q, q, bucket_size=S, max_position=64)[0]
    c2p, p2c = torch.randn(B, H, L, 2 * S, dtype=torch.float64), torch.randn(B, H, L, 2 * S, dtype=torch.float64)
    ci = torch.clamp(rel + S, 0, 2 * S - 1)
    pi_model = torch.clamp(-rel + S, 0, 2 * S - 1)   # the model's: row j of p2c, column per (j, i)
    want = (torch.gather(c2p, -1, ci.expand(B, H, L, L))
            + torch.gather(p2c, -1, pi_model.expand(B, H, L, L)).transpose(-1, -2))
    out = relative_bias(c2p, p2c, ci, pi_model.t().contiguous(), None)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def test_gradcheck_fp64():
    c2p, p2c, ci, pi, vis = _inputs(1, 2, 9, 7, 5, torch.float64)
    c2p, p2c = c2p.requires_grad_(), p2c.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: relative_bias(a, b, ci, pi, vis).clamp(min=-1e9), (c2p, p2c))


def test_capability_levels_agree(capability_levels):
    c2p, p2c, ci, pi, vis = _inputs(2, 3, 37, 37, 24, torch.bfloat16)
    dout = torch.randn(2, 3, 37, 37)
    results = []
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            results.append(_run(c2p, p2c, ci, pi, vis, dout))
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])
    for out, grads in results[1:]:
        assert torch.equal(out, results[0][0])
        for g, w in zip(grads, results[0][1]):
            assert torch.equal(g, w)


def test_custom_op_pair_opcheck_and_compile():
    c2p, p2c, ci, pi, vis = _inputs(2, 2, 9, 9, 6, torch.float32)
    o = rb_ops.RelativeBiasOptions(c2p_index=ci, p2c_index=pi, visible=vis)
    op = rb_ops.RELATIVE_BIAS
    torch.library.opcheck(op.fwd_op, op.op_args((c2p, p2c), o))
    outputs = op.fwd_op(*op.op_args((c2p, p2c), o))
    saved = op.save((c2p, p2c), o, tuple(outputs[:-1]))
    torch.library.opcheck(op.bwd_op, ([torch.randn_like(outputs[0])], list(saved), *o.flat(),
                                      [True, True], outputs[-1]))
    a, b = c2p.clone().requires_grad_(), p2c.clone().requires_grad_()

    def fn(x, y):
        return relative_bias(x, y, ci, pi, vis).clamp(min=-100).square().sum()

    want = fn(a, b)
    want_grads = torch.autograd.grad(want, (a, b))
    got = torch.compile(fn, fullgraph=True)(a, b)
    got_grads = torch.autograd.grad(got, (a, b))
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_bad_input_is_named():
    c2p, p2c, ci, pi, vis = _inputs(1, 2, 5, 5, 4, torch.float32)
    with pytest.raises(ValueError, match="`c2p` or `p2c`"):
        relative_bias(None, None, ci, pi)
    with pytest.raises(TypeError, match="`c2p_index` must be a 2-D int64"):
        relative_bias(c2p, p2c, ci.int(), pi)
    with pytest.raises(ValueError, match="`p2c` must be contiguous"):
        relative_bias(c2p, p2c.transpose(-1, -2).contiguous().transpose(-1, -2), ci, pi)
    with pytest.raises(ValueError, match="`visible` must be a bool"):
        relative_bias(c2p, p2c, ci, pi, vis.float())
    with pytest.raises(ValueError, match=r"`p2c_index` must hold columns of p2c \(0 <= index < 4\), got 4"):
        relative_bias(c2p, p2c, ci, pi.clamp(min=4))
    with pytest.raises(RuntimeError, match=r"index tables must hold values in \[0, W = 4\)"):
        o = rb_ops.RelativeBiasOptions(c2p_index=ci + 4, p2c_index=pi, visible=None)  # past the checks
        rb_ops.RELATIVE_BIAS((c2p, p2c), o)
    with pytest.raises(ValueError, match="`p2c` must have Lk = 5"):
        relative_bias(None, p2c[:, :, :3].contiguous(), None, pi)
    wide = torch.zeros(1, 1, 1, 1 << 24, dtype=torch.bfloat16)  # 32 MB: past the kernels' int32 offsets
    one = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"W \(the last dim of c2p / p2c\) must be below 2\^24, got 16777216"):
        relative_bias(wide, None, one)
    with pytest.raises(RuntimeError, match=r"W .* must be below 2\^24"):  # the C++ check, for traced calls
        rb_ops.RELATIVE_BIAS((wide, None), rb_ops.RelativeBiasOptions(c2p_index=one))
