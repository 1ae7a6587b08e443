"""ff.scaled_dot_product_attention against torch's, and ff.patch_sdpa."""
import pytest
import torch
import torch.nn.functional as F
from oracle import check

import fastformer as ff
from fastformer.ops.sdpa import _torch_sdpa


def _run(fn, q, k, v, go, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves, **kw)
    return (out.detach(), *torch.autograd.grad(out, leaves, go))


CASES = [
    dict(shape_q=(2, 4, 17, 16), shape_kv=(2, 4, 23, 16)),                       # 4-D
    dict(shape_q=(3, 17, 40), shape_kv=(3, 29, 40)),                              # 3-D
    dict(shape_q=(17, 8), shape_kv=(9, 8)),                                       # 2-D
    dict(shape_q=(2, 8, 13, 16), shape_kv=(2, 2, 13, 16), enable_gqa=True),       # GQA
    dict(shape_q=(2, 8, 13, 16), shape_kv=(2, 1, 13, 16)),                        # MQA by broadcast
    dict(shape_q=(2, 4, 17, 16), shape_kv=(2, 4, 17, 16), is_causal=True),
    dict(shape_q=(2, 4, 17, 16), shape_kv=(2, 4, 23, 16), mask="bool"),
    dict(shape_q=(2, 4, 17, 16), shape_kv=(2, 4, 23, 16), mask="float"),
    dict(shape_q=(2, 4, 17, 16), shape_kv=(2, 4, 17, 16), mask="bool", is_causal=True),
    dict(shape_q=(2, 4, 17, 16), shape_kv=(2, 4, 23, 16), scale=0.3),
    dict(shape_q=(2, 4, 17, 16), shape_kv=(2, 4, 23, 16), v_dim=24),               # Ev != E
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "shape_kv"))
def test_matches_torch_sdpa(case):
    case = dict(case)
    sq, skv = case.pop("shape_q"), case.pop("shape_kv")
    v_shape = skv[:-1] + (case.pop("v_dim", skv[-1]),)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sq, generator=g, dtype=torch.float64)
    k = torch.randn(skv, generator=g, dtype=torch.float64)
    v = torch.randn(v_shape, generator=g, dtype=torch.float64)
    mask = case.pop("mask", None)
    if mask == "bool":
        case["attn_mask"] = torch.rand(sq[-2], skv[-2], generator=g) > 0.3
    elif mask == "float":
        case["attn_mask"] = torch.randn(sq[-2], skv[-2], generator=g, dtype=torch.float64)
    go = torch.randn(sq[:-1] + (v_shape[-1],), generator=g, dtype=torch.float64)
    expected = _run(_torch_sdpa, q, k, v, go, **case)
    ours = _run(ff.scaled_dot_product_attention, q.float(), k.float(), v.float(), go.float(),
                **{kk: (vv.float() if isinstance(vv, torch.Tensor) and vv.is_floating_point() else vv)
                   for kk, vv in case.items()})
    for name, o, e in zip(("out", "dq", "dk", "dv"), ours, expected):
        assert o.shape == e.shape, name
        check(name, o, e, atol=1e-4 if name != "out" else 1e-5, rtol=1e-4 if name != "out" else 1e-5)


def test_errors_are_runtime_errors_like_torch():
    q = torch.randn(2, 4, 8, 16)
    with pytest.raises(RuntimeError, match="dropout_p"):
        ff.scaled_dot_product_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        ff.scaled_dot_product_attention(q, torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16))
    with pytest.raises(ValueError, match="attn_mask"):
        ff.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 8, dtype=torch.bool))
    with pytest.raises(ff.SDPAError):
        ff.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.int64))


def test_unsupported_input_falls_back_to_torch():
    q = torch.randn(2, 3, 4, 8, 16)  # rank 5
    out = ff.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(out, _torch_sdpa(q, q, q))
    d = ff.last_dispatch()
    assert d.backend == "torch" and "rank" in str(d)


def test_patch_sdpa_context_and_call():
    q = torch.randn(1, 2, 5, 8)
    assert F.scaled_dot_product_attention is _torch_sdpa
    with ff.patch_sdpa():
        assert F.scaled_dot_product_attention is ff.scaled_dot_product_attention
        out = F.scaled_dot_product_attention(q, q, q)
        assert ff.last_dispatch().op == "attention" and ff.last_dispatch().backend in ("cpu", "reference")
    assert F.scaled_dot_product_attention is _torch_sdpa
    ff.patch_sdpa(enable=True)
    try:
        assert F.scaled_dot_product_attention is ff.scaled_dot_product_attention
    finally:
        ff.patch_sdpa(enable=False)
    assert F.scaled_dot_product_attention is _torch_sdpa
    torch.testing.assert_close(out, _torch_sdpa(q, q, q))


def test_patched_multihead_attention_uses_fastformer():
    """nn.MultiheadAttention calls F.scaled_dot_product_attention: patched, same numbers."""
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)  # train mode: no native fast path
    x = torch.randn(2, 9, 32)
    expected, _ = mha(x, x, x, need_weights=False)
    ff.backends.record(None)
    with ff.patch_sdpa():
        got, _ = mha(x, x, x, need_weights=False)
    assert ff.last_dispatch() is not None and ff.last_dispatch().op == "attention"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
