"""Hugging Face transformers: attn_implementation="fastformer" on tiny randomly initialised models
built here from configs (no download).

* BERT (bidirectional, padding mask) and GPT-2 (causal, left padding, generate) against "sdpa".
* Mistral (sliding window), Qwen2 (use_sliding_window, max_window_layers), Gemma 2 (softcap,
  alternating sliding layers), Gemma 3 (text, sliding layers), gpt-oss (sinks, MoE) and T5
  (relative position bias, encoder-decoder, training) against "eager" on the same weights: fp32
  logits within 1e-4 of their scale and the gradient of every parameter within 1e-4 of its scale;
  bf16 logits by the error-ratio rule (tests/oracle.py).
* The mask function leaves causality and the window to the kernel (a spy on ops.attention.run).

Nothing here depends on which backend ran (the cpu kernels may decline an option and fall back
to the reference backend): only on the results.
"""
import contextlib
import copy

import pytest
import torch
from oracle import check

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (optional: pip install transformers)")

import fastformer as ff  # noqa: E402
import fastformer.integrations.transformers as ff_hf  # noqa: E402
import fastformer.ops.attention as ff_attention  # noqa: E402
from fastformer import backends  # noqa: E402
from transformers import masking_utils  # noqa: E402


def _pair(config_cls, model_cls, **config):
    ff_hf.register()
    torch.manual_seed(0)
    sdpa = model_cls(config_cls(**config, attn_implementation="sdpa")).eval()
    ours = model_cls(config_cls(**config, attn_implementation="fastformer")).eval()
    ours.load_state_dict(sdpa.state_dict())
    assert ours.config._attn_implementation == "fastformer"
    return ours, sdpa


def _batch(vocab, B=2, L=13, left_pad=False):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    if left_pad:
        mask[1, :4] = 0
    else:
        mask[1, 9:] = 0
    return ids, mask


def _compare(ours, sdpa, ids, mask, valid):
    """Hidden states where the mask is 1, and the gradient of every parameter."""
    backends.record(None)
    out = ours(input_ids=ids, attention_mask=mask).last_hidden_state
    assert backends.last_dispatch().op == "attention"  # fastformer's kernel ran
    out_ref = sdpa.double()(input_ids=ids, attention_mask=mask).last_hidden_state
    check("hidden", out[valid].detach(), out_ref[valid].detach())
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    names, params = zip(*ours.named_parameters())
    grads = torch.autograd.grad((out.double() * gy)[valid].sum(), params, allow_unused=True)
    grads_ref = torch.autograd.grad((out_ref * gy)[valid].sum(), list(sdpa.parameters()),
                                    allow_unused=True)
    for name, g, g_ref in zip(names, grads, grads_ref):
        if g_ref is None:  # e.g. the pooler, unused by the loss
            assert g is None or not g.any(), name
            continue
        check(f"d{name}", g, g_ref, grad=True, atol=1e-4, rtol=1e-4)


def test_bert_matches_sdpa():
    kw = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=96, max_position_embeddings=64, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0)
    ours, sdpa = _pair(transformers.BertConfig, transformers.BertModel, **kw)
    ids, mask = _batch(97)
    _compare(ours, sdpa, ids, mask, mask.bool())


def test_gpt2_matches_sdpa():
    kw = dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
              embd_pdrop=0.0, attn_pdrop=0.0)
    ours, sdpa = _pair(transformers.GPT2Config, transformers.GPT2Model, **kw)
    ids, mask = _batch(101, left_pad=True)
    _compare(ours, sdpa, ids, mask, mask.bool())
    with torch.no_grad():  # no padding: no mask is built, the kernel's causal flag is used
        check("unpadded", ours(input_ids=ids).last_hidden_state,
              sdpa(input_ids=ids).last_hidden_state)


def test_gpt2_generate_with_kv_cache_matches_sdpa():
    kw = dict(vocab_size=101, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    ff_hf.register()
    sdpa = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw, attn_implementation="sdpa")).eval()
    ours = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw, attn_implementation="fastformer")).eval()
    ours.load_state_dict(sdpa.state_dict())
    ids = torch.randint(0, 101, (1, 5), generator=torch.Generator().manual_seed(3))
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **gen), sdpa.generate(ids, **gen))


