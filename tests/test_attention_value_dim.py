"""A value head dim Dv different from the query/key head dim D (multi-head latent attention:
DeepSeek-V2/V3 and Kimi-K2 attend with D = 192 and Dv = 128): q, k (..., D), v (..., Dv), out
(..., Dv). The cpu kernels take it in every path (flash forward and backward, the bf16 GEMMs,
packed sequences, the decoding kernel with contiguous and paged caches); each against the eager
oracle of tests/attention_oracle.py by the numerical policy (fp32 against fp64 at 1e-5 / 1e-4,
bf16 by the error-ratio rule), with an option in play where the kernels branch on it. The
Hugging Face DeepSeek-V3 model: tests/test_convert_hf.py.
"""
import pytest
import torch
from attention_oracle import BF16_GEMMS, bf16_attention_gemm, oracle_attention, oracle_grads, run
from oracle import check

import fastformer as ff

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
BACKENDS = ["cpu", "reference"]

# (Lq, Lk, D, Dv, (H, Hkv), causal): Dv below and above D, odd lengths, MHA / GQA / MQA.
CASES = [(113, 203, 192, 128, (4, 4), False), (203, 113, 40, 72, (8, 2), "top_left"),
         (17, 17, 24, 16, (2, 1), "bottom_right"), (1, 239, 128, 64, (4, 4), False),
         (128, 128, 16, 80, (8, 1), "top_left"), (45, 37, 72, 40, (2, 2), "bottom_right")]
IDS = [f"{c[0]}x{c[1]}-d{c[2]}-dv{c[3]}-{c[5]}" for c in CASES]


def _inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=F64).to(dtype)  # noqa: E731
    return mk(B, H, Lq, D), mk(B, Hkv, Lk, D), mk(B, Hkv, Lk, Dv), mk(B, H, Lq, Dv)


def _compare(backend, q, k, v, go, **kw):
    with ff.use_backend(backend):
        ours = run(lambda *t, **o: ff.attention(*t, **o), q, k, v, go, **kw)
        assert ff.last_dispatch().backend == backend, str(ff.last_dispatch())
    assert ours[0].shape == q.shape[:3] + v.shape[3:]
    oracle = oracle_grads(q, k, v, go, **kw)
    lowp = run(oracle_attention, q, k, v, go, **kw) if q.dtype == BF16 else [None] * 4
    for name, o, r, low in zip(("out", "dq", "dk", "dv"), ours, oracle, lowp):
        grad = name != "out"
        check(name, o, r, low, grad=grad, atol=1e-4 if grad else 1e-5, rtol=1e-4 if grad else 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("lq,lk,d,dv,heads,causal", CASES, ids=IDS)
def test_value_head_dim_differs(backend, dtype, lq, lk, d, dv, heads, causal):
    q, k, v, go = _inputs(2, *heads, lq, lk, d, dv, dtype)
    _compare(backend, q, k, v, go, causal=causal)


@pytest.mark.parametrize("gemm", BF16_GEMMS)
@pytest.mark.parametrize("lq,lk,d,dv,heads,causal", CASES[:3], ids=IDS[:3])
def test_value_head_dim_differs_bf16_gemm_paths(gemm, lq, lk, d, dv, heads, causal):
    """Every bf16 GEMM path (AMX tiles, AVX512-BF16, the fp32 micro-kernel): D and Dv padded to
    their own multiples of 32, with a padded key row and a float mask (the stored-score path)."""
    q, k, v, go = _inputs(2, *heads, lq, lk, d, dv, BF16)
    pad = torch.rand(2, lk, generator=torch.Generator().manual_seed(1)) < 0.3
    mask = torch.randn(lq, lk, generator=torch.Generator().manual_seed(3)).to(BF16)
    with bf16_attention_gemm(gemm):
        _compare("cpu", q, k, v, go, causal=causal)
        _compare("cpu", q, k, v, go, causal=causal, key_padding_mask=pad, attn_mask=mask)


def test_value_head_dim_differs_every_level(capability_levels):
    """fp32 at every CPU kernel level (default, avx2, avx512) this machine runs."""
    q, k, v, go = _inputs(1, 4, 2, 70, 90, 40, 24, F32)
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            _compare("cpu", q, k, v, go, causal="bottom_right")
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])


OPTIONS = {
    "window": dict(window=(9, 2)),
    "softcap": dict(softcap=3.0),
    "alibi": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "sinks": dict(sinks=torch.tensor([0.3, -1.0, 2.0, 0.0])),
    "float_mask": dict(attn_mask=torch.randn(1, 4, 37, 53, generator=torch.Generator().manual_seed(4))),
    "position_bias": dict(position_bias=(torch.randn(32, 4, generator=torch.Generator().manual_seed(5)), True, 64)),
}
GRAD_OF = {"sinks": "sinks", "float_mask": "attn_mask", "position_bias": "table"}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_value_head_dim_differs_with_options(backend, option):
    """Each variant with D = 48, Dv = 24, and the gradient of the option where it has one."""
    from attention_oracle import ff_attention_oracle_kwargs, run_with_options
    q, k, v, go = _inputs(2, 4, 2, 37, 53, 48, 24, F32)
    kw = dict(OPTIONS[option], causal="bottom_right" if option == "window" else False)
    grads = (GRAD_OF[option],) if option in GRAD_OF else ()
    with ff.use_backend(backend):
        ours = run_with_options(ff_attention_oracle_kwargs, q, k, v, go, grads, **kw)
        assert ff.last_dispatch().backend == backend, str(ff.last_dispatch())
    ref = run_with_options(oracle_attention, q, k, v, go, grads, dtype=F64, **kw)
    for name, o, r in zip(("out", "dq", "dk", "dv", "d" + option), ours, ref):
        check(name, o, r, grad=name != "out", atol=1e-4 if name != "out" else 1e-5,
              rtol=1e-4 if name != "out" else 1e-5)


