"""BERT's self-attention written out in vision backbones (integrations/hf_vision_attention.py):
MobileViT's, the sequence-reduction attention of PVT, PVT v2 (strided and its pooled "linear"
variant) and GLPN, CvT's (convolution projections, a class token) and TimeSformer's (divided and
joint space-time), converted onto ff.attention, against the unconverted model run in
fp64: the last hidden state and every parameter's gradient; the (query rows, keys) of each call
(the reduced key counts); bf16 by the error-ratio rule; output_attentions (the original)."""
import copy

import pytest
import torch
from hf_encoder_checks import (assert_bf16_error_ratio, assert_output_attentions_match, run_with_grads, sharpened,
                               spy_lengths)
from oracle import assert_model_matches

transformers = pytest.importorskip("transformers", reason="needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_vision_attention, hf_written_out  # noqa: E402

STAGES = dict(hidden_sizes=[16, 32, 48, 64], num_attention_heads=[1, 2, 3, 4], depths=[1, 1, 1, 1],
              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# name: (config class, model class, config, image size, attention class, (query rows, keys) per call)
# PVT / GLPN: 64 x 64 images, stages of 16 x 16 ... 2 x 2 positions, keys from maps reduced by
# 8, 4, 2, 1 (PVT's last stage with its class token); PVT v2's linear variant pools every map to
# 7 x 7; MobileViT: 128 x 128 images, its three transformer stages over 64, 16 and 4 positions
# of each of 4 patch offsets
MODELS = {
    "mobilevit": ("MobileViTConfig", "MobileViTModel",
                  dict(image_size=256, hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
                       num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), 256,
                  "MobileViTSelfAttention", [(256, 256)] * 2 + [(64, 64)] * 4 + [(16, 16)] * 3),
    "pvt": ("PvtConfig", "PvtModel", dict(STAGES, image_size=64), 64, "PvtEfficientSelfAttention",
            [(256, 4), (64, 4), (16, 4), (5, 5)]),
    "pvt_v2": ("PvtV2Config", "PvtV2Model", STAGES, 64, "PvtV2SelfAttention", [(256, 4), (64, 4), (16, 4), (4, 4)]),
    "pvt_v2_linear": ("PvtV2Config", "PvtV2Model", dict(STAGES, linear_attention=True), 64, "PvtV2SelfAttention",
                      [(256, 49), (64, 49), (16, 49), (4, 49)]),
    "glpn": ("GLPNConfig", "GLPNModel", dict(STAGES, decoder_hidden_size=32), 64, "GLPNEfficientSelfAttention",
             [(256, 4), (64, 4), (16, 4), (4, 4)]),
    # CvT: stages of 16 x 16, 8 x 8, 4 x 4 positions (1, 2, 3 layers: transformers indexes each
    # stage's drop-path rates by the stage), keys / values strided by 2, the last stage with its
    # class token
    "cvt": ("CvtConfig", "CvtModel", dict(embed_dim=[16, 32, 48], num_heads=[1, 2, 3], depth=[1, 2, 3],
                                          drop_rate=[0.0] * 3, attention_drop_rate=[0.0] * 3), 64,
            "CvtSelfAttention",
            [(256, 64)] + [(64, 16)] * 2 + [(17, 5)] * 3),
    # TimeSformer on 2 frames of 32 x 32 (4 x 4 patches): each layer's divided attention over the
    # 2 frames of each patch, then over each frame's 16 patches and the class token
    "timesformer": ("TimesformerConfig", "TimesformerModel",
                    dict(image_size=32, patch_size=8, num_frames=2, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=48, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0), 32, "TimesformerSelfAttention",
                    [(2, 2), (17, 17)] * 2),
    "timesformer_joint": ("TimesformerConfig", "TimesformerModel",
                          dict(image_size=32, patch_size=8, num_frames=2, hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=48, attention_type="joint_space_time",
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), 32,
                          "TimesformerSelfAttention", [(33, 33)] * 2),
}


def _model(name):
    config, model, kw, *_ = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model)(getattr(transformers, config)(**kw))
    if name == "mobilevit":  # its transformer blocks only: spread wider, its convolution stack
        # saturates (gradients of 1e-20 in the first blocks, bf16 rounding noise amplified by it)
        sharpened(model.encoder.layer[2:])
        return model.eval()
    return sharpened(model)


def _inputs(name):
    size = MODELS[name][3]
    shape = (2, 2, 3, size, size) if name.startswith("timesformer") else (2, 3, size, size)  # video: 2 frames
    pixels = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    return lambda dtype=torch.float32: dict(pixel_values=pixels.to(dtype))


@pytest.mark.parametrize("name", list(MODELS))
def test_vision_attention_on_the_kernels_matches_fp64(name, monkeypatch):
    model = _model(name)
    report = ff.convert(model, inplace=False)
    attention, lengths_wanted = MODELS[name][4], MODELS[name][5]
    assert [r[1] for r in report.replaced].count(attention) == len(lengths_wanted), str(report)
    lengths = spy_lengths(monkeypatch, hf_vision_attention, hf_written_out)  # TimeSformer: hf_written_out's helper
    out, grads = run_with_grads(report.model, _inputs(name)())
    assert lengths == lengths_wanted
    ref, ref_grads = run_with_grads(copy.deepcopy(model).double(), _inputs(name)(torch.float64))
    assert_model_matches(out, grads, ref, ref_grads)


@pytest.mark.parametrize("name", list(MODELS))
def test_vision_attention_bf16_error_ratio(name):
    assert_bf16_error_ratio(_model(name), _inputs(name), sdpa_in=hf_vision_attention)


@pytest.mark.parametrize("name", ["pvt", "pvt_v2", "glpn"])
def test_vision_attention_output_attentions_runs_the_original(name):
    assert_output_attentions_match(_model(name), 4, _inputs(name)())