# ---- variants against eager ------------------------------------------------------------------
VOCAB = 100
# A larger init than the models' 0.02, so that the scores span a few units: the window, the
# softcap and the sinks then change the results well above the tolerance.
INIT = 0.15


@contextlib.contextmanager
def _spy():
    """Records the options of every ff.attention call made through ops.attention.run."""
    calls = []
    run = ff_attention.run

    def spy(q, k, v, o, position_bias=None):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), causal=o.causal,
                          window=(o.window_left, o.window_right), softcap=o.softcap,
                          sinks=o.sinks is not None, key_padding=o.key_padding_mask is not None,
                          attn_mask=None if o.attn_mask is None else tuple(o.attn_mask.shape),
                          mask_grad=o.attn_mask is not None and o.attn_mask.requires_grad))
        return run(q, k, v, o, position_bias)

    ff_attention.run = spy
    try:
        yield calls
    finally:
        ff_attention.run = run


def _models(config_cls, model_cls, prepare=None, **config):
    """(ours, eager): the same random weights under "fastformer" and "eager"."""
    ff_hf.register()
    torch.manual_seed(0)
    eager = model_cls(config_cls(**config, attn_implementation="eager"))
    if prepare is not None:
        prepare(eager)
    ours = model_cls(config_cls(**config, attn_implementation="fastformer"))
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "fastformer"
    return ours, eager


def _inputs(B=2, L=24, pad=5, left=True, seed=1):
    """ids, attention_mask (row 1 padded by `pad` tokens on the left or right), labels: -100 at
    padding and after it (the logits of a padding position, whose query sees no key, are not
    compared: fastformer gives them zero attention, eager the mean of the values)."""
    ids = torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(B, L, dtype=torch.long)
    if pad:
        mask[1, slice(None, pad) if left else slice(L - pad, None)] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:].masked_fill_(mask[:, :-1] == 0, -100)
    return ids, mask, labels


def _rel_err(name, ours, ref, rel=1e-4):
    """max |ours - ref| <= rel * max |ref|; returns the ratio max |ours - ref| / max |ref|."""
    assert ours.shape == ref.shape, name
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    err, scale = float((ours - ref).abs().max()), float(ref.abs().max())
    assert err <= rel * scale + 1e-12, (
        f"{name}: max|fastformer - eager| = {err:.3g} > {rel} * max|eager| ({scale:.3g})")
    return err / scale if scale else 0.0


def _check_fp32(ours, eager, inputs, valid, train=False):
    """Logits (where `valid`) and every parameter's gradient after loss.backward(). Returns
    (logits error, worst gradient error), relative to their scales."""
    ours.train(train)
    eager.train(train)
    out, ref = ours(**inputs), eager(**inputs)
    logits_err = _rel_err("logits", out.logits[valid].detach(), ref.logits[valid].detach())
    out.loss.backward()
    ref.loss.backward()
    grad_err = 0.0
    for (name, p), p_ref in zip(ours.named_parameters(), eager.parameters()):
        if p_ref.grad is None:
            assert p.grad is None or not p.grad.any(), name
            continue
        grad_err = max(grad_err, _rel_err(f"d{name}", p.grad, p_ref.grad))
    return logits_err, grad_err


def _check_bf16(ours, eager, inputs, valid, train=False):
    """bf16 logits (where `valid`) by the error-ratio rule, factor 2: |fastformer bf16 - eager
    fp32| against |eager bf16 - eager fp32|, eager fp32 on the same bf16-rounded weights. Returns
    both max errors.

    Gradients are not held to the rule at the scale of a whole model: the rest of the model's bf16
    roundings dominate them, and eager itself with its attention computed in fp32 (more precise,
    as fastformer's) is measured up to 4x eager bf16's error on T5's gradients."""
    oracle = copy.deepcopy(eager).to(torch.bfloat16).float().train(train)
    eager16 = copy.deepcopy(eager).to(torch.bfloat16).train(train)
    ours16 = copy.deepcopy(ours).to(torch.bfloat16).train(train)
    with torch.no_grad():
        ref, lowp, out = (m(**inputs).logits[valid] for m in (oracle, eager16, ours16))
    check("bf16 logits", out, ref, lowp)
    return float((out.float() - ref).abs().max()), float((lowp.float() - ref).abs().max())


