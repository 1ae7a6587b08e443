"""Encoder-decoders with BART's attention written out in their own code (integrations/
hf_written_out.py): FSMT (fairseq's WMT translation models: (L, B, E) activations, a bool key
padding mask and a float causal mask; its layers on the fused add + LayerNorm and ff.ffn,
hf_seq2seq_forms.py) and MVP (with and without its per-layer prompt keys / values), converted
onto ff.attention, against the unconverted model run in fp64: the logits at every position
(source and target one row padded each) and every parameter's gradient, with 4 and 6 heads;
bf16 by the error-ratio rule; greedy generation token for token through the cache, with the
(query rows, keys) of every call; output_attentions (the original)."""
import copy

import pytest
import torch
from hf_encoder_checks import (assert_bf16_error_ratio, assert_output_attentions_match, encoder_inputs,
                               run_with_grads, sharpened, spy_attention, spy_lengths)
from oracle import assert_model_matches

transformers = pytest.importorskip("transformers", reason="needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_written_out  # noqa: E402

SIZES = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=48, decoder_ffn_dim=48,
             max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def _fsmt(heads=4, activation="relu"):
    config = transformers.FSMTConfig(langs=["en", "de"], src_vocab_size=97, tgt_vocab_size=97,
                                     encoder_attention_heads=heads, decoder_attention_heads=heads,
                                     activation_function=activation, **dict(SIZES, d_model=16 * heads))
    torch.manual_seed(0)
    return sharpened(transformers.FSMTForConditionalGeneration(config))


def _mvp(heads=4, prompt=False):
    config = transformers.MvpConfig(vocab_size=97, encoder_attention_heads=heads, decoder_attention_heads=heads,
                                    use_prompt=prompt, prompt_length=5, prompt_mid_dim=32, pad_token_id=1,
                                    **dict(SIZES, d_model=16 * heads))
    torch.manual_seed(0)
    return sharpened(transformers.MvpForConditionalGeneration(config))


def _inputs(dtype=torch.float32):
    """17 source tokens (row 1 padded by 6), 11 target tokens (row 1 padded by 6: FSMT reads its
    padding from the pad id 1, MVP from the decoder's attention mask)."""
    source, target = encoder_inputs(17), encoder_inputs(11)
    target_ids = target["input_ids"].masked_fill(target["attention_mask"] == 0, 1)
    return dict(source, decoder_input_ids=target_ids, decoder_attention_mask=target["attention_mask"])


def _fsmt_inputs(dtype=torch.float32):
    """As _inputs, without the cache: FSMT builds its causal and target padding masks only then
    (as it does with labels; with the cache on, its decoder runs unmasked)."""
    inputs = _inputs(dtype)
    del inputs["decoder_attention_mask"]
    return dict(inputs, use_cache=False)


# name: (model(heads), inputs, converted modules by class)
MODELS = {"fsmt": (_fsmt, _fsmt_inputs, dict(Attention=6, EncoderLayer=2, DecoderLayer=2)),
          "mvp": (_mvp, _inputs, dict(MvpAttention=6)),
          "mvp-prompt": (lambda heads: _mvp(heads, prompt=True), _inputs, dict(MvpAttention=6))}


@pytest.fixture(autouse=True)
def _fsmt_fp64_causal_mask(monkeypatch):
    """FSMT fills its causal mask with finfo(dtype).min through an fp32 tensor, which overflows
    for an fp64 model: the fp64 oracle's mask filled in its own dtype (the same mask in fp32)."""
    from transformers.models.fsmt import modeling_fsmt
    monkeypatch.setattr(modeling_fsmt, "fill_with_neg_inf", lambda t: t.fill_(torch.finfo(t.dtype).min))


def _logits_with_grads(model, inputs):
    return run_with_grads(model, inputs, output=lambda out: out.logits)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("heads", [4, 6])
def test_written_out_seq2seq_on_the_kernels_matches_fp64(name, heads, monkeypatch):
    build, inputs, converted = MODELS[name]
    model = build(heads)
    report = ff.convert(model, inplace=False)
    kinds = [r[1] for r in report.replaced]
    assert {k: kinds.count(k) for k in converted} == converted, str(report)
    calls = spy_attention(monkeypatch, hf_written_out)
    out, grads = _logits_with_grads(report.model, inputs())
    assert len(calls) == 6
    ref, ref_grads = _logits_with_grads(copy.deepcopy(model).double(), inputs(torch.float64))
    assert_model_matches(out, grads, ref, ref_grads)
    masked = [c.get("key_padding_mask") is not None or c.get("attn_mask") is not None for c in calls]
    assert all(masked)  # the source's padding in each encoder and cross call, the causal mask in the decoder's


def test_fsmt_masks_reach_the_kernels(monkeypatch):
    """The encoder's and the cross-attention's bool key padding (True = padding), and the
    decoder's float causal mask with its padding."""
    ours = ff.convert(_fsmt(), inplace=False).model
    calls = spy_attention(monkeypatch, hf_written_out)
    with torch.no_grad():
        ours(**_fsmt_inputs())
    padding = _fsmt_inputs()["attention_mask"] == 0
    encoder, decoder = calls[:2], calls[2:]
    assert all(torch.equal(c["key_padding_mask"], padding) for c in encoder + decoder[1::2])
    for c in decoder[0::2]:
        assert c["attn_mask"].shape == (11, 11) and c["attn_mask"].is_floating_point()
        assert c["key_padding_mask"][1, -6:].all() and not c["key_padding_mask"][0].any()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skip(
    reason="transformers' bf16 MVP with prompts does not run (its prompt mask is fp32, and so its scores)"))
    if n == "mvp-prompt" else n for n in MODELS])
