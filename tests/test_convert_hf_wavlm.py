"""WavLM's attention converted (integrations/hf_own_attention.py): its gated relative-position bias
(a T5-style bucket table, gated per query row by that row's hidden state) handed to ff.attention
as a float (B, H, L, L) mask with the padding as a key mask, where the original calls torch's
F.multi_head_attention_forward. Against the unconverted model run in fp64: the hidden states at
every frame (the second clip padded) and every parameter's gradient (the bucket table's and the
gate's through the bias), post-norm (WavLM-base) and pre-norm ("stable", WavLM-large) layers,
4 and 6 heads; bf16 inference and training by the error-ratio rule; output_attentions (the
original)."""
import copy

import pytest
import torch
from hf_encoder_checks import (assert_bf16_error_ratio, assert_output_attentions_match, run_with_grads, sharpened,
                               spy_attention)
from oracle import LOWP_ATOL, OUT_FACTOR, assert_lowp_rule, assert_model_matches

transformers = pytest.importorskip("transformers", reason="needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_own_attention  # noqa: E402


def _wavlm(stable=False, heads=4):
    config = transformers.WavLMConfig(hidden_size=16 * heads, num_hidden_layers=2, num_attention_heads=heads,
                                      intermediate_size=48, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                      num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_buckets=32,
                                      max_bucket_distance=64, do_stable_layer_norm=stable,
                                      feat_extract_norm="layer" if stable else "group", hidden_dropout=0.0,
                                      attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                                      layerdrop=0.0, mask_time_prob=0.0)
    torch.manual_seed(0)
    return sharpened(transformers.WavLMModel(config))


def _inputs(dtype=torch.float32):
    """Two clips of 1600 samples (159 frames), the second's last 400 samples padding."""
    mask = torch.ones(2, 1600, dtype=torch.long)
    mask[1, 1200:] = 0
    return dict(input_values=torch.randn(2, 1600, generator=torch.Generator().manual_seed(1)).to(dtype),
                attention_mask=mask)


@pytest.mark.parametrize("stable", [False, True], ids=["base", "stable"])
@pytest.mark.parametrize("heads", [4, 6])
def test_wavlm_attention_on_the_kernels_matches_fp64(stable, heads, monkeypatch):
    model = _wavlm(stable, heads)
    report = ff.convert(model, inplace=False)
    assert [r[1] for r in report.replaced].count("WavLMAttention") == 2, str(report)
    calls = spy_attention(monkeypatch, hf_own_attention)
    out, grads = run_with_grads(report.model, _inputs())
    assert len(calls) == 2
    for c in calls:
        assert c["attn_mask"].shape == (2, heads, 159, 159) and c["attn_mask"].is_floating_point()
        assert c["key_padding_mask"][1, -40:].all() and not c["key_padding_mask"][0].any()
    ref, ref_grads = run_with_grads(copy.deepcopy(model).double(), _inputs(torch.float64))
    assert_model_matches(out, grads, ref, ref_grads)
    assert grads["encoder.layers.0.attention.rel_attn_embed.weight"].abs().max() > 0  # the bias's gradient


@pytest.mark.parametrize("stable", [False, True], ids=["base", "stable"])
def test_wavlm_bf16_inference_error_ratio(stable, monkeypatch):
    """bf16 inference on the kernels: the hidden states within the error-ratio rule of bf16 eager's
    error against fp64."""
    model = _wavlm(stable)
    bf16 = torch.bfloat16
    calls = spy_attention(monkeypatch, hf_own_attention)
    with torch.no_grad():
        ours = ff.convert(copy.deepcopy(model).to(bf16)).model(**_inputs(bf16)).last_hidden_state
        eager = copy.deepcopy(model).to(bf16)(**_inputs(bf16)).last_hidden_state
        ref = copy.deepcopy(model).double()(**_inputs(torch.float64)).last_hidden_state
    assert len(calls) == 2
    assert_lowp_rule("out", ours, ref, eager, OUT_FACTOR, LOWP_ATOL[bf16] * ref.abs().max().item())


@pytest.mark.parametrize("stable", [False, True], ids=["base", "stable"])
@pytest.mark.parametrize("heads", [4, 6])
def test_wavlm_bf16_training_on_the_kernels(stable, heads, monkeypatch):
    """bf16 with autograd recording on the CPU kernels, whose backward's delta is the fp32
    output's (ARCHITECTURE.md, Numerical policy): the output and every gradient, the key bias's
    (0 in exact arithmetic) and the gated bias's table and gate included, within the rule of
    bf16 eager (torch's SDPA has no flash backward for a bias needing a gradient)."""
    calls = spy_attention(monkeypatch, hf_own_attention)
    assert_bf16_error_ratio(_wavlm(stable, heads), _inputs)
    assert len(calls) == 2


def test_wavlm_output_attentions_runs_the_original():
    assert_output_attentions_match(_wavlm(), 2, _inputs())
