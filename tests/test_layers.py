"""ff.MultiheadAttention and the ff.Transformer* modules vs their torch.nn counterparts.

Every comparison loads the torch module's state_dict into ours (and back), then checks the
output and the gradient of every parameter and input (ARCHITECTURE.md, "Numerical policy"): fp32
against the torch module run in fp64 (atol=rtol=1e-5 for outputs, 1e-4 for gradients, the
attention gradient tolerance: every gradient here flows through attention); bf16 by the
error-ratio rule against the torch module in fp32 (oracle) and in bf16 (torch_lowp). Dropout 0
compares exactly; with
dropout > 0 the statistics of the outputs are compared (the RNGs differ by design).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from oracle import check
from torch import nn

import fastformer as ff

D_MODEL, NHEAD, FFD = 32, 4, 48


def _randomize(module: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial biases and norm weights (torch initialises them to 0 and 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                base = 1.0 if "norm" in name and name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return module


def _pair(nn_cls, ff_cls, *args, **kwargs):
    torch.manual_seed(0)
    ref = _randomize(nn_cls(*args, **kwargs))
    ours = ff_cls(*args, **kwargs)
    ours.load_state_dict(ref.state_dict())
    ref.load_state_dict(ours.state_dict())  # both directions
    assert list(ours.state_dict()) == list(ref.state_dict())
    return ours, ref


def _forward_backward(module, inputs: dict, kwargs: dict, dtype, grad_seed=1):
    """Output, input grads and parameter grads of `module` in `dtype` (fresh copies)."""
    module = copy.deepcopy(module).to(dtype)
    leaves = {k: v.detach().to(dtype).requires_grad_(True) for k, v in inputs.items()}
    kw = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
          for k, v in kwargs.items()}
    out = module(*leaves.values(), **kw)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.Generator().manual_seed(grad_seed)
    gy = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    params = dict(module.named_parameters())
    grads = torch.autograd.grad(out, list(leaves.values()) + list(params.values()), gy)
    names = [f"d{k}" for k in leaves] + [f"d{k}" for k in params]
    return out.detach(), dict(zip(names, grads))


def compare(ours, ref, inputs: dict, kwargs: dict = None, dtype=torch.float32):
    """ours (in dtype) vs ref: outputs and every gradient, by the numerical policy's rules."""
    kwargs = kwargs or {}
    out, grads = _forward_backward(ours, inputs, kwargs, dtype)
    if dtype == torch.float32:
        out_o, grads_o = _forward_backward(ref, inputs, kwargs, torch.float64)
        lowp_out, lowp_grads = None, {}
    else:  # oracle: the torch module in fp32 on the same low-precision weights and inputs
        rounded = copy.deepcopy(ref).to(dtype)
        out_o, grads_o = _forward_backward(rounded, {k: v.to(dtype) for k, v in inputs.items()},
                                           kwargs, torch.float32)
        lowp_out, lowp_grads = _forward_backward(ref, inputs, kwargs, dtype)
    assert set(grads) == set(grads_o)
    check("out", out, out_o, lowp_out)
    for name, g in grads.items():
        check(name, g, grads_o[name], lowp_grads.get(name), grad=True, atol=1e-4, rtol=1e-4)


