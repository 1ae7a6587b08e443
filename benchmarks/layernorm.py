"""add + LayerNorm / RMSNorm suite: ours vs eager ``F.layer_norm(x + r)`` / ``F.rms_norm(x + r)``.

Throughput is GB/s of the minimal traffic (every input read once, every output written once),
the same figure for both candidates: forward reads x, residual and writes y; the backward reads
dy, x, residual and writes one dz (dx and dresidual are the same tensor in both).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import fastformer as ff

from .common import Row, max_abs_err, policy_tolerance

SHAPES = [(512, 768), (4096, 1024), (8192, 4096), (16384, 1024)]
QUICK_SHAPES = [(4096, 1024)]  # the default run: a training step of both ops at one shape
# Verdict bound on max_err (common.policy_tolerance): outputs reach |y| ~ 20 (18.4 measured at
# (16384, 1024)); eager's own max error on these inputs, bf16 0.076 and fp16 0.0092.
TOLERANCE = policy_tolerance(magnitude=20, eager_err={"bfloat16": 0.076, "float16": 0.0092})
OPS = {
    "add_layer_norm": (lambda x, r, w, b: ff.add_layer_norm(x, r, w, b),
                       lambda x, r, w, b: F.layer_norm(x + r, (x.shape[-1],), w, b)),
    "add_rms_norm": (lambda x, r, w, b: ff.rms_norm(x, w, 1e-6, residual=r),
                     lambda x, r, w, b: F.rms_norm(x + r, (x.shape[-1],), w, 1e-6)),
}


def cases(device: str, dtypes: list, quick: bool = False):
    """Every case; quick: the representative ones fastformer-bench runs without --full."""
    shapes, modes = (QUICK_SHAPES, ("fwd+bwd",)) if quick else (SHAPES, ("fwd", "fwd+bwd"))
    for op, (ours, eager) in OPS.items():
        for rows, hidden in shapes:
            for dtype in dtypes:
                for mode in modes:
                    yield dict(op=op, ours=ours, eager=eager, rows=rows, hidden=hidden,
                               dtype=dtype, mode=mode, device=device)


def case_name(c: dict) -> str:
    return f"{c['op']} ({c['rows']}, {c['hidden']})"


def build(c: dict):
    """Returns (candidate fns, Row skeleton, error function)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, hidden, dtype, device = c["rows"], c["hidden"], c["dtype"], c["device"]
    mk = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    x, r, w, b = mk(rows, hidden), mk(rows, hidden), mk(hidden), mk(hidden)
    elem = x.element_size()
    n = rows * hidden
    if c["mode"] == "fwd":
        fns = {"ours": lambda: c["ours"](x, r, w, b), "eager": lambda: c["eager"](x, r, w, b)}
        work = {"bytes": 3 * n * elem}
    else:
        for t in (x, r, w, b):
            t.requires_grad_(True)
        gy = mk(rows, hidden)

        def step(fn):
            y = fn(x, r, w, b)
            return torch.autograd.grad(y, (x, r, w, b), gy, allow_unused=True)

        fns = {"ours": lambda: step(c["ours"]), "eager": lambda: step(c["eager"])}
        work = {"bytes": 7 * n * elem}

    def error():
        with torch.no_grad():
            up = [t.detach().double() if device == "cpu" else t.detach().float() for t in (x, r, w, b)]
            return max_abs_err(c["ours"](x.detach(), r.detach(), w.detach(), b.detach()), c["eager"](*up))

    row = Row("layernorm", case_name(c), str(dtype).replace("torch.", ""),
              c["mode"], {}, work)
    return fns, row, error
