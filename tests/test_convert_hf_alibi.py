"""BLOOM's and MPT's attention converted (integrations/hf_alibi.py): ff.attention with the model's
ALiBi slopes and mask in place of its own scores, against the unconverted model run in fp64: logits and
every parameter's gradient (oracle.assert_model_matches), with and without left padding, a head
count that is not a power of two (both families' extra slopes), bf16 by the error-ratio rule,
greedy generation with the cache against the unconverted model's tokens and logits, and
output_attentions (the original forward).

Left padding: the padded positions are don't-care rows (their outputs and gradient seeds are
left out), and the fp64 oracle runs each row's unpadded tokens alone (unconverted BLOOM in fp64
turns a left-padded row into NaN: its float mask's minimum added twice overflows to -inf)."""
import copy

import pytest
import torch
from oracle import GRAD_FACTOR, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule, assert_model_matches

transformers = pytest.importorskip("transformers", reason="needs transformers")

import fastformer as ff  # noqa: E402


FAMILIES = ["bloom", "mpt"]
ATTENTION = {"bloom": "BloomAttention", "mpt": "MptAttention"}


def _model(family, heads=4, seed=0):
    if family == "bloom":
        cfg = transformers.BloomConfig(vocab_size=97, hidden_size=16 * heads, n_layer=2, n_head=heads)
        cls = transformers.BloomForCausalLM
    else:
        cfg = transformers.MptConfig(vocab_size=97, d_model=16 * heads, n_layers=2, n_heads=heads,
                                     max_seq_len=64, attn_config={"clip_qkv": 1.5})
        cls = transformers.MptForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return cls(cfg).eval()


def _inputs(padded):
    ids = torch.randint(2, 90, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 13, dtype=torch.long)
    if padded:
        mask[1, :4] = 0  # row 1 left-padded by 4
    return dict(input_ids=ids, attention_mask=mask)


def _seed(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def _run(model, inputs):
    """(logits at the unpadded positions, {name: gradient}) for a fixed random seed of the
    logits' gradient, zero at padded positions."""
    logits = model(**inputs).logits
    keep = inputs["attention_mask"].bool()
    g = _seed(logits.shape) * keep[..., None]
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad((logits.double() * g).sum(), params, allow_unused=True)
    return logits.detach()[keep], dict(zip(names, grads))


def _reference(model, inputs):
    """_run's result from `model` in fp64, each row's unpadded tokens run alone."""
    model = copy.deepcopy(model).double()
    keep = inputs["attention_mask"].bool()
    g = _seed((*keep.shape, model.config.vocab_size))
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    outs, total = [], 0
    for b in range(keep.shape[0]):
        logits = model(input_ids=inputs["input_ids"][b:b + 1, keep[b]]).logits
        outs.append(logits.detach()[0])
        total = total + (logits * g[b:b + 1, keep[b]]).sum()
    grads = torch.autograd.grad(total, params, allow_unused=True)
    return torch.cat(outs), dict(zip(names, grads))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("heads", [4, 6])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_alibi_attention_on_the_kernels_matches_fp64(family, heads, padded):
    model = _model(family, heads)
    report = ff.convert(model, inplace=False)
    ours = report.model
    converted = [r for r in report.replaced if r[1] == ATTENTION[family]]
    assert len(converted) == 2 and "ALiBi" in converted[0][2], str(report)
    inputs = _inputs(padded)
    out, grads = _run(ours, inputs)
    assert ff.last_dispatch().op == "attention"
    ref, ref_grads = _reference(model, inputs)
    assert_model_matches(out, grads, ref, ref_grads)
    assert ours.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("family", FAMILIES)
def test_alibi_bf16_error_ratio(family):
    model = _model(family)
    ours = ff.convert(copy.deepcopy(model).to(torch.bfloat16)).model
    inputs = _inputs(padded=True)
    out, grads = _run(ours, inputs)
    low, low_grads = _run(copy.deepcopy(model).to(torch.bfloat16), inputs)
    ref, ref_grads = _reference(model, inputs)
    atol = LOWP_ATOL[torch.bfloat16]
    assert_lowp_rule("out", out, ref, low, OUT_FACTOR, atol * ref.abs().max().item())
    for n, r in ref_grads.items():
        if r is not None:
            assert_lowp_rule(f"d{n}", grads[n], r, low_grads[n], GRAD_FACTOR, atol * r.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_alibi_generate_with_cache_matches_unconverted(family):
    model = _model(family)
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs(padded=True)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(**inputs, **kw)
        got = ours.generate(**inputs, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):  # each decode step's logits
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"step {step}"


@pytest.mark.parametrize("family", FAMILIES)
def test_alibi_output_attentions_runs_the_original(family):
    model = _model(family)
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs(padded=False)
    with torch.no_grad():
        out = ours(**inputs, output_attentions=True)
        ref = model(**inputs, output_attentions=True)
    assert out.attentions is not None and len(out.attentions) == 2
    torch.testing.assert_close(out.attentions[0], ref.attentions[0])
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