def _padding(B, L, seed=3):
    g = torch.Generator().manual_seed(seed)
    pad = torch.rand(B, L, generator=g) < 0.35
    pad[:, 0] = False  # every sequence keeps a key: padded query rows still attend
    pad[0, L // 2:] = True
    return pad


def _x(*shape, seed=2):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _causal(L, kind):
    blocked = torch.ones(L, L, dtype=torch.bool).triu(1)
    return blocked if kind == "bool" else torch.zeros(L, L, dtype=torch.float64).masked_fill(blocked, float("-inf"))


# ---- MultiheadAttention -------------------------------------------------------------------------
MHA_CASES = ["self", "self_kpm_bool", "self_kpm_float", "causal_bool_2d", "causal_is_causal",
             "float_3d", "cross_kpm", "cross_kvdim", "unbatched"]


@pytest.mark.parametrize("batch_first", [True, False], ids=["bf", "sf"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
@pytest.mark.parametrize("case", MHA_CASES)
def test_multihead_attention_matches_torch(case, need_weights, batch_first):
    B, Lq, Lk, E = 3, 9, 13, D_MODEL
    kw = dict(batch_first=batch_first)
    if case == "cross_kvdim":
        kw.update(kdim=20, vdim=24)
    ours, ref = _pair(nn.MultiheadAttention, ff.MultiheadAttention, E, NHEAD, **kw)
    lay = (lambda t: t) if batch_first else (lambda t: t.transpose(0, 1))
    q = lay(_x(B, Lq, E))
    kwargs = dict(need_weights=need_weights)
    if case.startswith("cross"):
        k = lay(_x(B, Lk, ours.kdim, seed=4))
        v = lay(_x(B, Lk, ours.vdim, seed=5))
        inputs = dict(query=q, key=k, value=v)
        if case == "cross_kpm":
            kwargs["key_padding_mask"] = _padding(B, Lk)
    else:
        inputs = dict(query=q)
        if case == "self_kpm_bool":
            kwargs["key_padding_mask"] = _padding(B, Lq)
        elif case == "self_kpm_float":
            kwargs["key_padding_mask"] = torch.zeros(B, Lq, dtype=torch.float64).masked_fill(
                _padding(B, Lq), float("-inf")) + 0.3 * _x(B, Lq, seed=6)
        elif case == "causal_bool_2d":
            kwargs["attn_mask"] = _causal(Lq, "bool")
        elif case == "causal_is_causal":
            kwargs.update(attn_mask=_causal(Lq, "float"), is_causal=True)
        elif case == "float_3d":
            kwargs["attn_mask"] = _x(B * NHEAD, Lq, Lq, seed=7)
        elif case == "unbatched":
            inputs = dict(query=_x(Lq, E))
    self_attn = len(inputs) == 1

    class SelfAttention(nn.Module):  # q is k is v: the fused-projection path
        def __init__(self, mha):
            super().__init__()
            self.mha = mha

        def forward(self, x, **kw):
            return self.mha(x, x, x, **kw)

    wrap = SelfAttention if self_attn else (lambda m: m)
    compare(wrap(ours), wrap(ref), inputs, kwargs)
    if need_weights:  # the weights themselves
        with torch.no_grad():
            args = list(inputs.values()) * (3 if self_attn else 1)
            w = ours.double()(*args, **kwargs)[1]
            w_ref = ref.double()(*args, **kwargs)[1]
        check("attn_weights", w, w_ref)


@pytest.mark.parametrize("average", [True, False])
def test_multihead_attention_weights_per_head(average):
    ours, ref = _pair(nn.MultiheadAttention, ff.MultiheadAttention, D_MODEL, NHEAD, batch_first=True)
    x = _x(2, 7, D_MODEL).float()
    w = ours(x, x, x, average_attn_weights=average)[1]
    w_ref = ref(x, x, x, average_attn_weights=average)[1]
    assert w.shape == w_ref.shape == ((2, 7, 7) if average else (2, NHEAD, 7, 7))
    check("weights", w.detach(), w_ref.detach().double())


def test_multihead_attention_bf16():
    ours, ref = _pair(nn.MultiheadAttention, ff.MultiheadAttention, 64, 4, batch_first=True)

    class Self(nn.Module):
        def __init__(self, mha):
            super().__init__()
            self.mha = mha

        def forward(self, x, **kw):
            return self.mha(x, x, x, **kw)

    compare(Self(ours), Self(ref), dict(x=_x(2, 33, 64)),
            dict(need_weights=False, key_padding_mask=_padding(2, 33)), dtype=torch.bfloat16)


def test_fully_masked_query_gives_zeros_not_nan():
    mha = ff.MultiheadAttention(D_MODEL, NHEAD, batch_first=True)
    _randomize(mha)
    x = torch.randn(2, 5, D_MODEL)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1] = True
    for need_weights in (False, True):
        out = mha(x, x, x, key_padding_mask=pad, need_weights=need_weights)[0]
        assert torch.isfinite(out).all()
        # no key: attention output 0, so the module output is out_proj's bias
        torch.testing.assert_close(out[1], mha.out_proj.bias.expand(5, -1).detach())


# ---- encoder / decoder layers -------------------------------------------------------------------
ACTIVATIONS = ["relu", "gelu"]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["bf", "sf"])
@pytest.mark.parametrize("masks", ["padding", "causal_tensor", "causal_hint"])
def test_encoder_layer_matches_torch(masks, batch_first, norm_first, activation):
    B, L = 3, 11
    ours, ref = _pair(nn.TransformerEncoderLayer, ff.TransformerEncoderLayer, D_MODEL, NHEAD, FFD,
                      dropout=0.0, activation=activation, batch_first=batch_first,
                      norm_first=norm_first)
    src = _x(B, L, D_MODEL) if batch_first else _x(L, B, D_MODEL)
    kwargs = {}
    if masks == "padding":
        kwargs["src_key_padding_mask"] = _padding(B, L)
    elif masks == "causal_tensor":
        kwargs["src_mask"] = _causal(L, "float")
    else:
        kwargs.update(src_mask=_causal(L, "bool"), is_causal=True, src_key_padding_mask=_padding(B, L))
    compare(ours, ref, dict(src=src), kwargs)
    with torch.no_grad():  # eval: torch takes its fused fast path where it can
        out = ours.eval()(src.float(), **kwargs)
        out_ref = ref.eval().double()(src, **kwargs)
    check("eval out", out, out_ref)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["bf", "sf"])
