"""Attention suite: ff.attention vs torch's F.scaled_dot_product_attention vs eager math.

FLOPs: forward 4*B*H*L*L*D (half when causal), backward 2.5x the forward. Eager math is
softmax(q k^T / sqrt(d)) v with the score matrix materialized.

Variant cases (the attention options, against the same call without them or the baseline
that stands for them): a sliding window (left 512, causal) at (1, 8, 8192, 64) against our
full causal call ("ours_full"), SDPA given the equivalent boolean band mask ("sdpa") and our
call given that mask instead of the window ("ours_mask": the kernel reads it as the window);
softcap, ALiBi and sinks at (1, 8, 2048, 64) against the same call without the option
("ours_plain"); the T5 relative-position bias at (8, 8, 512, 64) against Hugging Face's eager
T5 attention math with its materialized (1, H, L, L) bias ("eager"). FLOPs of a window case:
the band's pairs only.

MLA case: multi-head latent attention's head dims (DeepSeek-V2/V3: q and k 192, v 128),
(1, 16, 2048), causal, against SDPA and eager math with the same Dv. FLOPs: 2 * B * H * L * L *
(D + Dv), halved for causal.

Varlen case: 16 causal sequences with lengths drawn from 64..2048 (fixed seed), 8 heads, head dim
64, packed (ff.varlen_attention, no padding) against the same batch padded to the longest with
its (B, 1, L, L) causal-and-padding mask, through SDPA ("sdpa") and through ff.attention with
causal=True and a key padding mask ("ours_padded"). FLOPs: the sequences' own causal pairs.

Baselines that would take longer than BUDGET_S per call are skipped with their estimate: torch's
bf16 matmul runs at ~1 GFLOP/s on CPUs without AVX512-BF16/AMX (AVX2-only ones), so eager
bf16 at L = 4096 would take minutes per call. Estimates come from each candidate's throughput on a
calibration shape measured in the same run.
"""
from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F

import fastformer as ff

from .common import Row, max_abs_err, policy_tolerance

SHAPES = [(8, 12, 128, 64), (4, 8, 512, 64), (1, 8, 2048, 64), (1, 16, 4096, 128)]
# The default run: a BERT-sized inference call and a causal training step at L = 2048.
QUICK_CASES = [((8, 12, 128, 64), False, "fwd"), ((1, 8, 2048, 64), True, "fwd+bwd")]
# Verdict bound on max_err (common.policy_tolerance): an output is a convex combination of
# rows of v ~ N(0, 1), so |y| <= max |v| ~ 5.5 at the largest shape; eager math's own max
# error on these inputs, bf16 0.012 and fp16 0.0027.
TOLERANCE = policy_tolerance(magnitude=5.5, eager_err={"bfloat16": 0.012, "float16": 0.0027})
MEMORY_SHAPE = (1, 8, 8192, 64)  # fwd+bwd peak memory: the score matrix alone would be 2 GiB
BUDGET_S = float(os.environ.get("FASTFORMER_BENCH_BUDGET_S", "20"))
CALIBRATION = (1, 4, 256, 64)


def eager_math(q, k, v, causal):
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


CANDIDATES = {
    "ours": lambda q, k, v, c: ff.attention(q, k, v, causal=c),
    "sdpa": lambda q, k, v, c: F.scaled_dot_product_attention(q, k, v, is_causal=c),
    "eager": eager_math,
}


def flops(shape, causal, mode):
    B, H, L, D = shape
    f = 4 * B * H * L * L * D / (2 if causal else 1)
    return f * (3.5 if mode == "fwd+bwd" else 1.0)


def _step(fn, q, k, v, causal, mode, grad_out):
    if mode == "fwd":
        return lambda: fn(q, k, v, causal)
    return lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), grad_out)


_rates: dict = {}


def _rate(name, dtype, mode, device):
    """GFLOP/s of a candidate on the calibration shape (measured once per run)."""
    key = (name, dtype, mode)
    if key not in _rates:
        q, k, v = [torch.randn(CALIBRATION, dtype=dtype, device=device, requires_grad=mode != "fwd")
                   for _ in range(3)]
        fn = _step(CANDIDATES[name], q, k, v, False, mode, torch.randn_like(q))
        fn()
        start = time.perf_counter()
        fn()
        _rates[key] = flops(CALIBRATION, False, mode) / (time.perf_counter() - start) / 1e9
    return _rates[key]


