"""Variable lengths: ff.varlen_attention (packed sequences) and ff.attention_with_kvcache
(decoding against a contiguous or paged KV cache), on the cpu and reference backends, against
the eager oracle of tests/attention_oracle.py run on each sequence alone (ARCHITECTURE.md,
"Numerical policy": fp32 against fp64 at 1e-5 / 1e-4, fp16/bf16 by the error-ratio rule).
"""
import pytest
import torch
from attention_oracle import BF16_GEMMS, bf16_attention_gemm, oracle_attention
from oracle import check

import fastformer as ff
from fastformer.reference.rng import keep_mask

BACKENDS = ["cpu", "reference"]
F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64


def _randn(g, *shape, dtype):
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _packed(q_lens, k_lens, H, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(q_lens), sum(k_lens)
    return (_randn(g, Tq, H, D, dtype=dtype), _randn(g, Tk, Hkv, D, dtype=dtype),
            _randn(g, Tk, Hkv, D, dtype=dtype), _randn(g, Tq, H, D, dtype=dtype))


def _oracle_varlen(q, k, v, q_lens, k_lens, dtype, alibi=None, keep=None, **kw):
    """Each sequence alone through the oracle ((1, H, L, D)), concatenated back."""
    outs, lses = [], []
    qo = ko = 0
    for s, (lq, lk) in enumerate(zip(q_lens, k_lens)):
        qs, ks = q[qo:qo + lq], k[ko:ko + lk]
        vs = v[ko:ko + lk]
        kw_s = dict(kw)
        if alibi is not None:
            kw_s["alibi_slopes"] = alibi[s] if alibi.dim() == 2 else alibi
        if keep is not None:
            kw_s["keep"] = keep[s]
        heads = lambda t: t.to(dtype).transpose(0, 1)[None]  # noqa: E731
        qo, ko = qo + lq, ko + lk
        if lk == 0:  # no keys: out 0, lse +inf (the convention of every backend)
            outs.append(qs.new_zeros((lq, qs.shape[1], vs.shape[-1]), dtype=dtype) + 0 * qs.sum().to(dtype))
            lses.append(torch.full((qs.shape[1], lq), float("inf"), dtype=dtype))
            continue
        out, lse = oracle_attention(heads(qs), heads(ks), heads(vs), return_lse=True, **kw_s)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _grads(fn, q, k, v, go, extra=()):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, *extra)]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, go.to(out.dtype), allow_unused=True, materialize_grads=True)
    return (out.detach(), lse.detach(), *grads)


def _ours(backend, q, k, v, go, cu_q, cu_k, q_lens, k_lens, sinks=None, **kw):
    def fn(q, k, v, *extra):
        return ff.varlen_attention(q, k, v, cu_q, cu_k, max(q_lens, default=0), max(k_lens, default=0),
                                   sinks=extra[0] if extra else None, return_lse=True, **kw)
    with ff.use_backend(backend):
        got = _grads(fn, q, k, v, go, () if sinks is None else (sinks,))
        assert ff.last_dispatch().backend == backend
    return got


def _compare_varlen(backend, q_lens, k_lens, H, Hkv, D, dtype, causal=False, window=None,
                    softcap=None, alibi=None, sinks=None, seed=0):
    q, k, v, go = _packed(q_lens, k_lens, H, Hkv, D, dtype, seed)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    ours = _ours(backend, q, k, v, go, cu_q, cu_k, q_lens, k_lens, sinks=sinks, causal=causal,
                 window=window, softcap=softcap, alibi_slopes=alibi)
    okw = dict(causal="bottom_right" if causal else False, window=window, softcap=softcap)
    up = F64 if dtype == F32 else F32

    def oracle(dt):
        def fn(q, k, v, *extra):
            s = extra[0] if extra else None
            return _oracle_varlen(q, k, v, q_lens, k_lens, dt, alibi=alibi, sinks=s, **okw)
        return _grads(fn, q.to(dt), k.to(dt), v.to(dt), go.to(dt),
                      () if sinks is None else (sinks.to(dt),))
    ref, low = oracle(up), (oracle(dtype) if dtype in (BF16, F16) else [None] * len(ours))
    names = ["out", "lse", "dq", "dk", "dv"] + ([] if sinks is None else ["dsinks"])
    for name, o, r, lo in zip(names, ours, ref, low):
        if name == "lse":  # fp32 for every input dtype; +inf for rows without keys
            finite = torch.isfinite(r)
            assert torch.equal(torch.isfinite(o), finite), "lse: rows without keys must be +inf"
            torch.testing.assert_close(o[finite].double(), r[finite].double(), atol=2e-3 if dtype != F32 else 1e-5,
                                       rtol=1e-3 if dtype != F32 else 1e-5)
            continue
        grad = name != "out"
        tol = 1e-4 if grad else 1e-5
        check(name, o, r.to(o.dtype) if o.dtype == F32 else r, lo, grad=grad, atol=tol, rtol=tol)