def test_decoder_layer_matches_torch(batch_first, norm_first, activation):
    B, Lt, Lm = 2, 7, 12  # cross-attention with Lq != Lk
    ours, ref = _pair(nn.TransformerDecoderLayer, ff.TransformerDecoderLayer, D_MODEL, NHEAD, FFD,
                      dropout=0.0, activation=activation, batch_first=batch_first,
                      norm_first=norm_first)
    lay = (lambda t: t) if batch_first else (lambda t: t.transpose(0, 1))
    inputs = dict(tgt=lay(_x(B, Lt, D_MODEL)), memory=lay(_x(B, Lm, D_MODEL, seed=8)))
    kwargs = dict(tgt_mask=_causal(Lt, "bool"), tgt_is_causal=activation == "gelu",
                  tgt_key_padding_mask=_padding(B, Lt), memory_key_padding_mask=_padding(B, Lm, 5))
    compare(ours, ref, inputs, kwargs)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_layers_bf16(norm_first):
    kw = dict(dropout=0.0, batch_first=True, norm_first=norm_first, activation="gelu")
    ours, ref = _pair(nn.TransformerEncoderLayer, ff.TransformerEncoderLayer, 64, 4, 128, **kw)
    compare(ours, ref, dict(src=_x(2, 33, 64)), dict(src_key_padding_mask=_padding(2, 33)),
            dtype=torch.bfloat16)
    ours, ref = _pair(nn.TransformerDecoderLayer, ff.TransformerDecoderLayer, 64, 4, 128, **kw)
    compare(ours, ref, dict(tgt=_x(2, 17, 64), memory=_x(2, 29, 64, seed=9)),
            dict(tgt_is_causal=True, tgt_mask=_causal(17, "float")), dtype=torch.bfloat16)


