"""Hugging Face models on fastformer's variable-length paths: packed training batches
(transformers' packed-sequence detection from position_ids, and DataCollatorWithFlattening's
cu_seq_lens keywords) through ff.varlen_attention, and greedy generation (dynamic and static
caches) whose decode steps take the cpu decode kernel. Small configs, random weights, compared
with the same weights under "eager" / "sdpa".
"""
import pytest
import torch
from oracle import LOWP_ATOL, OUT_FACTOR, assert_lowp_rule

transformers = pytest.importorskip("transformers", reason="the Hugging Face integration needs transformers")

import fastformer.integrations.transformers as ff_hf  # noqa: E402

VOCAB = 100
LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def _llama_pair(other="eager", dtype=torch.float32, **config):
    ff_hf.register()
    torch.manual_seed(0)
    cfg = {**LLAMA, **config}
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation=other))
    with torch.no_grad():  # scores of a few units, so that a wrong mask shows
        for p in ref.parameters():
            p.normal_(0, 0.15)
    ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation="fastformer"))
    ours.load_state_dict(ref.state_dict())
    return ours.to(dtype), ref.to(dtype)


class _CountVarlen:
    """Counts the calls of ff.varlen_attention made by the integration."""

    def __enter__(self):
        self.calls, self._fn = 0, ff_hf.varlen_attention

        def counted(*args, **kwargs):
            self.calls += 1
            return self._fn(*args, **kwargs)
        ff_hf.varlen_attention = counted
        return self

    def __exit__(self, *exc):
        ff_hf.varlen_attention = self._fn


LENGTHS = [5, 9, 1, 4]


def _packed_and_padded():
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    ids = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = ids.clone()
    starts = torch.tensor([0] + LENGTHS[:-1]).cumsum(0)
    labels[0, starts] = -100  # as DataCollatorWithFlattening: no label across a boundary
    L = max(LENGTHS)
    padded = torch.zeros(len(LENGTHS), L, dtype=torch.long)
    mask = torch.zeros(len(LENGTHS), L, dtype=torch.long)
    for s, t in enumerate(seqs):
        padded[s, :len(t)], mask[s, :len(t)] = t, 1
    padded_labels = padded.masked_fill(mask == 0, -100)
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    return (ids, position_ids, labels), (padded, mask, padded_labels), cu


@pytest.mark.parametrize("route", ["position_ids", "cu_seq_lens"])
def test_packed_training_loss_and_grads_match_padded_eager(route):
    ours, eager = _llama_pair()
    (ids, position_ids, labels), (padded, mask, padded_labels), cu = _packed_and_padded()
    kw = {}
    if route == "cu_seq_lens":
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS))
    with _CountVarlen() as count:
        loss = ours(input_ids=ids, position_ids=position_ids, labels=labels, **kw).loss
    assert count.calls == LLAMA["num_hidden_layers"], "every layer ran varlen attention"
    ref = eager.double()(input_ids=padded, attention_mask=mask, labels=padded_labels).loss
    torch.testing.assert_close(loss.double(), ref.double(), atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(loss, list(ours.parameters()))
    grads_ref = torch.autograd.grad(ref, list(eager.parameters()))
    for (name, _), g, r in zip(ours.named_parameters(), grads, grads_ref):
        scale = r.abs().max().item() or 1.0
        assert (g.double() - r).abs().max().item() <= 1e-4 * scale, name


def test_packed_mask_is_not_materialized():
    """The packed pattern reaches the attention as a tagged (1, T) mask, not a (T, T) one."""
    ff_hf.register()
    from transformers import masking_utils as mu
    ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    fn = mu.and_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, torch.tensor([[0, 1, 2, 0, 1, 0]])),
                      mu.packed_sequence_mask_function(ids))
    got = ff_hf.build_mask(1, 6, 6, mask_function=fn)
    assert got.shape == (1, 6)
    left, cu, longest, total = getattr(got, ff_hf._PACKED_TAG)
    assert left == -1 and cu.tolist() == [0, 3, 5, 6] and longest == 3 and total == 6


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_matches_sdpa_fp32(cache):
    ours, sdpa = _llama_pair("sdpa")
    ours.eval()
    sdpa.eval()
    prompt = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
               output_logits=True)
    if cache == "static":
        gen["cache_implementation"] = "static"
    with torch.no_grad():
        got = ours.generate(prompt, attention_mask=mask, **gen)
        want = sdpa.generate(prompt, attention_mask=mask, **gen)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_greedy_generate_bf16_within_the_error_ratio_rule():
    """bf16: every step's logits, until the tokens first differ, obey the error-ratio rule
    against fp64 with sdpa's bf16 as the baseline (tokens may differ after a near tie)."""
    ours, sdpa = _llama_pair("sdpa", dtype=torch.bfloat16)
    ref = _llama_pair("sdpa", dtype=torch.float64)[1]
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
               output_logits=True)
    with torch.no_grad():
        got = ours.eval().generate(prompt, **gen)
        want = sdpa.eval().generate(prompt, **gen)
        agree = 0
        while agree < 8 and got.sequences[0, 9 + agree] == want.sequences[0, 9 + agree]:
            agree += 1
        for step in range(max(agree, 1)):
            exact = ref.eval()(got.sequences[:, :9 + step]).logits[:, -1]
            assert_lowp_rule(f"step {step} logits", got.logits[step], exact, want.logits[step], OUT_FACTOR,
                             LOWP_ATOL[torch.bfloat16])
