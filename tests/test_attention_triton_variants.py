"""Triton flash attention's score variants under Triton's interpreter: windows, softcap, ALiBi,
sinks, the T5 bias table and learned float masks, alone and together with GQA and dropout,
against eager_variants (tests/triton_attention_oracle.py, independent of fastformer.reference)
on the output, dq, dk, dv and the gradients of the sinks, the table and the mask. The window
tests shrink the blocks (small_blocks) to walk the many-block paths GPUs take."""
import pytest
import torch
from oracle import check
from triton_attention_oracle import (BF16, F16, F32, _oracle_variants, _run_variants, _triton_variants,
                                     compare_variants, make_qkv, padding_mask)
from triton_attention_oracle import small_blocks  # noqa: F401 (a fixture)

import fastformer as ff
from fastformer.ops.attention import dropout_keep_mask
from fastformer.reference.rng import draw_rng_state

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
tk = pytest.importorskip("fastformer.triton_kernels.attention")
tko = pytest.importorskip("fastformer.triton_kernels.attention_options")


WINDOWS = [(0, 0), (1, 1), (5, -1), (-1, 5), (300, 300), (23, 9)]  # 300: wider than L


@pytest.mark.parametrize("Lq,Lk", [(37, 90), (90, 37)])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_window(small_blocks, window, causal, Lq, Lk):
    q, k, v, dout = make_qkv(1, 1, 1, Lq, Lk, 16, F32)
    compare_variants(q, k, v, dout, window=window, causal=causal)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_window_low_precision(small_blocks, dtype):
    q, k, v, dout = make_qkv(1, 2, 1, 70, 113, 64, dtype)
    compare_variants(q, k, v, dout, window=(20, 3), causal="bottom_right")


def test_window_never_visits_blocks_outside_the_band(monkeypatch):
    """NaN in every K/V row (then Q/dO row) of the blocks wholly outside the band: a kernel
    that loaded one into a dot would turn its output or gradients to NaN (0 * NaN), even with
    every score masked. Ours runs on the poisoned inputs, the oracle on the clean ones."""
    for kind in ("fwd", "dkdv", "dq"):
        monkeypatch.setitem(tk.INTERPRETER_CONFIGS, kind, dict(BLOCK_M=16, BLOCK_N=16))
    # 16 queries see keys [i + 144 - 20, i + 144]: key blocks below 112 are outside.
    q, k, v, dout = make_qkv(1, 1, 1, 16, 160, 16, F32)
    kw = dict(window=(20, 0), causal="bottom_right")
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, :112] = v_bad[:, :, :112] = float("nan")
    out, grads = _run_variants(_triton_variants, q, k_bad, v_bad, dout, {}, **kw)
    out_o, grads_o = _run_variants(_oracle_variants, *(t.double() for t in (q, k, v, dout)), {},
                                   **kw)
    check("out", out, out_o)
    for name in "qkv":
        check(f"d{name}", grads[name], grads_o[name], atol=1e-4, rtol=1e-4)
    # Query i sees keys j >= i - 4 (of 16): query blocks from 32 on see none.
    q, k, v, dout = make_qkv(1, 1, 1, 160, 16, 16, F32)
    q_bad, dout_bad = q.clone(), dout.clone()
    q_bad[:, :, 32:] = dout_bad[:, :, 32:] = float("nan")
    out, grads = _run_variants(_triton_variants, q_bad, k, v, dout_bad, {}, window=(4, -1))
    out_o, grads_o = _run_variants(_oracle_variants, *(t.double() for t in (q, k, v, dout)), {},
                                   window=(4, -1))
    check("out", out, out_o)
    for name in "qkv":
        check(f"d{name}", grads[name], grads_o[name], atol=1e-4, rtol=1e-4)


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, tko.tanh(tl.load(x_ptr + offs)))


def test_softcap_tanh_is_accurate():
    """The kernels' fp32 tanh (attention_options.tanh, built from exp2: libdevice's does not
    run under the interpreter) within 4 ulps of tanh over small, large and saturated inputs."""
    x = torch.cat([torch.linspace(-30, 30, 2001), torch.logspace(-30, 0, 1000),  # 4096 in all
                   -torch.logspace(-8, 1, 1091), torch.tensor([0.0, 0.25, -0.25, 0.2499999])])
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, N=x.numel())
    exact = torch.tanh(x.double())
    ulps = (y.double() - exact).abs() / (torch.finfo(F32).eps * exact.abs().clamp_min(1e-38))
    assert ulps.max() <= 4, f"{float(ulps.max()):.2f} ulps at x = {float(x[ulps.argmax()])}"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("causal,Lq,Lk", [(False, 113, 70), ("bottom_right", 70, 113)])