def _report(name, fp32, bf16=None):
    line = f"{name}: fp32 logits {fp32[0]:.2e}, grads {fp32[1]:.2e} (relative to scale)"
    if bf16 is not None:
        line += f"; bf16 logits max err {bf16[0]:.3g} (eager bf16 {bf16[1]:.3g})"
    print(line)


def _lm_case(config_cls, model_cls, prepare=None, left=True, **config):
    ours, eager = _models(config_cls, model_cls, prepare, vocab_size=VOCAB, hidden_size=64,
                          intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                          initializer_range=INIT, **config)
    ids, mask, labels = _inputs(left=left)
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    with _spy() as calls:
        fp32 = _check_fp32(ours, eager, inputs, mask.bool())
    bf16 = _check_bf16(ours, eager, inputs, mask.bool())
    return fp32, bf16, calls


def test_mistral_sliding_window_matches_eager():
    fp32, bf16, calls = _lm_case(transformers.MistralConfig, transformers.MistralForCausalLM,
                                 sliding_window=7)
    _report("mistral", fp32, bf16)
    assert len(calls) == 2 and all(c["window"][0] == 6 and c["attn_mask"] is None for c in calls)


def test_qwen2_sliding_layers_match_eager():
    fp32, bf16, calls = _lm_case(transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                                 left=False, use_sliding_window=True, sliding_window=6,
                                 max_window_layers=1)
    _report("qwen2", fp32, bf16)
    # layer 0 full attention, layer 1 (>= max_window_layers) sliding
    assert [c["window"][0] for c in calls] == [-1, 5]


def test_gemma2_softcap_and_sliding_layers_match_eager():
    fp32, bf16, calls = _lm_case(transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                                 sliding_window=7, attn_logit_softcapping=3.0,
                                 final_logit_softcapping=30.0, query_pre_attn_scalar=16,
                                 layer_types=["sliding_attention", "full_attention"])
    _report("gemma2", fp32, bf16)
    assert [c["window"][0] for c in calls] == [6, -1]
    assert all(c["softcap"] == 3.0 for c in calls)


def test_gemma3_sliding_layers_match_eager():
    fp32, bf16, calls = _lm_case(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                                 sliding_window=7, query_pre_attn_scalar=16,
                                 layer_types=["sliding_attention", "full_attention"])
    _report("gemma3", fp32, bf16)
    assert [c["window"][0] for c in calls] == [6, -1]


def _random_sinks(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)


def test_gpt_oss_sinks_match_eager():
    fp32, bf16, calls = _lm_case(transformers.GptOssConfig, transformers.GptOssForCausalLM,
                                 prepare=_random_sinks, sliding_window=7, num_local_experts=4,
                                 num_experts_per_tok=2,
                                 layer_types=["sliding_attention", "full_attention"])
    _report("gpt-oss", fp32, bf16)
    assert [c["window"][0] for c in calls] == [6, -1]
    assert all(c["sinks"] for c in calls)


def test_t5_training_matches_eager():
    ours, eager = _models(transformers.T5Config, transformers.T5ForConditionalGeneration,
                          vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2,
                          num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                          relative_attention_max_distance=20, dropout_rate=0.0,
                          initializer_factor=1.0, decoder_start_token_id=0, pad_token_id=0)
    ids, mask, _ = _inputs(L=19, pad=6, left=False)
    labels = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))
    labels[1, 8:] = -100
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    with _spy() as calls:
        fp32 = _check_fp32(ours, eager, inputs, slice(None), train=True)
    bf16 = _check_bf16(ours, eager, inputs, slice(None), train=True)
    _report("t5", fp32, bf16)
    assert len(calls) == 6  # 2 encoder self, 2 decoder self, 2 cross
    enc = [c for c in calls if c["q"][2] == 19]
    dec = [c for c in calls if c["q"][2] == 11 and c["k"][2] == 11]
    cross = [c for c in calls if c["q"][2] == 11 and c["k"][2] == 19]
    assert all(c["causal"] == 0 and c["key_padding"] and c["mask_grad"] for c in enc)
    assert all(c["causal"] == 1 and not c["key_padding"] and c["mask_grad"] for c in dec)
    assert all(c["causal"] == 0 and c["key_padding"] for c in cross)
    assert all(c["attn_mask"] == (1, 4, c["q"][2], c["k"][2]) for c in calls)  # the bias only


