"""Triton flash attention, forward and backward, under Triton's interpreter vs eager PyTorch.

Every test forces the triton backend (conftest sets TRITON_INTERPRET=1, so it runs on CPU
tensors). Oracle (ARCHITECTURE.md, "Numerical policy"): eager PyTorch autograd in fp64 for fp32
inputs (forward atol=rtol=1e-5, gradients 1e-4) and in fp32 for fp16/bf16 inputs, which follow
the error-ratio rule against eager PyTorch in the same dtype (tests/oracle.py). The interpreter
costs milliseconds per program, so batch and heads stay small and its blocks are 128 wide; the
causal tests shrink the blocks to walk the many-block paths that GPUs take. The score
variants (window, softcap, ALiBi, sinks, the T5 bias table, learned float masks):
test_attention_triton_variants.py; the oracles of both: triton_attention_oracle.py. A value
head dim Dv != D (MLA) runs through the plain, variant and packed paths. The `gpu` tests at the
end run the compiled kernels on CUDA tensors (TRITON_INTERPRET=0, benchmarks/gpu_check.sh).
"""
import itertools

import pytest
import torch
from attention_oracle import rising_score_inputs
from oracle import check, row_sum_tol
from triton_attention_oracle import (BF16, F16, F32, compare, compare_variants, eager_variants,
                                     make_qkv, padding_mask, run_triton, triton_forward)
from triton_attention_oracle import small_blocks  # noqa: F401 (a fixture)

import fastformer as ff
from fastformer.ops import attention_triton
from fastformer.ops.attention import ATTENTION, AttentionOptions, dropout_keep_mask
from fastformer.reference.rng import draw_rng_state

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
tk = pytest.importorskip("fastformer.triton_kernels.attention")
tko = pytest.importorskip("fastformer.triton_kernels.attention_options")

DTYPES = [F32, F16, BF16]


# ---- shapes, dtypes, causal alignments -------------------------------------------------------
# (B, H, Hkv, Lq, Lk, D, causal, scale): each length pair and head dim with several causal modes.
CASES = [
    (1, 2, 2, 113, 203, 64, False, None),
    (1, 2, 2, 203, 113, 40, False, 0.3),
    (2, 2, 2, 1, 1, 64, False, None),
    (2, 1, 1, 1, 1, 40, True, None),
    (2, 2, 2, 17, 17, 80, False, None),
    (1, 2, 2, 17, 17, 128, True, 0.05),
    (1, 2, 2, 113, 203, 80, "top_left", None),
    (1, 2, 2, 203, 113, 128, "top_left", None),
    (1, 2, 2, 113, 203, 40, "bottom_right", 0.2),
    (1, 2, 2, 203, 113, 64, "bottom_right", None),  # query rows 0..89 see no key
    (1, 1, 1, 1, 203, 128, "bottom_right", None),   # one decoding step over a KV cache
    (1, 1, 1, 250, 250, 64, True, None),            # full (unmasked) blocks left of the diagonal
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,Hkv,Lq,Lk,D,causal,scale", CASES)
def test_matches_eager(B, H, Hkv, Lq, Lk, D, causal, scale, dtype):
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, dtype)
    compare(q, k, v, dout, causal=causal, scale=scale)


@pytest.mark.parametrize("jump", [14.0, 100.0])
def test_large_scores_rising_between_key_blocks(jump):
    """Scores around 0, jump and 2 * jump over three 128-key blocks (exact in fp32, see
    rising_score_inputs): the online softmax rescales at magnitudes where fp32 rounding of the
    scaled scores matters, and the backward must recompute P as the forward computed it."""
    q, k, v, dout = rising_score_inputs(jump)
    compare(q, k, v, dout, scale=1.0)