def test_callable_activation_and_no_bias():
    act = lambda t: F.silu(t) * 1.5  # noqa: E731
    ours, ref = _pair(nn.TransformerEncoderLayer, ff.TransformerEncoderLayer, D_MODEL, NHEAD, FFD,
                      dropout=0.0, activation=act, batch_first=True, bias=False)
    compare(ours, ref, dict(src=_x(2, 9, D_MODEL)))
    for act_module in (nn.GELU(), nn.ReLU()):  # modules map onto the fused FFN's activations
        ours, ref = _pair(nn.TransformerEncoderLayer, ff.TransformerEncoderLayer, D_MODEL, NHEAD,
                          FFD, dropout=0.0, activation=act_module, batch_first=True)
        compare(ours, ref, dict(src=_x(2, 9, D_MODEL)))


# ---- stacks -------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_encoder_and_decoder_stacks_match_torch(norm_first):
    """Pre-norm stacks carry each layer's last residual add into the next fused add+norm."""
    kw = dict(dim_feedforward=FFD, dropout=0.0, batch_first=True, norm_first=norm_first)
    torch.manual_seed(0)
    ref_enc = _randomize(nn.TransformerEncoder(nn.TransformerEncoderLayer(D_MODEL, NHEAD, **kw), 3,
                                               nn.LayerNorm(D_MODEL), enable_nested_tensor=False))
    ours_enc = ff.TransformerEncoder(ff.TransformerEncoderLayer(D_MODEL, NHEAD, **kw), 3,
                                     ff.LayerNorm(D_MODEL))
    ours_enc.load_state_dict(ref_enc.state_dict())
    compare(ours_enc, ref_enc, dict(src=_x(2, 10, D_MODEL)),
            dict(mask=_causal(10, "bool"), src_key_padding_mask=_padding(2, 10)))
    ref_dec = _randomize(nn.TransformerDecoder(nn.TransformerDecoderLayer(D_MODEL, NHEAD, **kw), 2))
    ours_dec = ff.TransformerDecoder(ff.TransformerDecoderLayer(D_MODEL, NHEAD, **kw), 2)
    ours_dec.load_state_dict(ref_dec.state_dict())
    compare(ours_dec, ref_dec, dict(tgt=_x(2, 6, D_MODEL), memory=_x(2, 15, D_MODEL, seed=4)),
            dict(tgt_mask=_causal(6, "bool"), memory_key_padding_mask=_padding(2, 15)))


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # torch's, for batch_first=False
@pytest.mark.parametrize("batch_first", [True, False], ids=["bf", "sf"])
def test_transformer_matches_torch(batch_first):
    kw = dict(d_model=D_MODEL, nhead=NHEAD, num_encoder_layers=2, num_decoder_layers=2,
              dim_feedforward=FFD, dropout=0.0, batch_first=batch_first)
    ours, ref = _pair(nn.Transformer, ff.Transformer, **kw)
    lay = (lambda t: t) if batch_first else (lambda t: t.transpose(0, 1))
    inputs = dict(src=lay(_x(2, 12, D_MODEL)), tgt=lay(_x(2, 8, D_MODEL, seed=3)))
    kwargs = dict(tgt_mask=_causal(8, "bool"), src_key_padding_mask=_padding(2, 12),
                  memory_key_padding_mask=_padding(2, 12))
    compare(ours, ref, inputs, kwargs)
    torch.testing.assert_close(ff.Transformer.generate_square_subsequent_mask(5),
                               nn.Transformer.generate_square_subsequent_mask(5))


# ---- extra options ------------------------------------------------------------------------------
def test_swiglu_and_rmsnorm_options():
    layer = _randomize(ff.TransformerEncoderLayer(D_MODEL, NHEAD, FFD, dropout=0.0, batch_first=True,
                                                  norm_first=True, activation="swiglu",
                                                  norm="rmsnorm"))
    assert {"linear1.weight", "linear2.weight", "linear3.weight", "norm1.weight"} <= set(layer.state_dict())
    assert "norm1.bias" not in layer.state_dict()

    class Eager(nn.Module):  # the same math written with torch.nn pieces (same parameter names)
        def __init__(self, layer):
            super().__init__()
            self.self_attn = nn.MultiheadAttention(D_MODEL, NHEAD, batch_first=True)
            for name in ("linear1", "linear2", "linear3", "norm1", "norm2"):
                setattr(self, name, copy.deepcopy(getattr(layer, name)))
            self.load_state_dict(layer.state_dict())

        def forward(self, src):
            h = F.rms_norm(src, (D_MODEL,), self.norm1.weight, self.norm1.eps)
            x = src + self.self_attn(h, h, h, need_weights=False)[0]
            h = F.rms_norm(x, (D_MODEL,), self.norm2.weight, self.norm2.eps)
            return x + self.linear2(F.silu(self.linear1(h)) * self.linear3(h))

    compare(layer, Eager(layer), dict(src=_x(2, 9, D_MODEL)))


