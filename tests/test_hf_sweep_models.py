"""Every base-model family of the installed transformers that is not a CausalLM (encoders, vision
backbones, encoder-decoders, ...), converted: never a wrong answer.

As tests/test_hf_sweep.py, for transformers' AutoModel mapping less its CausalLM families (those
are that sweep's): each family's model built small with random weights from its config's defaults,
run under attn_implementation="eager" on token ids (and decoder ids) or a small image, converted in
place by ff.convert and run again. Some of these models are ill-conditioned in fp32 at random
weights (MobileViT's fp32 output is 25% off an fp64 run of the same weights, EmbeddingGemma's 1.2%),
so the answer is judged against an fp64 run of the unconverted model: the converted model's error
must stay within 1e-5 of the output's scale or twice eager fp32's own error (families that do not
run in fp64, such as experts on torch's grouped GEMM, or give NaN there, as CANINE, are judged as
the CausalLM sweep judges: within 1e-5 of eager fp32). A random draw in the forward (ViT-MAE's masking) is seeded alike for
every run. Each child may use 6 GB (the fp64 copy of the model beside the fp32 one).

FAMILIES are the ones whose eager forward runs at these sizes with these inputs under transformers
5.24 (the test requirement's pin; the others need other size fields, timm, ...): these take 131 s on
a 2-core Zen 3, a sweep of the full mapping several times that. AUDIO_FAMILIES are the speech and
audio models (Wav2Vec2, HuBERT, WavLM, Parakeet, Moonshine, Voxtral's and Qwen2-Audio's encoders,
codecs, ...) on random samples or features, each layout tried until eager runs one (71 s there). A
family that stops running under eager is counted, not failed; at least 90 (28 of the audio ones)
must run.
"""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the sweep needs transformers")

import fastformer as ff  # noqa: E402
from test_hf_sweep import SMALL, _sweep, child_setup, running_their_original_code, small_model  # noqa: E402

FAMILIES = """aimv2_vision_model albert beit bit canine chinese_clip_vision_model clip_text_model
clip_vision_model convbert cosmos3_edge_text csm cvt data2vec-vision deberta deberta-v2 deit dinov2
dinov2_with_registers dinov3_convnext dinov3_vit distilbert dpr dpt efficientnet embedding_gemma2
flaubert florence2 fnet focalnet fsmt glm_ocr glpn gradium_phonon_tts granite_docling gte hiera ibert
ijepa imagegpt jina_embeddings_v3 layoutlm led longformer longt5 luke m2m_100 markuplm mlcd
mlcd_vision_model mobilebert mobilenet_v1 mobilenet_v2 mobilevit modernvbert molmo2_text mpnet mra mt5
muse_glimmer_text muse_spark_text neomme nllb-moe nomic_bert nystromformer pegasus_x pixio pixtral
pocket_tts poolformer pvt pvt_v2 qwen3_vl_moe_text qwen3_vl_text regnet resnet sam2_vision_model
sam3_vision_model sam3_vit_model sam_hq_vision_model sam_vision_model seamless_m4t seamless_m4t_v2
segformer siglip_vision_model splinter swiftformer switch_transformers t5 tapas textnet
tipsv2_text_model tipsv2_vision_model ultrabert umt5 visual_bert vit vit_mae vit_msn vitdet yolos
yoso""".split()
# Speech and audio families on raw samples or features (_audio_inputs): 31 of the 62 in the mapping
# run at these sizes (the others need their own feature extractors' lengths, masks or sub-configs).
AUDIO_FAMILIES = """dac data2vec-audio glmasr_encoder hubert lasr_encoder mimi_encoder moonshine
moss_transcribe_diarize_audio omniasr_audio omniasr_ctc parakeet_ctc parakeet_encoder parakeet_rnnt
parakeet_tdt pe_audio_encoder pocket_tts_audio_tokenizer_encoder qwen2_audio_encoder sew sew-d
speech_to_text unispeech unispeech-sat univnet vibevoice_acoustic_tokenizer voxtral_encoder
voxtral_realtime_encoder wav2vec2 wav2vec2-bert wav2vec2-conformer wavlm xcodec""".split()
SIZES = dict(SMALL, image_size=32, patch_size=8)
TOLERANCE = 1e-5
MEMORY_BYTES = 6 << 30


def _inputs(model, config) -> dict:
    g = torch.Generator().manual_seed(1)
    if model.main_input_name == "input_ids":
        vocab = getattr(config, "vocab_size", None) or 97
        ids = torch.randint(2, min(90, vocab - 1), (2, 13), generator=g)
        out = dict(input_ids=ids)
        if getattr(config, "is_encoder_decoder", False):
            out["decoder_input_ids"] = ids[:, :7]
        return out
    if model.main_input_name == "pixel_values":
        size = getattr(config, "image_size", 32)  # ResNet-style configs have none
        size = size if isinstance(size, int) else size[0]
        return dict(pixel_values=torch.randn(2, getattr(config, "num_channels", 3), size, size, generator=g))
    raise RuntimeError(f"main input {model.main_input_name}: not in this sweep")


