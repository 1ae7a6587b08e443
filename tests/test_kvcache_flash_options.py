"""ff.attention_with_kvcache's FlashAttention options beyond the attention ones: rotary tables
(the new keys and the queries rotated at their positions before the keys are cached),
cache_batch_idx (batch row b on cache row cache_batch_idx[b]) and cache_leftpad (row b's cache
starting at cache_leftpad[b]), on the cpu and reference backends.

The oracle rotates q and k_new in fp64 at the positions FlashAttention's flash_attn_with_kvcache
documents (keys at cache_seqlens[b] + i; queries there when causal or windowed, else all at
cache_seqlens[b]), writes the keys into a copy of the cache, and attends per row with the eager
oracle of tests/attention_oracle.py (fp32 against fp64 at 1e-5, bf16 by the error-ratio rule),
the left padding as a key padding mask over the whole row (FlashAttention's test's rule).
"""
import pytest
import torch
from attention_oracle import oracle_attention
from oracle import check

import fastformer as ff

BACKENDS = ["cpu", "reference"]
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


def _tables(n, half, seed=3):
    angles = torch.rand(n, half, generator=torch.Generator().manual_seed(seed), dtype=F64) * 6.3
    return angles.cos().float(), angles.sin().float()


def _rotate(x, cos, sin, pos, interleaved):
    """x (B, H, L, D) fp64 rotated at positions pos (B, L), the first 2 * cos.shape[1] channels."""
    half = cos.shape[1]
    c, s = cos.double()[pos][:, None], sin.double()[pos][:, None]
    xr, rest = x[..., :2 * half], x[..., 2 * half:]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)
    else:
        a, b = xr[..., :half], xr[..., half:]
        y = torch.cat((a * c - b * s, b * c + a * s), -1)
    return torch.cat((y, rest), -1)


def _case(B, H, Hkv, Lq, D, rows, L_max, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype)
    return r(B, H, Lq, D), r(rows, Hkv, L_max, D), r(rows, Hkv, L_max, D), r(B, Hkv, Lq, D), r(B, Hkv, Lq, D)


def _expected(q, k_cache, v_cache, k_new, v_new, lens, rows, rotary, causal, window, dtype,
              pads=None, alibi_slopes=None):
    """(out in dtype's oracle precision, the caches after the call) by the documented rule;
    pads: each row's left padding (keys before it masked)."""
    B, _, Lq, _ = q.shape
    q64, k64 = q.double(), k_new.double()
    lens_t = torch.tensor(lens)
    pos = lens_t[:, None] + torch.arange(Lq)
    if rotary is not None:
        cos, sin, interleaved = rotary
        at_each = causal or window is not None
        k64 = _rotate(k64, cos, sin, pos, interleaved)
        q64 = _rotate(q64, cos, sin, pos if at_each else lens_t[:, None].expand(B, Lq), interleaved)
    kc, vc = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lens):
        kc[rows[b], :, n:n + Lq] = k64[b].to(kc.dtype)
        vc[rows[b], :, n:n + Lq] = v_new[b]
    kw = dict(causal="bottom_right" if causal else False, alibi_slopes=alibi_slopes)
    if window is not None:
        kw["window"] = window
    pads = pads or [0] * B
    outs = [oracle_attention(q64[b:b + 1].to(dtype), kc[rows[b]:rows[b] + 1, :, :n + Lq].to(dtype),
                             vc[rows[b]:rows[b] + 1, :, :n + Lq].to(dtype),
                             key_padding_mask=(torch.arange(n + Lq) < pads[b])[None], **kw)
            for b, n in enumerate(lens)]
    return torch.cat(outs), kc, vc


