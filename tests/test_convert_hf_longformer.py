"""Longformer's and LED's window + global-token attention on ff.attention
(integrations/hf_longformer.py), against fp64.

transformers' eager Longformer returns NaN gradients for every parameter below the attention
once a sequence carries more padding than the window's half-width (its own padding to a multiple
of the window counts) or any global token with padding in the batch: its softmax backward runs
through rows of -inf. So the gradients are judged against a dense fp64 oracle written here from
the attention's definition (every query row: the keys within the window that are neither padded
nor global, plus every global key; padded rows see none; global rows attend every unpadded key
through the global projections), itself checked against eager fp64 on the outputs everywhere and
on every gradient where eager's are finite."""
import copy
import math

import pytest
import torch
from hf_encoder_checks import assert_bf16_error_ratio, run_with_grads, sharpened, spy_attention, spy_lengths
from oracle import assert_model_matches

transformers = pytest.importorskip("transformers", reason="needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_longformer, hf_written_out  # noqa: E402


class _DenseOracle:
    """LongformerSelfAttention's forward as one dense masked softmax per part (fp64 runs)."""

    def forward(self, hidden_states, attention_mask=None, is_index_masked=None, is_index_global_attn=None,
                is_global_attn=None, output_attentions=False, **kwargs):
        batch, length, width = hidden_states.shape
        heads, d, w = self.num_heads, self.head_dim, self.one_sided_attn_window_size

        def split(x):
            return x.view(batch, length, heads, d).transpose(1, 2)

        def attend(q, k, v, visible):  # visible: (B, Lq, Lk); rows that see nothing give 0
            s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
            p = torch.softmax(s.masked_fill(~visible[:, None], float("-inf")), -1).nan_to_num(0.0)
            return (p @ v).transpose(1, 2).reshape(batch, length, width)
        masked, glob = is_index_masked, is_index_global_attn
        i = torch.arange(length)
        band = (i[:, None] - i[None, :]).abs() <= w
        local = ((band & ~masked[:, None, :] & ~glob[:, None, :]) | glob[:, None, :]) & ~masked[:, :, None]
        out = attend(split(self.query(hidden_states)), split(self.key(hidden_states)),
                     split(self.value(hidden_states)), local)
        if is_global_attn:
            everywhere = (~masked[:, None, :]).expand(-1, length, -1)
            out_global = attend(split(self.query_global(hidden_states)), split(self.key_global(hidden_states)),
                                split(self.value_global(hidden_states)), everywhere)
            out = torch.where(glob[:, :, None], out_global, out)
        return (out,)


def _oracle(model):
    """An fp64 copy of model with its self-attention on _DenseOracle."""
    ref = copy.deepcopy(model).double()
    for m in ref.modules():
        if type(m).__name__ in ("LongformerSelfAttention", "LEDEncoderSelfAttention"):
            m.__class__ = type("Dense" + type(m).__name__, (_DenseOracle, type(m)), {})
    return ref


def _longformer(heads=4):
    t = transformers
    config = t.LongformerConfig(vocab_size=97, hidden_size=16 * heads, num_hidden_layers=2, num_attention_heads=heads,
                                intermediate_size=48, max_position_embeddings=128, attention_window=[8, 16],
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1)
    torch.manual_seed(0)
    return sharpened(t.LongformerModel(config))


def _led():
    t = transformers
    config = t.LEDConfig(vocab_size=97, d_model=64, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, attention_window=[8, 16],
                         max_encoder_position_embeddings=128, max_decoder_position_embeddings=64, dropout=0.0,
                         attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1)
    torch.manual_seed(0)
    return sharpened(t.LEDModel(config))


def _inputs(length, pad, globals_=(), decoder=False):
    ids = torch.randint(2, 90, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.long)
    if pad:
        mask[1, length - pad:] = 0
    out = dict(input_ids=ids, attention_mask=mask)
    if globals_:
        g = torch.zeros(2, length, dtype=torch.long)
        for row, at in globals_:
            g[row, at] = 1
        out["global_attention_mask"] = g
    if decoder:
        out["decoder_input_ids"] = ids[:, :7]
    return out


# (length, padding of row 1, global tokens (row, position)): lengths off the window's multiple
# (the model pads them), padding within and beyond the window, global tokens in either row.
CASES = {"aligned": (48, 2, ()), "model-padded": (45, 0, ()), "padded-beyond-window": (37, 9, ()),
         "global": (48, 2, ((0, 0), (0, 20), (1, 3))), "global-padded": (41, 12, ((0, 0), (1, 0), (1, 28)))}


def test_dense_oracle_is_eager_longformer():
    """The oracle's outputs are eager's (fp64) in every case, and its gradients wherever eager's
    are finite (the first two cases), within the model tolerance: eager's fp64 run takes its
    softmax in fp32 (1.3e-7 of the outputs' scale apart)."""
    model = _longformer()
    for name, (length, pad, globals_) in CASES.items():
        inputs = _inputs(length, pad, globals_)
        out, grads = run_with_grads(_oracle(model), inputs)
        ref, ref_grads = run_with_grads(copy.deepcopy(model).double(), inputs)
        finite = all(g.isfinite().all() for g in ref_grads.values() if g is not None)
        assert finite == (name in ("aligned", "model-padded")), name  # eager's NaN gradients, as described
        if finite:
            assert_model_matches(out, grads, ref, ref_grads)
        else:
            assert (out - ref).abs().max() <= 1e-5 * ref.abs().max(), name


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [4, 6])
def test_longformer_on_the_kernels_matches_fp64(case, heads, monkeypatch):
    calls = spy_attention(monkeypatch, hf_longformer)
    model = _longformer(heads)
    report = ff.convert(model, inplace=False)
    kinds = [r[1] for r in report.replaced]
    assert kinds.count("LongformerSelfAttention") == 2 and kinds.count("LongformerLayer") == 2, str(report)
    length, pad, globals_ = CASES[case]
    out, grads = run_with_grads(report.model, _inputs(length, pad, globals_))
    assert len(calls) == (4 if globals_ else 2) and calls[0]["attn_mask"].dtype == torch.bool
    ref, ref_grads = run_with_grads(_oracle(model), _inputs(length, pad, globals_))
    assert_model_matches(out, grads, ref, ref_grads)


