"""ff.attention on the cpu and reference backends vs eager PyTorch (ARCHITECTURE.md, "Numerical
policy").

Every case checks the output and dq, dk, dv. fp32 against an fp64 oracle (atol=rtol=1e-5
forward, 1e-4 gradients); fp16/bf16 by the error-ratio rule against eager PyTorch in the same
precision. The Triton backend has its own file (interpreter-sized shapes); CUDA its GPU file.
"""
import itertools

import pytest
import torch
from attention_oracle import BF16_GEMMS, bf16_attention_gemm, ff_attention, oracle_attention, oracle_grads, rising_score_inputs, run
from oracle import check

import fastformer as ff
from fastformer.reference.attention import band_mask
from fastformer.reference.rng import draw_rng_state, keep_mask

BACKENDS = ["cpu", "reference"]
SHAPES = [(1, 1), (1, 239), (17, 17), (113, 203), (203, 113), (128, 128), (256, 512)]
HEAD_DIMS = [16, 40, 64, 72, 80, 128, 256]
HEADS = [(4, 4), (8, 2), (8, 1)]  # MHA, GQA, MQA
CAUSAL = [False, "top_left", "bottom_right"]


def _inputs(B, H, Hkv, Lq, Lk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(B, H, Lq, D), mk(B, Hkv, Lk, D), mk(B, Hkv, Lk, D), mk(B, H, Lq, D)


def _compare(backend, q, k, v, go, **kw):
    with ff.use_backend(backend):
        ours = run(ff_attention, q, k, v, go, **kw)
    oracle = oracle_grads(q, k, v, go, **kw)
    lowp = [None] * 4
    if q.dtype in (torch.float16, torch.bfloat16):
        lowp = run(oracle_attention, q, k, v, go, **kw)
    for name, o, r, l in zip(("out", "dq", "dk", "dv"), ours, oracle, lowp):
        grad = name != "out"
        tol = 1e-4 if grad else 1e-5
        check(name, o, r, l, grad=grad, atol=tol, rtol=tol)
    return ours


# Every (Lq, Lk) pair with every head dim, rotating heads, batch and causality through them.
_SHAPE_CASES = [
    (lq, lk, d, HEADS[i % 3], 1 + 2 * (i % 2), CAUSAL[i % 3])
    for i, ((lq, lk), d) in enumerate(itertools.product(SHAPES, HEAD_DIMS))
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lq,lk,d,heads,batch,causal", _SHAPE_CASES,
                         ids=[f"{c[0]}x{c[1]}-d{c[2]}-h{c[3][0]}kv{c[3][1]}-b{c[4]}-{c[5]}" for c in _SHAPE_CASES])
def test_shapes_fp32(backend, lq, lk, d, heads, batch, causal):
    q, k, v, go = _inputs(batch, heads[0], heads[1], lq, lk, d, torch.float32)
    _compare(backend, q, k, v, go, causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lq,lk,d,causal", [(113, 203, 64, False), (203, 113, 40, "top_left"),
                                             (128, 128, 128, "bottom_right"), (17, 17, 80, False),
                                             (1, 239, 72, False)])
def test_low_precision(backend, dtype, lq, lk, d, causal):
    q, k, v, go = _inputs(2, 8, 2, lq, lk, d, dtype)
    _compare(backend, q, k, v, go, causal=causal)


# bf16 at the avx512 level runs its GEMMs on AMX tiles where the CPU has AMX-BF16, else on
# AVX512-BF16 where it has that (csrc/cpu/bf16_gemm.h): head dims padded to 32, 16-row tiles,
# causal blocks skipped 32 x 32 (AMX) or 8 x 32 (AVX512-BF16) at a time. Every path against the
# oracle, at head dims off those grids.
_BF16_GEMM_CASES = [(113, 203, 40, (8, 2), "top_left"), (203, 113, 72, (4, 4), "bottom_right"),
              (256, 512, 128, (8, 1), False), (1, 239, 8, (4, 4), False), (45, 37, 200, (2, 2), "top_left"),
              (17, 17, 24, (2, 1), False),
              # decoding (attention_decode.cpp): G * Lq rows of a kv head against key rows read
              # in place (head dims of 32s), over several key blocks and splits
              (4, 800, 128, (8, 2), "bottom_right"), (3, 500, 64, (16, 1), False)]


