"""ops/dropout.py: dropout with the kernels' Philox mask (reference/rng.py), on the CPU kernel
(csrc/cpu/ffn_elementwise.cpp, identity mode) against the reference path, forward and backward,
every dtype, odd and strided shapes; fp64 gradcheck; the conversion of Hugging Face models'
nn.Dropout modules against an unconverted model given the same masks."""
import copy
import itertools

import pytest
import torch

import fastformer as ff
from fastformer.ops import dropout as dropout_ops
from fastformer.reference.rng import keep_mask

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SHAPES = [(1,), (17, 40), (3, 113, 72), (203, 80), (2, 1, 257)]

requires_kernel = pytest.mark.skipif(
    ff._ext.C is None or not hasattr(ff._ext.C, "dropout"),
    reason="the CPU extension is not built (the reference path is what runs)")


def _reference(x, p, state):
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    keep = keep_mask(state, x.shape, p)
    return (x.to(acc) * keep.to(acc) * torch.tensor(1.0 / (1.0 - p), dtype=acc)).to(x.dtype)


@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kernel_matches_reference_forward_and_backward(dtype, shape, p):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    state = torch.tensor([12345 + shape[-1], 2**40 + 3 * shape[0]])
    assert dropout_ops._kernel_takes(x)
    y = dropout_ops._Dropout.apply(x, p, state)
    want = _reference(x.detach(), p, state)
    assert torch.equal(y, want)
    assert torch.equal(y == 0, ~keep_mask(state, shape, p) | (x == 0))
    dy = torch.randn(shape, generator=g).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dx, _reference(dy, p, state))


@requires_kernel
def test_strided_input_uses_its_logical_order():
    x = torch.randn(40, 17).t()  # (17, 40), not contiguous
    state = torch.tensor([7, 99])
    assert torch.equal(dropout_ops._Dropout.apply(x, 0.3, state), _reference(x, 0.3, state))


def test_gradcheck_fp64():
    x = torch.randn(7, 13, dtype=torch.float64, requires_grad=True)
    state = torch.tensor([3, 11])
    assert torch.autograd.gradcheck(lambda t: dropout_ops._Dropout.apply(t, 0.4, state), (x,))


def test_keeps_one_minus_p_and_follows_manual_seed():
    x = torch.ones(1000, 1000)
    torch.manual_seed(0)
    a = dropout_ops.dropout(x, 0.3)
    torch.manual_seed(0)
    b = dropout_ops.dropout(x, 0.3)
    c = dropout_ops.dropout(x, 0.3)
    assert torch.equal(a, b) and not torch.equal(a, c)
    kept = (a != 0).double().mean().item()
    assert abs(kept - 0.7) < 0.003, kept                     # 1e6 draws: 6 sigma = 0.0027
    assert torch.allclose(a[a != 0], torch.tensor(1 / 0.7))


def test_eval_and_edge_probabilities():
    x = torch.randn(5, 6)
    assert dropout_ops.dropout(x, 0.5, training=False) is x
    assert dropout_ops.dropout(x, 0.0) is x
    assert not dropout_ops.dropout(x, 1.0).any()


@pytest.mark.parametrize("p", [-0.1, 1.5, True, "0.1"])
def test_bad_p_is_a_value_error(p):
    with pytest.raises(ValueError, match="`p`"):
        dropout_ops.dropout(torch.randn(3), p)


def test_integer_input_is_a_type_error():
    with pytest.raises(TypeError, match="`x`"):
        dropout_ops.dropout(torch.arange(3), 0.1)


def test_converted_bert_dropouts_match_the_same_masks(monkeypatch):
    """A BERT whose hidden dropout (p = 0.2) runs on ops/dropout.py after ff.convert, against the
    unconverted fp64 model whose nn.Dropout modules apply the same masks (reference/rng.py,
    drawn in the same call order): outputs and every parameter gradient."""
    transformers = pytest.importorskip("transformers", reason="the conversion needs transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=96,
                                     hidden_dropout_prob=0.2, attention_probs_dropout_prob=0.0,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertModel(config).train()
    states = lambda: (torch.tensor([1000 + i, 7 * i]) for i in itertools.count())  # noqa: E731
    report = ff.convert(copy.deepcopy(model), inplace=False)
    swapped = [path for path, kind, _ in report.replaced if kind == "Dropout"]
    assert len(swapped) >= 1 + 2 * config.num_hidden_layers, str(report)
    ours_states = states()
    monkeypatch.setattr(dropout_ops, "draw_rng_state", lambda: next(ours_states))
    exact = copy.deepcopy(model).double()
    ref_states = states()
    for m in exact.modules():
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            m.forward = lambda x, p=m.p: _reference(x, p, next(ref_states))
    ids = torch.randint(2, 100, (2, 17), generator=torch.Generator().manual_seed(1))
    outs = []
    for net in (report.model, exact):
        out = net(input_ids=ids).last_hidden_state
        dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        params = [p for _, p in net.named_parameters()]
        outs.append((out.detach().double(), torch.autograd.grad((out.double() * dy).sum(), params,
                                                                allow_unused=True)))
    (y, grads), (y_ref, grads_ref) = outs
    assert (y - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()
    for g, r in zip(grads, grads_ref):
        if r is not None:
            assert (g.double() - r).abs().max() <= 1e-5 * max(r.abs().max().item(), 1e-3)


@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_path_draws_the_kernels_result(dtype, monkeypatch):
    """The path other devices (and compiled calls) take: the same values as the CPU kernel."""
    x = torch.randn(113, 72).to(dtype)
    state = torch.tensor([5, 2**33 + 1])
    want = dropout_ops._Dropout.apply(x, 0.25, state)
    monkeypatch.setattr(dropout_ops, "_kernel_takes", lambda t: False)
    assert torch.equal(dropout_ops._Dropout.apply(x, 0.25, state), want)