# ---- dropout > 0: statistics --------------------------------------------------------------------
def _dropout_stats(module, x, draws, **kw):
    """Mean over draws, and the RMS of one draw's deviation from the eval output."""
    with torch.no_grad():
        clean = module.eval()(x, **kw)
        module.train()
        outs = torch.stack([module(x, **kw) for _ in range(draws)])
    return (outs.mean(0) - clean).pow(2).mean().sqrt(), (outs - clean).pow(2).mean().sqrt()


def test_dropout_statistics_match_torch():
    """Same expected value (dropout is unbiased) and the same spread as torch's dropout."""
    x = _x(4, 24, D_MODEL).float()
    ours, ref = _pair(nn.TransformerEncoderLayer, ff.TransformerEncoderLayer, D_MODEL, NHEAD, FFD,
                      dropout=0.2, batch_first=True, norm_first=True)
    mean_dev, spread = _dropout_stats(ours, x, 32)
    mean_dev_ref, spread_ref = _dropout_stats(ref, x, 32)
    assert 0.9 < spread / spread_ref < 1.1, (spread, spread_ref)
    assert mean_dev < 0.25 * spread and mean_dev_ref < 0.25 * spread_ref  # ~1/sqrt(32) of it
    mha, mha_ref = _pair(nn.MultiheadAttention, ff.MultiheadAttention, D_MODEL, NHEAD, dropout=0.3,
                         batch_first=True)

    class Self(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, t):
            return self.m(t, t, t, need_weights=False)[0]

    mean_dev, spread = _dropout_stats(Self(mha), x, 32)
    mean_dev_ref, spread_ref = _dropout_stats(Self(mha_ref), x, 32)
    assert 0.9 < spread / spread_ref < 1.1, (spread, spread_ref)
    assert mean_dev < 0.25 * spread and mean_dev_ref < 0.25 * spread_ref
    torch.manual_seed(5)
    a = ours.train()(x)
    torch.manual_seed(5)
    torch.testing.assert_close(ours(x), a, rtol=0, atol=0)  # torch.manual_seed reproduces it


# ---- bad input ----------------------------------------------------------------------------------
def test_unsupported_options_raise():
    with pytest.raises(NotImplementedError, match="add_bias_kv"):
        ff.MultiheadAttention(16, 2, add_bias_kv=True)
    with pytest.raises(NotImplementedError, match="add_zero_attn"):
        ff.MultiheadAttention(16, 2, add_zero_attn=True)
    with pytest.raises(ValueError, match="activation"):
        ff.TransformerEncoderLayer(16, 2, activation="tanh")
    with pytest.raises(TypeError, match="activation"):
        ff.TransformerDecoderLayer(16, 2, activation=3)
    with pytest.raises(ValueError, match="norm"):
        ff.TransformerEncoderLayer(16, 2, norm="batchnorm")
    with pytest.raises(ValueError, match="dim_feedforward"):
        ff.TransformerEncoderLayer(16, 2, dim_feedforward=0)
    mha = ff.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="attn_mask"):
        mha(x, x, x, attn_mask=torch.zeros(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask"):
        mha(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="key"):
        mha(x, torch.randn(2, 5, 8), torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="batch"):
        ff.Transformer(16, 2, 1, 1, 32)(torch.randn(4, 2, 16), torch.randn(4, 3, 16))
