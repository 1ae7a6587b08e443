"""ff.convert: a model holding every replaced module type gives the same outputs and gradients
after conversion, keeps its parameter objects, and reports what it left and why."""
import copy

import pytest
import torch
from oracle import check
from torch import nn

import fastformer as ff

D, H = 32, 4


class Model(nn.Module):
    """Every type convert() replaces, inside containers it leaves alone."""

    def __init__(self, norm_first=False):
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(D, H, 48, dropout=0.0, batch_first=True,
                                       norm_first=norm_first, activation="gelu"),
            2, nn.LayerNorm(D), enable_nested_tensor=False)
        self.decoder_layer = nn.TransformerDecoderLayer(D, H, 48, dropout=0.0, batch_first=True,
                                                        norm_first=norm_first)
        self.pool = nn.MultiheadAttention(D, H, batch_first=True, kdim=16, vdim=16)
        self.head_norm = nn.LayerNorm(D, eps=1e-3)
        self.query_proj = nn.Linear(8, 16)

    def forward(self, x, tgt, pad):
        memory = self.encoder(self.embed(x), src_key_padding_mask=pad)
        y = self.decoder_layer(self.embed(tgt), memory, tgt_is_causal=True,
                               tgt_mask=nn.Transformer.generate_square_subsequent_mask(tgt.shape[1]),
                               memory_key_padding_mask=pad)
        kv = self.query_proj(x)
        pooled, weights = self.pool(y, kv, kv, key_padding_mask=pad)
        return self.head_norm(pooled + y), weights


def _randomize(model):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _run(model, inputs):
    out, weights = model(*inputs)
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).sum() + weights.square().sum()
    names, params = zip(*model.named_parameters())
    return out.detach(), weights.detach(), dict(zip(names, torch.autograd.grad(loss, params)))


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
def test_convert_same_outputs_and_gradients(norm_first):
    torch.manual_seed(0)
    original = _randomize(Model(norm_first))
    model = copy.deepcopy(original)
    param_ids = {name: id(p) for name, p in model.named_parameters()}
    report = ff.convert(model)
    assert report.model is model
    assert isinstance(model.encoder.layers[0], ff.TransformerEncoderLayer)
    assert isinstance(model.encoder.layers[1].self_attn, ff.MultiheadAttention)
    assert isinstance(model.encoder.norm, ff.LayerNorm)
    assert isinstance(model.decoder_layer, ff.TransformerDecoderLayer)
    assert isinstance(model.decoder_layer.norm3, ff.LayerNorm)
    assert isinstance(model.pool, ff.MultiheadAttention) and not model.pool._qkv_same_embed_dim
    assert model.head_norm.eps == 1e-3
    # the same Parameter objects, under the same names: optimizers built before keep working
    assert {name: id(p) for name, p in model.named_parameters()} == param_ids
    assert model.state_dict().keys() == original.state_dict().keys()
    replaced = {path for path, _, _ in report.replaced}
    layers = {"encoder.layers.0", "encoder.layers.1", "decoder_layer"}
    inside = {f"{layer}.{child}" for layer in layers for child in ("self_attn", "norm1", "norm2")}
    inside |= {"decoder_layer.multihead_attn", "decoder_layer.norm3"}
    assert replaced == layers | inside | {"encoder.norm", "pool", "head_norm"}
    assert report.left == []

    g = torch.Generator().manual_seed(2)
    x, tgt = torch.randn(2, 11, 8, generator=g), torch.randn(2, 6, 8, generator=g)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[1, 7:] = True
    out, weights, grads = _run(model, (x, tgt, pad))
    out_o, weights_o, grads_o = _run(copy.deepcopy(original).double(),
                                     (x.double(), tgt.double(), pad))
    check("out", out, out_o)
    check("weights", weights, weights_o)
    for name, grad in grads.items():
        check(f"d{name}", grad, grads_o[name], grad=True, atol=1e-4, rtol=1e-4)


def test_convert_keeps_device_dtype_mode_and_copies_when_asked():
    model = nn.Sequential(nn.LayerNorm(16), nn.TransformerEncoderLayer(16, 2, 32, batch_first=True))
    model = model.to(torch.float64).eval()
    report = ff.convert(model, inplace=False)
    converted = report.model
    assert converted is not model and type(model[1]) is nn.TransformerEncoderLayer
    assert all(p.dtype == torch.float64 for p in converted.parameters())
    assert not converted[1].training and not converted[1].self_attn.training
    assert converted[1].dropout.p == model[1].dropout.p == 0.1
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        check("eval", converted(x), model(x))


def test_convert_root_module_and_rmsnorm():
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)
    report = ff.convert(layer)
    assert isinstance(report.model, ff.TransformerEncoderLayer) and report.replaced[0][0] == ""
    assert type(layer) is nn.TransformerEncoderLayer  # the argument itself cannot change type
    norm = nn.RMSNorm(16)
    assert isinstance(ff.convert(norm).model, ff.RMSNorm)


def test_convert_reports_what_it_leaves():
    class MyLayer(nn.TransformerEncoderLayer):
        pass

    model = nn.ModuleDict({
        "custom": MyLayer(16, 2, 32),
        "biased": nn.MultiheadAttention(16, 2, add_bias_kv=True),
        "hooked": nn.LayerNorm(16),
        "plain": nn.LayerNorm(16),
    })
    model["hooked"].register_forward_hook(lambda *args: None)
    report = ff.convert(model)
    left = {path: why for path, _, why in report.left}
    assert "subclass" in left["custom"]
    assert "add_bias_kv" in left["biased"]
    assert "hook" in left["hooked"]
    assert isinstance(model["plain"], ff.LayerNorm)
    # a left module's children are still converted
    assert isinstance(model["custom"].self_attn, ff.MultiheadAttention)
    assert isinstance(model["custom"].norm1, ff.LayerNorm)
    text = str(report)
    assert "custom" in text and "add_bias_kv" in text and "replaced" in text
    assert ff.convert(model).replaced == []  # converting twice changes nothing


def test_convert_bad_input():
    with pytest.raises(TypeError, match="model"):
        ff.convert("not a module")
    with pytest.raises(TypeError, match="inplace"):
        ff.convert(nn.Linear(2, 2), inplace="yes")
