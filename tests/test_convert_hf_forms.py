"""ff.convert on Hugging Face families it has no entry for: BERT-form layers by their bytecode
(hf_convert._forms) and MLPs by their traced forward (integrations/hf_mlp_forms.py). Each family
is built from a small config with random weights, converted (a copy) and compared with the
unconverted model in fp64 on the output and the gradient of every parameter (within 1e-5 of the
reference's scale; bf16 by the error-ratio rule); the report must name the fused MLPs. Plus the
matcher itself on hand-written modules: each form, and what it must refuse.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_FACTOR, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule, assert_model_matches
from test_convert_hf import _run, compile_family
from test_ffn import ACTS
from torch import nn

transformers = pytest.importorskip("transformers", reason="the Hugging Face conversion needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_mlp_forms  # noqa: E402

V = 100
DECODER = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               pad_token_id=0)
VISION = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              image_size=32, patch_size=8)
ENCODER = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=96, max_position_embeddings=64)
NO_DROPOUT = ("attention_dropout", "hidden_dropout", "dropout", "attention_probs_dropout_prob",
              "hidden_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop", "residual_dropout",
              "embedding_dropout", "mlp_dropout", "activation_dropout")


def _families():
    """name -> (config class, model class, config kwargs, what the report must say (one or a
    tuple))."""
    t = transformers
    plain, gated = "ff.ffn (an MLP", "ff.swiglu_ffn (a gated MLP"
    return {
        # out(act(inp(x))): tanh / exact GELU, partial rotary (Phi, GPT-NeoX), a dropout after
        "gpt_neox": (t.GPTNeoXConfig, t.GPTNeoXForCausalLM, dict(DECODER, rotary_pct=0.25, num_key_value_heads=None), plain),
        "phi": (t.PhiConfig, t.PhiForCausalLM, dict(DECODER, partial_rotary_factor=0.5), plain),
        "starcoder2": (t.Starcoder2Config, t.Starcoder2ForCausalLM, dict(DECODER, sliding_window=8), plain),
        "gptj": (t.GPTJConfig, t.GPTJForCausalLM, dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                                      n_positions=64), plain),
        # its encoder layers by form too (CLIP's): layer_norm2's residual add fused
        "siglip": (t.SiglipVisionConfig, t.SiglipVisionModel, dict(VISION),
                   (plain, "residual add fused into layer_norm2")),
        # OpenAI CLIP's quick_gelu, its default activation
        "clip": (t.CLIPVisionConfig, t.CLIPVisionModel, dict(VISION), (plain, "residual add fused into layer_norm2")),
        "dinov2": (t.Dinov2Config, t.Dinov2Model, dict(VISION, mlp_ratio=2), plain),
        # a, b = inp(x).chunk(2, -1); out(act(a) * b): the gate and up projections in one linear
        "glm4": (t.Glm4Config, t.Glm4ForCausalLM, dict(DECODER, head_dim=16), gated),
        "modernbert": (t.ModernBertConfig, t.ModernBertModel,
                       dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                            num_attention_heads=4, global_attn_every_n_layers=2, local_attention=8,
                            max_position_embeddings=64, pad_token_id=0), gated),
        # down(act(gate(x)) * up(x)) under other names; the MoE layer adds in place to its output
        "llama4": (t.Llama4TextConfig, t.Llama4ForCausalLM,
                   dict(DECODER, head_dim=16, intermediate_size_mlp=96, num_local_experts=2,
                        interleave_moe_layer_step=2, attention_chunk_size=8), gated),
        # squared ReLU (relu2): Arcee's up / down MLP, Persimmon's biased one, Nemotron's
        "arcee": (t.ArceeConfig, t.ArceeForCausalLM, dict(DECODER, head_dim=16), plain),
        "persimmon": (t.PersimmonConfig, t.PersimmonForCausalLM, dict(DECODER, num_key_value_heads=None), plain),
        # ... and its LayerNorm1P (weight + 1)
        "nemotron": (t.NemotronConfig, t.NemotronForCausalLM, dict(DECODER, head_dim=16),
                     (plain, "ff.layer_norm (weight + 1)")),
        # BERT's layers by their bytecode
        "xlm_roberta": (t.XLMRobertaConfig, t.XLMRobertaModel, dict(ENCODER, pad_token_id=1),
                        "ff.ffn + ff.add_layer_norm"),
        "electra": (t.ElectraConfig, t.ElectraModel, dict(ENCODER, embedding_size=64),
                    "ff.ffn + ff.add_layer_norm"),
    }


FAMILIES = list(_families())


def _model(name):
    config_cls, model_cls, kw, _ = _families()[name]
    config = config_cls(**kw)
    for key in NO_DROPOUT:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    return random_model(model_cls, config)


def random_model(model_cls, config):
    """model_cls(config) on eager attention, its initial weights perturbed (seeded) so that no
    bias or norm weight is exactly 0 or 1."""
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _inputs(name):
    g = torch.Generator().manual_seed(1)
    if name in ("siglip", "clip", "dinov2"):
        return dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g))
    return dict(input_ids=torch.randint(2, V, (2, 13), generator=g))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_without_an_entry_converted_and_matching_fp32(name):
    model = _model(name)
    report = ff.convert(model, inplace=False)
    whats = _families()[name][3]
    for what in (whats,) if isinstance(whats, str) else whats:
        assert any(what in kind for _, _, kind in report.replaced), (what, str(report))
    assert not [entry for entry in report.left if "MLP" in entry[1]], str(report)
    inputs = _inputs(name)
    out, grads = _run(report.model, inputs)
    ref, ref_grads = _run(copy.deepcopy(model).double(),
                          {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()})
    assert_model_matches(out, grads, ref, ref_grads)


@pytest.mark.parametrize("name", ["gpt_neox", "siglip", "clip", "glm4", "xlm_roberta", "nemotron"])
def test_family_without_an_entry_bf16_error_ratio(name):
    model = _model(name)
    ours_model = ff.convert(copy.deepcopy(model).to(torch.bfloat16)).model
    inputs = _inputs(name)
    low_inputs = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in inputs.items()}
    out, grads = _run(ours_model, low_inputs)
    low, low_grads = _run(copy.deepcopy(model).to(torch.bfloat16), low_inputs)
    ref, ref_grads = _run(copy.deepcopy(model).double(),
                          {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()})
    atol = LOWP_ATOL[torch.bfloat16]
    assert_lowp_rule("out", out, ref, low, OUT_FACTOR, atol * ref.abs().max().item())
    for n, r in ref_grads.items():
        if r is not None:
            assert_lowp_rule(f"d{n}", grads[n], r, low_grads[n], GRAD_FACTOR, atol * r.abs().max().item())


def test_unfused_activation_is_left_with_its_reason():
    """An activation without a kernel (Mish) leaves the MLP, named with the reason; CLIP's
    default quick_gelu (x * sigmoid(1.702 x)) and GELU run on ff.ffn."""
    t = transformers
    model = t.CLIPVisionModel(t.CLIPVisionConfig(**VISION, hidden_act="mish"))
    report = ff.convert(model)
    left = [entry for entry in report.left if entry[1] == "CLIPMLP"]
    assert len(left) == 2 and "none of the fused MLP forms" in left[0][2]
    for act in ("gelu", "quick_gelu"):
        model = t.CLIPVisionModel(t.CLIPVisionConfig(**VISION, hidden_act=act))
        assert sum(kind.startswith("ff.ffn (an MLP") for _, _, kind in ff.convert(model).replaced) == 2


# ---- the matcher on hand-written modules -----------------------------------------------------------
class _MLP(nn.Module):
    """A module "from transformers" (the matcher looks at no other) computing `body`."""

    def __init__(self, body, *, packed=False, act=None, drop=None):
        super().__init__()
        self.fc1 = nn.Linear(8, 24 if packed else 12)
        self.fc2 = nn.Linear(12, 8)
        self.up = nn.Linear(8, 12)
        self.act = act if act is not None else nn.GELU(approximate="tanh")
        self.drop = drop if drop is not None else nn.Dropout(0.0)
        self.body = body

    def forward(self, x):
        return self.body(self, x)


_MLP.__module__ = "transformers.models.fake.modeling_fake"

def _packed_first(m, x):  # Phi-3's, GLM-4's, ModernBERT's form
    gate, up = m.fc1(x).chunk(2, dim=-1)
    return m.fc2(F.gelu(gate) * up)


def _packed_second(m, x):
    up, gate = m.fc1(x).chunk(2, dim=-1)
    return m.fc2(up * F.silu(gate))


_FORMS = {
    "plain": (lambda m, x: m.fc2(m.act(m.fc1(x))), {}, ("plain", "gelu_tanh")),
    "plain_mid_dropout": (lambda m, x: m.fc2(m.drop(m.act(m.fc1(x)))), {}, ("plain", "gelu_tanh")),
    "plain_functional": (lambda m, x: m.fc2(F.silu(m.fc1(x))), {}, ("plain", "silu")),
    "plain_post_dropout": (lambda m, x: F.dropout(m.fc2(F.relu(m.fc1(x))), p=0.25, training=m.training),
                           {}, ("plain", "relu")),
    "gated": (lambda m, x: m.fc2(m.act(m.fc1(x)) * m.up(x)), {}, ("gated", "gelu_tanh")),
    "gated_swapped": (lambda m, x: m.fc2(m.up(x) * m.act(m.fc1(x))), {}, ("gated", "gelu_tanh")),
    "packed": (lambda m, x: m.fc2(m.act(m.fc1(x).chunk(2, dim=-1)[0]) * m.fc1(x).chunk(2, dim=-1)[1]),
               dict(packed=True), None),  # two fc1 calls: not the form (each linear once)
    "packed_first": (lambda m, x: _packed_first(m, x), dict(packed=True), ("packed", "gelu")),
    "packed_second": (lambda m, x: _packed_second(m, x), dict(packed=True), ("packed", "silu")),
    "scaled": (lambda m, x: m.fc2(m.act(m.fc1(x))) * 2.0, {}, None),
    "residual": (lambda m, x: x + m.fc2(m.act(m.fc1(x))), {}, None),
    "squared_relu": (lambda m, x: m.fc2(F.relu(m.fc1(x)) ** 2), {}, None),
    "sigmoid": (lambda m, x: m.fc2(torch.sigmoid(m.fc1(x))), {}, None),
    "dropout_always_on": (lambda m, x: F.dropout(m.fc2(F.relu(m.fc1(x))), 0.1, True), {}, None),
}


@pytest.mark.parametrize("name", list(_FORMS))
def test_mlp_form_matcher(name):
    body, kw, expected = _FORMS[name]
    torch.manual_seed(0)
    m = _MLP(body, **kw).eval()
    form = hf_mlp_forms.mlp_form(m)
    if expected is None:
        assert form is None, form
        return
    assert form is not None and (form.kind, form.act) == expected, form
    if name == "packed_second":
        assert form.act_half == 1
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    ref = m.double()(x)
    assert hf_mlp_forms.convert_mlp_by_form(m, lambda mod, mixin: setattr(
        mod, "__class__", type("Converted", (mixin, type(mod)), {}))) is None
    calls = []
    with torch.no_grad(), _counting(calls):  # packed forms take the kernels without a weight gradient
        torch.testing.assert_close(m(x), ref, rtol=1e-12, atol=1e-12)
    assert calls == ["ffn" if form.kind == "plain" else "swiglu_ffn"]
    with _counting(calls):
        torch.testing.assert_close(m(x), ref, rtol=1e-12, atol=1e-12)
    assert len(calls) == (1 if form.kind == "packed" else 2)


@contextlib.contextmanager
def _counting(calls):
    """Record the fused ops hf_mlp_forms calls."""
    real = hf_mlp_forms.ffn, hf_mlp_forms.swiglu_ffn
    hf_mlp_forms.ffn = lambda *a, **k: calls.append("ffn") or real[0](*a, **k)
    hf_mlp_forms.swiglu_ffn = lambda *a, **k: calls.append("swiglu_ffn") or real[1](*a, **k)
    try:
        yield
    finally:
        hf_mlp_forms.ffn, hf_mlp_forms.swiglu_ffn = real


@pytest.mark.parametrize("name", ["glm4", "modernbert"])
def test_packed_family_inference_on_the_fused_kernel(name):
    """Packed gate / up projections run fused without a weight gradient (with one they run the
    original forward, the fp32 family test above)."""
    model = _model(name).eval()
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs(name)
    calls = []
    with torch.no_grad(), _counting(calls):
        out = ours(**inputs)
    ref = copy.deepcopy(model).double()(**inputs)
    out, ref = [o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state for o in (out, ref)]
    assert calls.count("swiglu_ffn") == ours.config.num_hidden_layers
    assert (out.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_mlp_form_dropouts_follow_the_mode():
    """The functional dropout's p is kept and applied (ops/dropout.py) in training only; a
    dropout module between the activation and the second linear is fused into ff.ffn."""
    m = _MLP(_FORMS["plain_post_dropout"][0])
    form = hf_mlp_forms.mlp_form(m)
    assert form.post_dropout == ("p", 0.25) and form.mid_dropout is None
    m = _MLP(_FORMS["plain_mid_dropout"][0], drop=nn.Dropout(0.5))
    form = hf_mlp_forms.mlp_form(m)
    assert form.mid_dropout == "drop"
    hf_mlp_forms.convert_mlp_by_form(m, lambda mod, mixin: setattr(mod, "__class__", type("C", (mixin, type(mod)), {})))
    x = torch.randn(64, 8)
    m.train()
    torch.manual_seed(3)
    a = m(x)
    torch.manual_seed(3)
    b = m(x)
    torch.testing.assert_close(a, b)  # the mask from torch's seed
    assert not torch.allclose(a, m.eval()(x))


@pytest.mark.parametrize("name", ["gpt_neox", "phi", "glm4", "llama4"])
def test_greedy_generate_matches_eager(name):
    """Decoding with the converted model (left-padded prompts, the KV cache, the few-row
    kernels and the fused MLPs without autograd) picks eager's tokens (weights scaled up so that
    no two logits are near a tie)."""
    model = _model(name).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    ours = ff.convert(model, inplace=False).model
    ids = _inputs(name)["input_ids"][:, :9]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(**kw), model.generate(**kw))


@pytest.mark.parametrize("name", ["gpt_neox", "siglip", "glm4"])
def test_form_family_compiles_fullgraph(name):
    """The MLPs and layers converted by form trace without graph breaks, forward and backward
    (glm4 in eval: its packed MLP on the fused kernel)."""
    torch._dynamo.reset()
    model = _model(name)
    ours = ff.convert(model, inplace=False).model
    inputs = _inputs(name)
    out, grads = _run(compile_family(ours, name), inputs)
    exact = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
    ref, ref_grads = _run(copy.deepcopy(model).double(), exact)
    assert_model_matches(out, grads, ref, ref_grads, "_orig_mod.")
    if name == "glm4":
        with torch.no_grad():
            y = compile_family(ours.eval(), name)(**inputs).logits
        r = copy.deepcopy(model).double().eval()(**inputs).logits
        assert (y.double() - r).abs().max().item() <= 1e-5 * r.abs().max().item()


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "quick_gelu", "relu2"])
@pytest.mark.parametrize("gated", [False, True])
def test_decode_time_mlp_call(activation, gated):
    """A converted MLP's call without autograd of at most DECODE_ROWS rows runs three linears
    and torch's activation (ff.ffn's per-call cost skipped); more rows, or a gradient, run the
    fused op. Both against fp64 eager."""
    g = torch.Generator().manual_seed(0)
    w1, w_up, w2 = (torch.randn(*s, generator=g) / 8 for s in ((72, 40), (72, 40), (40, 72)))
    b1, b_up, b2 = (torch.randn(n, generator=g) for n in (72, 72, 40))
    act = ACTS[activation]

    def ours(x):
        if gated:
            return hf_mlp_forms.model_swiglu_ffn(x, w1, w_up, w2, b1, b_up, b2, activation=activation)
        return hf_mlp_forms.model_ffn(x, w1, b1, w2, b2, activation)

    def exact(x):
        d = [t.double() for t in (x, w1, b1, w_up, b_up, w2, b2)]
        h = act(F.linear(d[0], d[1], d[2]))
        return F.linear(h * F.linear(d[0], d[3], d[4]) if gated else h, d[5], d[6])
    for rows, grad in ((1, False), (hf_mlp_forms.DECODE_ROWS, False), (hf_mlp_forms.DECODE_ROWS + 1, False), (1, True)):
        x = torch.randn(rows, 1, 40, generator=g)
        calls = []
        with torch.set_grad_enabled(grad), _counting(calls):
            y = ours(x)
        assert calls == ([] if rows <= hf_mlp_forms.DECODE_ROWS and not grad else
                         ["swiglu_ffn" if gated else "ffn"]), (rows, grad, calls)
        torch.testing.assert_close(y.double(), exact(x), atol=1e-5, rtol=1e-5)


# ---- what a form must not match ------------------------------------------------------------------
def test_nanochat_rotary_with_flipped_signs_is_not_llamas():
    """NanoChat's apply_rotary_pos_emb has Llama's bytecode but calls its own rotate_half, whose
    signs are flipped: the form includes the functions a forward reaches, so its attention keeps
    its own rotation (ff.convert once rotated q and k Llama's way: logits off by 5e-3 of their
    scale); the converted model matches eager on the logits and every gradient."""
    if not hasattr(transformers, "NanoChatConfig"):
        pytest.skip("this transformers has no NanoChat")
    model = random_model(transformers.NanoChatForCausalLM, transformers.NanoChatConfig(**DECODER))
    report = ff.convert(model, inplace=False)
    assert not any("rotary" in kind for _, _, kind in report.replaced), str(report)
    out, grads = _run(report.model, _inputs("nanochat"))
    ref, ref_grads = _run(copy.deepcopy(model).double(), _inputs("nanochat"))
    assert_model_matches(out, grads, ref, ref_grads)


def test_class_form_includes_the_methods_a_forward_calls():
    """Two modules with the same forward calling self._norm, one of them a different _norm: not
    the same form (Llama 4's RMSNorm forward with another normalization must not be converted)."""
    from fastformer.integrations.hf_rotary import class_form
    from transformers.models.llama4 import modeling_llama4 as l4

    class OtherNorm(l4.Llama4TextRMSNorm):
        def _norm(self, x):
            return x / (x.abs().mean(-1, keepdim=True) + self.eps)

    OtherNorm.__module__ = l4.__name__
    OtherNorm._norm.__module__ = l4.__name__
    assert class_form(OtherNorm) != class_form(l4.Llama4TextRMSNorm)
    assert class_form(type("Same", (l4.Llama4TextRMSNorm,), {"__module__": l4.__name__})) == \
        class_form(l4.Llama4TextRMSNorm)


def test_model_whose_attention_is_eager_only_keeps_it():
    """GIT's text attention computes softmax(QK^T + mask) itself, on a mask transformers builds
    for config._attn_implementation: a model transformers runs only as eager (no sdpa, no attention
    backend) keeps its implementation (ff.convert once set "fastformer": logits 3e-2 off); its
    layers are converted and match."""
    config = transformers.GitConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                                       num_attention_heads=2, image_size=32, patch_size=8))
    model = random_model(transformers.GitForCausalLM, config)
    report = ff.convert(model, inplace=False)
    assert report.model.config._attn_implementation == "eager"
    assert any("attn_implementation left as it was" in why for _, _, why in report.left), str(report)
    assert any("add_layer_norm" in kind or "ff.ffn" in kind for _, _, kind in report.replaced), str(report)
    out, grads = _run(report.model, _inputs("git"))
    ref, ref_grads = _run(copy.deepcopy(model).double(), _inputs("git"))
    assert_model_matches(out, grads, ref, ref_grads)