# ---- packed sequences --------------------------------------------------------------------------
LENGTHS = [
    ([17], [17]),
    ([1, 203, 0, 17], [1, 203, 0, 17]),      # an empty sequence among others
    ([113, 5, 40], [113, 5, 40]),
    ([3, 17, 60], [40, 17, 200]),            # cross attention: more keys than queries
    ([7, 0, 9], [7, 4, 0]),                  # queries without keys (out 0, lse +inf)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: "-".join(map(str, x[0])))
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_each_sequence_alone(backend, lengths, causal):
    q_lens, k_lens = lengths
    _compare_varlen(backend, q_lens, k_lens, 4, 2, 40, F32, causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("D", [72, 128])
def test_varlen_low_precision(backend, dtype, D):
    _compare_varlen(backend, [1, 113, 17], [1, 113, 17], 4, 1, D, dtype, causal=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("option", ["window", "softcap", "alibi_heads", "alibi_sequences", "sinks"])
def test_varlen_options(backend, option):
    q_lens, k_lens, H = [17, 203, 1], [17, 203, 1], 4
    kw = {"window": dict(window=(5, 0)), "softcap": dict(softcap=3.0),
          "alibi_heads": dict(alibi=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
          "alibi_sequences": dict(alibi=torch.rand(3, H, generator=torch.Generator().manual_seed(1))),
          "sinks": dict(sinks=torch.randn(H, generator=torch.Generator().manual_seed(2)))}[option]
    _compare_varlen(backend, q_lens, k_lens, H, 2, 80, F32, causal=True, **kw)


def test_varlen_dropout_uses_each_sequences_stream():
    """Dropout on the cpu backend draws the reference's mask: sequence s's stream starts after
    the earlier sequences' H * Lq * Lk elements (reference/varlen.py)."""
    q_lens, H = [17, 40, 5], 2
    q, k, v, go = _packed(q_lens, q_lens, H, H, 40, F32)
    cu = _cu(q_lens)
    torch.manual_seed(7)
    got = {}
    for backend in BACKENDS:
        torch.manual_seed(7)
        with ff.use_backend(backend):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = ff.varlen_attention(*leaves, cu, cu, 40, 40, dropout_p=0.3)
            got[backend] = (out.detach(), *torch.autograd.grad(out, leaves, go))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got["cpu"], got["reference"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    # and the reference against the oracle with the keep masks of each sequence's stream
    torch.manual_seed(7)
    from fastformer.reference.rng import draw_rng_state
    seed, offset = draw_rng_state().tolist()
    keeps, base = [], offset
    for lq in q_lens:
        keeps.append(keep_mask(torch.tensor([seed, base]), (1, H, lq, lq), 0.3))
        base += H * lq * lq
    ref, _ = _oracle_varlen(q, k, v, q_lens, q_lens, F64, keep=keeps, dropout_p=0.3)
    torch.testing.assert_close(got["reference"][0].double(), ref, atol=1e-5, rtol=1e-5)


def test_varlen_gradcheck_fp64_cpu():
    q_lens = [3, 0, 5]
    q, k, v, _ = _packed(q_lens, q_lens, 2, 1, 8, F64)
    cu = _cu(q_lens)
    sinks = torch.randn(2, dtype=F64)
    with ff.use_backend("cpu"):
        fn = lambda q, k, v, s: ff.varlen_attention(q, k, v, cu, cu, 5, 5, causal=True, sinks=s,  # noqa: E731
                                                    softcap=2.0)
        assert torch.autograd.gradcheck(fn, [t.requires_grad_(True) for t in (q, k, v, sinks)])


def test_varlen_declined_by_the_cuda_backend():
    from fastformer import backends
    q, k, v, _ = _packed([4, 4], [4, 4], 2, 2, 16, F32)
    cu = _cu([4, 4])
    with ff.use_backend("cpu"):
        ff.varlen_attention(q, k, v, cu, cu, 4, 4)
    assert ff.last_dispatch().backend == "cpu"
    for impl in backends.implementations("attention"):
        if impl.backend == "cuda":  # no varlen kernel yet: auto falls back
            assert "cu_seqlens_q" not in impl.options, impl


# ---- KV cache ----------------------------------------------------------------------------------
def _cache_case(B, H, Hkv, Lq, D, lens, L_max, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (_randn(g, B, H, Lq, D, dtype=dtype), _randn(g, B, Hkv, L_max, D, dtype=dtype),
            _randn(g, B, Hkv, L_max, D, dtype=dtype), _randn(g, B, Hkv, Lq, D, dtype=dtype),
            _randn(g, B, Hkv, Lq, D, dtype=dtype), torch.tensor(lens, dtype=torch.int32))


def _paged(cache, block_size, seed=0):
    """(B, Hkv, L_max, D) as pages in shuffled order: (blocks, Hkv, block_size, D) and the table."""
    B, Hkv, L, D = cache.shape
    n = L // block_size
    pages = cache.reshape(B, Hkv, n, block_size, D).permute(0, 2, 1, 3, 4).reshape(B * n, Hkv, block_size, D)
    order = torch.randperm(B * n, generator=torch.Generator().manual_seed(seed))
    table = torch.empty(B * n, dtype=torch.int32)
    table[order] = torch.arange(B * n, dtype=torch.int32)
    return pages[order].contiguous(), table.reshape(B, n)


def _cache_oracle(q, k_cache, v_cache, lens, dtype, causal=True, alibi=None, **kw):
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        if n == 0:  # no keys: out 0
            outs.append(torch.zeros(1, *q.shape[1:3], v_cache.shape[-1], dtype=dtype))
            continue
        kw_b = dict(kw)
        if alibi is not None:
            kw_b["alibi_slopes"] = alibi[b:b + 1] if alibi.dim() == 2 else alibi
        outs.append(oracle_attention(q[b:b + 1].to(dtype), k_cache[b:b + 1, :, :n].to(dtype),
                                     v_cache[b:b + 1, :, :n].to(dtype),
                                     causal="bottom_right" if causal else False, **kw_b))
    return torch.cat(outs)


CACHE_CASES = [  # B, H, Hkv, Lq, D, cache_seqlens, L_max
    (1, 8, 2, 1, 128, [203], 256),     # decoding, GQA 4
    (3, 8, 1, 1, 80, [0, 17, 113], 128),
    (2, 4, 4, 5, 40, [1, 60], 80),     # a few new tokens (speculative decoding)
    (2, 4, 2, 40, 72, [17, 0], 64),    # a prefill chunk: the flash forward per row
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CACHE_CASES, ids=lambda c: f"B{c[0]}H{c[1]}kv{c[2]}Lq{c[3]}D{c[4]}")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kvcache_appends_and_attends(backend, case, paged, dtype):
    B, H, Hkv, Lq, D, lens, L_max = case
    q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case(B, H, Hkv, Lq, D, lens, L_max, dtype)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lens):
        expect_k[b, :, n:n + Lq] = k_new[b]
        expect_v[b, :, n:n + Lq] = v_new[b]
    kc, vc, table = k_cache, v_cache, None
    if paged:
        kc, table = _paged(k_cache, 16)
        vc, _ = _paged(v_cache, 16)
    with ff.use_backend(backend):
        out = ff.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table)
        assert ff.last_dispatch().backend == backend
    if paged:  # the appended cache, read back through the table
        kc = kc[table.long()].permute(0, 2, 1, 3, 4).reshape(B, Hkv, L_max, D)
        vc = vc[table.long()].permute(0, 2, 1, 3, 4).reshape(B, Hkv, L_max, D)
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v), "k_new / v_new appended in place"
    total = seqlens + Lq
    ref = _cache_oracle(q, expect_k, expect_v, total, F64 if dtype == F32 else F32)
    low = _cache_oracle(q, expect_k, expect_v, total, dtype) if dtype == BF16 else None
    check("out", out, ref.to(out.dtype) if dtype == F32 else ref, low, atol=1e-5, rtol=1e-5)


def _option_kwargs(option, B, H, window):
    """(ff.attention_with_kvcache's keywords, _cache_oracle's) for one attention option."""
    if option == "window":
        return dict(window=window), dict(window=window)
    if option == "softcap":
        return dict(softcap=2.0), dict(softcap=2.0)
    if option == "alibi":
        slopes = torch.rand(B, H)
        return dict(alibi_slopes=slopes), dict(alibi=slopes)
    if option == "sinks":
        sinks = torch.randn(H)
        return dict(sinks=sinks), dict(sinks=sinks)
    return {}, {}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("option", ["window", "softcap", "alibi", "sinks", "not_causal", "lse"])
def test_kvcache_options(backend, option):
    B, H, Hkv, D, lens = 2, 4, 2, 64, [90, 7]
    q, k_cache, v_cache, _, _, seqlens = _cache_case(B, H, Hkv, 1, D, lens, 128, F32)
    kw, okw = _option_kwargs(option, B, H, window=(16, 0))
    with ff.use_backend(backend):
        got = ff.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                        causal=option != "not_causal", return_lse=option == "lse", **kw)
    ref = _cache_oracle(q, k_cache, v_cache, seqlens, F64, causal=option != "not_causal", **okw)
    if option == "lse":
        out, lse = got
        expect = torch.stack([torch.logsumexp((q[b].double() @ k_cache[b, :, :lens[b]].double()
                                               .repeat_interleave(2, 0).transpose(-1, -2)) * D ** -0.5, -1)
                              for b in range(B)])
        torch.testing.assert_close(lse.double(), expect, atol=1e-5, rtol=1e-5)
        got = out
    check("out", got, ref.float(), atol=1e-5, rtol=1e-5)


# bf16 decoding on bf16 instructions (attention_decode.cpp, DecodeBf16Gemms) reads the cache's
# key rows in place 16 at a time where it can (head dims of 32s, a page of 16s) and copies the
# others, and interleaves value rows straight from the cache: contiguous and paged caches with
# pages of 8, 16 and 32 keys, a window, NaN in the cache past each row's keys (not part of the
# call, so not of the output). Every bf16 GEMM path.
@pytest.mark.parametrize("gemm", BF16_GEMMS)
@pytest.mark.parametrize("D, block_size", [(128, None), (64, 16), (64, 32), (128, 8), (80, 16), (72, None)])
@pytest.mark.parametrize("window", [None, (300, 0)])
def test_bf16_decode_reads_the_cache_in_place(gemm, D, block_size, window):
    B, H, Hkv, Lq, lens, L_max = 2, 8, 2, 2, [700, 37], 768
    q, k_cache, v_cache, _, _, seqlens = _cache_case(B, H, Hkv, Lq, D, lens, L_max, BF16)
    for b, n in enumerate(lens):
        k_cache[b, :, n:] = float("nan")
        v_cache[b, :, n:] = float("nan")
    kc, vc, table = k_cache, v_cache, None
    if block_size:
        kc, table = _paged(k_cache, block_size)
        vc, _ = _paged(v_cache, block_size)
    kw = dict(window=window) if window else {}
    with bf16_attention_gemm(gemm), ff.use_backend("cpu"):
        out = ff.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, **kw)
    ref = _cache_oracle(q, k_cache, v_cache, seqlens, F32, **kw)
    low = _cache_oracle(q, k_cache, v_cache, seqlens, BF16, **kw)
    check("out", out, ref, low)


# Decode calls of at most 4 query rows per kv head (G * Lq) run the fp32 GEMMs on a narrow
# micro-tile (attention_decode.cpp, DecodeFp32Gemms; gemm.h, kNarrowMR), more rows the full one:
# MHA, GQA 2 and 4, several new tokens, 5 rows; fp32, fp64 and fp16 (the fp32 path), a padding
# mask and several key blocks, at every CPU level, with the lse.
@pytest.mark.parametrize("dtype", [F32, F64, F16], ids=str)
@pytest.mark.parametrize("G, Lq", [(1, 1), (2, 2), (4, 1), (5, 1), (1, 3)])
def test_decode_narrow_rows_every_level(capability_levels, dtype, G, Lq):
    B, Hkv, D, Lk = 2, 2, 72, 500
    g = torch.Generator().manual_seed(0)
    q, k, v = (_randn(g, B, n, L, D, dtype=dtype) for n, L in ((Hkv * G, Lq), (Hkv, Lk), (Hkv, Lk)))
    pad = torch.rand(B, Lk, generator=g) < 0.2
    ref, ref_lse = oracle_attention(q.double(), k.double(), v.double(), causal="bottom_right",
                                    key_padding_mask=pad, return_lse=True)
    low = oracle_attention(q, k, v, causal="bottom_right", key_padding_mask=pad) if dtype == F16 else None
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            with ff.use_backend("cpu"):
                out, lse = ff.attention(q, k, v, causal="bottom_right", key_padding_mask=pad, return_lse=True)
            check("out", out, ref.to(dtype) if dtype != F16 else ref, low, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4 if dtype == F16 else 1e-5, rtol=1e-5)
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])


