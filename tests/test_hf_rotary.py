"""ff.convert's rotary embedding for Hugging Face attention (integrations/hf_rotary.py): q and k
rotated on ff.apply_rotary inside the converted attention modules, against the unconverted
model (fp64 oracle; bf16 by the error-ratio rule), on every output and parameter gradient; the
calls it leaves to transformers' function (per-row positions); unconverted models untouched."""
import copy
import inspect

import pytest
import torch
from oracle import GRAD_FACTOR, LOWP_ATOL, OUT_FACTOR, assert_lowp_rule, assert_model_matches

transformers = pytest.importorskip("transformers", reason="the Hugging Face conversion needs transformers")

import fastformer as ff  # noqa: E402
from fastformer.integrations import hf_rotary  # noqa: E402

V = 100
LAYERS = 2
DECODER = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               attention_dropout=0.0)


def _model(name, dtype=torch.float32):
    t = transformers
    config_cls, model_cls, kw = {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM, dict(DECODER)),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM, dict(DECODER, head_dim=24)),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM, dict(DECODER, head_dim=16, sliding_window=8,
                                                             attn_logit_softcapping=50.0)),
        "mistral": (t.MistralConfig, t.MistralForCausalLM, dict(DECODER, sliding_window=8)),
    }[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**kw, attn_implementation="eager"))
    with torch.no_grad():  # a larger init, so that a wrong rotation shows in every output
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The number of ff.apply_rotary calls made by converted attention modules."""
    calls = []
    real = hf_rotary.apply_rotary

    def counted(x, cos, sin, **kw):
        calls.append(tuple(x.shape))
        return real(x, cos, sin, **kw)

    monkeypatch.setattr(hf_rotary, "apply_rotary", counted)
    return calls


def _run(model, ids, **kw):
    out = model(ids, **kw).logits
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad((out.double() * g).sum(), params, allow_unused=True)
    return out.detach(), dict(zip(names, grads))


def _ids(batch=2, length=113):
    return torch.randint(2, V, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "mistral"])
@pytest.mark.parametrize("length", [1, 17, 113])
def test_rotary_on_the_kernel_matches_unconverted_fp32(name, length, kernel_calls):
    model = _model(name)
    report = ff.convert(copy.deepcopy(model))
    rotary = [p for p, _, what in report.replaced if "ff.apply_rotary" in what]
    assert len(rotary) == LAYERS, str(report)
    ids = _ids(length=length)
    out, grads = _run(report.model, ids)
    assert len(kernel_calls) == 2 * LAYERS  # q and k of every layer
    ref, ref_grads = _run(model.double(), ids)
    assert_model_matches(out, grads, ref, ref_grads)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_converted_model_compiles_fullgraph(name, kernel_calls):
    """ff.convert then torch.compile(fullgraph=True), forward and backward: the converted
    attention runs transformers' own forward under the compiler (hf_rotary._eager_only; the
    copy with its own globals broke dynamo's guards), its eager calls stay on the kernel."""
    torch._dynamo.reset()
    model = _model(name)
    ours = ff.convert(copy.deepcopy(model)).model
    ids = _ids(length=17)
    out, grads = _run(torch.compile(ours, fullgraph=True), ids)
    assert not kernel_calls
    ref, ref_grads = _run(model.double(), ids)
    assert_model_matches(out, grads, ref, ref_grads, prefix="_orig_mod.")
    _run(ours, ids)
    assert len(kernel_calls) == 2 * LAYERS


def test_rotary_on_the_kernel_bf16_error_ratio(kernel_calls):
    model = _model("llama")
    ours = ff.convert(copy.deepcopy(model).to(torch.bfloat16)).model
    ids = _ids()
    out, grads = _run(ours, ids)
    assert len(kernel_calls) == 2 * LAYERS
    low, low_grads = _run(copy.deepcopy(model).to(torch.bfloat16), ids)
    ref, ref_grads = _run(model.double(), ids)
    atol = LOWP_ATOL[torch.bfloat16]
    assert_lowp_rule("logits", out, ref, low, OUT_FACTOR, atol * ref.abs().max().item())
    for n, r in ref_grads.items():
        assert_lowp_rule(f"d{n}", grads[n], r, low_grads[n], GRAD_FACTOR, atol * r.abs().max().item())


def test_per_row_positions_take_transformers_rotary(kernel_calls):
    """Rows at different positions (left padding): HF's cos / sin differ between the batch's
    rows, which the (L, D/2) table cannot hold: transformers' function, same results."""
    model = _model("llama")
    ours = ff.convert(copy.deepcopy(model)).model
    ids = _ids(length=17)
    positions = torch.stack([torch.arange(17), torch.arange(17) + 5])
    out, _ = _run(ours, ids, position_ids=positions)
    assert kernel_calls == []
    ref, _ = _run(model.double(), ids, position_ids=positions)
    assert (out.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_generate_with_cache_matches_unconverted(kernel_calls):
    """Prefill and decode steps (one query at positions 17..21 against the cache): the logits
    of every generated position."""
    model = _model("llama").eval()
    ours = ff.convert(copy.deepcopy(model)).model
    ids = _ids(batch=1, length=17)
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.double().generate(ids, **kw)
        got = ours.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for step, (o, r) in enumerate(zip(got.logits, want.logits)):
        assert (o.double() - r).abs().max().item() <= 1e-5 * r.abs().max().item(), f"step {step}"
    assert (1, 4, 17, 16) in kernel_calls and (1, 4, 1, 16) in kernel_calls  # prefill, decode steps


def test_unconverted_models_keep_transformers_function():
    from transformers.models.llama import modeling_llama
    original = modeling_llama.apply_rotary_pos_emb
    ff.convert(_model("llama"))
    assert modeling_llama.apply_rotary_pos_emb is original
    forward = inspect.unwrap(modeling_llama.LlamaAttention.forward)
    assert forward.__globals__["apply_rotary_pos_emb"] is original


def test_with_global_reaches_through_decorators():
    import functools

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            return fn(*a, **k)
        return wrapper

    @deco
    def f(x):
        return helper(x)  # noqa: F821 (a global of this module, bound by _with_global)

    g, found = hf_rotary._with_global(f, "helper", lambda x: x + 1)
    assert found and g(1) == 2
    with pytest.raises(NameError):
        f(1)  # the original still reads this module's globals, which have no `helper`