def test_value_head_dim_differs_dropout():
    """Dropout with Dv != D: the cpu kernels' mask equals the reference's for the same seed."""
    q, k, v, go = _inputs(1, 4, 2, 33, 47, 40, 72, F32)
    outs = []
    for backend in BACKENDS:
        torch.manual_seed(7)
        with ff.use_backend(backend):
            outs.append(run(lambda *t, **o: ff.attention(*t, **o), q, k, v, go, dropout_p=0.3, causal=True))
    for name, o, r in zip(("out", "dq", "dk", "dv"), *outs):
        torch.testing.assert_close(o, r, atol=1e-4 if name != "out" else 1e-5, rtol=1e-4)


def test_value_head_dim_differs_gradcheck_fp64_cpu():
    q, k, v, _ = _inputs(1, 4, 2, 5, 7, 8, 12, F64)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    with ff.use_backend("cpu"):
        assert torch.autograd.gradcheck(lambda q, k, v: ff.attention(q, k, v, causal="bottom_right"),
                                        leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_value_head_dim_differs_packed(backend, dtype):
    """ff.varlen_attention (total, H, D) / (total, Hkv, Dv): each sequence against the oracle
    alone, an empty sequence among them."""
    lens, H, Hkv, D, Dv = [5, 0, 113, 17], 4, 2, 192, 128
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    q, k, v, go = (torch.randn(T, n, d, generator=g, dtype=F64).to(dtype)
                   for n, d in ((H, D), (Hkv, D), (Hkv, Dv), (H, Dv)))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    with ff.use_backend(backend):
        ours = run(lambda q, k, v: ff.varlen_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True),
                   q, k, v, go)
        assert ff.last_dispatch().backend == backend, str(ff.last_dispatch())

    def oracle(q, k, v):  # each sequence alone, as (1, H, L, D)
        heads = lambda t: t.transpose(0, 1)[None]  # noqa: E731
        return torch.cat([oracle_attention(heads(q[a:b]), heads(k[a:b]), heads(v[a:b]), causal=True)[0].transpose(0, 1)
                          for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a])
    up = F64 if dtype == F32 else F32
    ref = run(oracle, q.to(up), k.to(up), v.to(up), go.to(up))
    low = run(oracle, q, k, v, go) if dtype == BF16 else [None] * 4
    for name, o, r, lo in zip(("out", "dq", "dk", "dv"), ours, ref, low):
        grad = name != "out"
        check(name, o, r.to(o.dtype) if dtype == F32 else r, lo, grad=grad,
              atol=1e-4 if grad else 1e-5, rtol=1e-4 if grad else 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("Lq", [1, 4])
def test_value_head_dim_differs_kvcache(backend, dtype, paged, Lq):
    """ff.attention_with_kvcache with caches (B, Hkv, L_max, D) and (B, Hkv, L_max, Dv): the new
    keys and values appended in place, then attended (the decoding kernel; pages of 16)."""
    B, H, Hkv, D, Dv, L_max, lens = 2, 8, 2, 192, 128, 256, [203, 17]
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=F64).to(dtype)  # noqa: E731
    q, k_cache, v_cache = mk(B, H, Lq, D), mk(B, Hkv, L_max, D), mk(B, Hkv, L_max, Dv)
    k_new, v_new = mk(B, Hkv, Lq, D), mk(B, Hkv, Lq, Dv)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lens):
        expect_k[b, :, n:n + Lq], expect_v[b, :, n:n + Lq] = k_new[b], v_new[b]
    kc, vc, table = k_cache, v_cache, None
    if paged:  # pages of 16 keys in shuffled order
        n = L_max // 16
        order = torch.randperm(B * n, generator=torch.Generator().manual_seed(1))
        table = torch.empty(B * n, dtype=torch.int32)
        table[order] = torch.arange(B * n, dtype=torch.int32)
        table = table.reshape(B, n)
        pages = lambda c: c.reshape(B, Hkv, n, 16, -1).permute(0, 2, 1, 3, 4).reshape(B * n, Hkv, 16, -1)[order].contiguous()  # noqa: E731
        kc, vc = pages(k_cache), pages(v_cache)
    with ff.use_backend(backend):
        out = ff.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table)
        assert ff.last_dispatch().backend == backend, str(ff.last_dispatch())
    if paged:
        unpage = lambda p: p[table.long()].permute(0, 2, 1, 3, 4).reshape(B, Hkv, L_max, -1)  # noqa: E731
        kc, vc = unpage(kc), unpage(vc)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v), "k_new / v_new appended in place"

    def oracle(dt):
        return torch.cat([oracle_attention(q[b:b + 1].to(dt), expect_k[b:b + 1, :, :n + Lq].to(dt),
                                           expect_v[b:b + 1, :, :n + Lq].to(dt), causal="bottom_right")
                          for b, n in enumerate(lens)])
    check("out", out, oracle(F64).to(out.dtype) if dtype == F32 else oracle(F32),
          oracle(dtype) if dtype == BF16 else None, atol=1e-5, rtol=1e-5)