def test_softcap(dtype, causal, Lq, Lk):
    q, k, v, dout = make_qkv(1, 2, 2, Lq, Lk, 64, dtype)
    compare_variants(q, k, v, dout, softcap=3.0, scale=0.5, causal=causal)  # |s| ~ 4: tanh bends


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("per_batch", [False, True], ids=["H", "BH"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_alibi(dtype, per_batch, causal):
    B, H, Lq, Lk = 2, 2, 70, 113
    q, k, v, dout = make_qkv(B, H, H, Lq, Lk, 40, dtype)
    g = torch.Generator().manual_seed(5)
    slopes = torch.rand((B, H) if per_batch else (H,), generator=g) * 0.5
    compare_variants(q, k, v, dout, alibi_slopes=slopes, causal=causal)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_sinks_with_fully_masked_rows(dtype):
    """Sinks with their gradient; batch 1 has every key padded and batch 0 query 5 every key
    masked: there out = 0 and lse = sink (ff.attention's return_lse)."""
    B, H, Lq, Lk = 2, 2, 70, 113
    q, k, v, dout = make_qkv(B, H, 1, Lq, Lk, 64, dtype)
    sinks = torch.tensor([0.5, -1.0])
    mask = torch.rand(B, 1, Lq, Lk, generator=torch.Generator().manual_seed(4)) < 0.8
    mask[0, :, 5] = False
    kw = dict(attn_mask=mask, key_padding_mask=padding_mask(B, Lk), causal="bottom_right")
    out, _ = compare_variants(q, k, v, dout, learned={"sinks": sinks}, **kw)
    empty = torch.zeros(B, H, Lq, dtype=torch.bool)
    empty[1], empty[0, :, 5] = True, True
    assert (out[empty] == 0).all()
    with ff.use_backend("triton"):
        _, lse = ff.attention(q, k, v, sinks=sinks, return_lse=True, **kw)
    assert torch.equal(lse[empty], sinks[None, :, None].expand(B, H, Lq)[empty])
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("causal,bidirectional,Lq,Lk",
                         [(False, True, 113, 70), ("bottom_right", False, 70, 113),
                          ("top_left", True, 70, 113)])
def test_bias_table(dtype, causal, bidirectional, Lq, Lk):
    """T5's bucketed bias (ff.RelativePositionBias) with its table's gradient; the decoder's
    table is a transposed view (strides (1, 32))."""
    H = 2
    q, k, v, dout = make_qkv(2, H, H, Lq, Lk, 64, dtype)
    table = torch.randn(H, 32, generator=torch.Generator().manual_seed(6)).t()
    if bidirectional:
        table = table.contiguous()
    compare_variants(q, k, v, dout, learned={"table": table}, bidirectional=bidirectional,
                     causal=causal)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("shape", ["heads_shared", "batch_shared", "2d", "full", "keys_shared"])
def test_learned_float_mask(dtype, shape):
    """A float mask that requires grad: d attn_mask in its own shape and dtype, dS summed over
    its broadcast dims (atomics; keys_shared: every key of a tile row adds into one element),
    or stored as is (no broadcast dim)."""
    B, H, Lq, Lk = 2, 2, 70, 113
    q, k, v, dout = make_qkv(B, H, H, Lq, Lk, 40, dtype)
    shapes = {"heads_shared": (1, H, Lq, Lk), "batch_shared": (B, 1, Lq, Lk), "2d": (Lq, Lk),
              "full": (B, H, Lq, Lk), "keys_shared": (B, H, Lq, 1)}
    mask = torch.randn(shapes[shape], generator=torch.Generator().manual_seed(7))
    mask = mask.to(dtype if dtype != F16 else F32)
    _, grads = compare_variants(q, k, v, dout, learned={"attn_mask": mask}, causal="bottom_right")
    assert grads["attn_mask"].shape == mask.shape and grads["attn_mask"].dtype == mask.dtype


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_every_option_with_gqa_and_dropout(small_blocks, dtype):
    B, H, Hkv, Lq, Lk, D, p = 2, 4, 2, 70, 113, 40, 0.2
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, dtype)
    g = torch.Generator().manual_seed(8)
    learned = {"sinks": torch.randn(H, generator=g), "table": torch.randn(16, H, generator=g),
               "attn_mask": torch.randn(1, H, Lq, Lk, generator=g).to(dtype)}
    kw = dict(causal="bottom_right", window=(30, 0), softcap=8.0, dropout_p=p,
              alibi_slopes=torch.rand(B, H, generator=g) * 0.1,
              key_padding_mask=padding_mask(B, Lk))
    torch.manual_seed(7)
    keep = dropout_keep_mask(draw_rng_state(), (B, H, Lq, Lk), p)
    torch.manual_seed(7)
    compare_variants(q, k, v, dout, learned=learned, keep=keep, **kw)


def test_variants_on_the_custom_op_route(monkeypatch):
    """FASTFORMER_EAGER_VIA_OPS=1: the option gradients come back through the custom ops."""
    q, k, v, dout = make_qkv(1, 2, 1, 17, 40, 16, F32)
    g = torch.Generator().manual_seed(9)
    learned = {"sinks": torch.randn(2, generator=g), "table": torch.randn(8, 2, generator=g),
               "attn_mask": torch.randn(17, 40, generator=g)}
    kw = dict(causal="bottom_right", window=(6, 2), softcap=5.0, alibi_slopes=torch.rand(2))
    eager_route = _run_variants(_triton_variants, q, k, v, dout, learned, **kw)
    monkeypatch.setenv("FASTFORMER_EAGER_VIA_OPS", "1")
    ff.backends.reload_env()
    try:
        op_route = _run_variants(_triton_variants, q, k, v, dout, learned, **kw)
    finally:
        monkeypatch.delenv("FASTFORMER_EAGER_VIA_OPS")
        ff.backends.reload_env()
    assert torch.equal(eager_route[0], op_route[0])
    for name, grad in eager_route[1].items():
        torch.testing.assert_close(op_route[1][name], grad, atol=1e-6, rtol=1e-6)  # atomics