ROTARY_CASES = [  # B, H, Hkv, Lq, D, cache_seqlens, L_max, rotary dims R
    (1, 8, 2, 1, 128, [203], 256, 128),   # decoding, GQA 4
    (3, 4, 2, 1, 80, [0, 17, 113], 128, 80),  # rows at different positions: per-row tables
    (2, 4, 4, 5, 40, [1, 60], 80, 32),    # speculative tokens, partial rotary (32 of 40)
    (2, 4, 2, 17, 72, [9, 9], 64, 72),    # one start for every row: apply_rotary's pass
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ROTARY_CASES, ids=lambda c: f"B{c[0]}Lq{c[3]}D{c[4]}R{c[7]}")
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("mode", ["causal", "window", "not_causal"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kvcache_rotates_new_keys_and_queries(backend, case, interleaved, mode, dtype):
    B, H, Hkv, Lq, D, lens, L_max, R = case
    q, k_cache, v_cache, k_new, v_new = _case(B, H, Hkv, Lq, D, B, L_max, dtype)
    cos, sin = _tables(L_max + 4, R // 2)
    inputs = [t.clone() for t in (q, k_new, v_new)]
    causal, window = mode != "not_causal", ((7, 0) if mode == "window" else None)
    ref, expect_k, expect_v = _expected(q, k_cache, v_cache, k_new, v_new, lens, list(range(B)),
                                        (cos, sin, interleaved), causal, window, F64 if dtype == F32 else F32)
    low = (_expected(q, k_cache, v_cache, k_new, v_new, lens, list(range(B)), (cos, sin, interleaved),
                     causal, window, dtype)[0] if dtype == BF16 else None)
    with ff.use_backend(backend):
        out = ff.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                        causal=causal, window=window, rotary_cos=cos, rotary_sin=sin,
                                        rotary_interleaved=interleaved)
        assert ff.last_dispatch().backend == backend
    assert all(torch.equal(a, b) for a, b in zip(inputs, (q, k_new, v_new))), "q / k_new / v_new unchanged"
    # The cached keys are the rotated ones, rounded once to the cache's dtype.
    torch.testing.assert_close(k_cache, expect_k, atol=1e-6 if dtype == F32 else 0, rtol=1e-6 if dtype == F32 else 8e-3)
    assert torch.equal(v_cache, expect_v)
    check("out", out, ref.to(out.dtype) if dtype == F32 else ref, low, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("Lq", [1, 3])
def test_kvcache_batch_idx_picks_cache_rows(backend, with_rotary, Lq):
    B, H, Hkv, D, L_max, rows = 3, 4, 2, 64, 48, [4, 0, 2]
    lens = [17, 0, 30]
    q, k_cache, v_cache, k_new, v_new = _case(B, H, Hkv, Lq, D, 5, L_max, F32)
    before_k = k_cache.clone()
    rotary = (*_tables(L_max, D // 2), False) if with_rotary else None
    ref, expect_k, expect_v = _expected(q, k_cache, v_cache, k_new, v_new, lens, rows, rotary, True, None, F64)
    kw = dict(rotary_cos=rotary[0], rotary_sin=rotary[1], rotary_interleaved=False) if with_rotary else {}
    with ff.use_backend(backend):
        out = ff.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                        cache_batch_idx=torch.tensor(rows, dtype=torch.int32), **kw)
    torch.testing.assert_close(k_cache, expect_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache, expect_v)
    for untouched in (1, 3):  # the cache rows no batch row names
        assert torch.equal(k_cache[untouched], before_k[untouched])
    check("out", out, ref.float(), atol=1e-5, rtol=1e-5)


def test_kvcache_cache_seqlens_as_an_int():
    q, k_cache, v_cache, k_new, v_new = _case(2, 4, 2, 1, 32, 2, 40, F32)
    by_tensor = ff.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new,
                                          cache_seqlens=torch.tensor([11, 11], dtype=torch.int32))
    by_int = ff.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=11)
    assert torch.equal(by_int, by_tensor)


def test_kvcache_rotary_and_batch_idx_errors():
    q, k_cache, v_cache, k_new, v_new = _case(2, 4, 2, 1, 16, 3, 32, F32)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    cos, sin = _tables(32, 8)

    def call(**kw):
        args = dict(cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
        args.update(kw)
        new = args.pop("new", (k_new, v_new))
        return ff.attention_with_kvcache(q, k_cache[:2], v_cache[:2], *new, **args)
    with pytest.raises(TypeError, match="`rotary_interleaved` must be given"):
        call(rotary_interleaved=None)
    with pytest.raises(ValueError, match="pass `k_new` and `v_new`"):
        call(new=())
    with pytest.raises(ValueError, match="given together"):
        call(rotary_sin=None)
    with pytest.raises(ValueError, match="shape of `rotary_cos`"):
        call(rotary_sin=sin[:, :4])
    with pytest.raises(ValueError, match=r"R <= D = 16"):
        call(rotary_cos=torch.ones(32, 9), rotary_sin=torch.ones(32, 9))
    with pytest.raises(ValueError, match="reach position 9"):
        call(rotary_cos=cos[:9], rotary_sin=sin[:9])
    with pytest.raises(TypeError, match="rotary_cos"):
        call(rotary_cos=cos.double(), rotary_sin=sin.double())
    idx = torch.tensor([2, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="must index the cache's 3 rows"):
        ff.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cache_batch_idx=idx + 1)
    with pytest.raises(TypeError, match="`cache_batch_idx` must be int32"):
        ff.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cache_batch_idx=idx.long())
    with pytest.raises(ValueError, match="contiguous cache"):
        ff.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cache_batch_idx=idx,
                                  block_table=torch.zeros(2, 1, dtype=torch.int32))


def test_kvcache_rotary_tables_in_the_queries_dtype():
    """FlashAttention takes the tables in q's dtype: the same as fp32 tables holding those values."""
    q, k_cache, v_cache, k_new, v_new = _case(2, 4, 2, 3, 32, 2, 40, BF16)
    cos, sin = (t.bfloat16() for t in _tables(40, 16))
    lens = torch.tensor([5, 11], dtype=torch.int32)
    kw = dict(cache_seqlens=lens, rotary_interleaved=False)
    low = ff.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k_new, v_new, rotary_cos=cos,
                                    rotary_sin=sin, **kw)
    wide = ff.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos.float(),
                                     rotary_sin=sin.float(), **kw)
    assert torch.equal(low, wide)