def _one_row_case(B, H, lens, D, dtype, paged):
    """One query per head (MHA) against caches of 1664 slots holding `lens` keys, NaN past them;
    (q, k_cache, v_cache, seqlens, and the caches as passed: paged in blocks of 16 or as they are,
    with the block table or None)."""
    q, k_cache, v_cache, _, _, seqlens = _cache_case(B, H, H, 1, D, lens, 1664, dtype)
    for b, n in enumerate(lens):
        k_cache[b, :, n:] = float("nan")
        v_cache[b, :, n:] = float("nan")
    if not paged:
        return q, k_cache, v_cache, seqlens, k_cache, v_cache, None
    kc, table = _paged(k_cache, 16)
    vc, _ = _paged(v_cache, 16)
    return q, k_cache, v_cache, seqlens, kc, vc, table


# One query row per task (multi-head attention decoding one token, G * Lq = 1: attention_decode.cpp,
# DecodeRowGemms) reads the cache's rows in place: head dims with vector tails, one key, a
# block's worth, several key splits, paged caches, NaN past each row's keys, the options, every
# CPU level; head dims of one vector or less, and of several register chunks of P V (256).
@pytest.mark.parametrize("D", [8, 40, 72, 80, 128, 256])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("option", [None, "window", "softcap", "alibi", "sinks"])
def test_decode_one_row_reads_the_cache_in_place(capability_levels, D, paged, option):
    B, H = 3, 4
    q, k_cache, v_cache, seqlens, kc, vc, table = _one_row_case(B, H, [1, 203, 1600], D, F32, paged)
    kw, okw = _option_kwargs(option, B, H, window=(150, 0))
    ref = _cache_oracle(q, k_cache, v_cache, seqlens, F64, **okw)
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            with ff.use_backend("cpu"):
                out = ff.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table, **kw)
            check("out", out, ref.float(), atol=1e-5, rtol=1e-5)
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])


