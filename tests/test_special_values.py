"""NaN and +-inf propagate as in eager PyTorch; -inf masks; huge logits."""
import pytest
import torch
import torch.nn.functional as F
from attention_oracle import oracle_attention

import fastformer as ff

BACKENDS = ["cpu", "reference"]


def _same_nonfinite_pattern(ours, eager):
    assert torch.equal(torch.isnan(ours), torch.isnan(eager)), "NaN pattern differs from eager"
    assert torch.equal(torch.isposinf(ours), torch.isposinf(eager)), "+inf pattern differs"
    assert torch.equal(torch.isneginf(ours), torch.isneginf(eager)), "-inf pattern differs"
    finite = torch.isfinite(eager)
    torch.testing.assert_close(ours[finite], eager[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["x", "residual", "weight"])
def test_add_norm_propagates_like_eager(backend, value, where):
    x, r, w, b = torch.randn(5, 33), torch.randn(5, 33), torch.randn(33), torch.randn(33)
    {"x": x, "residual": r, "weight": w}[where][..., 3] = value
    with ff.use_backend(backend):
        ours = ff.add_layer_norm(x, r, w, b)
        ours_rms = ff.rms_norm(x, w, 1e-6, residual=r)
    _same_nonfinite_pattern(ours, F.layer_norm(x + r, (33,), w, b))
    _same_nonfinite_pattern(ours_rms, F.rms_norm(x + r, (33,), w, 1e-6))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_attention_propagates_like_eager(backend, value, where):
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    {"q": q, "k": k, "v": v}[where][0, 1, 2, 3] = value
    with ff.use_backend(backend):
        ours = ff.attention(q, k, v)
    eager = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
    _same_nonfinite_pattern(ours, eager)


@pytest.mark.parametrize("backend", BACKENDS)
def test_neg_inf_float_mask_and_all_neg_inf_rows(backend):
    q, k, v = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
    mask = torch.randn(2, 1, 7, 11)
    mask[..., :4] = float("-inf")          # some keys excluded by -inf
    mask[1, :, 3, :] = float("-inf")        # a row with every key at -inf
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    with ff.use_backend(backend):
        out = ff.attention(*leaves, attn_mask=mask)
    expected = oracle_attention(q.double(), k.double(), v.double(), attn_mask=mask.double())
    assert torch.isfinite(out).all()
    assert torch.equal(out[1, :, 3], torch.zeros_like(out[1, :, 3]))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    assert torch.equal(leaves[0].grad[1, :, 3], torch.zeros_like(leaves[0].grad[1, :, 3]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_huge_logits_do_not_overflow(backend, dtype):
    """Scores of ~1e4: exp would overflow without the running max; the result is the hard max."""
    q = torch.randn(1, 2, 16, 32) * 20
    k = torch.randn(1, 2, 24, 32) * 20
    v = torch.randn(1, 2, 24, 32)
    with ff.use_backend(backend):
        out = ff.attention(q.to(dtype), k.to(dtype), v.to(dtype), scale=1.0)
    assert torch.isfinite(out).all()
    expected = oracle_attention(q.to(dtype).double(), k.to(dtype).double(), v.to(dtype).double(), scale=1.0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("lq,lk", [(128, 128), (113, 203), (203, 113)])
def test_causal_tiles_ignore_stale_scratch(causal, lq, lk):
    """Diagonal tiles skip the micro-tiles above the diagonal (Band in csrc/cpu/gemm.h), leaving
    those entries of the per-thread score/dS scratch unwritten. A NaN call first fills the
    scratch with NaN; the causal call after it must not read any of it (forward and grads)."""
    poison = [torch.full((2, 3, 203, 64), float("nan"), requires_grad=True) for _ in range(3)]
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, lq, 64), torch.randn(2, 3, lk, 64), torch.randn(2, 3, lk, 64)
    go = torch.randn(2, 3, lq, 64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with ff.use_backend("cpu"):
        ff.attention(*poison).sum().backward()
        out = ff.attention(*leaves, causal=causal)
        grads = torch.autograd.grad(out, leaves, go)
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    expected = oracle_attention(*ref, causal=causal)
    expected_grads = torch.autograd.grad(expected, ref, go.double())
    for ours, exp in zip((out, *grads), (expected, *expected_grads)):
        assert torch.isfinite(ours).all(), f"non-finite values with causal={causal}"
        torch.testing.assert_close(ours.double(), exp, atol=1e-5, rtol=1e-5)