# ---- the mask function -------------------------------------------------------------------------
def _mistral_pair(**config):
    return _models(transformers.MistralConfig, transformers.MistralForCausalLM, vocab_size=VOCAB,
                   hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   max_position_embeddings=128, initializer_range=INIT, **config)


def test_mask_function_leaves_the_window_to_the_kernel():
    ours, eager = _mistral_pair(sliding_window=7)
    ours.eval()
    eager.eval()
    ids, mask, _ = _inputs(L=24, pad=5)
    cfg = ours.config
    emb = torch.zeros(2, 24, 8)
    built = masking_utils.create_sliding_window_causal_mask(cfg, emb, None, None)
    assert built.shape == (2, 24) and built.dtype == torch.bool  # a key mask, no (L, L)
    built = masking_utils.create_sliding_window_causal_mask(cfg, emb, mask, None)
    assert built.shape == (2, 24) and torch.equal(built, mask.bool())
    for attention_mask in (None, mask):
        with _spy() as calls, torch.no_grad():
            ours(input_ids=ids, attention_mask=attention_mask)
        assert len(calls) == 2
        for c in calls:
            assert c["window"][0] == 6 and c["causal"] == 1 and c["attn_mask"] is None
            assert c["key_padding"] == (attention_mask is not None)
    # Patterns the kernel cannot take natively are built in full, as sdpa_mask does.
    full = masking_utils.create_sliding_window_causal_mask(
        cfg, emb, mask, None, or_mask_function=lambda b, h, q, kv: kv == 0)
    ref = masking_utils.sdpa_mask(batch_size=2, q_length=24, kv_length=24,
                                  mask_function=masking_utils.or_masks(
                                      masking_utils.sliding_window_causal_mask_function(7),
                                      lambda b, h, q, kv: kv == 0),
                                  attention_mask=mask.bool(), allow_is_causal_skip=False)
    assert full.shape == (2, 1, 24, 24) and torch.equal(full, ref)
    chunked = ff_hf.build_mask(2, 24, 24, mask_function=masking_utils.chunked_causal_mask_function(
        5, torch.zeros(2, dtype=torch.long)), attention_mask=mask.bool(), local_size=5)
    assert chunked.shape == (2, 1, 24, 24)


def test_mask_function_under_tracing_keeps_causality_in_the_kernel(monkeypatch):
    """Traced (torch.compile, export) there are no tensor tags: a plain causal pattern comes back
    as the untagged key mask (None without padding), read as causal from the module; a window,
    which could not reach the kernel that way, as sdpa_mask's full mask."""
    monkeypatch.setattr(ff_hf, "_tracing", lambda: True)
    _, mask, _ = _inputs(L=24, pad=5)
    assert ff_hf.build_mask(2, 24, 24) is None
    keys = ff_hf.build_mask(2, 24, 24, attention_mask=mask)
    assert keys.shape == (2, 24) and torch.equal(keys, mask.bool())
    assert getattr(keys, ff_hf._KEY_MASK_TAG, None) is None
    sliding = ff_hf.build_mask(2, 24, 24, attention_mask=mask,
                               mask_function=masking_utils.sliding_window_causal_mask_function(7))
    ref = masking_utils.sdpa_mask(batch_size=2, q_length=24, kv_length=24,
                                  mask_function=masking_utils.sliding_window_causal_mask_function(7),
                                  attention_mask=mask.bool(), allow_is_causal_skip=False)
    assert sliding.shape == (2, 1, 24, 24) and torch.equal(sliding, ref)


def test_compiled_llama_runs_causal_tiles_and_matches_eager():
    ours, eager = _models(transformers.LlamaConfig, transformers.LlamaForCausalLM, vocab_size=VOCAB,
                          hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          initializer_range=INIT)
    for attention_mask, calls in _compiled_fullgraph_against_eager(ours, eager):
        assert calls and all(c["causal"] == 1 and c["attn_mask"] is None for c in calls)
        assert all(c["key_padding"] == (attention_mask is not None) for c in calls)