# fp64 on the same path (its dot products summed one key at a time, in fp64).
@pytest.mark.parametrize("D", [8, 72, 256])
def test_decode_one_row_fp64(capability_levels, D):
    q, k_cache, v_cache, seqlens, kc, vc, table = _one_row_case(2, 3, [17, 203], D, F64, paged=False)
    ref = _cache_oracle(q, k_cache, v_cache, seqlens, F64)
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            with ff.use_backend("cpu"):
                out = ff.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
            check("out", out, ref, atol=1e-12, rtol=1e-12)
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])


# bf16 and fp16 take the one-row path too; 16 or more (batch row, kv head) tasks run without key
# splits, each thread a fixed range of them.
@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("D", [40, 128])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_one_row_low_precision_without_splits(capability_levels, dtype, D, paged):
    q, k_cache, v_cache, seqlens, kc, vc, table = _one_row_case(2, 16, [203, 1600], D, dtype, paged)
    ref = _cache_oracle(q, k_cache, v_cache, seqlens, F64)
    low = _cache_oracle(q, k_cache, v_cache, seqlens, dtype)
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            with ff.use_backend("cpu"):
                out = ff.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table)
            check("out", out, ref, low)
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])


def test_decode_splits_keys_deterministically():
    """Batch 1, one kv head: the decode kernel splits the keys across tasks and merges them; the
    result does not depend on the thread count and matches the flash forward's."""
    q, k, v = (torch.randn(1, 4, 1, 64), torch.randn(1, 1, 3000, 64), torch.randn(1, 1, 3000, 64))
    with ff.use_backend("cpu"):
        threads = torch.get_num_threads()
        try:
            outs = []
            for n in (1, threads):
                torch.set_num_threads(n)
                outs.append(ff.attention(q, k, v, return_lse=True))
        finally:
            torch.set_num_threads(threads)
    ref, lse = oracle_attention(q.double(), k.double(), v.double(), return_lse=True)
    for out, l in outs:
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(l.double(), lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0][0], outs[1][0])


