"""Triton flash attention, forward and backward, under Triton's interpreter vs eager PyTorch.

Every test forces the triton backend (conftest sets TRITON_INTERPRET=1, so it runs on CPU
tensors). Oracle (ARCHITECTURE.md, "Numerical policy"): eager PyTorch autograd in fp64 for fp32
inputs (forward atol=rtol=1e-5, gradients 1e-4) and in fp32 for fp16/bf16 inputs, which follow
the error-ratio rule against eager PyTorch in the same dtype (tests/oracle.py). The interpreter
costs milliseconds per program, so batch and heads stay small and its blocks are 128 wide; the
causal and window tests shrink the blocks to walk the many-block paths that GPUs take. The
score variants (window, softcap, ALiBi, sinks, the T5 bias table, learned float masks) have
their own eager oracle, eager_variants, independent of fastformer.reference, and are checked
on the gradients of the sinks, the table and the mask too. A value head dim Dv != D (MLA) runs
through the plain, variant and packed paths. The `gpu` tests at the end run the
compiled kernels on CUDA tensors (TRITON_INTERPRET=0, benchmarks/gpu_check.sh).
"""
import itertools
import math

import pytest
import torch
from attention_oracle import rising_score_inputs
from oracle import check, row_sum_tol

import fastformer as ff
from fastformer.ops import attention_triton
from fastformer.ops.attention import ATTENTION, AttentionOptions, dropout_keep_mask
from fastformer.reference.rng import draw_rng_state

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
tk = pytest.importorskip("fastformer.triton_kernels.attention")
tko = pytest.importorskip("fastformer.triton_kernels.attention_options")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = [F32, F16, BF16]


# ---- oracle ----------------------------------------------------------------------------------
def eager_attention(q, k, v, *, causal=False, key_padding_mask=None, attn_mask=None, scale=None,
                    dropout_p=0.0, keep=None):
    """Attention as a PyTorch user writes it, in q's dtype; rows with no allowed key give 0."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, 1)
    v = v.repeat_interleave(H // Hkv, 1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool, device=q.device)
    if causal:
        shift = Lk - Lq if causal == "bottom_right" else 0
        i, j = torch.arange(Lq, device=q.device), torch.arange(Lk, device=q.device)
        allowed &= j[None, :] <= i[:, None] + shift
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed &= attn_mask
    elif attn_mask is not None:
        s = s + attn_mask.to(s.dtype)
    if key_padding_mask is not None:
        allowed &= ~key_padding_mask[:, None, None, :]
    s = s.masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    if keep is not None:
        p = p * keep.to(p.device, p.dtype) / (1.0 - dropout_p)
    return p @ v


def _run(fn, q, k, v, dout, **kw):
    """Forward + backward with upstream grad dout; returns (out, (dq, dk, dv))."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves, **kw)
    return out.detach(), torch.autograd.grad(out, leaves, dout)


def run_triton(q, k, v, dout, **kw):
    """ff.attention forward + backward on the triton backend (kw: its keywords)."""
    with ff.use_backend("triton"):
        out, grads = _run(ff.attention, q, k, v, dout, **kw)
    assert ff.last_dispatch().backend == "triton"
    return out, grads


def triton_forward(q, k, v, **kw):
    with ff.use_backend("triton"):
        return ff.attention(q, k, v, **kw)


def compare(q, k, v, dout, **kw):
    """Ours vs the oracle (and vs eager in the same dtype for fp16/bf16); returns ours."""
    dtype = q.dtype
    out, grads = run_triton(q, k, v, dout, **{n: a for n, a in kw.items() if n != "keep"})
    oracle_dtype = torch.float64 if dtype == F32 else F32
    up = {n: (a.to(oracle_dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a)
          for n, a in kw.items()}
    out_o, grads_o = _run(eager_attention, *(t.to(oracle_dtype) for t in (q, k, v, dout)), **up)
    out_l, grads_l = (None, (None,) * 3)
    if dtype != F32:
        out_l, grads_l = _run(eager_attention, q, k, v, dout, **kw)
    check("out", out, out_o, out_l)
    for name, g, g_o, g_l in zip(("dq", "dk", "dv"), grads, grads_o, grads_l):
        check(name, g, g_o, g_l, grad=True, atol=1e-4, rtol=1e-4)
    return out, grads


def make_qkv(B, H, Hkv, Lq, Lk, D, dtype, seed=0, device="cpu", Dv=None):
    """q, k (..., D) and v, dout (..., Dv); Dv defaults to D."""
    Dv = D if Dv is None else Dv
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    return mk(B, H, Lq, D), mk(B, Hkv, Lk, D), mk(B, Hkv, Lk, Dv), mk(B, H, Lq, Dv)


def padding_mask(B, Lk, seed=1, device="cpu"):
    """30% of the keys padded at random; in batch 1 (if any), every key."""
    g = torch.Generator().manual_seed(seed)
    kpm = torch.rand(B, Lk, generator=g) < 0.3
    if B > 1:
        kpm[1] = True
    return kpm.to(device)


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


# ---- score variants: window, softcap, ALiBi, sinks, T5 bias table, learned masks --------------
def eager_variants(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None,
                   sinks=None, bias=None, attn_mask=None, key_padding_mask=None, scale=None,
                   dropout_p=0.0, keep=None):
    """The variants as a PyTorch user writes them, in q's dtype, independent of
    fastformer.reference: window and ALiBi from index arithmetic (aligned to d = Lk - Lq for
    bottom-right causality, else 0), the T5 bias gathered into an (H, Lq, Lk) tensor from
    bias = (table, buckets), sinks as one more key column whose probability is dropped (as
    Hugging Face's gpt-oss eager attention). Option tensors are cast to q's dtype (a
    differentiable cast). Rows with no allowed key and no sink give 0."""
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, 1)
    v = v.repeat_interleave(H // Hkv, 1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(Lq, device=q.device)[:, None], torch.arange(Lk, device=q.device)[None, :]
    rel = j - i - (Lk - Lq if causal == "bottom_right" else 0)   # key - query - d
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype)
        slopes = slopes[None, :, None, None] if slopes.dim() == 1 else slopes[:, :, None, None]
        s = s - slopes * rel.abs().to(s.dtype)
    if bias is not None:
        table, buckets = bias
        s = s + table.to(s.dtype)[buckets.long()[j - i + Lq - 1]].permute(2, 0, 1)
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool, device=q.device)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        allowed &= attn_mask
    elif attn_mask is not None:
        s = s + attn_mask.to(s.dtype)
    if key_padding_mask is not None:
        allowed &= ~key_padding_mask[:, None, None, :]
    left, right = (-1, -1) if window is None else window
    if causal:
        allowed &= rel <= 0
    if left >= 0:
        allowed &= rel >= -left
    if right >= 0:
        allowed &= rel <= right
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.to(s.dtype).reshape(1, H, 1, 1).expand(B, H, Lq, 1)
        p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    else:
        empty = torch.isneginf(s).all(-1, keepdim=True)
        p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    if keep is not None:
        p = p * keep.to(p.device, p.dtype) / (1.0 - dropout_p)
    return p @ v


