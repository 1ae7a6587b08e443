"""Shared checks of converted Hugging Face encoders with their attention in their own code
(tests/test_convert_hf_deberta.py, test_convert_hf_mpnet.py, test_convert_hf_written_out.py): the
inputs (one row right-padded), hidden states and every parameter's gradient for a fixed output
gradient, the bf16 error-ratio rule against fp64 and bf16 eager, and a classification head's
loss with training dropout on the kernels."""
import copy

import torch
import torch.nn.functional as F
from oracle import GRAD_FACTOR, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule

import fastformer as ff


def encoder_inputs(L=23):
    ids = torch.randint(2, 90, (2, L), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, max(L - 6, 1):] = 0  # row 1 right-padded by 6 (by none at L = 1)
    return dict(input_ids=ids, attention_mask=mask)


def sharpened(model):
    """`model` with weights of a larger spread (each plus randn x 0.1), in eval mode: at the
    configs' init (std 0.02) every score is ~0 and the softmax ~uniform, where the scale and the
    masks barely change the output."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def spy_attention(monkeypatch, module):
    """Record the keyword arguments of every call of module.attention (ff.attention there)."""
    calls = []
    kernel = module.attention
    monkeypatch.setattr(module, "attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    return calls


def spy_lengths(monkeypatch, *modules):
    """(query rows, keys) of every call of module.attention, for each of `modules`, in call order."""
    lengths = []
    for module in modules:
        kernel = module.attention
        monkeypatch.setattr(module, "attention", lambda q, k, v, kernel=kernel, **kw:
                            lengths.append((q.shape[-2], k.shape[-2])) or kernel(q, k, v, **kw))
    return lengths


def run_with_grads(model, inputs, output=lambda out: out.last_hidden_state):
    """(the output at every position: by default the hidden states, {name: gradient}) for a
    fixed random output gradient."""
    out = output(model(**inputs))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad((out.double() * g).sum(), params, allow_unused=True)
    return out.detach(), dict(zip(names, grads))


def _torch_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, scale=None, key_padding_mask=None):
    """ff.attention's call as the integrations make it, on torch's own SDPA (a key padding mask,
    True = padding, joined to attn_mask)."""
    if key_padding_mask is not None:
        keep = ~key_padding_mask[:, None, None, :]
        attn_mask = keep if attn_mask is None else (attn_mask.masked_fill(~keep, float("-inf"))
                                                    if attn_mask.is_floating_point() else attn_mask & keep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)


def assert_bf16_error_ratio(model, inputs, run=run_with_grads, sdpa_in=None, reference=None):
    """The converted bf16 model's outputs and gradients against fp64, by the error-ratio rule:
    within a factor of torch's own bf16 error. `inputs`: a dict, or dtype -> dict; `run`: model,
    inputs -> (output, {name: gradient}). torch's error is bf16 eager's; with `sdpa_in` (the
    integration module whose `attention` the converted model calls) per quantity the larger of
    eager's and the same converted model's with that attention on torch's SDPA: a model whose
    attention transformers runs only as eager softmax code has no "sdpa" of its own, and on the
    gradients that cancel in exact arithmetic (the key bias's) a flash-style backward with delta
    from the rounded output, torch's SDPA's included, is several times eager's error
    (ARCHITECTURE.md, "Numerical policy").
    `reference`: model -> the fp64 model to judge against (default: the model in fp64)."""
    at = inputs if callable(inputs) else (lambda dtype: inputs)
    bf16 = torch.bfloat16
    out, grads = run(ff.convert(copy.deepcopy(model).to(bf16)).model, at(bf16))
    lows = [run(copy.deepcopy(model).to(bf16), at(bf16))]
    if sdpa_in is not None:
        kernel, sdpa_in.attention = sdpa_in.attention, _torch_sdpa
        try:
            lows.append(run(ff.convert(copy.deepcopy(model).to(bf16)).model, at(bf16)))
        finally:
            sdpa_in.attention = kernel
    exact = reference(model) if reference is not None else copy.deepcopy(model).double()
    ref, ref_grads = run(exact, at(torch.float64))

    def worst(ref, torch_results):
        return max(torch_results, key=lambda t: (t.double() - ref).abs().max().item())

    atol = LOWP_ATOL[bf16]
    assert_lowp_rule("out", out, ref, worst(ref, [low[0] for low in lows]), OUT_FACTOR, atol * ref.abs().max().item())
    for n, r in ref_grads.items():
        if r is not None:
            assert_lowp_rule(f"d{n}", grads[n], r, worst(r, [low[1][n] for low in lows]), GRAD_FACTOR,
                             atol * r.abs().max().item())


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


def assert_output_attentions_match(model, layers: int, inputs=None, fields=("attentions",),
                                   output="last_hidden_state"):
    """output_attentions runs the original attention (the converted forward gives no
    probabilities): every layer's probabilities (each of `fields` of the model's output) and its
    `output` as the unconverted model's, on `inputs` (default: encoder_inputs())."""
    inputs = encoder_inputs() if inputs is None else inputs
    ours = ff.convert(model, inplace=False).model
    with torch.no_grad():
        out = ours(**inputs, output_attentions=True)
        ref = model(**inputs, output_attentions=True)
    for field in fields:
        got, want = getattr(out, field), getattr(ref, field)
        assert got is not None and len(got) == layers, field
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(getattr(out, output), getattr(ref, output), atol=1e-5, rtol=1e-5)
