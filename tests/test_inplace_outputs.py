"""In-place ops on the ops' outputs under autograd, as on torch's: ``y += residual`` must work and
give the gradients of the out-of-place sum, on every backend's output (the kernels return views
of buffers they made: a transposed (B, L, H, D) attention output, a reshaped GEMM result), and an
output the backward needs (attention's, a norm's residual stream) must raise autograd's
"modified by an inplace operation" error, as torch's SDPA and eager norms do, never give a wrong
gradient."""
import pytest
import torch

import fastformer as ff
from fastformer.ops.dropout import dropout
from fastformer.ops.linear import linear


def _case(name):
    """(inputs, fn(*inputs) -> output)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()
    x, w1, w2, wu, w, b = t(2, 13, 40), t(72, 40), t(40, 72), t(72, 40), t(40), t(40)
    q = t(1, 4, 17, 40)
    cos, sin = torch.randn(17, 20, generator=g, dtype=torch.float64), torch.randn(17, 20, generator=g, dtype=torch.float64)
    return {
        "ffn": ((x, w1, w2), lambda x, w1, w2: ff.ffn(x, w1, None, w2, None, "gelu")),
        "swiglu_ffn": ((x, w1, wu, w2), lambda x, w1, wu, w2: ff.swiglu_ffn(x, w1, wu, w2)),
        "rms_norm": ((x, w), lambda x, w: ff.rms_norm(x, w, 1e-6)),
        "layer_norm": ((x, w, b), lambda x, w, b: ff.layer_norm(x, w, b)),
        "add_layer_norm": ((x, w, b), lambda x, w, b: ff.add_layer_norm(x, x * 0.5, w, b)),
        "rms_norm_residual": ((x, w), lambda x, w: ff.rms_norm(x, w, 1e-6, residual=x * 0.5, return_residual=True)[0]),
        "apply_rotary": ((q,), lambda q: ff.apply_rotary(q, cos, sin)),
        "linear": ((x, w1), lambda x, w1: linear(x, w1, None)),
        "dropout": ((x,), lambda x: dropout(x * 1.0, 0.25)),
    }[name]


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("name", ["ffn", "swiglu_ffn", "rms_norm", "layer_norm", "add_layer_norm",
                                  "rms_norm_residual", "apply_rotary", "linear", "dropout"])
def test_inplace_add_on_output_has_the_out_of_place_gradients(name, backend):
    inputs, fn = _case(name)
    with ff.use_backend(backend):
        torch.manual_seed(1)
        y = fn(*inputs)
        y += 1.5            # in place (before: "...is a view and is being modified inplace")
        y.mul_(2.0)
        weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        grads = torch.autograd.grad((y * weights).sum(), inputs)
        torch.manual_seed(1)
        ref = (fn(*inputs) + 1.5) * 2.0
        ref_grads = torch.autograd.grad((ref * weights).sum(), inputs)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("saved", ["attention", "residual stream"])
def test_inplace_on_an_output_the_backward_needs_raises(saved, backend):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 17, 40, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 13, 40, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.ones(40, dtype=torch.float64, requires_grad=True)
    with ff.use_backend(backend):
        if saved == "attention":  # the backward's rowsum(dO * O) reads the output
            y = ff.attention(q, q, q, causal=True)
        else:                     # the norm's backward reads x + residual
            y = ff.rms_norm(x, w, 1e-6, residual=x * 0.5, return_residual=True)[1]
        y += 1.0
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
