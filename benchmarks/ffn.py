"""Feed-forward suite: ff.ffn / ff.swiglu_ffn vs eager PyTorch.

Eager is what a PyTorch user writes: ``F.linear(act(F.linear(x, w1, b1)), w2, b2)`` and the
SwiGLU ``F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)`` (GeGLU: F.gelu(approximate=
"tanh") in place of F.silu). FLOPs: forward 2*N*D*F per
GEMM (2 GEMMs, 3 gated), backward twice the forward (d input and d weight of every GEMM).

Saved for the backward: the bytes of the tensors autograd keeps (torch.autograd.graph.
saved_tensors_hooks), each storage once, not counting x and the weights (both candidates keep
those, and they are alive anyway). Ours is measured on the real call; eager's on meta tensors
(the same autograd graph without computing anything: eager bf16 would take minutes).

Baselines that would take longer than BUDGET_S per call are skipped with their estimate: torch's
bf16 matmul runs at ~1 GFLOP/s on CPUs without AVX512-BF16/AMX. The max error is
measured on the first ERR_TOKENS tokens against fp64 (fp32 on GPU) eager math: the forward
treats tokens independently, and a full fp64 reference at (2048, 4096, 11008) costs a minute.
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

import fastformer as ff

from .common import Row, max_abs_err, policy_tolerance

# (tokens, d_model, dim_feedforward, activation, gated)
SHAPES = [(4096, 768, 3072, "relu", False), (4096, 768, 3072, "gelu", False),
          (8192, 1024, 4096, "gelu", False), (2048, 4096, 11008, "silu", True),
          (2048, 2048, 5632, "gelu_tanh", True),
          (4096, 1024, 4096, "quick_gelu", False)]  # OpenAI CLIP ViT-L/14's MLP
# Decode-time MLPs (inference only): 1 and 16 token rows through a Llama-7B-sized SwiGLU, where
# reading the weights is the cost.
DECODE_SHAPES = [(1, 4096, 11008, "silu", True), (16, 4096, 11008, "silu", True)]
# The default run: a training step of a BERT-base FFN and of a SwiGLU (the Llama ratio 2.75),
# at 1024 tokens (a quarter of SHAPES' tokens, to keep the run short).
QUICK_SHAPES = [(1024, 768, 3072, "gelu", False), (1024, 1024, 2816, "silu", True)]
# Verdict bound on max_err (common.policy_tolerance): outputs reach |y| ~ 3.5; eager's own max
# error on these inputs, bf16 0.013 and fp16 0.0015.
TOLERANCE = policy_tolerance(magnitude=4, eager_err={"bfloat16": 0.013, "float16": 0.0015})
# 40 s: eager fp32 SwiGLU forward+backward at the gated shape (~20 s/call on a 2-core Zen 3,
# estimated 24 s from the small calibration GEMM) is an acceptance baseline and must run; eager
# bf16 (minutes at ~1 GFLOP/s) is still skipped.
BUDGET_S = float(os.environ.get("FASTFORMER_BENCH_BUDGET_S", "40"))
CALIBRATION = (256, 256, 1024)
ERR_TOKENS = 256
_ACT = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t)}  # transformers' QuickGELUActivation


def _eager(x, w, act, gated):
    if gated:
        wg, wu, wd = w
        return F.linear(_ACT[act](F.linear(x, wg)) * F.linear(x, wu), wd)
    w1, b1, w2, b2 = w
    return F.linear(_ACT[act](F.linear(x, w1, b1)), w2, b2)


def _ours(x, w, act, gated):
    if gated:
        wg, wu, wd = w
        return ff.swiglu_ffn(x, wg, wu, wd, activation=act)
    w1, b1, w2, b2 = w
    return ff.ffn(x, w1, b1, w2, b2, activation=act)


CANDIDATES = {"ours": _ours, "eager": _eager}


def flops(tokens, d, hidden, gated, mode):
    f = 2.0 * tokens * d * hidden * (3 if gated else 2)
    return f * (3.0 if mode == "fwd+bwd" else 1.0)


def _tensors(tokens, d, hidden, gated, dtype, device, grad):
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)  # noqa: E731
    x = mk(tokens, d)
    if gated:
        w = [mk(hidden, d, scale=d ** -0.5), mk(hidden, d, scale=d ** -0.5),
             mk(d, hidden, scale=hidden ** -0.5)]
    else:
        w = [mk(hidden, d, scale=d ** -0.5), mk(hidden, scale=0.1),
             mk(d, hidden, scale=hidden ** -0.5), mk(d, scale=0.1)]
    for t in [x] + w:
        t.requires_grad_(grad)
    return x, w, mk(tokens, d)


def _step(fn, x, w, act, gated, mode, grad_out):
    if mode == "fwd":
        return lambda: fn(x, w, act, gated)
    return lambda: torch.autograd.grad(fn(x, w, act, gated), [x] + w, grad_out)


_rates: dict = {}


def _rate(name, dtype, gated, mode, device):
    """GFLOP/s of a candidate on the calibration shape (measured once per run)."""
    key = (name, dtype, gated, mode)
    if key not in _rates:
        x, w, gy = _tensors(*CALIBRATION, gated, dtype, device, mode != "fwd")
        fn = _step(CANDIDATES[name], x, w, "silu" if gated else "gelu", gated, mode, gy)
        fn()
        start = time.perf_counter()
        fn()
        _rates[key] = flops(*CALIBRATION, gated, mode) / (time.perf_counter() - start) / 1e9
    return _rates[key]


def saved_bytes(fn, exclude) -> int:
    """Bytes of the distinct storages autograd saves while fn() runs, minus those of `exclude`
    (storages told apart by their StorageImpl, which works for meta tensors too)."""
    skip = {t.untyped_storage()._cdata for t in exclude}
    seen: dict = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in skip:
            seen[storage._cdata] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def cases(device: str, dtypes: list, quick: bool = False):
    """Every case; quick: the representative ones fastformer-bench runs without --full."""
    shapes = [(s, ("fwd+bwd",)) for s in QUICK_SHAPES] if quick else (
        [(s, ("fwd", "fwd+bwd")) for s in SHAPES] + [(s, ("fwd",)) for s in DECODE_SHAPES])
    for (tokens, d, hidden, act, gated), modes in shapes:
        for dtype in dtypes:
            for mode in modes:
                yield dict(shape=(tokens, d, hidden), act=act, gated=gated, dtype=dtype,
                           mode=mode, device=device)


def case_name(c: dict) -> str:
    """The row's case name, known before build() allocates anything (single_call filters on it)."""
    tokens, d, hidden = c["shape"]
    kind = ({"silu": "swiglu", "gelu_tanh": "geglu"}.get(c["act"], f"gated {c['act']}")
            if c["gated"] else f"ffn {c['act']}")
    return f"{kind} ({tokens}, {d}, {hidden})"


