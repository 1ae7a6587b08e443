"""MPNet converted (integrations/hf_mpnet.py): its attention on ff.attention with the relative-
position bias inside the kernels (an ff.RelativePositionBias over the encoder's table) and the
residual adds + LayerNorms and the MLP fused, against the unconverted model run in fp64 — the hidden states
at every position and every parameter's gradient (the bias table's included) — at lengths within
and beyond the buckets' max distance, with padding; bf16 by the error-ratio rule; a sentence-
embedding head's loss and training dropout; output_attentions (the original, given the bias
from the same table); torch.compile; an encoder whose attention is not converted keeps the
original bias."""
import copy

import pytest
import torch
from hf_encoder_checks import (assert_bf16_error_ratio, assert_classifier_loss_and_training_dropout, encoder_inputs,
                               run_with_grads, spy_attention, assert_output_attentions_match)
from oracle import assert_model_matches

transformers = pytest.importorskip("transformers", reason="needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_mpnet  # noqa: E402


def _model(heads=4, cls=None, seed=0, **kw):
    cfg = dict(vocab_size=97, hidden_size=16 * heads, num_hidden_layers=2, num_attention_heads=heads,
               intermediate_size=48, max_position_embeddings=320, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, num_labels=3)
    cfg.update(kw)
    torch.manual_seed(seed)
    model = (cls or transformers.MPNetModel)(transformers.MPNetConfig(**cfg)).eval()
    with torch.no_grad():  # a table the outputs depend on visibly (its default init is small)
        for m in model.modules():
            if hasattr(m, "relative_attention_bias"):
                m.relative_attention_bias.weight.normal_()
    return model


_inputs, _run = encoder_inputs, run_with_grads


def _spy(monkeypatch):
    return spy_attention(monkeypatch, hf_mpnet)


@pytest.mark.parametrize("L", [1, 23, 203])  # 203: distances past max_distance 128 share the last bucket
@pytest.mark.parametrize("heads", [4, 6])
def test_mpnet_on_the_kernels_matches_fp64(L, heads, monkeypatch):
    calls = _spy(monkeypatch)
    model = _model(heads)
    report = ff.convert(model, inplace=False)
    ours = report.model
    kinds = [r[1] for r in report.replaced]
    assert kinds.count("MPNetAttention") == 2 and kinds.count("MPNetEncoder") == 1, str(report)
    assert kinds.count("MPNetLayer") == 2, str(report)  # the MLP on ff.ffn
    out, grads = _run(ours, _inputs(L))
    assert len(calls) == 2 and isinstance(calls[0]["position_bias"], ff.RelativePositionBias)
    assert ff.last_dispatch().backend == "cpu"
    ref, ref_grads = _run(copy.deepcopy(model).double(), _inputs(L))
    if L > 1:  # one key: the bias is constant per row, which the softmax ignores
        assert ref_grads["encoder.relative_attention_bias.weight"].abs().max() > 0
    assert_model_matches(out, grads, ref, ref_grads)
    assert ours.state_dict().keys() == model.state_dict().keys()


def test_mpnet_bf16_error_ratio():
    assert_bf16_error_ratio(_model(), _inputs(150))


def test_mpnet_classifier_loss_and_training_dropout():
    ours = assert_classifier_loss_and_training_dropout(_model(cls=transformers.MPNetForSequenceClassification),
                                                       "MPNetSelfAttention")
    assert ours.mpnet.encoder.relative_attention_bias.weight.grad.abs().max() > 0


def test_mpnet_output_attentions_runs_the_original_with_the_same_bias():
    assert_output_attentions_match(_model(), 2)


def test_mpnet_converted_compiles():
    model = _model()
    ours = ff.convert(model, inplace=False).model
    compiled = torch.compile(ours, fullgraph=True)
    with torch.no_grad():
        want = ours(**_inputs()).last_hidden_state
        got = compiled(**_inputs()).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_unconverted_attention_gets_the_original_bias():
    """The encoder hands its layers the tensor bias unless every layer's attention is converted."""
    model = _model()
    ours = ff.convert(model, inplace=False).model
    layer = ours.encoder.layer[0]
    layer.attention.__class__ = type(layer.attention)._fastformer_original
    bias = ours.encoder.compute_position_bias(torch.zeros(2, 23, 64))
    want = model.encoder.compute_position_bias(torch.zeros(2, 23, 64))
    assert isinstance(bias, torch.Tensor) and torch.equal(bias, want)
    with torch.no_grad():
        torch.testing.assert_close(ours(**_inputs()).last_hidden_state, model(**_inputs()).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)