@pytest.mark.parametrize("causal", ["top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(113, 203), (203, 113)])
def test_causal_with_small_mixed_blocks(monkeypatch, Lq, Lk, causal):
    """GPU configs pair different BLOCK_M and BLOCK_N: walk the diagonal with many of them."""
    monkeypatch.setitem(tk.INTERPRETER_CONFIGS, "fwd", dict(BLOCK_M=32, BLOCK_N=16))
    monkeypatch.setitem(tk.INTERPRETER_CONFIGS, "dkdv", dict(BLOCK_M=16, BLOCK_N=64))
    monkeypatch.setitem(tk.INTERPRETER_CONFIGS, "dq", dict(BLOCK_M=64, BLOCK_N=32))
    q, k, v, dout = make_qkv(1, 1, 1, Lq, Lk, 16, F32)
    compare(q, k, v, dout, causal=causal, key_padding_mask=padding_mask(1, Lk))


# ---- masks -----------------------------------------------------------------------------------
def attn_mask(kind, B, H, Lq, Lk, dtype, seed=2):
    """A mask of `kind` (its broadcast shape in the name); float masks hold some -inf."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"batch": (1, H, Lq, Lk), "heads": (B, 1, Lq, Lk), "2d": (Lq, Lk),
              "rows": (B, H, Lq, 1)}
    is_bool, where = kind.split("_")
    shape = shapes[where]
    if is_bool == "bool":  # "rows": each query row attends to every key or to none
        return torch.rand(shape, generator=g) < (0.5 if where == "rows" else 0.7)
    m = torch.randn(shape, generator=g) * 2
    m = m.masked_fill(torch.rand(shape, generator=g) < 0.2, float("-inf"))
    return m.to(dtype)


MASKS = ["bool_batch", "bool_heads", "bool_2d", "bool_rows", "float_batch", "float_heads",
         "float_2d"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", MASKS)
def test_attn_mask(kind, dtype):
    B, H, Lq, Lk, D = 2, 2, 113, 203, 64
    q, k, v, dout = make_qkv(B, H, H, Lq, Lk, D, dtype)
    mask = attn_mask(kind, B, H, Lq, Lk, dtype if dtype != F16 else F32)
    compare(q, k, v, dout, attn_mask=mask, causal="bottom_right" if kind == "float_2d" else False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, "top_left"])
def test_key_padding_mask(dtype, causal):
    B, H, Lq, Lk, D = 2, 2, 203, 113, 80
    q, k, v, dout = make_qkv(B, H, H, Lq, Lk, D, dtype)
    compare(q, k, v, dout, key_padding_mask=padding_mask(B, Lk), causal=causal)


def test_fully_masked_rows_give_zeros_and_zero_grads():
    B, H, Lq, Lk, D = 2, 2, 203, 113, 40
    q, k, v, dout = make_qkv(B, H, H, Lq, Lk, D, F32)
    kpm = padding_mask(B, Lk)                      # batch 1: every key padded
    mask = torch.rand(B, 1, Lq, Lk) < 0.8
    mask[0, :, 5] = False                          # batch 0, query 5: every key masked
    out, (dq, dk, dv) = compare(q, k, v, dout, key_padding_mask=kpm, attn_mask=mask,
                                causal="bottom_right")  # batch 0, queries 0..89: no key
    causal = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)
    empty = ~(mask & causal & ~kpm[:, None, None, :]).any(-1).expand(B, H, Lq)
    assert empty[1].all() and empty[0, :, 5].all() and empty[0, :, :Lq - Lk].all()
    for name, t in (("out", out), ("dq", dq)):
        assert torch.isfinite(t).all(), name
        assert (t[empty] == 0).all(), f"{name} is not 0 on fully masked rows"
    assert (dk[1] == 0).all() and (dv[1] == 0).all(), "padded keys must get zero grads"
    _, lse = attention_triton.attention_fwd(q, k, v, AttentionOptions(
        causal=2, attn_mask=mask.expand(B, H, Lq, Lk), key_padding_mask=kpm))
    assert torch.isposinf(lse[empty]).all() and torch.isfinite(lse[~empty]).all()


# ---- GQA / MQA, layouts, the custom-op route -------------------------------------------------
@pytest.mark.parametrize("H,Hkv,dtype", [(8, 2, F32), (8, 2, BF16), (4, 1, F16)], ids=str)
def test_grouped_and_multi_query(H, Hkv, dtype):
    B, Lq, Lk, D = 1, 113, 203, 64
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, dtype)
    compare(q, k, v, dout, causal="bottom_right", key_padding_mask=padding_mask(B, Lk, seed=3))


@pytest.mark.parametrize("grad_layout", ["heads_major", "last_dim_strided"])
def test_strided_inputs_and_grad(grad_layout):
    """(B, L, H, D) activations viewed as (B, H, L, D), and a non-contiguous upstream grad."""
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 113, 113, 64
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, F32)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    if grad_layout == "heads_major":
        dout = dout.transpose(1, 2).contiguous().transpose(1, 2)
    else:
        dout = dout.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not q.is_contiguous() and not dout.is_contiguous()
    out, _ = compare(q, k, v, dout, causal=True)
    assert out.transpose(1, 2).is_contiguous()  # stored (B, Lq, H, D), as _out_like says


def test_custom_op_route(monkeypatch):
    """FASTFORMER_EAGER_VIA_OPS=1: torch.ops.fastformer.attention_fwd/bwd run the same kernels."""
    q, k, v, dout = make_qkv(1, 2, 1, 17, 113, 40, F32)
    eager_route = run_triton(q, k, v, dout, causal="bottom_right")
    monkeypatch.setenv("FASTFORMER_EAGER_VIA_OPS", "1")
    ff.backends.reload_env()
    try:
        op_route = run_triton(q, k, v, dout, causal="bottom_right")
    finally:
        monkeypatch.delenv("FASTFORMER_EAGER_VIA_OPS")
        ff.backends.reload_env()
    assert torch.equal(eager_route[0], op_route[0])
    for a, b in zip(eager_route[1], op_route[1]):
        assert torch.equal(a, b)


# ---- dropout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.4, 0.7])  # thresholds below and above 2**31
def test_dropout_mask_is_the_reference_rng_bit_for_bit(p):
    """With v = I the output is P * keep / (1 - p): its zeros are the kernel's dropped entries.
    The offset starts just below 2**32, so counters carry into the high Philox word."""
    B, H, L = 2, 3, 64
    q, k, _, _ = make_qkv(B, H, H, L, L, L, F32)
    v = torch.eye(L).expand(B, H, L, L)
    rng_state = torch.tensor([2**40 + 12345, 2**32 - 5000], dtype=torch.int64)
    out, _ = attention_triton.attention_fwd(q * 0.1, k, v, AttentionOptions(
        scale=0.125, dropout_p=p, rng_state=rng_state))
    keep = dropout_keep_mask(rng_state, (B, H, L, L), p)
    assert torch.equal(out != 0, keep)
    assert abs(keep.float().mean() - (1 - p)) < 0.05


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_dropout_reproducible_and_matches_eager_with_its_mask(dtype):
    B, H, Hkv, Lq, Lk, D, p = 2, 2, 1, 113, 203, 64, 0.3  # GQA: the counter uses query heads
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, dtype)
    kw = dict(causal="bottom_right", key_padding_mask=padding_mask(B, Lk), dropout_p=p)
    torch.manual_seed(7)
    out = triton_forward(q, k, v, **kw)
    torch.manual_seed(7)
    assert torch.equal(out, triton_forward(q, k, v, **kw)), "same RNG state, same output"
    assert not torch.equal(out, triton_forward(q, k, v, **kw)), "the next call draws a new mask"

    torch.manual_seed(7)
    keep = dropout_keep_mask(draw_rng_state(), (B, H, Lq, Lk), p)
    torch.manual_seed(7)
    compare(q, k, v, dout, keep=keep, **kw)


# ---- value head dim Dv != D (MLA) ------------------------------------------------------------
# q, k (..., D), v, out (..., Dv): the kernels take both head dims (HEAD_DIM / BLOCK_D and
# HEAD_DIM_V / BLOCK_DV), Dv below and above D, each padded to its own power of two in the tile.
# (B, H, Hkv, Lq, Lk, D, Dv, causal)
DV_CASES = [
    (1, 2, 2, 113, 203, 40, 72, False),
    (1, 4, 2, 203, 113, 48, 32, "top_left"),        # GQA
    (2, 2, 1, 70, 113, 24, 80, "bottom_right"),     # MQA
    (1, 2, 1, 17, 30, 192, 128, "bottom_right"),    # DeepSeek-V2/V3's MLA dims
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("B,H,Hkv,Lq,Lk,D,Dv,causal", DV_CASES)
def test_value_head_dim_differs(B, H, Hkv, Lq, Lk, D, Dv, causal, dtype):
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, dtype, Dv=Dv)
    out, (dq, dk, dv) = compare(q, k, v, dout, causal=causal)  # asserts the triton dispatch
    assert out.shape == (B, H, Lq, Dv) and dq.shape == q.shape
    assert dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("D,Dv", [(24, 80), (48, 32)])
def test_value_head_dim_differs_with_variants(small_blocks, D, Dv, dtype):
    """A causal window, GQA, and the option gradients (sinks, a learned float mask, the T5
    table) with Dv != D: the dQ kernel's dO V^T is Dv deep, its option gradients and dS K D
    wide."""
    B, H, Hkv, Lq, Lk = 2, 4, 2, 70, 113
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, dtype, Dv=Dv)
    g = torch.Generator().manual_seed(10)
    learned = {"sinks": torch.randn(H, generator=g), "table": torch.randn(16, H, generator=g),
               "attn_mask": torch.randn(1, H, Lq, Lk, generator=g).to(dtype)}
    compare_variants(q, k, v, dout, learned=learned, causal="bottom_right", window=(30, 0),
                     softcap=8.0, key_padding_mask=padding_mask(B, Lk))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("D,Dv", [(40, 72), (48, 32)])
def test_value_head_dim_differs_varlen(small_blocks, D, Dv, dtype):
    """Packed sequences (ff.varlen_attention), causal (bottom-right per sequence) with sinks,
    GQA: each sequence against eager_variants alone, out (total_q, H, Dv)."""
    q_lens, k_lens, H, Hkv = [17, 90, 1, 0], [30, 90, 1, 5], 4, 2
    g = torch.Generator().manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    Tq, Tk = sum(q_lens), sum(k_lens)
    q, k, v, dout = mk(Tq, H, D), mk(Tk, Hkv, D), mk(Tk, Hkv, Dv), mk(Tq, H, Dv)
    sinks = torch.randn(H, generator=g)
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32)
                  for n in (q_lens, k_lens))

    def ours(q, k, v, sinks):
        with ff.use_backend("triton"):
            out = ff.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=True,
                                      sinks=sinks)
        assert ff.last_dispatch().backend == "triton", ff.last_dispatch()
        return out

    def oracle(q, k, v, sinks):
        heads = lambda t: t.transpose(0, 1)[None]  # noqa: E731  (L, H, D) -> (1, H, L, D)
        outs = []
        for qs, ks, vs in zip(q.split(q_lens), k.split(k_lens), v.split(k_lens)):
            out = eager_variants(heads(qs), heads(ks), heads(vs), causal="bottom_right",
                                 sinks=sinks)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)

    def run(fn, *t):
        leaves = [x.detach().clone().requires_grad_(True) for x in t]
        out = fn(*leaves)
        return out.detach(), torch.autograd.grad(out, leaves, dout.to(out.dtype))

    out, grads = run(ours, q, k, v, sinks)
    assert out.shape == (Tq, H, Dv)
    up = torch.float64 if dtype == F32 else F32
    out_o, grads_o = run(oracle, *(t.to(up) for t in (q, k, v, sinks)))
    out_l, grads_l = (None, (None,) * 4)
    if dtype != F32:
        out_l, grads_l = run(oracle, q, k, v, sinks)
    check("out", out, out_o, out_l)
    for name, a, b, c in zip(("dq", "dk", "dv", "dsinks"), grads, grads_o, grads_l):
        check(name, a, b, c, grad=True, atol=1e-4, rtol=1e-4)


def test_value_head_dim_outside_the_kernels_range_is_declined():
    """Dv outside 16..256 never reaches the kernels: the triton impl declines, naming Dv."""
    (impl,) = ff.backends.implementations("attention", "triton")
    for Dv in (8, 264):
        q, k, v, _ = make_qkv(1, 2, 2, 5, 7, 64, F32, Dv=Dv)
        why = impl.reasons(ATTENTION.call((q, k, v), AttentionOptions()))
        assert any("Dv" in w and str(Dv) in w for w in why), why
        with ff.use_backend("triton"), pytest.raises(ValueError, match="Dv"):
            ff.attention(q, k, v)
    q, k, v, _ = make_qkv(1, 2, 2, 5, 7, 64, F32, Dv=16)
    assert impl.reasons(ATTENTION.call((q, k, v), AttentionOptions())) == []


# ---- the compiled kernels on a GPU -----------------------------------------------------------
# `TRITON_INTERPRET=0 pytest -m gpu tests` (benchmarks/gpu_check.sh): with the interpreter on,
# triton would interpret these too, so they skip. One fixed config per kernel (its first GPU
# config, mixed BLOCK_M/BLOCK_N) instead of autotuning: each variant compiles once.
@pytest.fixture
def cuda_compiled(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if tk.interpreter_mode():
        pytest.skip("TRITON_INTERPRET=1 interprets the kernels; run with TRITON_INTERPRET=0")
    monkeypatch.setattr(tk, "kernel_and_config", tk.fixed_config)
    return "cuda"


GPU_CASES = [  # (B, H, Hkv, Lq, Lk, D, causal, dtype)
    (2, 4, 4, 1024, 1024, 128, True, BF16),
    (2, 4, 2, 113, 203, 80, "bottom_right", BF16),
    (1, 4, 4, 203, 113, 64, False, BF16),
    (2, 2, 2, 257, 257, 40, "top_left", F16),
    (1, 2, 1, 300, 200, 64, "bottom_right", F32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,Hkv,Lq,Lk,D,causal,dtype", GPU_CASES, ids=str)
def test_gpu_matches_eager(cuda_compiled, B, H, Hkv, Lq, Lk, D, causal, dtype):
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, dtype, device=cuda_compiled)
    compare(q, k, v, dout, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,Hkv,Lq,Lk,D,Dv,causal,dtype", [
    (2, 8, 2, 300, 411, 192, 128, "bottom_right", BF16),  # DeepSeek-V2/V3's MLA dims
    (1, 4, 2, 203, 113, 40, 72, False, F32),
], ids=str)
def test_gpu_value_head_dim_differs(cuda_compiled, B, H, Hkv, Lq, Lk, D, Dv, causal, dtype):
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, dtype, device=cuda_compiled, Dv=Dv)
    compare(q, k, v, dout, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_gpu_masks_and_gqa(cuda_compiled, dtype):
    B, H, Hkv, Lq, Lk, D = 2, 8, 2, 300, 411, 128
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, dtype, device=cuda_compiled)
    kind = "bool_batch" if dtype == BF16 else "float_heads"
    mask = attn_mask(kind, B, H, Lq, Lk, F32).to(cuda_compiled)
    compare(q, k, v, dout, attn_mask=mask, causal="bottom_right",
            key_padding_mask=padding_mask(B, Lk, device=cuda_compiled))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_gpu_variants(cuda_compiled, dtype):
    """Window, softcap, ALiBi, sinks, the T5 table and a learned mask together (fp32 atomics
    for the table and the broadcast mask's gradients), GQA, Lq != Lk."""
    B, H, Hkv, Lq, Lk, D = 2, 8, 2, 300, 411, 128 if dtype == BF16 else 64
    dev = cuda_compiled
    q, k, v, dout = make_qkv(B, H, Hkv, Lq, Lk, D, dtype, device=dev)
    g = torch.Generator().manual_seed(8)
    learned = {"sinks": torch.randn(H, generator=g).to(dev),
               "table": torch.randn(32, H, generator=g).to(dev),
               "attn_mask": torch.randn(1, H, Lq, Lk, generator=g).to(dev, dtype)}
    compare_variants(q, k, v, dout, learned=learned, window=(100, 20),
                     softcap=10.0, alibi_slopes=(torch.rand(H, generator=g) * 0.05).to(dev),
                     opt_tol=row_sum_tol(1e-4, B * Lq))


@pytest.mark.gpu
def test_gpu_dropout(cuda_compiled):
    B, H, L, p = 2, 3, 64, 0.4
    q, k, _, _ = make_qkv(B, H, H, L, L, L, F32, device=cuda_compiled)
    v = torch.eye(L, device=cuda_compiled).expand(B, H, L, L)
    rng_state = torch.tensor([2**40 + 12345, 2**32 - 5000], dtype=torch.int64)
    out, _ = attention_triton.attention_fwd(q * 0.1, k, v, AttentionOptions(
        scale=0.125, dropout_p=p, rng_state=rng_state))
    assert torch.equal((out != 0).cpu(), dropout_keep_mask(rng_state, (B, H, L, L), p))

    q, k, v, dout = make_qkv(2, 4, 2, 300, 200, 64, BF16, device=cuda_compiled)
    kw = dict(causal="bottom_right", dropout_p=0.2)
    torch.manual_seed(3)
    keep = dropout_keep_mask(draw_rng_state(), (2, 4, 300, 200), 0.2)
    torch.manual_seed(3)
    compare(q, k, v, dout, keep=keep, **kw)
