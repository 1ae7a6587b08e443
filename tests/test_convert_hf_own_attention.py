"""Attention modules in their model's own code converted (integrations/hf_own_attention.py):
BLOOM's and MPT's on ff.attention with the model's ALiBi slopes and mask in place of its own
scores, Falcon's (its ALiBi bias mask, its rotary forms: multi-query and the new decoder
architecture's grouped heads), GPT-Neo's (unscaled, global and local layers; a window of 5 keys
over 13 tokens), XGLM's (BART's attention written out; the config's output_attentions too),
GPT-NeoX-Japanese's (its partial rotary), against the unconverted model run in fp64: logits and
every parameter's gradient (oracle.assert_model_matches), with and without left padding, a head
count that is not a power of two (both families' extra slopes), bf16 by the error-ratio rule,
greedy generation with the cache against the unconverted model's tokens and logits, and
output_attentions (the original forward).

Left padding: the padded positions are don't-care rows (their outputs and gradient seeds are
left out), and the fp64 oracle runs each row's unpadded tokens alone (unconverted BLOOM in fp64
turns a left-padded row into NaN: its float mask's minimum added twice overflows to -inf).

Falcon's reference is its sdpa path: in transformers 5.24 its eager ALiBi path adds the bias twice
(itself and through the mask the model folded it into; integrations/hf_own_attention.py), sdpa once."""
import copy

import pytest
import torch
from oracle import GRAD_FACTOR, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule, assert_model_matches

