"""ff.convert on encoder-decoder families whose layers are of BART or Whisper
form (integrations/hf_seq2seq_forms.py): each built from a small config with random weights,
converted (a copy) and compared with the unconverted model in fp64 on the logits and the gradient
of every parameter (within 1e-5 of the reference's scale; bf16 by the error-ratio rule), greedy
generation against eager's tokens, the report naming every converted layer, and the calls the
converted layers must leave to the original forward.
"""
import copy

import pytest
import torch
from oracle import GRAD_FACTOR, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule, assert_model_matches
from test_convert_hf import _run, compile_family
from test_convert_hf_forms import random_model

transformers = pytest.importorskip("transformers", reason="the Hugging Face conversion needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_seq2seq_forms  # noqa: E402

V = 100
SEQ2SEQ = dict(vocab_size=V, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
               pad_token_id=1, decoder_start_token_id=2, eos_token_id=3, bos_token_id=0)
POST, PRE = "post-norm", "pre-norm"


def _families():
    """name -> (config class, model class, config kwargs, the layers' form)."""
    t = transformers
    return {
        "bart": (t.BartConfig, t.BartForConditionalGeneration, dict(SEQ2SEQ), POST),
        "marian": (t.MarianConfig, t.MarianMTModel, dict(SEQ2SEQ), POST),  # SiLU ("swish")
        "mbart": (t.MBartConfig, t.MBartForConditionalGeneration, dict(SEQ2SEQ), PRE),
        "m2m100": (t.M2M100Config, t.M2M100ForConditionalGeneration, dict(SEQ2SEQ), PRE),  # ReLU
        "pegasus": (t.PegasusConfig, t.PegasusForConditionalGeneration, dict(SEQ2SEQ), PRE),
        "whisper": (t.WhisperConfig, t.WhisperForConditionalGeneration,
                    dict(SEQ2SEQ, num_mel_bins=16, max_source_positions=16, max_target_positions=64,
                         decoder_start_token_id=2, suppress_tokens=None, begin_suppress_tokens=None), PRE),
        "blenderbot_small": (t.BlenderbotSmallConfig, t.BlenderbotSmallForConditionalGeneration, dict(SEQ2SEQ), POST),
    }


FAMILIES = list(_families())
NO_DROPOUT = ("dropout", "attention_dropout", "activation_dropout")


def _model(name, dropout=0.0):
    config_cls, model_cls, kw, _ = _families()[name]
    config = config_cls(**kw)
    for key in NO_DROPOUT:
        setattr(config, key, dropout)
    return random_model(model_cls, config)


def _inputs(name, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, V, (2, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # a padded encoder row
    decoder_ids = torch.randint(4, V, (2, 7), generator=g)
    if name == "whisper":
        return dict(input_features=torch.randn(2, 16, 32, generator=g).to(dtype), decoder_input_ids=decoder_ids)
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)


def _exact(inputs):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}


def _layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith(("EncoderLayer", "DecoderLayer"))]


@pytest.mark.parametrize("name", FAMILIES)
def test_seq2seq_family_converted_and_matching_fp32(name):
    model = _model(name)
    report = ff.convert(model, inplace=False)
    form = _families()[name][3]
    layers = _layers(model)
    converted = [kind for _, cls, kind in report.replaced if cls.endswith(("EncoderLayer", "DecoderLayer"))]
    assert len(converted) == len(layers) and all(form in kind for kind in converted), str(report)
    inputs = _inputs(name)
    out, grads = _run(report.model, inputs)
    ref, ref_grads = _run(copy.deepcopy(model).double(), _exact(inputs))
    assert_model_matches(out, grads, ref, ref_grads)


@pytest.mark.parametrize("name", ["bart", "whisper"])
def test_seq2seq_family_bf16_error_ratio(name):
    model = _model(name)
    ours_model = ff.convert(copy.deepcopy(model).to(torch.bfloat16)).model
    inputs = _inputs(name)
    low_inputs = _inputs(name, torch.bfloat16)
    out, grads = _run(ours_model, low_inputs)
    low, low_grads = _run(copy.deepcopy(model).to(torch.bfloat16), low_inputs)
    ref, ref_grads = _run(copy.deepcopy(model).double(), _exact(inputs))
    atol = LOWP_ATOL[torch.bfloat16]
    assert_lowp_rule("out", out, ref, low, OUT_FACTOR, atol * ref.abs().max().item())
    for n, r in ref_grads.items():
        if r is not None:
            assert_lowp_rule(f"d{n}", grads[n], r, low_grads[n], GRAD_FACTOR, atol * r.abs().max().item())


@pytest.mark.parametrize("name", ["bart", "marian", "mbart", "whisper"])
def test_seq2seq_greedy_generate_matches_eager(name):
    """Generation through the converted layers (the self-attention cache, the cross-attention
    cache after the first step) picks eager's tokens (weights scaled up so that no two logits
    are near a tie)."""
    model = _model(name).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs(name)
    inputs.pop("decoder_input_ids", None)
    kw = dict(inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False, num_beams=1)
    with torch.no_grad():
        assert torch.equal(ours.generate(**kw), model.generate(**kw))


def test_dropout_runs_in_training_and_follows_the_seed():
    """With dropout in the config the converted layers drop in training (the kernels' Philox mask
    from torch's seed: the same seed gives the same output) and not in eval, where they match
    the unconverted model."""
    model = _model("bart", dropout=0.3)
    ours = ff.convert(model, inplace=False).model.train()
    inputs = _inputs("bart")
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        outs.append(ours(**inputs).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    with torch.no_grad():
        evaluated = ours.eval()(**inputs).logits
        ref = model.eval()(**inputs).logits
    assert not torch.allclose(outs[0], evaluated)
    assert (evaluated - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_float16_runs_the_original(monkeypatch):
    """float16 runs the unconverted forward (the originals clamp the stream to its range): no
    fused feed-forward call in float16, one per layer in float32."""
    calls = []
    real = hf_seq2seq_forms.model_ffn
    monkeypatch.setattr(hf_seq2seq_forms, "model_ffn", lambda *a, **k: calls.append(1) or real(*a, **k))
    ours = ff.convert(_model("bart").eval(), inplace=False).model
    inputs = _inputs("bart")
    with torch.no_grad():
        ours.half()(**inputs)
        assert calls == []
        ours.float()(**inputs)
        assert len(calls) == 4  # two encoder and two decoder layers


def test_activation_without_a_kernel_keeps_the_norm_fusion():
    """An activation with no fused kernel (Mish) converts the layer all the same: the
    residual adds still run fused, the feed-forward as written."""
    kw = dict(SEQ2SEQ, activation_function="mish")
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(**kw)).eval()
    report = ff.convert(model, inplace=False)
    assert sum("post-norm" in kind for _, _, kind in report.replaced) == 4
    inputs = _inputs("bart")
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(**inputs).logits
        out = report.model(**inputs).logits
    assert (out.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_seq2seq_compiles_fullgraph():
    """A converted BART trains under torch.compile(fullgraph=True), matching fp64 eager."""
    torch._dynamo.reset()
    model = _model("bart")
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs("bart")
    out, grads = _run(compile_family(ours, "bart"), inputs)
    ref, ref_grads = _run(copy.deepcopy(model).double(), _exact(inputs))
    assert_model_matches(out, grads, ref, ref_grads, "_orig_mod.")
