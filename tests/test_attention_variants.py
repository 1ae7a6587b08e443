"""The attention variants (window, softcap, ALiBi, sinks, T5 relative-position bias, learned
float masks, return_lse) on the cpu and reference backends, against the eager oracle of
tests/attention_oracle.py (ARCHITECTURE.md, "Numerical policy").

Each case checks the output, dq, dk, dv and the option's own gradient (sinks, the mask, the
bias table): fp32 against an fp64 oracle (1e-5 forward, 1e-4 gradients), fp16/bf16 by the
error-ratio rule against eager PyTorch in the same precision. The Triton backend's cases are in
tests/test_attention_triton.py.
"""
import itertools

import pytest
import torch
from attention_oracle import BF16_GEMMS, bf16_attention_gemm, ff_attention_oracle_kwargs, oracle_attention, run_with_options, to_ff_kwargs
from oracle import check

import fastformer as ff
from fastformer.reference.rng import draw_rng_state, keep_mask

BACKENDS = ["cpu", "reference"]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CAUSAL = [False, "top_left", "bottom_right"]


def _inputs(B, H, Hkv, Lq, Lk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(B, H, Lq, D), mk(B, Hkv, Lk, D), mk(B, Hkv, Lk, D), mk(B, H, Lq, D)


def _grad_names(kw):
    names = [n for n in ("sinks", "attn_mask") if isinstance(kw.get(n), torch.Tensor)
             and kw[n].is_floating_point()]
    if kw.get("position_bias") is not None:
        names.append("table")
    return names


def _compare(backend, q, k, v, go, **kw):
    """Ours (on `backend`) against the oracle on out, dq, dk, dv and the options' gradients."""
    names = _grad_names(kw)
    with ff.use_backend(backend):
        ours = run_with_options(ff_attention_oracle_kwargs, q, k, v, go, names, **kw)
        assert ff.last_dispatch().backend == backend
    up = torch.float64 if q.dtype in (F32, torch.float64) else F32
    oracle = run_with_options(oracle_attention, q, k, v, go, names, dtype=up, **kw)
    lowp = [None] * len(ours)
    if q.dtype in (F16, BF16):
        lowp = run_with_options(oracle_attention, q, k, v, go, names, **kw)
    for name, o, r, l in zip(("out", "dq", "dk", "dv", *names), ours, oracle, lowp):
        grad = name != "out"
        tol = 1e-4 if grad else 1e-5
        check(name, o, r.to(o.dtype) if r.dtype != o.dtype and o.dtype == F32 else r, l, grad=grad,
              atol=tol, rtol=tol)
    return ours


# ---- window ------------------------------------------------------------------------------------
WINDOWS = [(0, 0), (1, 1), (0, -1), (5, -1), (-1, 3), (2, 7), (300, 300), (-1, -1)]
_WINDOW_CASES = [(lq, lk, w, CAUSAL[n % 3], (40, 72, 80, 128)[n % 4])
                 for n, ((lq, lk), w) in enumerate(itertools.product(
                     [(1, 1), (17, 17), (113, 203), (203, 113), (400, 520)], WINDOWS))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq,lk,window,causal,d", _WINDOW_CASES,
                         ids=[f"{c[0]}x{c[1]}-w{c[2][0]}_{c[2][1]}-{c[3]}-d{c[4]}" for c in _WINDOW_CASES])
def test_window(backend, lq, lk, window, causal, d):
    q, k, v, go = _inputs(2, 4, 2, lq, lk, d, F32)
    _compare(backend, q, k, v, go, window=window, causal=causal)


@pytest.mark.parametrize("causal", CAUSAL)
def test_window_with_every_alignment_against_the_band_mask(causal):
    """A window is the bool band mask it stands for (same alignment), exactly as SDPA with it."""
    q, k, v, go = _inputs(1, 2, 2, 150, 410, 32, F32)
    d = 410 - 150 if causal == "bottom_right" else 0
    i, j = torch.arange(150)[:, None], torch.arange(410)[None, :]
    band = (j >= i + d - 50) & (j <= i + d + (0 if causal else 20))
    with ff.use_backend("cpu"):
        ours = ff.attention(q, k, v, window=(50, 20), causal=causal)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                            attn_mask=band)
    check("out", ours, sdpa, atol=1e-5, rtol=1e-5)


# ---- softcap, ALiBi ----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq,lk,d,causal,softcap", [(113, 203, 64, False, 5.0), (203, 113, 40, "top_left", 1.0),
                                                    (300, 300, 80, "bottom_right", 50.0), (1, 239, 72, False, 0.5)])
