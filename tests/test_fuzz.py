"""Property-based fuzzing of the public ops against eager PyTorch (hypothesis, seeded, bounded).

Random shapes (1 and odd sizes included), dtypes, strides (transposed views, slices, expanded
inputs), masks (random bool/float, fully masked rows, padding), causal modes, GQA ratios, head
dims, scales and eps values; forward and gradients. The cpu backend gets the large budgets
(>= 300 attention and >= 200 add+norm cases per run), the Triton interpreter small ones.
A failure is shrunk by hypothesis and printed with the exact example.
"""
import pytest
import torch
from attention_oracle import ff_attention_oracle_kwargs, oracle_attention, oracle_grads, run, run_with_options
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from oracle import check, row_sum_tol

import fastformer as ff
from fastformer import backends

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_FUZZ = settings(deadline=None, database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fuzz(max_examples: int):
    """Seeded (see @seed on each test), no example database, no per-example deadline."""
    return settings(_FUZZ, max_examples=max_examples)


def _leaf_and_view(t: torch.Tensor, kind: str):
    """A leaf storing t's values in another layout, and the view that presents them as t.

    The op sees the strided view; gradients flow back to the leaf through autograd."""
    if kind == "transposed" and t.dim() >= 3:
        return t.transpose(0, 1).contiguous(), lambda leaf: leaf.transpose(0, 1)
    if kind == "sliced":
        big = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype)
        big[..., 1:1 + t.shape[-1]] = t
        return big, lambda leaf: leaf[..., 1:1 + t.shape[-1]]
    return t, lambda leaf: leaf


def _upstream(outs, grad_seed=1):
    gen = torch.Generator().manual_seed(grad_seed)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]