@pytest.mark.parametrize("case", ["padded-beyond-window", "global-padded"])
def test_led_encoder_on_the_kernels_matches_fp64(case):
    model = _led()
    report = ff.convert(model, inplace=False)
    kinds = [r[1] for r in report.replaced]
    assert kinds.count("LEDEncoderSelfAttention") == 2 and kinds.count("LEDDecoderAttention") == 2, str(report)
    length, pad, globals_ = CASES[case]
    out, grads = run_with_grads(report.model, _inputs(length, pad, globals_, decoder=True))
    ref, ref_grads = run_with_grads(_oracle(model), _inputs(length, pad, globals_, decoder=True))
    assert_model_matches(out, grads, ref, ref_grads)


def test_longformer_bf16_against_the_oracle():
    """bf16: outputs and every gradient within 3x (outputs 2x) of bf16 eager's own error where
    eager's gradients are finite, against the fp64 oracle."""
    assert_bf16_error_ratio(_longformer(), _inputs(*CASES["aligned"]), reference=_oracle)


def test_longformer_output_attentions_runs_the_original():
    model = _longformer()
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs(*CASES["global"])
    with torch.no_grad():
        got, want = ours(**inputs, output_attentions=True), model(**inputs, output_attentions=True)
    assert got.attentions is not None and got.global_attentions is not None
    for a, b in zip(got.attentions + got.global_attentions, want.attentions + want.global_attentions):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, atol=1e-5, rtol=1e-5)


def test_longformer_visibility_is_built_once_and_not_kept(monkeypatch):
    """The layers share the mask the first one built (the encoder hands them the same masks); it
    is dropped with them after the forward."""
    builds = []
    band = torch.Tensor.triu_
    monkeypatch.setattr(torch.Tensor, "triu_", lambda t, *a: builds.append(t.shape) or band(t, *a))
    ours = ff.convert(_longformer(), inplace=False).model
    for m in ours.modules():  # one window for both layers
        if hasattr(m, "one_sided_attn_window_size"):
            m.one_sided_attn_window_size = 4
    with torch.no_grad():
        ours(**_inputs(*CASES["global"]))
    assert len(builds) == 1 and hf_longformer._last_visibility == []


def test_led_summarizes_alike_through_the_cache(monkeypatch):
    """LED's generate: the encoder's window + global attention once, the decoder's steps against
    its self- and cross-attention caches on the kernels, token for token."""
    t = transformers
    base = _led()
    torch.manual_seed(1)
    model = t.LEDForConditionalGeneration(base.config)
    model.led.load_state_dict(base.state_dict())
    model = sharpened(model)
    model.config.decoder_start_token_id, model.config.eos_token_id = 2, 3
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs(*CASES["global-padded"])
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
    lengths = spy_lengths(monkeypatch, hf_written_out)
    assert torch.equal(ours.generate(**inputs, **kw), model.generate(**inputs, **kw))
    # the decoder's steps: its self-attention over the tokens so far, its cross-attention over the
    # encoder's 41 positions (computed once, then cached)
    assert lengths[0::2] == [(1, n) for n in range(1, 7)] and lengths[1::2] == [(1, 41)] * 6
