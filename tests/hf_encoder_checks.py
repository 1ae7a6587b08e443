"""Shared checks of converted Hugging Face encoders with their attention in their own code
(tests/test_convert_hf_deberta.py, tests/test_convert_hf_mpnet.py): the inputs (one row
right-padded), hidden states and every parameter's gradient for a fixed output gradient, the
bf16 error-ratio rule against fp64 and bf16 eager, and a classification head's loss with
training dropout on the kernels."""
import copy

import torch
from oracle import GRAD_FACTOR, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule

import fastformer as ff


def encoder_inputs(L=23):
    ids = torch.randint(2, 90, (2, L), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, max(L - 6, 1):] = 0  # row 1 right-padded by 6 (by none at L = 1)
    return dict(input_ids=ids, attention_mask=mask)


def spy_attention(monkeypatch, module):
    """Record the keyword arguments of every call of module.attention (ff.attention there)."""
    calls = []
    kernel = module.attention
    monkeypatch.setattr(module, "attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    return calls


def run_with_grads(model, inputs):
    """(hidden states at every position, {name: gradient}) for a fixed random output gradient."""
    out = model(**inputs).last_hidden_state
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad((out.double() * g).sum(), params, allow_unused=True)
    return out.detach(), dict(zip(names, grads))


def assert_bf16_error_ratio(model, inputs):
    """The converted bf16 model's outputs and gradients against fp64, by the error-ratio rule
    (within a factor of bf16 eager's own error)."""
    ours = ff.convert(copy.deepcopy(model).to(torch.bfloat16)).model
    out, grads = run_with_grads(ours, inputs)
    low, low_grads = run_with_grads(copy.deepcopy(model).to(torch.bfloat16), inputs)
    ref, ref_grads = run_with_grads(copy.deepcopy(model).double(), inputs)
    atol = LOWP_ATOL[torch.bfloat16]
    assert_lowp_rule("out", out, ref, low, OUT_FACTOR, atol * ref.abs().max().item())
    for n, r in ref_grads.items():
        if r is not None:
            assert_lowp_rule(f"d{n}", grads[n], r, low_grads[n], GRAD_FACTOR, atol * r.abs().max().item())


def assert_classifier_loss_and_training_dropout(model, attention_class: str):
    """A sequence classifier's loss converted equals the original's; then with dropout 0.1 in
    the modules named attention_class (the kernels' dropout) a training step gives a finite loss
    and finite gradients. Returns the converted model."""
    ours = ff.convert(model, inplace=False).model
    labels = torch.tensor([0, 2])
    want = model(**encoder_inputs(), labels=labels).loss
    got = ours(**encoder_inputs(), labels=labels).loss
    assert (got - want).abs() <= 1e-5 * want.abs()
    for m in ours.modules():
        if type(m).__name__ == attention_class:
            m.dropout.p = 0.1
    ours.train()
    loss = ours(**encoder_inputs(), labels=labels).loss
    loss.backward()
    assert loss.isfinite() and all(p.grad.isfinite().all() for p in ours.parameters() if p.grad is not None)
    return ours


def assert_output_attentions_match(model, layers: int):
    """output_attentions runs the original attention (the converted forward gives no
    probabilities): every layer's probabilities and the hidden states as the unconverted model's."""
    ours = ff.convert(model, inplace=False).model
    with torch.no_grad():
        out = ours(**encoder_inputs(), output_attentions=True)
        ref = model(**encoder_inputs(), output_attentions=True)
    assert out.attentions is not None and len(out.attentions) == layers
    for got, want in zip(out.attentions, ref.attentions):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=1e-5, rtol=1e-5)
