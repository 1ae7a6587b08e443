"""Custom-op registration: torch.compile(fullgraph=True) and torch.library.opcheck."""
import pytest
import torch

import fastformer as ff
from fastformer.ops import norm as norm_ops


def _ln_block(x, r, w, b):
    y, res = ff.add_layer_norm(x, r, w, b, return_residual=True)
    return (y * 2).sum() + res.sum(), y


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_add_layer_norm_matches_eager(backend):
    torch._dynamo.reset()
    x = torch.randn(6, 40, requires_grad=True)
    r = torch.randn(6, 40, requires_grad=True)
    w = torch.randn(40, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    compiled = torch.compile(_ln_block, fullgraph=True, backend=backend)
    loss_c, y_c = compiled(x, r, w, b)
    grads_c = torch.autograd.grad(loss_c, (x, r, w, b))
    loss_e, y_e = _ln_block(x, r, w, b)
    grads_e = torch.autograd.grad(loss_e, (x, r, w, b))
    torch.testing.assert_close(y_c, y_e)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge)


def test_opcheck_add_norm_ops():
    x = torch.randn(5, 24, requires_grad=True)
    r = torch.randn(5, 24, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    torch.library.opcheck(norm_ops.add_norm_fwd_op, (x, r, w, b, 1e-5, False, True))
    torch.library.opcheck(norm_ops.add_norm_fwd_op, (x, None, w, None, 1e-6, True, False))
    y, res, mean, rstd = norm_ops.add_norm_fwd_op(x.detach(), r.detach(), w.detach(), b.detach(),
                                                  1e-5, False, True)
    dy = torch.randn_like(y)
    torch.library.opcheck(norm_ops.add_norm_bwd_op,
                          (dy, None, res, None, w.detach(), mean, rstd, False, True, True,
                           torch.float32))


def test_eager_via_ops_route(monkeypatch):
    """FASTFORMER_EAGER_VIA_OPS=1 sends eager calls through torch.ops: same results."""
    x = torch.randn(7, 33, requires_grad=True)
    w = torch.randn(33, requires_grad=True)
    y1 = ff.rms_norm(x, w)
    g1 = torch.autograd.grad(y1.square().sum(), (x, w))
    monkeypatch.setenv("FASTFORMER_EAGER_VIA_OPS", "1")
    ff.backends.reload_env()
    try:
        y2 = ff.rms_norm(x, w)
        g2 = torch.autograd.grad(y2.square().sum(), (x, w))
    finally:
        monkeypatch.delenv("FASTFORMER_EAGER_VIA_OPS")
        ff.backends.reload_env()
    torch.testing.assert_close(y1, y2)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
