"""The oracles and runners of the Triton attention tests (test_attention_triton.py: shapes,
masks, GQA, dropout, Dv != D, the GPU runs; test_attention_triton_variants.py: the score
variants). eager_attention and eager_variants are attention as a PyTorch user writes it,
independent of fastformer.reference; compare / compare_variants run ff.attention on the triton
backend and check the output and every gradient against them (tests/oracle.py's policy)."""
import math

import pytest
import torch
from oracle import check

import fastformer as ff

tk = pytest.importorskip("fastformer.triton_kernels.attention")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _expanded_values_and_scores(q, k, v, scale):
    """GQA's k / v heads repeated to q's, and the scaled scores q k^T (scale None: 1/sqrt(D))."""
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
    k = k.repeat_interleave(H // Hkv, 1)
    v = v.repeat_interleave(H // Hkv, 1)
    return v, (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D) if scale is None else scale)


def eager_attention(q, k, v, *, causal=False, key_padding_mask=None, attn_mask=None, scale=None,
                    dropout_p=0.0, keep=None):
    """Attention as a PyTorch user writes it, in q's dtype; rows with no allowed key give 0."""
    B, H, Lq = q.shape[:3]
    Lk = k.shape[2]
    v, s = _expanded_values_and_scores(q, k, v, scale)
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


def eager_variants(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None,
                   sinks=None, bias=None, attn_mask=None, key_padding_mask=None, scale=None,
                   dropout_p=0.0, keep=None):
    """The variants as a PyTorch user writes them, in q's dtype, independent of
    fastformer.reference: window and ALiBi from index arithmetic (aligned to d = Lk - Lq for
    bottom-right causality, else 0), the T5 bias gathered into an (H, Lq, Lk) tensor from
    bias = (table, buckets), sinks as one more key column whose probability is dropped (as
    Hugging Face's gpt-oss eager attention). Option tensors are cast to q's dtype (a
    differentiable cast). Rows with no allowed key and no sink give 0."""
    B, H, Lq = q.shape[:3]
    Lk = k.shape[2]
    v, s = _expanded_values_and_scores(q, k, v, scale)
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