transformers = pytest.importorskip("transformers", reason="needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_own_attention  # noqa: E402


FAMILIES = ["bloom", "mpt", "falcon_alibi", "falcon_rotary_mq", "falcon_new_arch", "gpt_neo", "xglm",
            "gpt_neox_japanese"]
ATTENTION = {"bloom": "BloomAttention", "mpt": "MptAttention", "falcon_alibi": "FalconAttention",
             "falcon_rotary_mq": "FalconAttention", "falcon_new_arch": "FalconAttention",
             "gpt_neo": "GPTNeoSelfAttention", "xglm": "XGLMAttention", "gpt_neox_japanese": "GPTNeoXJapaneseAttention"}
# Falcon-RW (ALiBi, biases, sequential blocks), Falcon-7B's form (rotary, one key / value head,
# parallel attention and MLP), Falcon-40B's (rotary, grouped key / value heads)
FALCON = {"falcon_alibi": dict(alibi=True, multi_query=False, parallel_attn=False, bias=True),
          "falcon_rotary_mq": dict(alibi=False, multi_query=True, parallel_attn=True, bias=False),
          "falcon_new_arch": dict(alibi=False, new_decoder_architecture=True, num_kv_heads=2, bias=False)}


def _model(family, heads=4, seed=0):
    if family == "bloom":
        cfg = transformers.BloomConfig(vocab_size=97, hidden_size=16 * heads, n_layer=2, n_head=heads)
        cls = transformers.BloomForCausalLM
    elif family == "mpt":
        cfg = transformers.MptConfig(vocab_size=97, d_model=16 * heads, n_layers=2, n_heads=heads,
                                     max_seq_len=64, attn_config={"clip_qkv": 1.5})
        cls = transformers.MptForCausalLM
    elif family == "gpt_neo":
        cfg = transformers.GPTNeoConfig(vocab_size=97, hidden_size=16 * heads, num_layers=2, num_heads=heads,
                                        attention_types=[[["global", "local"], 1]], window_size=5,
                                        max_position_embeddings=64)
        cls = transformers.GPTNeoForCausalLM
    elif family == "xglm":
        cfg = transformers.XGLMConfig(vocab_size=97, d_model=16 * heads, num_layers=2, attention_heads=heads,
                                      ffn_dim=48, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                      activation_dropout=0.0)
        cls = transformers.XGLMForCausalLM
    elif family == "gpt_neox_japanese":  # rotary on half of each head's channels
        cfg = transformers.GPTNeoXJapaneseConfig(vocab_size=97, hidden_size=16 * heads, num_hidden_layers=2,
                                                 num_attention_heads=heads, intermediate_multiple_size=2,
                                                 max_position_embeddings=64, attention_dropout=0.0,
                                                 hidden_dropout=0.0, rope_parameters={"rope_type": "default",
                                                 "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
        cls = transformers.GPTNeoXJapaneseForCausalLM
    else:
        cfg = transformers.FalconConfig(vocab_size=97, hidden_size=16 * heads, num_hidden_layers=2,
                                        num_attention_heads=heads, **FALCON[family])
        cls = transformers.FalconForCausalLM
    cfg._attn_implementation = "sdpa" if family.startswith("falcon") else "eager"
    torch.manual_seed(seed)
    return cls(cfg).eval()


def _inputs(padded, family=None):
    ids = torch.randint(2, 90, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 13, dtype=torch.long)
    if padded:
        mask[1, :4] = 0  # row 1 left-padded by 4
    out = dict(input_ids=ids, attention_mask=mask)
    if family in ("gpt_neo", "xglm", "gpt_neox_japanese"):  # positions counted from each row's first token
        out["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return out


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
    # XGLM's eager attention clamps its scores with torch.full((), finfo(dtype).min), made in the
    # default dtype: in fp64 that overflows fp32 unless the default is fp64 too
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for b in range(keep.shape[0]):
            logits = model(input_ids=inputs["input_ids"][b:b + 1, keep[b]]).logits
            outs.append(logits.detach()[0])
            total = total + (logits * g[b:b + 1, keep[b]]).sum()
    finally:
        torch.set_default_dtype(default)
    grads = torch.autograd.grad(total, params, allow_unused=True)
    return torch.cat(outs), dict(zip(names, grads))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("heads", [4, 6])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_own_attention_on_the_kernels_matches_fp64(family, heads, padded, monkeypatch):
    calls = []
    kernel = hf_own_attention.attention
    monkeypatch.setattr(hf_own_attention, "attention", lambda *a, **kw: calls.append(kw) or kernel(*a, **kw))
    model = _model(family, heads)
    report = ff.convert(model, inplace=False)
    ours = report.model
    converted = [r for r in report.replaced if r[1] == ATTENTION[family]]
    assert len(converted) == 2 and "ff.attention" in converted[0][2], str(report)
    inputs = _inputs(padded, family)
    out, grads = _run(ours, inputs)
    assert len(calls) == 2
    if family in ("bloom", "mpt"):
        assert calls[0]["alibi_slopes"] is not None
    ref, ref_grads = _reference(model, inputs)
    assert_model_matches(out, grads, ref, ref_grads)
    assert ours.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("family", FAMILIES)
def test_own_attention_bf16_error_ratio(family):
    model = _model(family)
    ours = ff.convert(copy.deepcopy(model).to(torch.bfloat16)).model
    inputs = _inputs(padded=True, family=family)
    out, grads = _run(ours, inputs)
    low, low_grads = _run(copy.deepcopy(model).to(torch.bfloat16), inputs)
    ref, ref_grads = _reference(model, inputs)
    atol = LOWP_ATOL[torch.bfloat16]
    assert_lowp_rule("out", out, ref, low, OUT_FACTOR, atol * ref.abs().max().item())
    for n, r in ref_grads.items():
        if r is not None:
            assert_lowp_rule(f"d{n}", grads[n], r, low_grads[n], GRAD_FACTOR, atol * r.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_own_attention_generate_with_cache_matches_unconverted(family):
    model = _model(family)
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs(padded=True, family=family)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(**inputs, **kw)
        got = ours.generate(**inputs, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):  # each decode step's logits
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), f"step {step}"


@pytest.mark.parametrize("family", FAMILIES)
def test_own_attention_output_attentions_runs_the_original(family):
    model = _model(family)
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs(padded=False, family=family)
    with torch.no_grad():
        out = ours(**inputs, output_attentions=True)
        ref = model(**inputs, output_attentions=True)
    assert out.attentions is not None and len(out.attentions) == 2
    torch.testing.assert_close(out.attentions[0], ref.attentions[0])
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)


def test_falcon_alibi_long_rows_keep_the_models_bf16_bias():
    """Falcon-RW's bias is bf16-rounded slope x position (steps of 0.125 past 256 positions here):
    over 300 tokens exact ALiBi slopes land 4e-3 of the largest logit off the model; the converted
    forward (the model's own bias mask) stays within fp32's 1e-5."""
    model = _model("falcon_alibi")
    ours = ff.convert(model, inplace=False).model
    ids = torch.randint(2, 90, (1, 300), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = ours(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_xglm_attentions_asked_by_config_run_the_original():
    """XGLM's attentions reach the output through transformers' recorder, also when the config
    (not an argument) asks for them: the converted forward sees the recorder collecting."""
    model = _model("xglm")
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs(padded=False, family="xglm")
    ours.config.output_attentions = model.config.output_attentions = True
    with torch.no_grad():
        out, ref = ours(**inputs), model(**inputs)
    assert out.attentions is not None and len(out.attentions) == 2
    torch.testing.assert_close(out.attentions[1], ref.attentions[1])