def test_written_out_seq2seq_bf16_error_ratio(name):
    build, inputs, _ = MODELS[name]
    if name == "fsmt":
        # GELU for FSMT's ReLU here: ReLU's derivative is a step, and a pre-activation within
        # bf16 rounding of 0 lands on either side, moving a whole token's term of fc1's weight
        # gradient. Which ones flip differs between any two bf16 runs (torch's eager included),
        # so the rule's max error became a discrete draw: built with seeds 0-5, ReLU failed
        # the rule on one (an fc1 weight gradient 6.7 off against torch's 2.2), GELU on none.
        # The attention under test is the same; ReLU is in the fp32 tests.
        build = lambda heads: _fsmt(heads, activation="gelu")  # noqa: E731
    assert_bf16_error_ratio(build(4), inputs, run=_logits_with_grads, sdpa_in=hf_written_out)


@pytest.mark.parametrize("name", list(MODELS))
def test_written_out_seq2seq_generates_alike_through_the_cache(name, monkeypatch):
    """Greedy decoding: the encoder once, then per step and layer the self-attention over the
    tokens so far and the cross-attention over the 17 source positions (keys computed once)."""
    build, inputs, _ = MODELS[name]
    model = build(4)
    ours = ff.convert(model, inplace=False).model
    source = {k: _inputs()[k] for k in ("input_ids", "attention_mask")}
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
    want = model.generate(**source, **kw)
    lengths = spy_lengths(monkeypatch, hf_written_out)
    got = ours.generate(**source, **kw)
    assert torch.equal(got, want)
    prompt = 5 if name == "mvp-prompt" else 0  # MVP's prompt keys ahead of each decoder attention's
    assert lengths[:2] == [(17, 17)] * 2
    steps = lengths[2:]
    assert steps[0::2] == [(1, n + prompt) for n in range(1, got.shape[1]) for _ in range(2)]
    assert steps[1::2] == [(1, 17 + prompt)] * (2 * (got.shape[1] - 1))


def test_fsmt_output_attentions_runs_the_original():
    assert_output_attentions_match(_fsmt(), 2, _fsmt_inputs(),
                                   ("encoder_attentions", "decoder_attentions", "cross_attentions"), "logits")
