"""BERT's, ViT's, BART's and GPT-2's attention written out in a family's own code (TAPAS,
RemBERT, Megatron-BERT, VisualBERT, FLAVA, ViLT, RoFormer, LXMERT, BLIP, TrOCR, Table
Transformer, Bark, OpenAI GPT, XLM, FlauBERT: integrations/hf_written_out.py), converted onto
ff.attention with the model's mask, against the unconverted model run in fp64: the hidden states
at every position (one row right-padded) and every parameter's gradient, with 4 and 6 heads; bf16
by the error-ratio rule; output_attentions (the original). Table Transformer (DETR's attention
written out) on a small ResNet backbone, its image padding as the encoder's and the
cross-attention's mask. The decoders: RemBERT's, Megatron-BERT's and RoFormer's causal LMs,
BLIP's captioner and TrOCR's reader (vision encoder, text decoder with cross-attention) in logits
and gradients, and greedy generation through the caches token for token, with the keys each step
attends to; Bark's causal model step by step through its cache."""
import copy

import pytest
import torch
from hf_encoder_checks import (assert_bf16_error_ratio, assert_output_attentions_match, encoder_inputs, run_with_grads,
                               sharpened, spy_attention, spy_lengths)
from oracle import assert_model_matches

transformers = pytest.importorskip("transformers", reason="needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_written_out  # noqa: E402

BERT = dict(vocab_size=97, num_hidden_layers=2, intermediate_size=48, max_position_embeddings=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
FAMILIES = {"tapas": ("TapasConfig", "TapasModel", "TapasSelfAttention", {}),
            "rembert": ("RemBertConfig", "RemBertModel", "RemBertSelfAttention",
                        dict(input_embedding_size=32, output_embedding_size=32)),
            "megatron_bert": ("MegatronBertConfig", "MegatronBertModel", "MegatronBertSelfAttention", {}),
            "visual_bert": ("VisualBertConfig", "VisualBertModel", "VisualBertSelfAttention", {}),
            "flava_text": ("FlavaTextConfig", "FlavaTextModel", "FlavaSelfAttention", {}),
            # RoFormer: its interleaved rotary on queries and keys (and values) through ff.apply_rotary
            "roformer": ("RoFormerConfig", "RoFormerModel", "RoFormerSelfAttention", {}),
            "roformer-rotary-value": ("RoFormerConfig", "RoFormerModel", "RoFormerSelfAttention",
                                      dict(rotary_value=True))}
# the layers whose feed-forward chunk is BERT's: ff.ffn + ff.add_layer_norm
LAYERS = {"tapas": "TapasLayer", "rembert": "RemBertLayer", "visual_bert": "VisualBertLayer",
          "roformer": "RoFormerLayer", "roformer-rotary-value": "RoFormerLayer"}
CAUSAL_LMS = {"rembert": ("RemBertConfig", "RemBertForCausalLM",
                          dict(input_embedding_size=32, output_embedding_size=32)),
              "megatron_bert": ("MegatronBertConfig", "MegatronBertForCausalLM", {}),
              "roformer": ("RoFormerConfig", "RoFormerForCausalLM", {})}  # the rotary's positions past the cache


def _model(family, heads=4, seed=0):
    config_name, model_name, _, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(hidden_size=16 * heads, num_attention_heads=heads, **BERT, **extra)
    return sharpened(getattr(transformers, model_name)(config))


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("heads", [4, 6])
def test_written_out_attention_on_the_kernels_matches_fp64(family, heads, monkeypatch):
    calls = spy_attention(monkeypatch, hf_written_out)
    model = _model(family, heads)
    report = ff.convert(model, inplace=False)
    converted = [r for r in report.replaced if r[1] == FAMILIES[family][2]]
    assert len(converted) == 2 and "ff.attention" in converted[0][2], str(report)
    if family in LAYERS:
        assert [r[1] for r in report.replaced].count(LAYERS[family]) == 2, str(report)
    out, grads = run_with_grads(report.model, encoder_inputs())
    assert len(calls) == 2 and calls[0]["attn_mask"] is not None
    ref, ref_grads = run_with_grads(copy.deepcopy(model).double(), encoder_inputs())
    assert_model_matches(out, grads, ref, ref_grads)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_written_out_attention_bf16_error_ratio(family):
    assert_bf16_error_ratio(_model(family), encoder_inputs(), sdpa_in=hf_written_out)


@pytest.mark.parametrize("family", ["tapas", "rembert", "visual_bert", "roformer"])
def test_written_out_attention_output_attentions_runs_the_original(family):
    assert_output_attentions_match(_model(family), 2)


def _lxmert():
    t = transformers
    config = t.LxmertConfig(vocab_size=97, hidden_size=64, num_attention_heads=4, intermediate_size=48, l_layers=2,
                            x_layers=1, r_layers=1, visual_feat_dim=12, visual_pos_dim=4, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return sharpened(t.LxmertModel(config))


def _lxmert_inputs(dtype=torch.float32):
    """Text (one row padded) and 7 image regions' features and boxes (one row's last 2 masked)."""
    g = torch.Generator().manual_seed(3)
    return dict(encoder_inputs(), visual_feats=torch.randn(2, 7, 12, generator=g).to(dtype),
                visual_pos=torch.rand(2, 7, 4, generator=g).to(dtype),
                visual_attention_mask=torch.tensor([[1] * 7, [1] * 5 + [0] * 2]))


def _lxmert_outputs_with_grads(model, inputs):
    return run_with_grads(model, inputs, output=lambda out: torch.cat([out.language_output, out.vision_output], 1))


def test_lxmert_attention_on_the_kernels_matches_fp64(monkeypatch):
    """LXMERT: the language and vision encoders' self-attention and the cross-modality layer's
    cross-attention (each way, one module) on the kernels, each with its own padding mask."""
    model = _lxmert()
    report = ff.convert(model, inplace=False)
    assert [r[1] for r in report.replaced].count("LxmertAttention") == 6, str(report)  # 2 + 1 + (1 cross + 2 self)
    lengths = spy_lengths(monkeypatch, hf_written_out)
    out, grads = _lxmert_outputs_with_grads(report.model, _lxmert_inputs())
    assert sorted(lengths) == sorted([(23, 23)] * 3 + [(7, 7)] * 2 + [(23, 7), (7, 23)])
    ref, ref_grads = _lxmert_outputs_with_grads(copy.deepcopy(model).double(), _lxmert_inputs(torch.float64))
    assert_model_matches(out, grads, ref, ref_grads)


def test_lxmert_bf16_error_ratio():
    assert_bf16_error_ratio(_lxmert(), _lxmert_inputs, run=_lxmert_outputs_with_grads, sdpa_in=hf_written_out)


def _causal_lm(family):
    config_name, model_name, extra = CAUSAL_LMS[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(hidden_size=64, num_attention_heads=4, is_decoder=True,
                                                pad_token_id=0, **BERT, **extra)
    return sharpened(getattr(transformers, model_name)(config))


def _logits_with_grads(model, inputs):
    return run_with_grads(model, inputs, output=lambda out: out.logits)


@pytest.mark.parametrize("family", list(CAUSAL_LMS))
def test_written_out_causal_lm_matches_fp64_and_generates_alike(family, monkeypatch):
    """The decoder's causal + padding mask from the model, through the kernels; then greedy
    decoding (prefill, then one query row per step against the cached keys) token for token."""
    model = _causal_lm(family)
    ours = ff.convert(model, inplace=False).model
    out, grads = _logits_with_grads(ours, encoder_inputs(17))
    ref, ref_grads = _logits_with_grads(copy.deepcopy(model).double(), encoder_inputs(17))
    assert_model_matches(out, grads, ref, ref_grads)
    calls = spy_attention(monkeypatch, hf_written_out)
    prompt = encoder_inputs(9)["input_ids"][:1]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kw), model.generate(prompt, **kw))
    assert len(calls) == 2 * 6  # 2 layers, the prefill and 5 cached steps


def _blip(heads=4):
    t = transformers
    vision = t.BlipVisionConfig(hidden_size=16 * heads, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=heads, image_size=32, patch_size=8)
    text = t.BlipTextConfig(vocab_size=97, hidden_size=16 * heads, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=heads, encoder_hidden_size=16 * heads, max_position_embeddings=64,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
                            bos_token_id=1, sep_token_id=2)
    torch.manual_seed(0)
    return sharpened(t.BlipForConditionalGeneration(t.BlipConfig(text_config=text.to_dict(),
                                                                  vision_config=vision.to_dict())))


def _blip_inputs(dtype=torch.float32):
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return dict(encoder_inputs(11), pixel_values=pixels.to(dtype))


def test_blip_captioner_bf16_error_ratio():
    assert_bf16_error_ratio(_blip(), _blip_inputs, run=_logits_with_grads, sdpa_in=hf_written_out)


def test_blip_caption_generates_alike_through_the_cache(monkeypatch):
    """Captioning: the vision encoder, then the text decoder greedy from BOS, each step one query
    row against the cached self-attention keys and the cross-attention keys computed once."""
    model = _blip()
    ours = ff.convert(model, inplace=False).model
    lengths = spy_lengths(monkeypatch, hf_written_out)
    pixels = _blip_inputs()["pixel_values"]
    kw = dict(max_new_tokens=5, do_sample=False, min_new_tokens=5)
    got = ours.generate(pixel_values=pixels, **kw)
    assert torch.equal(got, model.generate(pixel_values=pixels, **kw))
    # 2 vision layers on 17 positions; then per step and layer the self-attention over the
    # tokens so far and the cross-attention over the 17 image positions, one query row after BOS
    text = lengths[2:]
    assert lengths[:2] == [(17, 17)] * 2 and len(text) == 4 * 5
    assert text[0::2] == [(1, 1), (1, 1), (1, 2), (1, 2), (1, 3), (1, 3), (1, 4), (1, 4), (1, 5), (1, 5)]
    assert text[1::2] == [(1, 17)] * 10


def test_blip_vision_attentions_run_the_original():
    model = _blip()
    ours = ff.convert(model, inplace=False).model
    with torch.no_grad():
        got = ours.vision_model(_blip_inputs()["pixel_values"], output_attentions=True)
        want = model.vision_model(_blip_inputs()["pixel_values"], output_attentions=True)
    assert got.attentions is not None and len(got.attentions) == 2
    for a, b in zip(got.attentions, want.attentions):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=1e-5)


def _trocr(heads=4):
    """TrOCR's form: a ViT encoder and TrOCR's decoder through VisionEncoderDecoderModel."""
    t = transformers
    encoder = t.ViTConfig(image_size=32, patch_size=8, hidden_size=16 * heads, num_hidden_layers=2,
                          num_attention_heads=heads, intermediate_size=48)
    decoder = t.TrOCRConfig(vocab_size=97, d_model=16 * heads, decoder_layers=2, decoder_attention_heads=heads,
                            decoder_ffn_dim=48, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                            eos_token_id=2, decoder_start_token_id=1, dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0)
    torch.manual_seed(0)
    model = t.VisionEncoderDecoderModel(encoder=t.ViTModel(encoder), decoder=t.TrOCRForCausalLM(decoder))
    model.config.decoder_start_token_id, model.config.pad_token_id = 1, 0
    return sharpened(model)


def _trocr_inputs(dtype=torch.float32):
    text = encoder_inputs(11)
    return dict(pixel_values=_blip_inputs(dtype)["pixel_values"], decoder_input_ids=text["input_ids"],
                decoder_attention_mask=text["attention_mask"])


# image-to-text models: (model(heads), inputs(dtype), converted modules by class, ff.attention calls)
IMAGE_TO_TEXT = {"blip": (_blip, _blip_inputs, dict(BlipAttention=2, BlipTextSelfAttention=4, BlipEncoderLayer=2,
                                                    BlipTextLayer=2), 2 + 4),  # vision; text self + cross
                 "trocr": (_trocr, _trocr_inputs, dict(TrOCRAttention=4, TrOCRDecoderLayer=2), 4)}


@pytest.mark.parametrize("family", list(IMAGE_TO_TEXT))
@pytest.mark.parametrize("heads", [4, 6])
def test_image_to_text_on_the_kernels_matches_fp64(family, heads, monkeypatch):
    build, inputs, converted, n_calls = IMAGE_TO_TEXT[family]
    calls = spy_attention(monkeypatch, hf_written_out)
    model = build(heads)
    report = ff.convert(model, inplace=False)
    kinds = [r[1] for r in report.replaced]
    assert {k: kinds.count(k) for k in converted} == converted, str(report)
    out, grads = _logits_with_grads(report.model, inputs())
    assert len(calls) == n_calls and calls[-2]["attn_mask"] is not None  # the text's causal + padding mask
    ref, ref_grads = _logits_with_grads(copy.deepcopy(model).double(), inputs(torch.float64))
    assert_model_matches(out, grads, ref, ref_grads)


def test_trocr_decoder_bf16_error_ratio():
    assert_bf16_error_ratio(_trocr(), _trocr_inputs, run=_logits_with_grads, sdpa_in=hf_written_out)


def test_trocr_reads_text_alike_through_the_cache(monkeypatch):
    model = _trocr()
    ours = ff.convert(model, inplace=False).model
    lengths = spy_lengths(monkeypatch, hf_written_out)
    pixels = _trocr_inputs()["pixel_values"]
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(ours.generate(pixels, **kw), model.generate(pixels, **kw))
    # per step and layer: the self-attention over the tokens so far, the cross-attention over
    # the encoder's 17 positions (computed once, read from the cache after)
    assert lengths[0::2] == [(1, n) for n in range(1, 7) for _ in range(2)]
    assert lengths[1::2] == [(1, 17)] * 12


def test_trocr_output_attentions_runs_the_original():
    assert_output_attentions_match(_trocr(), 2, _trocr_inputs(), ("decoder_attentions", "cross_attentions"), "logits")


def test_vilt_on_the_kernels_matches_fp64(monkeypatch):
    """ViLT (text tokens and image patches in one BERT-style encoder; the patches it keeps drawn
    at random per forward: seeded alike for every run)."""
    t = transformers
    config = t.ViltConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=48, image_size=32, patch_size=8, max_image_length=-1,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = sharpened(t.ViltModel(config))
    report = ff.convert(model, inplace=False)
    assert [r[1] for r in report.replaced].count("ViltSelfAttention") == 2, str(report)
    calls = spy_attention(monkeypatch, hf_written_out)

    def run(m, dtype):
        torch.manual_seed(3)
        return run_with_grads(m, _blip_inputs(dtype))
    out, grads = run(report.model, torch.float32)
    assert len(calls) == 2 and calls[0]["attn_mask"] is not None
    ref, ref_grads = run(copy.deepcopy(model).double(), torch.float64)
    assert_model_matches(out, grads, ref, ref_grads)


def _table_transformer():
    """Table Transformer's form (DETR's attention written out) on a small ResNet backbone (no timm)."""
    t = transformers
    backbone = t.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1],
                              out_features=["stage4"])
    config = t.TableTransformerConfig(use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone,
                                      d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                      decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, num_queries=10,
                                      dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    return sharpened(t.TableTransformerModel(config))


def _table_inputs(dtype=torch.float32):
    """2 images of 160 x 224 (5 x 7 feature positions), the second's right 64 columns padding
    (its last 2 feature columns masked)."""
    mask = torch.ones(2, 160, 224, dtype=torch.long)
    mask[1, :, 160:] = 0
    return dict(pixel_values=torch.randn(2, 3, 160, 224, generator=torch.Generator().manual_seed(1)).to(dtype),
                pixel_mask=mask)


def test_table_transformer_on_the_kernels_matches_fp64(monkeypatch):
    """Table Transformer: the encoder's self-attention over the 35 feature positions with the
    image's padding mask, the decoder's over its 10 object queries and its cross-attention to
    the features, position embeddings on the queries' and keys' inputs only."""
    model = _table_transformer()
    report = ff.convert(model, inplace=False)
    assert [r[1] for r in report.replaced].count("TableTransformerAttention") == 6, str(report)
    calls = spy_attention(monkeypatch, hf_written_out)
    lengths = spy_lengths(monkeypatch, hf_written_out)
    out, grads = run_with_grads(report.model, _table_inputs())
    assert lengths == [(35, 35)] * 2 + [(10, 10), (10, 35)] * 2
    assert all(c["attn_mask"] is not None for c in calls[:2] + calls[3::2])  # the padding, where it applies
    ref, ref_grads = run_with_grads(copy.deepcopy(model).double(), _table_inputs(torch.float64))
    assert_model_matches(out, grads, ref, ref_grads)


def test_table_transformer_bf16_error_ratio():
    assert_bf16_error_ratio(_table_transformer(), _table_inputs, sdpa_in=hf_written_out)


def _bark(causal: bool):
    t = transformers
    config = dict(block_size=64, input_vocab_size=97, output_vocab_size=97, num_layers=2, num_heads=4,
                  hidden_size=64, dropout=0.0)
    torch.manual_seed(0)
    if causal:  # the semantic (and coarse) model: a GPT-2-form causal LM
        return sharpened(t.BarkSemanticModel(t.BarkSemanticConfig(**config)))
    return sharpened(t.BarkFineModel(t.BarkFineConfig(**config, n_codes_total=4, n_codes_given=1)))


def _bark_inputs(causal: bool):
    if causal:
        return encoder_inputs(13)
    return dict(codebook_idx=2, input_ids=torch.randint(2, 90, (2, 13, 4), generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("causal", [True, False], ids=["semantic", "fine"])
def test_bark_on_the_kernels_matches_fp64(causal, monkeypatch):
    """Bark's causal models (its lower-triangular buffer as bottom-right causality, with the
    padding mask) and its fine model (no mask): logits and every gradient; its blocks' second
    residual add fused."""
    model = _bark(causal)
    report = ff.convert(model, inplace=False)
    kinds = [r[1] for r in report.replaced]
    assert kinds.count("BarkSelfAttention") == 2 and kinds.count("BarkBlock") == 2, str(report)
    calls = spy_attention(monkeypatch, hf_written_out)
    out, grads = _logits_with_grads(report.model, _bark_inputs(causal))
    assert [c["causal"] for c in calls] == ["bottom_right" if causal else False] * 2
    ref, ref_grads = _logits_with_grads(copy.deepcopy(model).double(), _bark_inputs(causal))
    assert_model_matches(out, grads, ref, ref_grads)


def test_bark_semantic_steps_through_the_cache_alike():
    """A prefill of 9 tokens, then 4 single-token steps against the cache: the logits of every
    step as the unconverted model's."""
    model = _bark(True)
    ours = ff.convert(model, inplace=False).model
    ids = encoder_inputs(13)["input_ids"][:1]
    with torch.no_grad():
        outs = []
        for m in (model, ours):
            step = m(input_ids=ids[:, :9], use_cache=True)
            logits, cache = [step.logits], step.past_key_values
            for i in range(9, 13):
                step = m(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True)
                logits.append(step.logits)
                cache = step.past_key_values
            outs.append(torch.cat(logits, 1))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    full = model(input_ids=ids).logits
    torch.testing.assert_close(outs[1], full, atol=1e-5, rtol=1e-5)  # and as the whole sequence at once


XLM_FAMILIES = {"xlm": ("XLMConfig", "XLMModel", {}), "flaubert": ("FlaubertConfig", "FlaubertModel", {}),
                "xlm-clm": ("XLMConfig", "XLMWithLMHeadModel", dict(causal=True))}


def _xlm(family):
    config_name, model_name, extra = XLM_FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(vocab_size=97, emb_dim=64, n_layers=2, n_heads=4, dropout=0.0,
                                                attention_dropout=0.0, max_position_embeddings=64, **extra)
    return sharpened(getattr(transformers, model_name)(config))


@pytest.mark.parametrize("family", list(XLM_FAMILIES))
def test_xlm_attention_on_the_kernels_matches_fp64(family, monkeypatch):
    """XLM's and FlauBERT's MultiHeadAttention: their 0 / 1 key mask (the padding), and the causal
    (B, L, L) mask of XLM's causal LM, as ff.attention's bool mask."""
    model = _xlm(family)
    report = ff.convert(model, inplace=False)
    assert [r[1] for r in report.replaced].count("MultiHeadAttention") == 2, str(report)
    calls = spy_attention(monkeypatch, hf_written_out)
    output = (lambda out: out.logits) if family == "xlm-clm" else (lambda out: out.last_hidden_state)
    out, grads = run_with_grads(report.model, encoder_inputs(), output)
    assert len(calls) == 2 and calls[0]["attn_mask"].dtype == torch.bool
    ref, ref_grads = run_with_grads(copy.deepcopy(model).double(), encoder_inputs(), output)
    assert_model_matches(out, grads, ref, ref_grads)


def test_xlm_causal_lm_generates_alike_through_the_cache(monkeypatch):
    model = _xlm("xlm-clm")
    ours = ff.convert(model, inplace=False).model
    lengths = spy_lengths(monkeypatch, hf_written_out)
    prompt = encoder_inputs(9)["input_ids"][:1]
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=2)
    assert torch.equal(ours.generate(prompt, **kw), model.generate(prompt, **kw))
    # layer 0: the prompt and the mask token XLM's generate appends, then single rows against the cache
    assert lengths[0::2] == [(10, 10)] + [(1, n) for n in range(11, 15)]


def test_openai_gpt_attention_on_the_kernels_matches_fp64(monkeypatch):
    """OpenAI GPT's attention: causal by its buffer (masked scores set to -1e4), the padding mask."""
    t = transformers
    torch.manual_seed(0)
    model = sharpened(t.OpenAIGPTLMHeadModel(t.OpenAIGPTConfig(vocab_size=97, n_positions=64, n_embd=64, n_layer=2,
                                                                n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                attn_pdrop=0.0)))
    report = ff.convert(model, inplace=False)
    assert [r[1] for r in report.replaced].count("Attention") == 2, str(report)
    calls = spy_attention(monkeypatch, hf_written_out)
    out, grads = _logits_with_grads(report.model, encoder_inputs())
    assert [c["causal"] for c in calls] == [True, True] and calls[0]["attn_mask"] is not None
    ref, ref_grads = _logits_with_grads(copy.deepcopy(model).double(), encoder_inputs())
    assert_model_matches(out, grads, ref, ref_grads)