def _run_variants(fn, q, k, v, dout, learned, **kw):
    """Forward + backward of fn(q, k, v, **learned, **kw); learned: the float tensors whose
    gradients are checked. Returns (out, {name: grad} for q, k, v and each learned tensor)."""
    leaves = {n: t.detach().clone().requires_grad_(True)
              for n, t in (("q", q), ("k", k), ("v", v), *learned.items())}
    out = fn(leaves["q"], leaves["k"], leaves["v"],
             **{n: t for n, t in leaves.items() if n not in "qkv"}, **kw)
    grads = torch.autograd.grad(out, list(leaves.values()), dout)
    return out.detach(), dict(zip(leaves, grads))


def _triton_variants(q, k, v, *, table=None, bidirectional=True, **kw):
    """ff.attention on the triton backend; table: a T5 bias table (ff.RelativePositionBias)."""
    if table is not None:
        kw["position_bias"] = ff.RelativePositionBias(table, bidirectional=bidirectional)
    with ff.use_backend("triton"):
        out = ff.attention(q, k, v, **kw)
    assert ff.last_dispatch().backend == "triton", ff.last_dispatch()
    return out


def _oracle_variants(q, k, v, *, table=None, bidirectional=True, **kw):
    if table is not None:
        Lq, Lk = q.shape[2], k.shape[2]
        d = Lk - Lq if kw.get("causal") == "bottom_right" else 0
        position_bias = ff.RelativePositionBias(table.detach(), bidirectional=bidirectional)
        buckets = position_bias.buckets(Lq, Lk, d)
        kw["bias"] = (table, buckets)
    return eager_variants(q, k, v, **kw)


def compare_variants(q, k, v, dout, *, learned=(), opt_tol=1e-4, **kw):
    """Ours vs the oracle (fp64 for fp32, fp32 for fp16/bf16, and eager in the same low
    precision for the ratio rule) on out, dq, dk, dv and the gradient of every tensor in
    `learned` (sinks, table, attn_mask); kw: the other keywords (keep: the dropout mask for the
    oracle, not passed to ours). Returns ours."""
    learned = dict(learned)
    ours_kw = {n: a for n, a in kw.items() if n != "keep"}
    out, grads = _run_variants(_triton_variants, q, k, v, dout, learned, **ours_kw)
    oracle_dtype = torch.float64 if q.dtype == F32 else F32
    def up(a):
        return a.to(oracle_dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
    out_o, grads_o = _run_variants(_oracle_variants, *(up(t) for t in (q, k, v, dout)),
                                   {n: up(t) for n, t in learned.items()},
                                   **{n: up(a) for n, a in kw.items()})
    out_l, grads_l = None, dict.fromkeys(grads)
    if q.dtype != F32:
        out_l, grads_l = _run_variants(_oracle_variants, q, k, v, dout, learned, **kw)
    check("out", out, out_o, out_l)
    for name in grads:
        tol = 1e-4 if name in "qkv" else opt_tol
        check(f"d{name}", grads[name], grads_o[name], grads_l[name], grad=True, atol=tol, rtol=tol)
    return out, grads


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 and 32 (mixed, as GPU configs): a band then cuts several blocks per row
    block, and whole blocks fall outside it."""
    monkeypatch.setitem(tk.INTERPRETER_CONFIGS, "fwd", dict(BLOCK_M=32, BLOCK_N=16))
    monkeypatch.setitem(tk.INTERPRETER_CONFIGS, "dkdv", dict(BLOCK_M=16, BLOCK_N=32))
    monkeypatch.setitem(tk.INTERPRETER_CONFIGS, "dq", dict(BLOCK_M=32, BLOCK_N=16))


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