def cases(device: str, dtypes: list, quick: bool = False):
    """Every case; quick: the representative ones fastformer-bench runs without --full."""
    if quick:
        for shape, causal, mode in QUICK_CASES:
            for dtype in dtypes:
                yield dict(shape=shape, dtype=dtype, causal=causal, mode=mode, device=device)
        return
    for shape in SHAPES:
        for dtype in dtypes:
            for causal in (False, True):
                for mode in ("fwd", "fwd+bwd"):
                    yield dict(shape=shape, dtype=dtype, causal=causal, mode=mode, device=device)
    if torch.float32 in dtypes:
        yield dict(shape=MEMORY_SHAPE, dtype=torch.float32, causal=False, mode="fwd+bwd",
                   device=device, memory_only=True)
    for dtype in dtypes:
        for mode in ("fwd", "fwd+bwd"):
            yield dict(variant="window", shape=WINDOW_SHAPE, dtype=dtype, causal=True, mode=mode,
                       device=device)
            for variant in ("softcap", "alibi", "sinks"):
                yield dict(variant=variant, shape=OPTION_SHAPE, dtype=dtype, causal=False,
                           mode=mode, device=device)
        yield dict(variant="t5", shape=T5_SHAPE, dtype=dtype, causal=False, mode="fwd+bwd",
                   device=device)
        yield dict(variant="varlen", shape=VARLEN_SHAPE, dtype=dtype, causal=True, mode="fwd+bwd",
                   device=device)
        for mode in ("fwd", "fwd+bwd"):
            yield dict(variant="mla", shape=MLA_SHAPE, dtype=dtype, causal=True, mode=mode, device=device)


def case_name(c: dict) -> str:
    """The row's case name, known before build() allocates anything (single_call filters on it)."""
    B, H, L, D = c["shape"]
    if c.get("variant") == "varlen":
        return f"varlen {B} seqs {VARLEN_MIN}..{L} H={H} D={D} causal"
    if c.get("variant") == "mla":
        return f"({B}, {H}, {L}, {D}, Dv {MLA_DV}) causal MLA"
    variant = {"window": f" window {WINDOW}", "softcap": f" softcap {SOFTCAP}", "alibi": " alibi",
               "sinks": " sinks", "t5": " T5 bias"}.get(c.get("variant"), "")
    return f"({B}, {H}, {L}, {D}){' causal' if c['causal'] else ''}{variant}"


WINDOW_SHAPE, WINDOW = (1, 8, 8192, 64), (512, 0)
OPTION_SHAPE, SOFTCAP = (1, 8, 2048, 64), 30.0
T5_SHAPE, T5_BUCKETS = (8, 8, 512, 64), 32
VARLEN_SHAPE, VARLEN_MIN = (16, 8, 2048, 64), 64  # sequences, heads, longest allowed, head dim
MLA_SHAPE, MLA_DV = (1, 16, 2048, 192), 128


