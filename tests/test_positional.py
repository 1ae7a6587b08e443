"""Positional encodings: ff.apply_rotary on every backend, RotaryEmbedding (also inside
ff.MultiheadAttention), SinusoidalPositionalEncoding, LearnedPositionalEncoding."""
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import backend_params
from oracle import check

import fastformer as ff
from fastformer.ops import rotary as rotary_ops


# ---- oracle: RoPE written the way Hugging Face models write it (cos/sin expanded to D) --------
def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def eager_rotary(x, cos, sin, interleaved):
    rot = 2 * cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        pairs = xr.unflatten(-1, (-1, 2))
        swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        y = xr * c + swapped * s
    else:
        c, s = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        y = xr * c + _rotate_half(xr) * s
    return torch.cat((y, rest), dim=-1)


def _heads(B, L, H, D, dtype, seed=0):
    """q (B, H, L, D) as a strided view of a fused (B, L, 3, H, D) projection, and a grad."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(B, L, 3, H, D, generator=g, dtype=torch.float64).to(dtype)
    return proj[:, :, 0].transpose(1, 2), torch.randn(B, H, L, D, generator=g, dtype=torch.float64)


def _run(fn, x, gy):
    leaf = x.detach().clone().requires_grad_(True)
    y = fn(leaf)
    (dx,) = torch.autograd.grad(y, leaf, gy.to(y.dtype))
    return y.detach(), dx


@pytest.mark.parametrize("backend", backend_params("rotary"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("B,L,H,D,rot", [(2, 17, 3, 64, 64), (1, 113, 2, 40, 16), (3, 1, 4, 72, 72),
                                         (2, 33, 2, 80, 40)])
def test_apply_rotary_matches_eager(backend, dtype, interleaved, B, L, H, D, rot):
    x, gy = _heads(B, L, H, D, dtype)
    rope = ff.RotaryEmbedding(rot, interleaved=interleaved)
    cos, sin = rope.tables(L)
    with ff.use_backend(backend):
        y, dx = _run(lambda t: ff.apply_rotary(t, cos, sin, interleaved=interleaved), x, gy)
    assert ff.last_dispatch().backend == backend and y.dtype == dtype
    c64, s64 = rope.tables(L, dtype=torch.float64)
    oracle_dt = torch.float64 if dtype == torch.float32 else torch.float32
    y_o, dx_o = _run(lambda t: eager_rotary(t, c64.to(oracle_dt), s64.to(oracle_dt), interleaved),
                     x.to(oracle_dt), gy)
    y_l = dx_l = None
    if dtype != torch.float32:  # what a low-precision model computes (tables in its dtype)
        y_l, dx_l = _run(lambda t: eager_rotary(t, cos.to(dtype), sin.to(dtype), interleaved), x, gy)
    check("y", y, y_o, y_l)
    check("dx", dx, dx_o, dx_l, grad=True)


def test_apply_rotary_gradcheck_fp64():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    cos, sin = ff.RotaryEmbedding(6).tables(5, dtype=torch.float64)
    for interleaved in (False, True):
        assert torch.autograd.gradcheck(
            lambda t: ff.apply_rotary(t, cos, sin, interleaved=interleaved), (x,))


def test_rotary_custom_op_opcheck_and_compile():
    x = torch.randn(2, 3, 5, 8, requires_grad=True)
    cos, sin = ff.RotaryEmbedding(8).tables(5)
    o = rotary_ops.RotaryOptions(cos=cos, sin=sin)
    torch.library.opcheck(rotary_ops.ROTARY.fwd_op, rotary_ops.ROTARY.op_args((x,), o))
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: ff.apply_rotary(t, cos, sin).square().sum(), fullgraph=True,
                             backend="aot_eager")
    (g_c,) = torch.autograd.grad(compiled(x), x)
    (g_e,) = torch.autograd.grad(ff.apply_rotary(x, cos, sin).square().sum(), x)
    torch.testing.assert_close(g_c, g_e)


def test_rotary_scores_depend_only_on_relative_position():
    """q_m . k_n after RoPE is a function of m - n: the property RoPE exists for."""
    rope = ff.RotaryEmbedding(16)
    q = torch.randn(1, 1, 1, 16, dtype=torch.float64).expand(1, 1, 40, 16)
    k = torch.randn(1, 1, 1, 16, dtype=torch.float64).expand(1, 1, 40, 16)
    qr, kr = rope(q, k)
    scores = (qr[0, 0] @ kr[0, 0].T)
    for shift in (0, 3, 17):
        diag = torch.diagonal(scores, offset=shift)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-10, atol=1e-10)


def test_rotary_embedding_offsets_and_extrapolation():
    rope = ff.RotaryEmbedding(8, base=500.0)
    cos_short, _ = rope.tables(10)
    cos_long, sin_long = rope.tables(5000, offset=3)  # past every length seen so far
    torch.testing.assert_close(cos_long[:7], cos_short[3:10])
    pos, i = 4321, 3
    angle = (pos + 3) * 500.0 ** (-2 * i / 8)
    assert abs(float(sin_long[pos, i]) - math.sin(angle)) < 1e-6
    x = torch.randn(2, 2, 6, 8)
    torch.testing.assert_close(rope.rotate(x, offset=4), ff.apply_rotary(x, *rope.tables(6, 4)))
    assert rope.state_dict() == {} and list(rope.parameters()) == []


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_rotary_option(batch_first):
    """ff.MultiheadAttention(rotary=True) = projections, RoPE on q and k, attention, out_proj."""
    E, H, Lq = 32, 4, 9
    ours = ff.MultiheadAttention(E, H, batch_first=batch_first, rotary=True).double()
    x = torch.randn(2, Lq, E, dtype=torch.float64)
    inp = x if batch_first else x.transpose(0, 1)
    out, _ = ours(inp, inp, inp, need_weights=False, is_causal=True)
    out_w, weights = ours(inp, inp, inp, need_weights=True, is_causal=True)
    q, k, v = F.linear(x, ours.in_proj_weight, ours.in_proj_bias).unflatten(-1, (3, H, -1)).permute(2, 0, 3, 1, 4)
    cos, sin = ours.rotary.tables(Lq, dtype=torch.float64)
    q, k = eager_rotary(q, cos, sin, False), eager_rotary(k, cos, sin, False)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
    ref = F.linear(ref, ours.out_proj.weight, ours.out_proj.bias)
    ref = ref if batch_first else ref.transpose(0, 1)
    check("out", out.detach(), ref)
    check("out(need_weights)", out_w.detach(), ref)
    assert set(ours.state_dict()) == set(torch.nn.MultiheadAttention(E, H).state_dict())


# ---- sinusoidal and learned ---------------------------------------------------------------------
@pytest.mark.parametrize("d_model", [16, 7])
def test_sinusoidal_is_the_paper_formula_and_extrapolates(d_model):
    pe = ff.SinusoidalPositionalEncoding(d_model, batch_first=True)
    x = torch.zeros(1, 20, d_model, dtype=torch.float64)
    short = pe(x)[0]
    long = pe.encoding(3000, dtype=torch.float64)  # longer than any cached table
    torch.testing.assert_close(long[:20], short)
    for pos in (0, 1, 19, 2999):
        for j in range(d_model):
            angle = pos / 10000 ** ((j - j % 2) / d_model)
            expected = math.sin(angle) if j % 2 == 0 else math.cos(angle)
            assert abs(float(long[pos, j]) - expected) < 1e-9, (pos, j)


def test_sinusoidal_layouts_offset_and_dropout():
    d = 12
    pe = ff.SinusoidalPositionalEncoding(d)
    x = torch.randn(6, 3, d)
    table = pe.encoding(6, offset=2)
    check("seq-first", pe(x, offset=2), x + table[:, None, :])
    pe_bf = ff.SinusoidalPositionalEncoding(d, batch_first=True)
    check("batch-first", pe_bf(x.transpose(0, 1)), x.transpose(0, 1) + pe_bf.encoding(6)[None])
    check("unbatched", pe(x[:, 0]), x[:, 0] + pe.encoding(6))
    drop = ff.SinusoidalPositionalEncoding(d, dropout=0.5).train()
    y = drop(torch.ones(200, 4, d))
    zero_frac = float((y == 0).float().mean())
    assert 0.45 < zero_frac < 0.55
    with pytest.raises(ValueError, match="d_model"):
        pe(torch.randn(4, 2, d + 1))


def test_learned_positional_encoding():
    pe = ff.LearnedPositionalEncoding(10, 8, batch_first=True)
    x = torch.randn(2, 6, 8, requires_grad=True)
    y = pe(x, offset=3)
    check("y", y.detach(), (x + pe.weight[3:9]).detach())
    y.sum().backward()
    assert torch.equal(pe.weight.grad[3:9], torch.full((6, 8), 2.0))
    assert torch.equal(pe.weight.grad[:3], torch.zeros(3, 8))
    assert list(pe.state_dict()) == ["weight"]
    with pytest.raises(ValueError, match=r"max_len = 10"):
        pe(torch.randn(2, 8, 8), offset=3)
    with pytest.raises(ValueError, match="offset"):
        pe(x, offset=-1)


# ---- bad input -------------------------------------------------------------------------------
def test_bad_input():
    x = torch.randn(2, 3, 5, 8)
    cos, sin = ff.RotaryEmbedding(8).tables(5)
    with pytest.raises(ValueError, match="cos"):
        ff.apply_rotary(x, cos[:4], sin[:4])
    with pytest.raises(ValueError, match="cos"):
        ff.apply_rotary(x, *ff.RotaryEmbedding(10).tables(5))
    with pytest.raises(TypeError, match="cos"):
        ff.apply_rotary(x, cos.double(), sin.double())
    with pytest.raises(ValueError, match="4-D"):
        ff.apply_rotary(x[0], cos, sin)
    with pytest.raises(ValueError, match="even"):
        ff.RotaryEmbedding(7)
    with pytest.raises(ValueError, match="rotary dim"):
        ff.MultiheadAttention(16, 4, rotary=ff.RotaryEmbedding(8))
    with pytest.raises(ValueError, match="max_len"):
        ff.LearnedPositionalEncoding(0, 8)
