"""DeBERTa-v2 / v3's disentangled attention converted (integrations/hf_deberta.py): ff.attention
with the relative terms as its bias (ops/relative_bias.py), against the unconverted model run in
fp64 — the hidden states at every position (padded rows included: the converted forward gives
them the original's mean of V) and every parameter's gradient — over the config forms the
checkpoints use (shared or separate position projections, c2p / p2c / both / none, log-bucketed
or plain relative positions over more tokens than the buckets), bf16 by the error-ratio rule,
a classification head, output_attentions (the original), torch.compile; DeBERTa v1's form (fused
in_proj with q / v biases, unbucketed positions, its own LayerNorm class on the fused add + norm),
its talking-heads variant left on its own code with the reason."""
import copy

import pytest
import torch
from hf_encoder_checks import (assert_bf16_error_ratio, assert_classifier_loss_and_training_dropout, encoder_inputs,
                               run_with_grads, spy_attention, assert_output_attentions_match)
from oracle import assert_model_matches

transformers = pytest.importorskip("transformers", reason="needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_deberta  # noqa: E402

FORMS = {
    "v3": dict(),                                     # deberta-v3-base's: shared keys, both terms
    "separate_projections": dict(share_att_key=False),
    "c2p_only": dict(pos_att_type=["c2p"]),
    "p2c_only": dict(pos_att_type=["p2c"]),
    "no_relative": dict(relative_attention=False),
    "plain_positions": dict(position_buckets=-1, max_relative_positions=16),
}


def _model(form="v3", heads=4, cls=None, seed=0):
    kw = dict(vocab_size=97, hidden_size=16 * heads, num_hidden_layers=2, num_attention_heads=heads,
              intermediate_size=48, max_position_embeddings=64, relative_attention=True,
              pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=-1,
              share_att_key=True, norm_rel_ebd="layer_norm", hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, num_labels=3)
    kw.update(FORMS[form])
    torch.manual_seed(seed)
    return (cls or transformers.DebertaV2Model)(transformers.DebertaV2Config(**kw)).eval()


_inputs, _run = encoder_inputs, run_with_grads


def _spy(monkeypatch):
    return spy_attention(monkeypatch, hf_deberta)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("heads", [4, 6])
def test_deberta_v2_attention_on_the_kernels_matches_fp64(form, heads, monkeypatch):
    calls = _spy(monkeypatch)
    model = _model(form, heads)
    report = ff.convert(model, inplace=False)
    ours = report.model
    converted = [r for r in report.replaced if r[1] == "DisentangledSelfAttention"]
    assert len(converted) == 2 and "ff.attention" in converted[0][2], str(report)
    out, grads = _run(ours, _inputs())
    assert len(calls) == 2
    if form != "no_relative":
        assert calls[0]["attn_mask"].dtype == torch.float32  # the relative terms, as a bias
    ref, ref_grads = _run(copy.deepcopy(model).double(), _inputs())
    assert_model_matches(out, grads, ref, ref_grads)
    assert ours.state_dict().keys() == model.state_dict().keys()


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_deberta_bf16_error_ratio(version):
    assert_bf16_error_ratio(_model() if version == "v2" else _v1_model(), _inputs())


def test_deberta_v2_classifier_loss_and_training_dropout():
    assert_classifier_loss_and_training_dropout(_model(cls=transformers.DebertaV2ForSequenceClassification),
                                                "DisentangledSelfAttention")


def test_deberta_v2_output_attentions_runs_the_original():
    assert_output_attentions_match(_model(), 2)


def test_deberta_v2_converted_compiles():
    model = _model()
    ours = ff.convert(model, inplace=False).model
    compiled = torch.compile(ours)
    with torch.no_grad():
        want = ours(**_inputs()).last_hidden_state
        got = compiled(**_inputs()).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _v1_model(heads=4, seed=0, **kw):
    cfg = dict(vocab_size=97, hidden_size=16 * heads, num_hidden_layers=2, num_attention_heads=heads,
               intermediate_size=48, max_position_embeddings=64, relative_attention=True,
               pos_att_type=["c2p", "p2c"], max_relative_positions=-1, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
    cfg.update(kw)
    torch.manual_seed(seed)
    model = transformers.DebertaModel(transformers.DebertaConfig(**cfg)).eval()
    with torch.no_grad():  # q_bias / v_bias start at zero: give them values the test can see
        for m in model.modules():
            if hasattr(m, "q_bias"):
                m.q_bias.normal_()
                m.v_bias.normal_()
    return model


V1_FORMS = {"both_terms": dict(), "c2p_only": dict(pos_att_type=["c2p"]), "no_relative": dict(relative_attention=False),
            "span_below_length": dict(max_relative_positions=8)}


@pytest.mark.parametrize("form", list(V1_FORMS))
@pytest.mark.parametrize("heads", [4, 6])
def test_deberta_v1_attention_and_add_norms_on_the_kernels_match_fp64(form, heads, monkeypatch):
    """DeBERTa v1 (microsoft/deberta-base's form): fused in_proj with q / v biases, unbucketed
    positions (a span of 8 below the 23 tokens: clamped), its own DebertaLayerNorm on the fused
    add + LayerNorm."""
    calls = _spy(monkeypatch)
    model = _v1_model(heads, **V1_FORMS[form])
    report = ff.convert(model, inplace=False)
    ours = report.model
    converted = [r for r in report.replaced if r[1] == "DisentangledSelfAttention"]
    assert len(converted) == 2, str(report)
    assert sum(r[1] in ("DebertaSelfOutput", "DebertaOutput") for r in report.replaced) == 4, str(report)
    out, grads = _run(ours, _inputs())
    assert len(calls) == 2
    ref, ref_grads = _run(copy.deepcopy(model).double(), _inputs())
    assert_model_matches(out, grads, ref, ref_grads)


def test_deberta_v1_talking_heads_are_left_with_their_reason():
    report = ff.convert(_v1_model(talking_head=True), inplace=False)
    left = [r for r in report.left if r[1] == "DisentangledSelfAttention"]
    assert len(left) == 2 and "talking heads" in left[0][2], str(report)