def _audio_inputs(model, config) -> list:
    """Candidate inputs of an audio model, tried in order until eager runs one: raw samples
    (input_values: (B, samples), or (B, channels, samples) for codecs) or features (input_features:
    (B, features, frames) as Whisper or (B, frames, features) as Speech2Text, with the feature count
    from whichever field the config names it by, and Whisper-style encoders' exact frame count)."""
    g = torch.Generator().manual_seed(1)
    extra = {}
    if getattr(config, "is_encoder_decoder", False):
        extra["decoder_input_ids"] = torch.randint(2, 90, (2, 7), generator=g)
    required = inspect.signature(model.forward).parameters.get("input_features_mask")
    if required is not None and required.default is inspect.Parameter.empty:
        extra["input_features_mask"] = None  # set below, to the features' frames
    if model.main_input_name == "input_values":
        channels = getattr(config, "audio_channels", None) or getattr(config, "num_channels", None) or 1
        return [dict(input_values=torch.randn(2, 4000, generator=g), **extra),
                dict(input_values=torch.randn(2, channels, 4000, generator=g), **extra)]
    features = next((getattr(config, key) for key in ("feature_projection_input_dim", "num_mel_bins", "feature_size",
                                                      "n_mels", "num_mel_filters",
                                                      "input_feat_per_channel", "input_dim", "hidden_size")
                     if isinstance(getattr(config, key, None), int)), 80)
    if isinstance(getattr(config, "input_channels", None), int):
        features *= config.input_channels
    frames = [2 * config.max_source_positions] if isinstance(getattr(config, "max_source_positions", None), int) else []
    out = []
    for n in frames + [64]:
        for shape in ((2, features, n), (2, n, features)):
            inputs = dict(input_features=torch.randn(*shape, generator=g), **extra)
            if "input_features_mask" in extra:
                inputs["input_features_mask"] = torch.ones(2, n, dtype=torch.bool)
            out.append(inputs)
    return out


def _output(out) -> torch.Tensor:
    for key in ("last_hidden_state", "logits", "pooler_output"):
        t = getattr(out, key, None)
        if isinstance(t, torch.Tensor):
            return t.double()
    values = out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else ()
    for t in values:  # a codec's audio_values / audio_codes, ...: the first floating tensor
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.double()
    raise RuntimeError("no output tensor")


def _run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        torch.manual_seed(5)  # the same draw for a forward that samples (ViT-MAE's masking)
        return _output(model(**inputs))


def _one(name: str, queue, package: str) -> None:
    """In the child: ("eager fails", why) / ("ours fails", why) / ("ok", (ours' error, eager's))."""
    if not child_setup(queue, package, MEMORY_BYTES):
        return
    try:
        model = small_model(name, transformers.AutoModel, SIZES)
        config = model.config
        audio = model.main_input_name in ("input_values", "input_features")
        candidates = _audio_inputs(model, config) if audio else [_inputs(model, config)]
        for i, inputs in enumerate(candidates):
            try:
                eager = _run(model, inputs)
                break
            except Exception:  # noqa: BLE001 - the next layout; the last one's error is the family's
                if i == len(candidates) - 1:
                    raise
        if not eager.isfinite().all():
            raise RuntimeError("eager's output is not finite at random weights")
    except Exception as exc:  # noqa: BLE001 - anything eager cannot run is out of the sweep
        queue.put(("eager fails", f"{type(exc).__name__}: {str(exc)[:120]}"))
        return
    try:
        exact = _run(copy.deepcopy(model).double(),
                     {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()})
    except Exception:  # noqa: BLE001 - no fp64 run (grouped_mm experts, ...): eager fp32 is the reference
        exact = eager
    if not exact.isfinite().all():  # CANINE's fp64 run: NaN where its fp32 one is finite
        exact = eager
    try:
        ff.convert(model)
        ours = _run(model, inputs)
        scale = exact.abs().max().item() or 1.0
        queue.put(running_their_original_code(model)
                  or ("ok", ((ours - exact).abs().max().item() / scale, (eager - exact).abs().max().item() / scale)))
    except Exception as exc:  # noqa: BLE001
        queue.put(("ours fails", f"{type(exc).__name__}: {str(exc)[:200]}"))


def _judge(families: list, at_least: int) -> None:
    results = _sweep(families, target=_one)
    ran = {n: r[1] for n, r in results.items() if r[0] == "ok"}
    wrong = {n: f"ours {ours:.2e}, eager fp32 {eager:.2e}" for n, (ours, eager) in ran.items()
             if not ours <= max(TOLERANCE, 2 * eager)}
    failed = {n: r[1] for n, r in results.items() if r[0] == "ours fails"}
    print(f"{len(ran)} families converted and compared, {len(results) - len(ran) - len(failed)} not runnable "
          f"by eager")
    assert not wrong, f"converted outputs off the fp64 run by more than eager's: {wrong}"
    assert not failed, f"ff.convert or the converted forward raised: {failed}"
    assert len(ran) >= at_least, f"only {len(ran)} families ran: {sorted(set(families) - set(ran))} did not"


def test_every_base_model_family_converts_without_a_wrong_answer():
    _judge(FAMILIES, at_least=90)


def test_every_audio_family_converts_without_a_wrong_answer():
    _judge(AUDIO_FAMILIES, at_least=28)