def _compiled_fullgraph_against_eager(ours, eager):
    """Yields (attention_mask, the kernel calls) of a fullgraph-compiled `ours` on a 24-token
    batch without and with right padding, after checking its logits against `eager`'s."""
    ours.eval()
    eager.eval()
    ids, mask, _ = _inputs(L=24, pad=5, left=False)
    compiled = torch.compile(ours, fullgraph=True)
    for attention_mask in (None, mask):
        torch._dynamo.reset()
        with _spy() as calls, torch.no_grad():
            got = compiled(input_ids=ids, attention_mask=attention_mask).logits
            want = eager(input_ids=ids, attention_mask=attention_mask).logits
        valid = (mask.bool() if attention_mask is not None else torch.ones_like(mask, dtype=torch.bool))
        _rel_err("logits", got[valid], want[valid])
        yield attention_mask, calls


def test_compiled_mistral_fullgraph_matches_eager():
    """A fullgraph torch.compile of a sliding-window model: traced, the mask function's closure
    cannot be read, so the window comes as sdpa_mask's full (B, 1, L, L) mask."""
    ours, eager = _mistral_pair(sliding_window=7)
    for _, calls in _compiled_fullgraph_against_eager(ours, eager):
        assert calls and all(c["attn_mask"] == (2, 1, 24, 24) for c in calls)


def test_mistral_cache_decoding_matches_eager():
    """Chunked prefill and greedy decoding past the window (bottom-right causality with the
    window, sliding-window cache layers), with a left-padded batch."""
    ours, eager = _mistral_pair(sliding_window=5)
    ours.eval()
    eager.eval()
    ids, mask, _ = _inputs(L=14, pad=3)
    valid = mask.bool()
    with torch.no_grad():
        logits = []
        for model in (ours, eager):
            cache = transformers.DynamicCache(config=model.config)
            first = model(input_ids=ids[:, :8], attention_mask=mask[:, :8], cache=cache,
                          use_cache=True)
            with _spy() as chunk_calls:
                second = model(input_ids=ids[:, 8:], attention_mask=mask, cache=cache,
                               use_cache=True)
            logits.append((first.logits[valid[:, :8]], second.logits[valid[:, 8:]]))
            if model is ours:  # 6 queries, the window's 4 cached keys and their own 6
                assert [(c["q"][2], c["k"][2], c["causal"], c["window"][0]) for c in chunk_calls] \
                    == [(6, 10, 2, 4)] * 2
        _rel_err("prefill logits", *[pair[0] for pair in logits])
        _rel_err("chunk logits", *[pair[1] for pair in logits])
        gen = dict(max_new_tokens=9, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                   output_logits=True)
        with _spy() as calls:
            got = ours.generate(ids, attention_mask=mask, **gen)
        want = eager.generate(ids, attention_mask=mask, **gen)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        _rel_err(f"step {step} logits", a, b)
    decode = [c for c in calls if c["q"][2] == 1]
    assert len(decode) == 2 * 8 and all(c["attn_mask"] is None for c in decode)
    assert all(c["causal"] == 2 and c["k"][2] <= 5 for c in decode)  # the sliding cache: w keys


def test_mistral_full_cache_decoding_takes_the_window():
    """A full (non-sliding) cache: decoding steps see more keys than the window, padding too."""
    ours, eager = _mistral_pair(sliding_window=4)
    ours.eval()
    eager.eval()
    ids, mask, _ = _inputs(L=6, pad=2)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
               output_logits=True)
    with torch.no_grad():
        with _spy() as calls:
            got = ours.generate(ids, attention_mask=mask, cache=transformers.DynamicCache(), **gen)
        want = eager.generate(ids, attention_mask=mask, cache=transformers.DynamicCache(), **gen)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        _rel_err(f"step {step} logits", a, b)
    decode = [c for c in calls if c["q"][2] == 1]
    assert decode and all(c["causal"] == 2 and c["window"][0] == 3 for c in decode)
    assert all(c["attn_mask"] is None and c["key_padding"] for c in calls)