# ---- errors ------------------------------------------------------------------------------------
def _varlen_args():
    q, k, v, _ = _packed([3, 5], [3, 5], 2, 2, 16, F32)
    return q, k, v, _cu([3, 5]), _cu([3, 5])


@pytest.mark.parametrize("change, error, words", [
    (dict(cu_seqlens_q=torch.tensor([0, 3, 8])), TypeError, "`cu_seqlens_q` must be int32"),
    (dict(cu_seqlens_q=torch.tensor([1, 3, 8], dtype=torch.int32)), ValueError, "must start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 3, 8], dtype=torch.int32)), ValueError, "non-decreasing"),
    (dict(cu_seqlens_k=torch.tensor([0, 3, 9], dtype=torch.int32)), ValueError, "number of packed rows"),
    (dict(cu_seqlens_k=torch.tensor([0, 8], dtype=torch.int32), max_seqlen_k=8), ValueError, "same number of sequences"),
    (dict(max_seqlen_q=4), ValueError, "`max_seqlen_q` must be an int >= the longest sequence (5)"),
    (dict(cu_seqlens_q=[0, 3, 8]), TypeError, "must be an int32 tensor"),
])
def test_varlen_errors(change, error, words):
    q, k, v, cu_q, cu_k = _varlen_args()
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=5)
    args.update(change)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace("`", "`")):
        ff.varlen_attention(q, k, v, **args)