@pytest.mark.parametrize("gemm", BF16_GEMMS)
@pytest.mark.parametrize("lq,lk,d,heads,causal", _BF16_GEMM_CASES,
                         ids=[f"{c[0]}x{c[1]}-d{c[2]}-{c[4]}" for c in _BF16_GEMM_CASES])
def test_bf16_gemm_paths(gemm, lq, lk, d, heads, causal):
    q, k, v, go = _inputs(2, heads[0], heads[1], lq, lk, d, torch.bfloat16)
    with bf16_attention_gemm(gemm):
        _compare("cpu", q, k, v, go, causal=causal)
        # a padded key row and a float mask: the score_row path after the bf16 GEMM
        pad = _padding(2, lk)
        mask = torch.randn(lq, lk, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        _compare("cpu", q, k, v, go, causal=causal, key_padding_mask=pad, attn_mask=mask)


def _padding(B, Lk, seed=1):
    g = torch.Generator().manual_seed(seed)
    pad = torch.rand(B, Lk, generator=g) < 0.3
    pad[0] = True  # a fully padded batch row: its queries see no key
    return pad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_kind", ["padding", "bool_batch", "bool_heads", "bool_2d",
                                       "float_batch", "float_heads", "float_2d", "float_neg_inf"])
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
def test_masks(backend, dtype, mask_kind, causal):
    B, H, Hkv, Lq, Lk, D = 3, 4, 2, 113, 203, 40
    q, k, v, go = _inputs(B, H, Hkv, Lq, Lk, D, dtype)
    g = torch.Generator().manual_seed(2)
    kw = {"causal": causal}
    if mask_kind == "padding":
        kw["key_padding_mask"] = _padding(B, Lk)
    else:
        kind, where = mask_kind.split("_", 1)
        shape = {"batch": (B, 1, Lq, Lk), "heads": (1, H, Lq, Lk), "2d": (Lq, Lk),
                 "neg_inf": (B, H, Lq, Lk)}[where]
        if kind == "bool":
            mask = torch.rand(*shape, generator=g) > 0.3
            mask[..., 5, :] = False  # a fully masked query row
        else:
            mask = torch.randn(*shape, generator=g).to(dtype)
            if where == "neg_inf":
                mask = mask.masked_fill(torch.rand(*shape, generator=g) > 0.7, float("-inf"))
                mask[..., 7, :] = float("-inf")  # an all -inf row: zeros, not NaN
        kw["attn_mask"] = mask
    ours = _compare(backend, q, k, v, go, **kw)
    assert all(torch.isfinite(t).all() for t in ours), "NaN/inf from masked rows"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_give_zeros_and_zero_grads(backend):
    q, k, v, go = _inputs(2, 2, 2, 9, 12, 16, torch.float32)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1] = True
    with ff.use_backend(backend):
        out, dq, dk, dv = run(ff_attention, q, k, v, go, key_padding_mask=pad)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(dq[1], torch.zeros_like(dq[1]))
    assert torch.equal(dk[1], torch.zeros_like(dk[1])) and torch.equal(dv[1], torch.zeros_like(dv[1]))
    # bottom-right alignment with Lq > Lk: the first Lq - Lk queries see nothing
    q, k, v, go = _inputs(1, 2, 2, 12, 5, 16, torch.float32)
    with ff.use_backend(backend):
        out, dq, _, _ = run(ff_attention, q, k, v, go, causal="bottom_right")
    assert torch.equal(out[:, :, :7], torch.zeros_like(out[:, :, :7]))
    assert torch.equal(dq[:, :, :7], torch.zeros_like(dq[:, :, :7]))


# Masks with structure at the cpu kernel's tile scale (144 queries x 192 keys,
# csrc/cpu/attention_mask_structure.h). An exact band ("band", "band_two_sided") is run as the
# equivalent window; else tiles the mask excludes wholly are skipped, tiles it attends wholly
# take the unmasked path, the rest the masked one: every kind is in each of those cases, and
# (FULLY_MASKED) rows whose every tile is skipped (fully masked: zeros).
def _band(Lq, Lk, left, right):
    return band_mask(Lq, Lk, 0, left, right)