def test_softcap(backend, lq, lk, d, causal, softcap):
    q, k, v, go = _inputs(2, 4, 2, lq, lk, d, F32)
    _compare(backend, q * 2, k, v, go, softcap=softcap, causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_batch", [False, True], ids=["H", "BH"])
@pytest.mark.parametrize("causal", CAUSAL)
def test_alibi(backend, per_batch, causal):
    q, k, v, go = _inputs(2, 4, 4, 113, 203, 40, F32)
    slopes = torch.rand(2, 4) if per_batch else 2.0 ** -torch.arange(1, 5, dtype=F32)
    _compare(backend, q, k, v, go, alibi_slopes=slopes, causal=causal)


# ---- sinks, T5 bias, learned masks -----------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq,lk,causal", [(17, 17, "top_left"), (113, 203, "bottom_right"), (203, 113, False), (1, 300, False)])
def test_sinks_with_gradient(backend, lq, lk, causal):
    q, k, v, go = _inputs(2, 4, 2, lq, lk, 64, F32)
    pad = torch.zeros(2, lk, dtype=torch.bool)
    pad[1] = True  # batch 1: no key at all, only the sink
    sinks = torch.randn(4, dtype=torch.float64).to(F32) * 2
    out = _compare(backend, q, k, v, go, sinks=sinks, causal=causal, key_padding_mask=pad)
    assert (out[0][1] == 0).all() and (out[1][1] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("lq,lk,causal", [(17, 23, False), (203, 113, "bottom_right"), (130, 400, "top_left")])
def test_relative_position_bias_with_gradient(backend, bidirectional, lq, lk, causal):
    q, k, v, go = _inputs(2, 4, 4, lq, lk, 40, F32)
    table = torch.randn(32, 4, dtype=torch.float64).to(F32)
    _compare(backend, q, k, v, go, position_bias=(table, bidirectional, 64), causal=causal)


# Key blocks that no edge, mask or padding column touches compute a softcap's and the inline
# terms' scores on the fly in the forward (csrc/cpu/attention_fwd.cpp, OnTheFlyScores), every
# combination its own code: Lk = 400 is two such 192-key blocks and a short one; batch 1's last
# keys padded leave its first blocks wholly attended (the key padding's bias row all zeros).
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("opts", ["softcap", "alibi", "rel", "softcap+alibi", "softcap+rel"])
def test_options_on_whole_unmasked_key_blocks(backend, dtype, opts):
    q, k, v, go = _inputs(2, 4, 2, 113, 400, 64, dtype)
    pad = torch.zeros(2, 400, dtype=torch.bool)
    pad[1, 390:] = True
    kw = {}
    if "softcap" in opts:
        kw["softcap"] = 5.0
    if "alibi" in opts:
        kw["alibi_slopes"] = 2.0 ** -torch.arange(1, 5, dtype=F32)
    if "rel" in opts:
        kw["position_bias"] = (torch.randn(32, 4, dtype=torch.float64).to(F32), True, 64)
    _compare(backend, q * 2, k, v, go, key_padding_mask=pad, **kw)


# A softcap alone on whole key blocks: P = 2^(cap(S) - shift) in one rounding, the cap a folded
# polynomial where |scale S / cap| < 1/2 (vec_math.h, ScaledTanh: degree 9 for fp32, 7 for bf16;
# a row test in the forward, a vector test in the backward), fast_tanh elsewhere. Query rows
# scaled 0.05 .. 4 give rows wholly in range, rows and vectors that mix; a cap of 1e9 puts the
# folded coefficients out of fp32's range (fast_tanh throughout). Every CPU level.
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize("softcap", [5.0, 1e9])
def test_softcap_alone_on_whole_key_blocks_every_level(capability_levels, dtype, softcap):
    q, k, v, go = _inputs(2, 4, 2, 150, 384, 64, dtype)
    row_scale = torch.logspace(-1.3, 0.6, 150).to(dtype)[:, None]  # 0.05 .. 4
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            _compare("cpu", q * row_scale, k, v, go, softcap=softcap)
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])


# ALiBi: the forward visits each query block's key blocks from its diagonal's block, wrapping
# around (attention_fwd.cpp); several query and key blocks, both alignments and none.
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_alibi_over_many_key_blocks(causal, dtype):
    q, k, v, go = _inputs(1, 2, 2, 500, 700, 40, dtype)
    _compare("cpu", q, k, v, go, alibi_slopes=torch.tensor([0.5, 0.01]), causal=causal)