def _paged(cache, block, seed=5):
    """A contiguous (B, Hkv, L_max, D) cache as pages (B * L_max / block, Hkv, block, D) in a
    shuffled order, and its block table."""
    B, Hkv, L_max, D = cache.shape
    n = L_max // block
    order = torch.randperm(B * n, generator=torch.Generator().manual_seed(seed))
    pages = torch.empty(B * n, Hkv, block, D, dtype=cache.dtype)
    pages[order] = cache.reshape(B, Hkv, n, block, D).permute(0, 2, 1, 3, 4).reshape(B * n, Hkv, block, D)
    return pages, order.reshape(B, n).to(torch.int32)


def _unpaged(pages, table):
    B, n = table.shape
    Hkv, block, D = pages.shape[1:]
    return pages[table.long()].permute(0, 2, 1, 3, 4).reshape(B, Hkv, n * block, D)


LEFTPAD_CASES = [  # B, H, Hkv, Lq, D, cache_seqlens, cache_leftpad, L_max
    (3, 4, 2, 1, 64, [17, 40, 113], [0, 23, 113], 128),  # decoding; the last row sees only its new key
    (2, 8, 2, 4, 72, [30, 9], [5, 9], 48),                # speculative tokens, GQA 4
    (2, 4, 4, 17, 128, [20, 33], [3, 16], 64),            # a prefill chunk (the flash kernels)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", LEFTPAD_CASES, ids=lambda c: f"B{c[0]}Lq{c[3]}D{c[4]}")
@pytest.mark.parametrize("layout", ["contiguous", "paged", "batch_idx"])
@pytest.mark.parametrize("mode", ["causal", "window", "not_causal", "alibi"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kvcache_leftpad_masks_the_padding(backend, case, layout, mode, dtype):
    B, H, Hkv, Lq, D, lens, pads, L_max = case
    rows = [B - 1 - b for b in range(B)] if layout == "batch_idx" else list(range(B))
    q, k_cache, v_cache, k_new, v_new = _case(B, H, Hkv, Lq, D, B, L_max, dtype)
    causal, window = mode != "not_causal", ((6, 0) if mode == "window" else None)
    slopes = torch.rand(H, generator=torch.Generator().manual_seed(1)) * 0.3 if mode == "alibi" else None
    rotary = (*_tables(L_max, D // 4), False)  # partial rotary, at the cache's positions
    expect = [_expected(q, k_cache, v_cache, k_new, v_new, lens, rows, rotary, causal, window, dt,
                        pads=pads, alibi_slopes=slopes) for dt in ((F64,) if dtype == F32 else (F32, BF16))]
    kw = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32), causal=causal, window=window,
              alibi_slopes=slopes, rotary_cos=rotary[0], rotary_sin=rotary[1], rotary_interleaved=False,
              cache_leftpad=torch.tensor(pads, dtype=torch.int32))
    if layout == "paged":
        k_pages, table = _paged(k_cache, 16)
        v_pages, _ = _paged(v_cache, 16)
        caches, kw["block_table"] = (k_pages, v_pages), table
    else:
        caches = (k_cache, v_cache)
        if layout == "batch_idx":
            kw["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32)
    with ff.use_backend(backend):
        out = ff.attention_with_kvcache(q, *caches, k_new, v_new, **kw)
        assert ff.last_dispatch().backend == backend
    k_after, v_after = (_unpaged(c, table) for c in caches) if layout == "paged" else caches
    torch.testing.assert_close(k_after, expect[0][1], atol=1e-6 if dtype == F32 else 0, rtol=1e-6 if dtype == F32 else 8e-3)
    assert torch.equal(v_after, expect[0][2])
    ref = expect[0][0]
    check("out", out, ref.to(out.dtype) if dtype == F32 else ref, expect[1][0] if dtype == BF16 else None,
          atol=1e-5, rtol=1e-5)


def test_kvcache_leftpad_is_padding_left_out():
    """A row padded by p gives the output of the same row without its first p keys."""
    q, k_cache, v_cache, _, _ = _case(2, 4, 2, 1, 32, 2, 40, F32)
    pads, lens = [7, 0], [25, 18]
    padded = ff.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       cache_leftpad=torch.tensor(pads, dtype=torch.int32))
    trimmed = ff.attention_with_kvcache(q[:1], k_cache[:1, :, 7:].contiguous(), v_cache[:1, :, 7:].contiguous(),
                                        cache_seqlens=torch.tensor([18], dtype=torch.int32))
    torch.testing.assert_close(padded[:1], trimmed, atol=1e-6, rtol=1e-6)


def test_kvcache_leftpad_errors():
    q, k_cache, v_cache, _, _ = _case(2, 4, 2, 1, 16, 2, 32, F32)
    lens = torch.tensor([3, 9], dtype=torch.int32)

    def call(pad):
        return ff.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cache_leftpad=pad)
    with pytest.raises(ValueError, match=r"`cache_leftpad` \[4, 0\] must be >= 0 and <= `cache_seqlens`"):
        call(torch.tensor([4, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="must be >= 0"):
        call(torch.tensor([-1, 0], dtype=torch.int32))
    with pytest.raises(TypeError, match="`cache_leftpad` must be int32"):
        call(torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"`cache_leftpad` must have shape \(2,\)"):
        call(torch.tensor([1], dtype=torch.int32))