def _grads_through_views(fn, tensors, views, grad_outs=None):
    """Outputs of fn(*views(leaves)) and the gradients w.r.t. the views (given upstream grads,
    default: seeded random ones)."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    args = [view(leaf) if leaf is not None else None for leaf, view in zip(leaves, views)]
    for a in args:
        if a is not None:
            a.retain_grad()
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    grad_outs = _upstream(outs) if grad_outs is None else grad_outs
    loss = sum((o.double() * g.double()).sum() for o, g in zip(outs, grad_outs))
    used = [a for a in args if a is not None]
    if loss.requires_grad:
        loss.backward()
    grads = [a.grad if a.grad is not None else torch.zeros_like(a) for a in used]
    return [o.detach() for o in outs], grads


def _has_triton_cpu():
    b = backends.get("triton")
    return b.availability() is None and "cpu" in b.devices()


# ---- attention ---------------------------------------------------------------------------------
@st.composite
def attention_case(draw, max_len=48, head_dims=(8, 16, 24, 40, 64)):
    groups = draw(st.sampled_from([1, 2, 4]))
    hkv = draw(st.integers(1, 2))
    return dict(
        B=draw(st.integers(1, 2)), H=hkv * groups, Hkv=hkv,
        Lq=draw(st.integers(1, max_len)), Lk=draw(st.integers(1, max_len)),
        D=draw(st.sampled_from(head_dims)),
        dtype=draw(st.sampled_from(DTYPES)),
        causal=draw(st.sampled_from([False, "top_left", "bottom_right"])),
        mask=draw(st.sampled_from([None, "bool", "float", "padding", "bool+padding"])),
        mask_shape=draw(st.sampled_from(["full", "batch", "heads", "2d"])),
        layout=draw(st.sampled_from(["contiguous", "transposed", "sliced"])),
        scale=draw(st.sampled_from([None, 0.1, 1.0, 3.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def _attention_inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, H, Hkv, Lq, Lk, D = c["B"], c["H"], c["Hkv"], c["Lq"], c["Lk"], c["D"]
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(c["dtype"])  # noqa: E731
    q, k, v, go = mk(B, H, Lq, D), mk(B, Hkv, Lk, D), mk(B, Hkv, Lk, D), mk(B, H, Lq, D)
    kw = {"causal": c["causal"], "scale": c["scale"]}
    shape = {"full": (B, H, Lq, Lk), "batch": (B, 1, Lq, Lk), "heads": (1, H, Lq, Lk),
             "2d": (Lq, Lk)}[c["mask_shape"]]
    if c["mask"] and "bool" in c["mask"]:
        m = torch.rand(*shape, generator=g) > 0.25
        m[..., 0, :] = False  # a fully masked row
        kw["attn_mask"] = m
    elif c["mask"] == "float":
        m = torch.randn(*shape, generator=g).to(c["dtype"])
        kw["attn_mask"] = m.masked_fill(torch.rand(*shape, generator=g) > 0.8, float("-inf"))
    if c["mask"] and "padding" in c["mask"]:
        pad = torch.rand(B, Lk, generator=g) > 0.7
        pad[-1] = True
        kw["key_padding_mask"] = pad
    return q, k, v, go, kw


def _check_attention(backend, c):
    q, k, v, go, kw = _attention_inputs(c)
    leaves, views = zip(*(_leaf_and_view(t, c["layout"]) for t in (q, k, v)))
    with ff.use_backend(backend):
        outs, grads = _grads_through_views(lambda q, k, v: ff.attention(q, k, v, **kw), leaves,
                                           views, [go])
    ours = (outs[0], *grads)
    oracle = oracle_grads(q, k, v, go, **kw)
    lowp = run(oracle_attention, q, k, v, go, **kw)  # eager in the input dtype (fp32 too)
    for name, o, r, l in zip(("out", "dq", "dk", "dv"), ours, oracle, lowp):
        tol = 1e-4 if name != "out" else 1e-5
        check(name, o, r, l, grad=name != "out", atol=tol, rtol=tol)


@fuzz(320)
@seed(20261129)
@given(c=attention_case())
def test_fuzz_attention_cpu(c):
    _check_attention("cpu", c)


@pytest.mark.skipif(not _has_triton_cpu(), reason="triton not installed or TRITON_INTERPRET unset")
@fuzz(25)
@seed(20261130)
@given(c=attention_case(max_len=40, head_dims=(16, 32, 40)))
def test_fuzz_attention_triton(c):
    _check_attention("triton", c)


# The variants (window, softcap, ALiBi, sinks, T5 bias, learned masks) drawn together, with
# their own gradients.
@st.composite
def attention_options_case(draw, max_len=48, head_dims=(8, 16, 40, 64)):
    c = draw(attention_case(max_len, head_dims))
    side = st.sampled_from([-1, 0, 1, 3, 17, 100])
    c.update(
        window=draw(st.one_of(st.none(), st.tuples(side, side))),
        softcap=draw(st.sampled_from([None, 0.5, 3.0, 30.0])),
        alibi=draw(st.sampled_from([None, "H", "BH"])),
        sinks=draw(st.booleans()),
        bias=draw(st.sampled_from([None, "encoder", "decoder"])),
        learned_mask=draw(st.booleans()),
        layout="contiguous",
    )
    return c


def _check_attention_options(backend, c):
    q, k, v, go, kw = _attention_inputs(c)
    g = torch.Generator().manual_seed(c["seed"] + 1)
    B, H = c["B"], c["H"]
    kw.update(window=c["window"], softcap=c["softcap"])
    if c["alibi"]:
        kw["alibi_slopes"] = torch.rand(H, generator=g) if c["alibi"] == "H" else torch.rand(B, H, generator=g)
    if c["sinks"]:
        kw["sinks"] = torch.randn(H, generator=g).to(c["dtype"])
    if c["bias"]:
        kw["position_bias"] = (torch.randn(16, H, generator=g).to(c["dtype"]), c["bias"] == "encoder", 20)
    names = [n for n in ("sinks",) if n in kw]
    if c["learned_mask"] and isinstance(kw.get("attn_mask"), torch.Tensor) and kw["attn_mask"].is_floating_point():
        kw["attn_mask"] = kw["attn_mask"].clamp(min=-1e4)  # finite, so that its gradient is
        names.append("attn_mask")
    if c["bias"]:
        names.append("table")
    with ff.use_backend(backend):
        ours = run_with_options(ff_attention_oracle_kwargs, q, k, v, go, names, **kw)
    up = torch.float64 if c["dtype"] == torch.float32 else torch.float32
    oracle = run_with_options(oracle_attention, q, k, v, go, names, dtype=up, **kw)
    lowp = run_with_options(oracle_attention, q, k, v, go, names, **kw)
    for name, o, r, l in zip(("out", "dq", "dk", "dv", *names), ours, oracle, lowp):
        tol = 1e-4 if name != "out" else 1e-5
        check(name, o, r, l, grad=name != "out", atol=tol, rtol=tol)


@fuzz(150)
@seed(20261201)
@given(c=attention_options_case())
def test_fuzz_attention_options_cpu(c):
    _check_attention_options("cpu", c)


# ---- variable lengths --------------------------------------------------------------------------
@st.composite
def varlen_case(draw):
    n = draw(st.integers(1, 5))
    q_lens = draw(st.lists(st.sampled_from([0, 1, 2, 17, 40, 113]), min_size=n, max_size=n))
    cross = draw(st.booleans())
    k_lens = draw(st.lists(st.sampled_from([0, 1, 5, 17, 64]), min_size=n, max_size=n)) if cross else q_lens
    Hkv = draw(st.sampled_from([1, 2]))
    option = draw(st.sampled_from([None, "window", "softcap", "alibi", "sinks"]))
    return dict(q_lens=q_lens, k_lens=k_lens, Hkv=Hkv, H=Hkv * draw(st.sampled_from([1, 2])),
                D=draw(st.sampled_from([8, 40, 72])), causal=draw(st.booleans()), option=option,
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), seed=draw(st.integers(0, 2**16)))


@fuzz(60)
@seed(20261202)
@given(c=varlen_case())
def test_fuzz_varlen_cpu(c):
    from test_varlen import _compare_varlen
    g = torch.Generator().manual_seed(c["seed"])
    kw = {"window": dict(window=(3, 1)), "softcap": dict(softcap=2.5),
          "alibi": dict(alibi=torch.rand(len(c["q_lens"]), c["H"], generator=g)),
          "sinks": dict(sinks=torch.randn(c["H"], generator=g)), None: {}}[c["option"]]
    _compare_varlen("cpu", c["q_lens"], c["k_lens"], c["H"], c["Hkv"], c["D"], c["dtype"],
                    causal=c["causal"], seed=c["seed"], **kw)


@st.composite
def kvcache_case(draw):
    B = draw(st.integers(1, 3))
    Lq = draw(st.sampled_from([1, 1, 3, 16, 17]))
    lens = draw(st.lists(st.integers(0, 90), min_size=B, max_size=B))
    return dict(B=B, Lq=Lq, lens=lens, Hkv=draw(st.sampled_from([1, 2])), G=draw(st.sampled_from([1, 4, 8])),
                D=draw(st.sampled_from([16, 80, 128])), paged=draw(st.booleans()), append=draw(st.booleans()),
                causal=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


@fuzz(60)
@seed(20261203)
@given(c=kvcache_case())
def test_fuzz_kvcache_cpu(c):
    from test_varlen import _cache_case, _cache_oracle, _paged
    B, Lq, H, Hkv, D = c["B"], c["Lq"], c["Hkv"] * c["G"], c["Hkv"], c["D"]
    q, k_cache, v_cache, k_new, v_new, seqlens = _cache_case(B, H, Hkv, Lq, D, c["lens"], 112, torch.float32,
                                                             c["seed"])
    if c["append"]:
        expect_k, expect_v = k_cache.clone(), v_cache.clone()
        for b, n in enumerate(c["lens"]):
            expect_k[b, :, n:n + Lq], expect_v[b, :, n:n + Lq] = k_new[b], v_new[b]
        total = seqlens + Lq
    else:
        k_new = v_new = None
        expect_k, expect_v, total = k_cache, v_cache, seqlens
    kc, vc, table = k_cache, v_cache, None
    if c["paged"]:
        kc, table = _paged(k_cache, 16, c["seed"])
        vc, _ = _paged(v_cache, 16, c["seed"])
    with ff.use_backend("cpu"):
        out = ff.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                        causal=c["causal"])
    ref = _cache_oracle(q, expect_k, expect_v, total, torch.float64, causal=c["causal"])
    # rows that see no key (an empty cache, or causal queries before the first key) are 0
    check("out", out, ref.nan_to_num(0.0).float(), atol=1e-5, rtol=1e-5)


# ---- add + norm --------------------------------------------------------------------------------
@st.composite
def norm_case(draw):
    return dict(
        rows=draw(st.integers(0, 40)), hidden=draw(st.sampled_from([1, 3, 7, 16, 33, 100, 257, 1000])),
        lead=draw(st.sampled_from([(), (2,), (3, 2)])),
        dtype=draw(st.sampled_from(DTYPES)),
        rms=draw(st.booleans()), residual=draw(st.booleans()), weight=draw(st.booleans()),
        bias=draw(st.booleans()), return_residual=draw(st.booleans()),
        layout=draw(st.sampled_from(["contiguous", "transposed", "sliced", "expanded"])),
        eps=draw(st.sampled_from([1e-5, 1e-6, 1e-2, 0.0])),
        seed=draw(st.integers(0, 2**16)),
    )


def _norm_call(c, x, r, w, b):
    if c["rms"]:
        return ff.rms_norm(x, w, c["eps"], residual=r, return_residual=c["return_residual"])
    return ff.add_layer_norm(x, r, w, b, c["eps"], return_residual=c["return_residual"])


def _norm_eager(c, x, r, w, b):
    z = x + r if r is not None else x
    shape = (x.shape[-1],)
    y = (torch.nn.functional.rms_norm(z, shape, w, c["eps"]) if c["rms"]
         else torch.nn.functional.layer_norm(z, shape, w, b, c["eps"]))
    return (y, z) if c["return_residual"] else y


def _check_norm(backend, c):
    g = torch.Generator().manual_seed(c["seed"])
    shape = (*c["lead"], c["rows"], c["hidden"])
    mk = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) * 3 + 1).to(c["dtype"])  # noqa: E731
    if c["eps"] == 0.0 and c["hidden"] == 1:
        c = dict(c, eps=1e-5)  # variance 0 with eps 0 is 1/0 in eager too
    if c["layout"] == "expanded":
        x_leaf = mk(*c["lead"], 1, c["hidden"])
        x_view = lambda leaf: leaf.expand(shape)  # noqa: E731  stride 0 over rows
    else:
        x_leaf, x_view = _leaf_and_view(mk(*shape), c["layout"])
    r = mk(*shape) if c["residual"] else None
    w = mk(c["hidden"]) if c["weight"] else None
    b = mk(c["hidden"]) if c["bias"] and not c["rms"] else None
    tensors = [x_leaf, r, w, b]
    ident = lambda t: t  # noqa: E731
    views = [x_view, ident, ident, ident]
    with ff.use_backend(backend):
        ours = _grads_through_views(lambda *a: _norm_call(c, *a), tensors, views)
    up = torch.float64 if c["dtype"] == torch.float32 else torch.float32
    upcast = [t.to(up) if t is not None else None for t in tensors]
    oracle = _grads_through_views(lambda *a: _norm_eager(c, *a), upcast, views)
    lowp = _grads_through_views(lambda *a: _norm_eager(c, *a), tensors, views)  # eager, same dtype
    rows = max(1, c["rows"]) * max(1, int(torch.tensor(c["lead"]).prod()) if c["lead"] else 1)
    for i, (o, r_) in enumerate(zip(ours[0], oracle[0])):
        check(f"out{i}", o, r_, lowp[0][i] if lowp else None)
    names = [n for n, t in zip(("dx", "dresidual", "dweight", "dbias"), tensors) if t is not None]
    for i, (name, o, r_) in enumerate(zip(names, ours[1], oracle[1])):
        tol = row_sum_tol(2e-5, rows) if name in ("dweight", "dbias") else 1e-5
        check(name, o, r_, lowp[1][i] if lowp else None, grad=True, atol=tol, rtol=tol)


@fuzz(220)
@seed(20261201)
@given(c=norm_case())
def test_fuzz_add_norm_cpu(c):
    _check_norm("cpu", c)


@pytest.mark.skipif(not _has_triton_cpu(), reason="triton not installed or TRITON_INTERPRET unset")
@fuzz(25)
@seed(20261202)
@given(c=norm_case())
def test_fuzz_add_norm_triton(c):
    if c["layout"] in ("transposed", "expanded") and c["lead"]:
        # rows without one common stride: triton declines them (auto falls back; test_backends)
        c = dict(c, layout="contiguous")
    _check_norm("triton", c)


# ---- feed-forward ------------------------------------------------------------------------------
FFN_ACTS = {"relu": torch.relu, "gelu": torch.nn.functional.gelu,
            "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
            "silu": torch.nn.functional.silu, "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t),
            "relu2": lambda t: torch.relu(t).square()}


@st.composite
def ffn_case(draw, max_tokens=40, dims=(1, 3, 8, 17, 64, 100), hiddens=(1, 5, 16, 33, 130)):
    gated = draw(st.booleans())
    return dict(
        lead=draw(st.sampled_from([(), (1,), (2,), (3,)])), tokens=draw(st.integers(1, max_tokens)),
        d=draw(st.sampled_from(dims)), hidden=draw(st.sampled_from(hiddens)),
        dtype=draw(st.sampled_from(DTYPES)), act=draw(st.sampled_from(list(FFN_ACTS))),
        gated=gated, bias=draw(st.sampled_from(["all", "none", "first"])),
        dropout=0.0 if gated else draw(st.sampled_from([0.0, 0.0, 0.3])),
        layout=draw(st.sampled_from(["contiguous", "transposed", "sliced"])),
        seed=draw(st.integers(0, 2**16)),
    )


def _ffn_eager(c, keep, x, w1, b1, w2, b2, w_up, b_up):
    act = FFN_ACTS[c["act"]]
    pre = torch.nn.functional.linear(x, w1, b1)
    if c["gated"]:
        h = act(pre) * torch.nn.functional.linear(x, w_up, b_up)
    else:
        h = act(pre)
        if keep is not None:
            h = h * keep.reshape(*x.shape[:-1], -1).to(h.dtype) / (1 - c["dropout"])
    return torch.nn.functional.linear(h, w2, b2)


def _check_ffn(backend, c):
    from fastformer.reference.rng import draw_rng_state, keep_mask
    g = torch.Generator().manual_seed(c["seed"])
    d, hidden = c["d"], c["hidden"]
    mk = lambda *s, scale=1.0: (torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
                                * scale).to(c["dtype"])
    shape = (*c["lead"], c["tokens"], d)
    x_leaf, x_view = _leaf_and_view(mk(*shape), c["layout"])
    w1, w2 = mk(hidden, d, scale=d ** -0.5), mk(d, hidden, scale=hidden ** -0.5)
    w_up = mk(hidden, d, scale=d ** -0.5) if c["gated"] else None
    b1 = mk(hidden, scale=0.5) if c["bias"] != "none" else None
    b2 = mk(d, scale=0.5) if c["bias"] == "all" else None
    b_up = mk(hidden, scale=0.5) if c["gated"] and c["bias"] == "all" else None
    tensors = [x_leaf, w1, b1, w2, b2, w_up, b_up]
    ident = lambda t: t  # noqa: E731
    views = [x_view] + [ident] * 6
    p = c["dropout"]

    def ours(x, w1, b1, w2, b2, w_up, b_up):
        if c["gated"]:
            return ff.swiglu_ffn(x, w1, w_up, w2, b1, b_up, b2, activation=c["act"])
        return ff.ffn(x, w1, b1, w2, b2, activation=c["act"], dropout_p=p)

    keep = None
    if p > 0:
        torch.manual_seed(c["seed"])
        keep = keep_mask(draw_rng_state(), (c["tokens"] * max(1, int(torch.tensor(c["lead"]).prod()))
                                             if c["lead"] else c["tokens"], hidden), p)
        torch.manual_seed(c["seed"])
    with ff.use_backend(backend):
        out = _grads_through_views(ours, tensors, views)
    up = torch.float64 if c["dtype"] == torch.float32 else torch.float32
    oracle = _grads_through_views(lambda *a: _ffn_eager(c, keep, *a),
                                  [t.to(up) if t is not None else None for t in tensors], views)
    lowp = _grads_through_views(lambda *a: _ffn_eager(c, keep, *a), tensors, views)
    check("y", out[0][0], oracle[0][0], lowp[0][0])
    tokens = c["tokens"] * (int(torch.tensor(c["lead"]).prod()) if c["lead"] else 1)
    names = [n for n, t in zip(("dx", "dw1", "db1", "dw2", "db2", "dw_up", "db_up"), tensors)
             if t is not None]
    for name, o, r, l in zip(names, out[1], oracle[1], lowp[1]):
        tol = 1e-5 if name == "dx" else row_sum_tol(2e-5, tokens)
        check(name, o, r, l, grad=True, atol=tol, rtol=tol)


@fuzz(220)
@seed(20261203)
@given(c=ffn_case())
def test_fuzz_ffn_cpu(c):
    _check_ffn("cpu", c)


@pytest.mark.skipif(not _has_triton_cpu(), reason="triton not installed or TRITON_INTERPRET unset")
@fuzz(20)
@seed(20261204)
@given(c=ffn_case(max_tokens=20, dims=(1, 8, 17, 40), hiddens=(1, 16, 33)))
def test_fuzz_ffn_triton(c):
    if c["layout"] == "transposed" and c["lead"]:
        c = dict(c, layout="contiguous")  # rows without one stride: triton declines them
    _check_ffn("triton", c)