MASK_SHAPES = {"full": lambda B, H, Lq, Lk: (B, H, Lq, Lk), "batch": lambda B, H, Lq, Lk: (1, H, Lq, Lk),
               "heads": lambda B, H, Lq, Lk: (B, 1, Lq, Lk), "2d": lambda B, H, Lq, Lk: (Lq, Lk),
               "rows": lambda B, H, Lq, Lk: (B, H, Lq, 1), "keys": lambda B, H, Lq, Lk: (B, 1, 1, Lk)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", list(MASK_SHAPES))
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_learned_float_mask_gradient(backend, shape, dtype):
    B, H, Hkv, Lq, Lk = 2, 4, 2, 113, 203
    q, k, v, go = _inputs(B, H, Hkv, Lq, Lk, 40, dtype)
    g = torch.Generator().manual_seed(5)
    mask = torch.randn(MASK_SHAPES[shape](B, H, Lq, Lk), generator=g).to(dtype)
    _compare(backend, q, k, v, go, attn_mask=mask, causal="bottom_right")


def test_learned_mask_memory_is_linear_not_quadratic():
    """The kernels write d(mask) in the mask's own shape: no (B, H, Lq, Lk) tensor for a
    (1, H, Lq, Lk) bias (autograd keeps only the inputs, out and lse)."""
    B, H, L, D = 4, 4, 512, 32
    q, k, v, go = _inputs(B, H, H, L, L, D, F32)
    bias = torch.randn(1, H, L, L, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = ff.attention(q, k, v, attn_mask=bias)
    assert ff.last_dispatch().backend == "cpu"
    assert max(saved) <= max(q.numel(), bias.numel()), saved  # nothing of (B, H, L, L) size
    (g,) = torch.autograd.grad(out, bias, go)
    assert g.shape == bias.shape


# ---- everything at once ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
@pytest.mark.parametrize("causal", CAUSAL)
def test_every_option_combined(backend, dtype, causal):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 150, 230, 40
    q, k, v, go = _inputs(B, H, Hkv, Lq, Lk, D, dtype)
    g = torch.Generator().manual_seed(7)
    pad = torch.rand(B, Lk, generator=g) < 0.1
    kw = dict(causal=causal, window=(60, 90), softcap=4.0, alibi_slopes=torch.rand(H, generator=g) / 8,
              sinks=torch.randn(H, generator=g).to(dtype), key_padding_mask=pad,
              attn_mask=torch.randn(1, H, Lq, Lk, generator=g).to(dtype),
              position_bias=(torch.randn(32, H, generator=g).to(dtype), True, 128))
    _compare(backend, q, k, v, go, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_option_with_dropout(backend):
    """Dropout with the options: the oracle is given the kernel's keep mask."""
    B, H, Hkv, Lq, Lk, D, p = 2, 4, 2, 70, 90, 32, 0.3
    q, k, v, go = _inputs(B, H, Hkv, Lq, Lk, D, F32)
    g = torch.Generator().manual_seed(8)
    kw = dict(causal="bottom_right", window=(30, -1), softcap=3.0, sinks=torch.randn(H, generator=g),
              alibi_slopes=torch.rand(B, H, generator=g) / 4, attn_mask=torch.randn(Lq, Lk, generator=g))
    torch.manual_seed(11)
    state = draw_rng_state()
    keep = keep_mask(state, (B, H, Lq, Lk), p)
    with ff.use_backend(backend):
        torch.manual_seed(11)
        ours = run_with_options(ff_attention_oracle_kwargs, q, k, v, go, ["sinks", "attn_mask"],
                                dropout_p=p, **kw)
    oracle = run_with_options(oracle_attention, q, k, v, go, ["sinks", "attn_mask"],
                              dtype=torch.float64, keep=keep, dropout_p=p, **kw)
    for name, o, r in zip(("out", "dq", "dk", "dv", "sinks", "attn_mask"), ours, oracle):
        tol = 1e-5 if name == "out" else 1e-4
        check(name, o, r, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_return_lse(backend, with_sinks):
    q, k, v, _ = _inputs(2, 4, 2, 113, 203, 40, F32)
    pad = torch.zeros(2, 203, dtype=torch.bool)
    pad[1] = True
    kw = dict(causal="bottom_right", window=(40, -1), key_padding_mask=pad)
    if with_sinks:
        kw["sinks"] = torch.randn(4)
    with ff.use_backend(backend):
        out, lse = ff.attention(q, k, v, return_lse=True, **kw)
    ref_out, ref_lse = oracle_attention(q.double(), k.double(), v.double(), return_lse=True,
                                        **{n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                                           for n, t in kw.items()})
    assert lse.dtype == F32 and lse.shape == (2, 4, 113)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    check("lse", lse[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)
    check("out", out, ref_out, atol=1e-5, rtol=1e-5)


# ---- fp64 gradcheck, ISA levels -----------------------------------------------------------------
@pytest.mark.parametrize("causal", CAUSAL)
def test_gradcheck_fp64_every_option(causal):
    f64 = dict(dtype=torch.float64)
    q, k, v = (torch.randn(2, 4, n, 16, **f64, requires_grad=True) for n in (17, 23, 23))
    k, v = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()
    sinks = torch.randn(4, **f64, requires_grad=True)
    mask = torch.randn(4, 17, 23, **f64, requires_grad=True)
    table = torch.randn(16, 4, **f64, requires_grad=True)
    slopes = torch.rand(4)

    def f(q, k, v, sinks, mask, table):
        return ff.attention(q, k, v, causal=causal, window=(6, 3), softcap=2.5, alibi_slopes=slopes,
                            sinks=sinks, attn_mask=mask,
                            position_bias=ff.RelativePositionBias(table, max_distance=32))
    with ff.use_backend("cpu"):
        assert torch.autograd.gradcheck(f, (q, k, v, sinks, mask, table), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_every_isa_level(capability_levels, dtype):
    """The variants at every CPU kernel level this machine runs (default, avx2, avx512)."""
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 120, 210, 40
    q, k, v, go = _inputs(B, H, Hkv, Lq, Lk, D, dtype)
    kw = dict(causal="top_left", window=(50, -1), softcap=3.0, sinks=torch.randn(H).to(dtype),
              alibi_slopes=torch.rand(H) / 4, attn_mask=torch.randn(1, H, Lq, Lk).to(dtype),
              position_bias=(torch.randn(32, H).to(dtype), False, 128))
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            _compare("cpu", q, k, v, go, **kw)
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])


@pytest.mark.parametrize("gemm", BF16_GEMMS)
def test_bf16_gemm_paths(gemm):
    with bf16_attention_gemm(gemm):
        q, k, v, go = _inputs(2, 4, 2, 150, 260, 72, BF16)
        kw = dict(causal="bottom_right", window=(80, -1), softcap=5.0, sinks=torch.randn(4).to(BF16),
                  alibi_slopes=torch.rand(4) / 8, attn_mask=torch.randn(2, 1, 150, 260).to(BF16),
                  position_bias=(torch.randn(32, 4).to(BF16), True, 64))
        _compare("cpu", q, k, v, go, **kw)


def test_options_reach_the_kernels():
    """The cpu backend runs every option itself (no fallback), and says so."""
    q, k, v, _ = _inputs(1, 2, 2, 30, 40, 16, F32)
    table = torch.randn(8, 2)
    kw = to_ff_kwargs(dict(window=(3, 4), softcap=2.0, alibi_slopes=torch.rand(2), sinks=torch.randn(2),
                           position_bias=(table, True, 16),
                           attn_mask=torch.randn(2, 30, 40, requires_grad=True)))
    ff.attention(q, k, v, **kw)
    d = ff.last_dispatch()
    assert d.backend == "cpu" and not d.rejected, str(d)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_window_never_reads_keys_outside_the_band(dtype):
    """Decoding-like shape: 40 queries, 2000 keys, bottom-right causal, window 100: no query
    sees keys below 1860. Poisoning those keys (and values) with NaN changes nothing: the key
    blocks outside the band are never visited, and where the band's lower edge cuts a tile the
    skipped scores are never read (forward and backward)."""
    B, H, Lq, Lk, D, left = 1, 2, 40, 2000, 64, 100
    q, k, v, go = _inputs(B, H, H, Lq, Lk, D, dtype)
    first_visible = Lk - Lq - left
    kp, vp = k.clone(), v.clone()
    kp[:, :, :first_visible] = float("nan")
    vp[:, :, :first_visible] = float("nan")
    kw = dict(causal="bottom_right", window=(left, 0))
    with ff.use_backend("cpu"):
        clean = run_with_options(ff_attention_oracle_kwargs, q, k, v, go, [], **kw)
        poisoned = run_with_options(ff_attention_oracle_kwargs, q, kp, vp, go, [], **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), clean, poisoned):
        if name in ("dk", "dv"):
            a, b = a[:, :, first_visible:], b[:, :, first_visible:]
        assert torch.equal(a, b), name
    assert (poisoned[2][:, :, :first_visible] == 0).all() and (poisoned[3][:, :, :first_visible] == 0).all()