def test_varlen_errors_on_shapes():
    q, k, v, cu_q, cu_k = _varlen_args()
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        ff.varlen_attention(q, k[:, :0], v[:, :0], cu_q, cu_k, 5, 5)
    with pytest.raises(ValueError, match="must have 3 dims|3-D|dims"):
        ff.varlen_attention(q[None], k, v, cu_q, cu_k, 5, 5)
    with pytest.raises(ValueError, match="alibi_slopes"):
        ff.varlen_attention(q, k, v, cu_q, cu_k, 5, 5, alibi_slopes=torch.ones(3, 2))


def test_kvcache_errors():
    q, k_cache, v_cache, k_new, v_new, lens = _cache_case(2, 4, 2, 1, 16, [3, 60], 64, F32)
    with pytest.raises(ValueError, match="must fit the cache"):
        ff.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.tensor([3, 64], dtype=torch.int32))
    with pytest.raises(ValueError, match="given together"):
        ff.attention_with_kvcache(q, k_cache, v_cache, k_new, None, cache_seqlens=lens)
    with pytest.raises(TypeError, match="`cache_seqlens` must be int32"):
        ff.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens.long())
    with pytest.raises(TypeError, match="`block_table` must be an int32 tensor"):
        ff.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="`k_new` / `v_new` must be"):
        ff.attention_with_kvcache(q, k_cache, v_cache, k_new[:, :1], v_new[:, :1], cache_seqlens=lens)
    with pytest.raises(ValueError, match="batch size"):
        ff.attention_with_kvcache(q, k_cache[:1], v_cache[:1], cache_seqlens=lens)