def build(c: dict):
    (tokens, d, hidden), act, gated = c["shape"], c["act"], c["gated"]
    dtype, mode, device = c["dtype"], c["mode"], c["device"]
    x, w, grad_out = _tensors(tokens, d, hidden, gated, dtype, device, mode != "fwd")
    work = flops(tokens, d, hidden, gated, mode)
    fns, notes = {}, []
    for name in CANDIDATES:
        rate = _rate(name, dtype, gated, mode, device)
        est = work / 1e9 / rate
        if name != "ours" and est > BUDGET_S:
            notes.append(f"{name} skipped (est. {est:.0f} s/call at {rate:.2f} GFLOP/s measured "
                         f"on {CALIBRATION})")
            continue
        fns[name] = _step(CANDIDATES[name], x, w, act, gated, mode, grad_out)

    if mode == "fwd+bwd":
        ours = saved_bytes(lambda: _ours(x, w, act, gated), [x] + w)
        xm, wm = x.to("meta").requires_grad_(True), [t.to("meta").requires_grad_(True) for t in w]
        eager = saved_bytes(lambda: _eager(xm, wm, act, gated), [xm] + wm)
        notes.append(f"saved for backward beyond x and weights: ours {ours / 2**20:.0f} MiB, "
                     f"eager {eager / 2**20:.0f} MiB ({100 * ours / max(eager, 1):.0f}%)")

    def error():
        with torch.no_grad():
            xs = x.detach()[:ERR_TOKENS]
            ws = [t.detach() for t in w]
            ref_dtype = torch.float64 if device == "cpu" else torch.float32
            ref = _eager(xs.to(ref_dtype), [t.to(ref_dtype) for t in ws], act, gated)
            return max_abs_err(_ours(xs, ws, act, gated), ref)

    row = Row("ffn", case_name(c), str(dtype).replace("torch.", ""), mode,
              {}, {"flops": work}, note="; ".join(notes))
    return fns, row, error