def _build_varlen(c: dict):
    S, H, L_max, D = c["shape"]
    dtype, device = c["dtype"], c["device"]
    g = torch.Generator(device="cpu").manual_seed(0)
    lens = torch.randint(VARLEN_MIN, L_max + 1, (S,), generator=g).tolist()
    T, L = sum(lens), max(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    packed = [torch.randn(T, H, D, generator=g).to(device=device, dtype=dtype) for _ in range(4)]
    padded = [torch.zeros(S, H, L, D, device=device, dtype=dtype) for _ in range(4)]
    for s in range(S):
        for p, t in zip(padded, packed):
            p[s, :, :lens[s]] = t[cu[s]:cu[s + 1]].transpose(0, 1)
    for t in packed[:3] + padded[:3]:
        t.requires_grad_()
    valid = torch.arange(L, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]  # (S, L)
    i, j = torch.arange(L, device=device)[:, None], torch.arange(L, device=device)[None, :]
    mask = (j <= i)[None, None] & valid[:, None, None, :]

    def grads(fn, inputs):
        q, k, v, go = inputs
        return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), go)
    ours = lambda q, k, v: ff.varlen_attention(q, k, v, cu, cu, L, L, causal=True)  # noqa: E731
    fns = {"ours": grads(ours, packed),
           "sdpa": grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), padded),
           "ours_padded": grads(lambda q, k, v: ff.attention(q, k, v, causal=True, key_padding_mask=~valid), padded)}
    pairs = sum(n * (n + 1) // 2 for n in lens)

    def error():
        with torch.no_grad():
            q, k, v = (t.detach() for t in packed[:3])
            with ff.use_backend("reference"):
                ref = ours(q.double(), k.double(), v.double())
            return max_abs_err(ours(q, k, v), ref)
    row = Row("attention", case_name(c), str(dtype).replace("torch.", ""), c["mode"], {},
              {"flops": 4 * H * pairs * D * 3.5}, note=f"{T} tokens packed, {S * L} padded")
    return fns, row, error


def _variant_candidates(c: dict, q, k, v):
    """{name: fn(q, k, v, causal)} of a variant case, and its FLOPs."""
    B, H, L, D = c["shape"]
    g = torch.Generator(device="cpu").manual_seed(1)
    variant = c["variant"]
    if variant == "window":
        i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
        band = ((j <= i) & (j >= i - WINDOW[0])).to(q.device)
        pairs = int(band.sum())
        work = 4 * B * H * pairs * D * (3.5 if c["mode"] == "fwd+bwd" else 1.0)
        return {"ours": lambda q, k, v, causal: ff.attention(q, k, v, causal=True, window=WINDOW),
                "ours_full": lambda q, k, v, causal: ff.attention(q, k, v, causal=True),
                "ours_mask": lambda q, k, v, causal: ff.attention(q, k, v, attn_mask=band),
                "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, attn_mask=band)}, work
    if variant == "mla":
        work = 2 * B * H * L * L * (D + MLA_DV) / 2 * (3.5 if c["mode"] == "fwd+bwd" else 1.0)
        return {"ours": lambda q, k, v, causal: ff.attention(q, k, v, causal=True),
                "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                "eager": eager_math}, work
    work = flops(c["shape"], False, c["mode"])
    if variant == "t5":
        table = torch.randn(T5_BUCKETS, H, generator=g).to(q.device, q.dtype).requires_grad_()
        bias = ff.RelativePositionBias(table, bidirectional=True, max_distance=128)
        buckets = bias.buckets(L, L).long()

        def hf_eager(q, k, v, causal):
            # Hugging Face's eager T5 attention: no scaling, the bias materialized and added
            rel = torch.arange(L)[None, :] - torch.arange(L)[:, None]
            position_bias = table[buckets[rel + L - 1]].permute(2, 0, 1)[None]
            s = torch.matmul(q, k.transpose(-1, -2)) + position_bias
            return torch.matmul(torch.softmax(s, dim=-1), v)
        return {"ours": lambda q, k, v, causal: ff.attention(q, k, v, scale=1.0, position_bias=bias),
                "eager": hf_eager}, work
    kw = {"softcap": dict(softcap=SOFTCAP),
          "alibi": dict(alibi_slopes=(2.0 ** -torch.arange(1, H + 1, dtype=torch.float32)).to(q.device)),
          "sinks": dict(sinks=torch.randn(H, generator=g).to(q.device))}[variant]
    return {"ours": lambda q, k, v, causal: ff.attention(q, k, v, **kw),
            "ours_plain": lambda q, k, v, causal: ff.attention(q, k, v)}, work


def _build_variant(c: dict):
    shape, dtype, mode, device = c["shape"], c["dtype"], c["mode"], c["device"]
    g = torch.Generator(device="cpu").manual_seed(0)
    v_shape = (*shape[:3], MLA_DV) if c["variant"] == "mla" else shape
    q, k, v = [torch.randn(s, generator=g).to(device=device, dtype=dtype)
               .requires_grad_(mode != "fwd") for s in (shape, shape, v_shape)]
    grad_out = torch.randn(v_shape, generator=g).to(device=device, dtype=dtype)
    candidates, work = _variant_candidates(c, q, k, v)
    fns = {name: _step(fn, q, k, v, c["causal"], mode, grad_out) for name, fn in candidates.items()}

    def error():
        with torch.no_grad():
            qd, kd, vd = (t.detach() for t in (q, k, v))
            if c["variant"] == "window":  # the last 256 queries (the reference materializes)
                n = 256 + WINDOW[0]
                qd, kd, vd = qd[:, :, -256:], kd[:, :, -n:], vd[:, :, -n:]
                fn = lambda q, k, v, causal: ff.attention(q, k, v, causal="bottom_right", window=WINDOW)  # noqa: E731
            else:
                fn = candidates["ours"]
            with ff.use_backend("reference"):
                ref = fn(qd.double(), kd.double(), vd.double(), c["causal"])
            return max_abs_err(fn(qd, kd, vd, c["causal"]), ref)
    row = Row("attention", case_name(c), str(dtype).replace("torch.", ""), mode, {},
              {"flops": work})
    return fns, row, error


def build(c: dict):
    if c.get("variant") == "varlen":
        return _build_varlen(c)
    if c.get("variant"):
        return _build_variant(c)
    shape, dtype, causal, mode, device = c["shape"], c["dtype"], c["causal"], c["mode"], c["device"]
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = [torch.randn(shape, generator=g).to(device=device, dtype=dtype)
               .requires_grad_(mode != "fwd") for _ in range(3)]
    grad_out = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    work = flops(shape, causal, mode)
    fns, notes = {}, []
    names = ["ours", "sdpa"] if c.get("memory_only") else list(CANDIDATES)
    for name in names:
        est = work / 1e9 / _rate(name, dtype, mode, device)
        if name != "ours" and est > BUDGET_S:
            notes.append(f"{name} skipped (est. {est:.0f} s/call at {_rate(name, dtype, mode, device):.2f} "
                         f"GFLOP/s measured on {CALIBRATION})")
            continue
        fns[name] = _step(CANDIDATES[name], q, k, v, causal, mode, grad_out)
    if c.get("memory_only"):
        notes.append("memory case: peak MiB beyond inputs (outputs and grads: "
                     f"{4 * q.numel() * 4 / 2**20:.0f} MiB of it)")

    def error():
        with torch.no_grad():
            qd, kd, vd = (t.detach() for t in (q, k, v))
            ours = CANDIDATES["ours"](qd, kd, vd, causal)
            if c.get("memory_only"):
                return None
            ref_dtype = torch.float64 if device == "cpu" else torch.float32
            return max_abs_err(ours, eager_math(qd.to(ref_dtype), kd.to(ref_dtype), vd.to(ref_dtype), causal))

    row = Row("attention", case_name(c), str(dtype).replace("torch.", ""), mode,
              {}, {"flops": work}, note="; ".join(notes))
    return fns, row, error