# ---- keywords the kernels do not take: the family's eager attention, with the mask converted ----
@pytest.fixture
def dispatches(monkeypatch):
    """Every Dispatch recorded while the test runs."""
    seen = []
    real = backends.record
    monkeypatch.setattr(backends, "record", lambda d: (seen.append(d), real(d))[1])
    return seen


@pytest.fixture
def every_keyword_unknown(monkeypatch, dispatches):
    """Every keyword a model passes counts as one the kernels do not take (position_ids,
    use_cache, ...): each call runs the family's eager_attention_forward through _family_eager,
    given each of build_mask()'s mask forms converted to eager's additive one."""
    monkeypatch.setattr(ff_hf, "_NO_EFFECT", frozenset())
    return dispatches


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_unknown_keywords_run_the_family_eager_attention(family, every_keyword_unknown):
    """A keyword the kernels do not know with a value is never dropped: the call runs the family's
    own eager attention, on the key masks (causal, sliding window, padding) build_mask made;
    logits and every gradient as eager's, the reason in last_dispatch()."""
    if family == "mistral":
        case = (transformers.MistralConfig, transformers.MistralForCausalLM, None, dict(sliding_window=7))
    else:
        case = (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, None,
                dict(sliding_window=7, attn_logit_softcapping=3.0, query_pre_attn_scalar=16,
                     layer_types=["sliding_attention", "full_attention"]))
    config_cls, model_cls, prepare, config = case
    fp32, _, calls = _lm_case(config_cls, model_cls, prepare, **config)
    assert not calls  # the kernels never ran
    fell_back = [d for d in every_keyword_unknown if d is not None and d.impl == "eager_attention_forward"]
    assert fell_back and "position_ids" in str(fell_back[0]), [str(d) for d in every_keyword_unknown]


def test_unknown_keywords_with_t5s_relative_bias(every_keyword_unknown):
    """A converted T5 (its bias as the kernels' placeholder) through the fallback: the bias is
    materialized for eager; encoder padding, decoder causality and the cross-attention mask."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
                                   dropout_rate=0.0, attn_implementation="eager", decoder_start_token_id=0)
    eager = transformers.T5ForConditionalGeneration(config).eval()
    ours = ff.convert(eager, inplace=False).model
    ids, mask, _ = _inputs(left=False)
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :9], output_hidden_states=True)
    with torch.no_grad():
        _rel_err("logits", ours(**inputs).logits, eager(**inputs).logits, rel=1e-5)
    assert any(d is not None and d.impl == "eager_attention_forward" for d in every_keyword_unknown)


def test_per_query_sinks_run_the_family_eager_attention(dispatches):
    """Inkling 2 passes `sinks` of shape (B, H, Lq, 1), one logit per query (gpt-oss's are one per
    head): not the kernels' sinks, so its eager attention runs, and the model matches eager."""
    if not hasattr(transformers, "Inkling2TextConfig"):
        pytest.skip("this transformers has no Inkling 2")
    ours, eager = _models(transformers.Inkling2TextConfig, transformers.Inkling2ForCausalLM,
                          vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=128, num_local_experts=4, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=48)
    ids = _inputs(pad=0)[0]
    with torch.no_grad():
        _rel_err("logits", ours(input_ids=ids).logits, eager(input_ids=ids).logits, rel=1e-5)
    assert any(d is not None and d.impl == "eager_attention_forward" and "sinks of shape" in str(d)
               for d in dispatches)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_attention_output_is_contiguous_on_every_backend(backend):
    """transformers' attention functions return a contiguous (B, Lq, H, D) (AfMoE and JetMoE
    .view() it): the cpu backend's layout makes the transpose contiguous, the others' outputs are
    copied (a model on the reference backend raised in .view before)."""
    ff_hf.register()
    q, k, v = (torch.randn(2, 4, 7, 16) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    with ff.use_backend(backend):
        out, _ = ff_hf.attention_forward(module, q, k, v, None)
    assert out.shape == (2, 7, 4, 16) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                               .transpose(1, 2), atol=1e-5, rtol=1e-5)
