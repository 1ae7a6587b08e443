"""Hugging Face transformers: attn_implementation="fastformer" vs "sdpa" on tiny randomly
initialised BERT (bidirectional, padding mask) and GPT-2 (causal, left padding) models built
here from configs (no download)."""
import pytest
import torch
from oracle import check

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (optional: pip install transformers)")

import fastformer.integrations.transformers as ff_hf  # noqa: E402
from fastformer import backends  # noqa: E402


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
