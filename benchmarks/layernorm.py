"""add + LayerNorm / RMSNorm suite: ours vs eager ``F.layer_norm(x + r)`` / ``F.rms_norm(x + r)``.

Throughput is GB/s of the minimal traffic (every input read once, every output written once),
the same figure for both candidates: forward reads x, residual and writes y; the backward reads
dy, x, residual and writes one dz (dx and dresidual are the same tensor in both).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import fastformer as ff

from .common import Row, max_abs_err

SHAPES = [(512, 768), (4096, 1024), (8192, 4096), (16384, 1024)]
OPS = {
    "add_layer_norm": (lambda x, r, w, b: ff.add_layer_norm(x, r, w, b),
                       lambda x, r, w, b: F.layer_norm(x + r, (x.shape[-1],), w, b)),
    "add_rms_norm": (lambda x, r, w, b: ff.rms_norm(x, w, 1e-6, residual=r),
                     lambda x, r, w, b: F.rms_norm(x + r, (x.shape[-1],), w, 1e-6)),
}


def cases(device: str, dtypes: list, quick: bool = False):
    shapes = SHAPES[:2] if quick else SHAPES
    for op, (ours, eager) in OPS.items():
        for rows, hidden in shapes:
            for dtype in dtypes:
                for mode in ("fwd", "fwd+bwd"):
                    yield dict(op=op, ours=ours, eager=eager, rows=rows, hidden=hidden,
                               dtype=dtype, mode=mode, device=device)


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

    row = Row("layernorm", f"{c['op']} ({rows}, {hidden})", str(dtype).replace("torch.", ""),
              c["mode"], {}, work)
    return fns, row, error