def _structured_mask(kind, B, H, Lq, Lk):
    if kind == "band":            # a sliding window materialized, as a traced HF model passes it
        return _band(Lq, Lk, 250, 0).expand(B, 1, Lq, Lk)
    if kind == "band_two_sided":
        return _band(Lq, Lk, 100, 333)
    if kind == "band_one_off":    # a band but for one pair: not a window
        mask = _band(Lq, Lk, 250, 0).expand(B, 1, Lq, Lk).clone()
        mask[1, 0, 590, 3] = True
        return mask
    if kind == "band_per_head":  # a different window per head
        mask = torch.stack([_band(Lq, Lk, 100 + 150 * h, 40 * h) for h in range(H)])[None].expand(B, H, Lq, Lk)
    elif kind == "documents":     # block-diagonal: packed documents of 300 / 210 / rest
        doc_q = torch.bucketize(torch.arange(Lq), torch.tensor([300, 510]), right=True)
        doc_k = torch.bucketize(torch.arange(Lk), torch.tensor([300, 510]), right=True)
        mask = (doc_q[:, None] == doc_k[None])[None, None].expand(B, 1, Lq, Lk).clone()
    else:                         # "keys": (B, 1, 1, Lk), a key-padding mask in bool-mask form
        mask = torch.ones(B, 1, 1, Lk, dtype=torch.bool)
        mask[0, ..., 200:] = False
        mask[-1, ..., :400] = False
        return mask
    mask = mask.clone()
    mask[-1, :, 320:480] = False  # fully masked query rows across every key block
    return mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["band", "band_two_sided", "band_one_off", "band_per_head", "documents", "keys"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_bool_masks_with_whole_tiles_masked_or_attended(backend, dtype, kind, causal):
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 600, 700, 40
    q, k, v, go = _inputs(B, H, Hkv, Lq, Lk, D, dtype)
    ours = _compare(backend, q, k, v, go, causal=causal, attn_mask=_structured_mask(kind, B, H, Lq, Lk))
    if kind in ("band_per_head", "documents"):  # their rows 320 .. 479 of the last batch row
        assert torch.equal(ours[0][-1, :, 320:480], torch.zeros_like(ours[0][-1, :, 320:480]))
        assert torch.equal(ours[1][-1, :, 320:480], torch.zeros_like(ours[1][-1, :, 320:480]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_padding_with_whole_key_blocks_padded(backend):
    """Key blocks all padding (skipped), none padding (the unmasked path) and mixed, alone and
    with a bool band mask on top."""
    B, H, Lq, Lk, D = 3, 2, 300, 800, 24
    q, k, v, go = _inputs(B, H, H, Lq, Lk, D, torch.float32)
    pad = torch.zeros(B, Lk, dtype=torch.bool)
    pad[0, 190:] = True
    pad[1, :390] = True
    pad[2, 500:505] = True
    _compare(backend, q, k, v, go, key_padding_mask=pad)
    _compare(backend, q, k, v, go, key_padding_mask=pad, attn_mask=_band(Lq, Lk, 300, 200), causal="bottom_right")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("jump", [2.0, 14.0, 100.0])
def test_large_scores_rising_between_key_blocks(backend, jump):
    """Scores around 0, jump and 2 * jump (natural units) in three key blocks of the cpu kernel
    (kBlockK = 192 keys, csrc/cpu/attention_common.h; the reference ignores blocks): the online
    softmax rescales at every block, at magnitudes where fp32 rounding of the scaled scores is
    ~1e-5. The backward recomputes P from the saved lse, so it must score exactly as the forward
    did: scaling Q before the forward's GEMM but S after the backward's puts dq 2e-4 off at
    jump 100 (eager 2e-6). Entries are multiples of 1/64 and scale is 1,
    so Q K^T is exact in fp32 and the comparison with the fp64 oracle measures the softmax."""
    q, k, v, go = rising_score_inputs(jump, block=192)
    _compare(backend, q, k, v, go, scale=1.0)
    # The same keys in falling order: the first block holds every row's max (no rescaling).
    _compare(backend, q, k.flip(2), v, go, scale=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_key_blocks_bounded_above_the_running_max(capability_levels, dtype):
    """The cpu forward skips a key block's max pass when scale |q_i| max_j |k_j| is within 24
    (log2 units, kShiftHeadroom) of the row's running max, shifting by that max: P then reaches
    2^23 before the normalization. Keys parallel to the queries make the bound exact: block 0's
    scores are the row's first max, block 1's 23 log2 units above it (bounded: no max pass),
    block 2's 140 above block 0's (the bound fails: the pass and a rescale; shifted by block 0's
    max its P would overflow fp32), the short block 3 back at block 0's level. Every CPU level
    (exp2 of positive arguments differs between them)."""
    D, Lq = 16, 40
    log2e = 1.4426950408889634
    levels = torch.tensor([0.5, 0.5 + 23 / log2e, 0.5 + 140 / log2e, 0.5])  # |k| per block (natural units)
    norms = torch.cat([levels[i].repeat(n) for i, n in enumerate((192, 192, 192, 30))])
    g = torch.Generator().manual_seed(3)
    direction = torch.ones(D) / D ** 0.5
    q = (direction * (1 + 0.01 * torch.rand(1, 2, Lq, 1, generator=g, dtype=torch.float64))).to(dtype)
    k = (direction * norms[:, None] * (1 - 0.01 * torch.rand(1, 2, len(norms), 1, generator=g,
                                                             dtype=torch.float64))).to(dtype)
    v = torch.randn(1, 2, len(norms), D, generator=g, dtype=torch.float64).to(dtype)
    go = torch.randn(1, 2, Lq, D, generator=g, dtype=torch.float64).to(dtype)
    try:
        for level in capability_levels:
            ff._ext.set_cpu_capability(level)
            _compare("cpu", q, k, v, go, scale=1.0)
    finally:
        ff._ext.set_cpu_capability(capability_levels[-1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [None, 0.05, 1.7, -0.3])  # -0.3: score_row on every tile
def test_scale(backend, scale):
    q, k, v, go = _inputs(1, 2, 2, 33, 47, 24, torch.float32)
    _compare(backend, q, k, v, go, scale=scale, causal="top_left")


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    """(B, L, H, D) projections viewed as (B, H, L, D): no copies, right answers."""
    B, L, H, D = 2, 37, 4, 32
    qkv = torch.randn(B, L, 3, H, D)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    go = torch.randn(B, H, L, D)
    _compare(backend, q, k, v, go, causal=True)


# ---- dropout --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # bf16: AMX where there is one
def test_dropout_matches_oracle_with_the_same_mask(backend, causal, dtype):
    B, H, Hkv, Lq, Lk, D, p = 2, 4, 2, 31, 45, 16, 0.3
    q, k, v, go = _inputs(B, H, Hkv, Lq, Lk, D, dtype)
    torch.manual_seed(123)
    rng_state = draw_rng_state()
    keep = keep_mask(rng_state, (B, H, Lq, Lk), p)
    torch.manual_seed(123)
    with ff.use_backend(backend):
        ours = run(ff_attention, q, k, v, go, dropout_p=p, causal=causal)
    oracle = oracle_grads(q, k, v, go, keep=keep, dropout_p=p, causal=causal)
    lowp = [None] * 4
    if dtype == torch.bfloat16:
        lowp = run(oracle_attention, q, k, v, go, keep=keep, dropout_p=p, causal=causal)
    for name, o, r, l in zip(("out", "dq", "dk", "dv"), ours, oracle, lowp):
        check(name, o, r, l, atol=1e-4 if name != "out" else 1e-5, rtol=1e-4 if name != "out" else 1e-5)


def test_dropout_is_reproducible_and_varies_between_calls():
    q, k, v, go = _inputs(1, 2, 2, 40, 40, 16, torch.float32)
    torch.manual_seed(7)
    a = run(ff_attention, q, k, v, go, dropout_p=0.5)
    torch.manual_seed(7)
    b = run(ff_attention, q, k, v, go, dropout_p=0.5)
    c = run(ff_attention, q, k, v, go, dropout_p=0.5)  # generator advanced: a new mask
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not torch.equal(a[0], c[0])


def test_dropout_fraction_and_expectation():
    """out = P' when v is the identity: the zero fraction is the drop rate."""
    p, L = 0.2, 128
    q = torch.randn(2, 4, 256, L) * 0.1
    k = torch.randn(2, 4, L, L) * 0.1
    v = torch.eye(L).expand(2, 4, L, L)
    out = ff.attention(q, k, v, dropout_p=p)
    dropped = (out == 0).double().mean().item()
    assert abs(dropped - p) < 0.01, dropped
    # E[out] over masks equals the no-dropout output (within the Monte-Carlo noise)
    q, k, v, _ = _inputs(1, 2, 2, 8, 16, 8, torch.float32)
    plain = ff.attention(q, k, v)
    mean = torch.stack([ff.attention(q, k, v, dropout_p=0.3) for _ in range(3000)]).mean(0)
    assert (mean - plain).abs().max() < 0.03


# ---- gradcheck and torch.compile -------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(causal="top_left"), dict(causal="bottom_right"),
                                dict(attn_mask="float"), dict(key_padding_mask=True),
                                dict(dropout_p=0.25)], ids=lambda kw: "-".join(kw))
def test_gradcheck_fp64_cpu(kw):
    q, k, v, _ = _inputs(1, 4, 2, 5, 7, 8, torch.float64)
    kw = dict(kw)
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(1, 1, 5, 7, dtype=torch.float64)
    if kw.get("key_padding_mask"):
        kw["key_padding_mask"] = torch.tensor([[False, True, False, False, True, False, False]])
    leaves = [t.requires_grad_(True) for t in (q, k, v)]

    def fn(q, k, v):
        torch.manual_seed(0)  # the same dropout mask on every evaluation
        return ff.attention(q, k, v, **kw)

    with ff.use_backend("cpu"):
        assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_compile_fullgraph_attention():
    torch._dynamo.reset()
    q, k, v, go = _inputs(2, 4, 2, 19, 23, 16, torch.float32)

    def block(q, k, v):
        return ff.attention(q, k, v, causal=True) * 2

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    a = run(compiled, q, k, v, go)
    b = run(block, q, k, v, go)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


# ---- bad input --------------------------------------------------------------------------------------
def _bad_cases():
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    return [
        (lambda: ff.attention(q[0], k, v), ValueError, "q"),
        (lambda: ff.attention(q, k[:1], v), ValueError, "k"),
        (lambda: ff.attention(q, k[..., :8], v), ValueError, "k"),
        (lambda: ff.attention(q, k, v[:, :, :5]), ValueError, "v"),
        (lambda: ff.attention(q, torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16)), ValueError, "k"),
        (lambda: ff.attention(q, k, v.double()), TypeError, "v"),
        (lambda: ff.attention(q.long(), k, v), TypeError, "q"),
        (lambda: ff.attention(q, k, v.to("meta")), ValueError, "v"),
        (lambda: ff.attention(q, k, v, key_padding_mask=torch.zeros(2, 9)), TypeError, "key_padding_mask"),
        (lambda: ff.attention(q, k, v, key_padding_mask=torch.zeros(2, 8, dtype=torch.bool)), ValueError, "key_padding_mask"),
        (lambda: ff.attention(q, k, v, attn_mask=torch.zeros(8, 8)), ValueError, "attn_mask"),
        (lambda: ff.attention(q, k, v, attn_mask=torch.zeros(8, 9, dtype=torch.int32)), TypeError, "attn_mask"),
        (lambda: ff.attention(q, k, v, dropout_p=1.0), ValueError, "dropout_p"),
        (lambda: ff.attention(q, k, v, dropout_p=-0.1), ValueError, "dropout_p"),
        (lambda: ff.attention(q, k, v, causal="diagonal"), ValueError, "causal"),
        (lambda: ff.attention(q, k, v, scale=float("nan")), ValueError, "scale"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_names_the_argument(case):
    call, exc, name = _bad_cases()[case]
    with pytest.raises(exc, match=f"`{name}`"):
        call()
