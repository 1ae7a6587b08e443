"""Converted Hugging Face models whose parts change after ff.convert (integrations/hf_parts.py):
a LoRA layer in place of a linear the converted code reads, hooks, accelerate's instance
forwards, global hooks. Each must give the unconverted model's answer with the same change, and
its gradients; ff.convert of a model inside a wrapper (PEFT's PeftModel, a user's module)
converts the model. fp32 against the unconverted model in fp64, as tests/test_convert_hf.py
(oracle.assert_model_matches).

pyproject.toml turns the fallback's warning into an error for every other test: a converted model
that runs its original code where nothing changed fails the suite.
"""
import contextlib
import copy
import functools
import io
import warnings

import pytest
import torch
from oracle import assert_model_matches
from torch import nn

transformers = pytest.importorskip("transformers", reason="the Hugging Face conversion needs transformers")

import fastformer as ff  # noqa: E402

FALLBACK = "fastformer. a converted"
V = 97


def _llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def _bert(seed=0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=96, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertModel(config).eval()


def _gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


MODELS = {"llama": _llama, "bert": _bert, "gpt2": _gpt2}


def _ids(length=17):
    return torch.randint(3, V, (2, length), generator=torch.Generator().manual_seed(1))


def _out(model, **kw):
    out = model(input_ids=_ids(), **kw)
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _close(ours, ref):
    assert (ours.double() - ref.double()).abs().max().item() <= 1e-5 * ref.abs().max().item()


def _matches(ours, ref, run=_out, expect_warning=True):
    """run(ours) in fp32 against run(ref) in fp64: outputs, and every gradient for a random
    upstream gradient (as tests/test_convert_hf.py)."""
    ref = ref.double()
    with pytest.warns(UserWarning, match=FALLBACK) if expect_warning else contextlib.nullcontext():
        out = run(ours)
    expected = run(ref)
    g = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (out.double() * g).sum().backward()
    (expected * g).sum().backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert_model_matches(out, grads, expected, {n: p.grad for n, p in ref.named_parameters()})


class _Adapter(nn.Module):
    """A LoRA-style wrapper (PEFT's form, no PEFT): base(x) + up(down(x)), a trainable delta."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int):
        super().__init__()
        self.base_layer = base
        self.down = nn.Linear(in_features, 4, bias=False)
        self.up = nn.Linear(4, out_features, bias=False)
        nn.init.normal_(self.up.weight, std=0.5)

    @property
    def weight(self):  # as PEFT's layers: the base weight under the old name
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.up(self.down(x))


def _wrap(model: nn.Module, path: str, sizes) -> None:
    parent, name = model.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]
    torch.manual_seed(7)
    setattr(parent, name, _Adapter(getattr(parent, name), *sizes))


# (model, the part replaced after conversion, its (in, out) features): each read, not called, by
# a converted module (the MLPs, BERT's feed-forward chunk, GPT-2's Conv1D MLP)
WRAPPED = [("llama", "model.layers.0.mlp.gate_proj", (64, 96)), ("llama", "model.layers.1.mlp.down_proj", (96, 64)),
           ("bert", "encoder.layer.0.intermediate.dense", (64, 96)), ("bert", "encoder.layer.1.output.dense", (96, 64)),
           ("gpt2", "transformer.h.0.mlp.c_fc", (64, 256))]


@pytest.mark.parametrize("name,path,sizes", WRAPPED)
def test_a_part_wrapped_after_convert_runs_and_trains(name, path, sizes):
    ref, ours = MODELS[name](), MODELS[name]()
    ff.convert(ours)
    _wrap(ref, path, sizes)
    _wrap(ours, path, sizes)
    _matches(ours, ref)


class _Doubled(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 2 * self.inner(x)


def test_a_part_read_by_a_layer_wrapped_after_convert():
    """The decoder layer reads post_attention_layernorm for the fused residual add."""
    ref, ours = _llama(), _llama()
    ff.convert(ours)
    for m in (ref, ours):
        layer = m.model.layers[0]
        layer.post_attention_layernorm = _Doubled(layer.post_attention_layernorm)
    _matches(ours, ref)


def test_a_part_replaced_by_a_plain_linear_is_read_without_fallback():
    """A new nn.Linear in a converted linear's place (resize_token_embeddings' new head, a
    user's swap) is read as the old one was: no fallback."""
    ref, ours = _llama(), _llama()
    ff.convert(ours)
    torch.manual_seed(3)
    new = nn.Linear(64, 96, bias=False)
    ref.model.layers[0].mlp.up_proj = new
    ours.model.layers[0].mlp.up_proj = copy.deepcopy(new)
    _matches(ours, ref, expect_warning=False)


FAMILIES = {"llama": _llama, "bert": _bert, "gpt2": _gpt2,
            "t5": lambda: transformers.T5Model(transformers.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=96,
                                                                     num_layers=2, num_heads=4,
                                                                     dropout_rate=0.0)).eval(),
            "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
                vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=8)).eval(),
            "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
                vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)).eval()}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_converted_model_pickles(name):
    """torch.save / torch.load of the whole converted model: pickle looks classes up by module and
    name, which the converted subclasses share with their originals; they pickle as recipes."""
    torch.manual_seed(0)
    model = FAMILIES[name]()
    ff.convert(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    converted = [type(m).__mro__[1] for m in model.modules() if hasattr(type(m), "_fastformer_original")]
    assert converted == [type(m).__mro__[1] for m in loaded.modules() if hasattr(type(m), "_fastformer_original")]
    inputs = dict(input_ids=_ids())
    if name == "t5":
        inputs["decoder_input_ids"] = _ids(5)
    with torch.no_grad():
        a, b = model(**inputs), loaded(**inputs)
    key = "logits" if getattr(a, "logits", None) is not None else "last_hidden_state"
    assert torch.equal(getattr(a, key), getattr(b, key))


def test_a_peft_model_around_a_converted_model_pickles():
    ours = _peft(_llama(), "llama")
    ff.convert(ours)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        assert torch.equal(_out(ours), _out(loaded))


@pytest.mark.parametrize("kind", ["forward_hook", "pre_hook", "instance_forward"])
def test_hooks_on_a_read_part_run(kind):
    ref, ours = _llama(), _llama()
    ff.convert(ours)
    seen = []
    for m in (ref, ours):
        part = m.model.layers[1].mlp.down_proj
        if kind == "forward_hook":
            part.register_forward_hook(lambda mod, args, out: seen.append(1) or out * 3)
        elif kind == "pre_hook":
            part.register_forward_pre_hook(lambda mod, args: (args[0] + 1,))
        else:  # accelerate's add_hook_to_module: a forward set on the instance
            part.forward = functools.partial(lambda mod, old, x: old(x) - 0.5, part, part.forward)
    _matches(ours, ref)
    assert kind != "forward_hook" or len(seen) == 2


def test_global_module_hooks_see_every_linear():
    ours = _llama()
    ff.convert(ours)
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: calls.append(type(mod).__name__) if isinstance(mod, nn.Linear) else None)
    try:
        with pytest.warns(UserWarning, match=FALLBACK):
            _out(ours)
    finally:
        handle.remove()
    assert calls.count("Linear") >= 2 * 7  # q, k, v, o, gate, up, down in each layer


def test_transformers_output_capturing_hooks_are_not_changes():
    """transformers hooks layers and attention modules at the first call (idle unless asked):
    the converted modules keep their code (the fallback warning is an error here) and the
    hidden states match."""
    ref, ours = _llama().double(), _llama()
    _out(ours, output_hidden_states=True)  # the hooks are put in before the conversion
    ff.convert(ours)
    assert any(m._forward_hooks for m in ours.modules())
    a = ours(input_ids=_ids(), output_hidden_states=True).hidden_states
    b = ref(input_ids=_ids(), output_hidden_states=True).hidden_states
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        _close(x, y)


def test_convert_finds_models_inside_a_wrapper():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.lm = _bert(), _llama()

    ref, ours = Pair().double(), Pair()
    report = ff.convert(ours)
    paths = {path for path, *_ in report.replaced}
    assert "encoder.encoder.layer.0" in paths and "lm.model.layers.0.mlp" in paths
    assert ("lm", "LlamaForCausalLM", "attention: attn_implementation='fastformer'") in report.replaced
    _close(_out(ours.lm), _out(ref.lm))
    _close(_out(ours.encoder), _out(ref.encoder))


# ---- PEFT itself ---------------------------------------------------------------------------------
LORA_TARGETS = {"llama": ["q_proj", "v_proj", "gate_proj", "down_proj"], "bert": ["query", "value", "dense"],
                "gpt2": ["c_attn", "c_fc", "c_proj"]}


def _peft(model, name):
    peft = pytest.importorskip("peft", reason="PEFT is an optional test dependency")
    torch.manual_seed(11)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=LORA_TARGETS[name],
                                                      init_lora_weights=False))


@pytest.mark.parametrize("name", sorted(LORA_TARGETS))
@pytest.mark.parametrize("order", ["convert_then_lora", "lora_then_convert"])
def test_peft_lora_matches_unconverted(name, order):
    ref = _peft(MODELS[name](), name)
    if order == "convert_then_lora":
        base = MODELS[name]()
        ff.convert(base)
        ours = _peft(base, name)
    else:
        ours = _peft(MODELS[name](), name)
        report = ff.convert(ours)
        assert report.replaced, "the model inside the PeftModel is converted"
    # LoRA layers put in after the conversion: the MLPs run their original code, warned
    _matches(ours, ref, expect_warning=order == "convert_then_lora")
    assert any(p.grad is not None for n, p in ours.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("order", ["convert_then_lora", "lora_then_convert"])
def test_peft_lora_fused_loss(order):
    """With labels, the LM loss of a PeftModel around a converted Llama runs on
    ff.linear_cross_entropy (no logits returned); loss and LoRA gradients as unconverted."""
    ref = _peft(_llama(), "llama")
    if order == "convert_then_lora":
        base = _llama()
        ff.convert(base)
        ours = _peft(base, "llama")
    else:
        ours = _peft(_llama(), "llama")
        ff.convert(ours)
    ids = _ids()
    logits = []

    def loss(model):
        out = model(input_ids=ids, labels=ids)
        logits.append(out.logits)
        return out.loss
    _matches(ours, ref, loss, expect_warning=order == "convert_then_lora")
    assert logits[0] is None and logits[1] is not None


def test_lora_then_convert_reports_what_it_left():
    ours = _peft(_llama(), "llama")
    report = ff.convert(ours)
    left = {path: why for path, _, why in report.left}
    mlp = "base_model.model.model.layers.0.mlp"
    assert "not gate_proj / up_proj / down_proj linears" in left[mlp]
    replaced = {path for path, *_ in report.replaced}
    assert "base_model.model.model.layers.0.input_layernorm" in replaced


def test_lora_then_convert_leaves_a_module_reading_a_lora_layer():
    """GPT-2's MLP converter takes its Conv1D children by name: LoRA layers in their place are no
    Conv1D, and the conversion is undone for that MLP, with the reason."""
    ours = _peft(_gpt2(), "gpt2")
    report = ff.convert(ours)
    left = {path: why for path, _, why in report.left}
    mlp = "base_model.model.transformer.h.0.mlp"
    assert "peft.tuners.lora" in left[mlp] and "c_fc" in left[mlp]
    assert not [r for r in report.replaced if r[0] == mlp]



def test_compiled_converted_model_with_a_wrapped_part():
    """Under torch.compile the check is traced (fullgraph): the wrapped part's fallback runs."""
    torch._dynamo.reset()
    ref, ours = _llama(), _llama()
    ff.convert(ours)
    for m in (ref, ours):
        _wrap(m, "model.layers.0.mlp.gate_proj", (64, 96))
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    with torch.no_grad():
        _close(compiled(input_ids=_ids()).logits, ref.double()(input_ids=_ids()).logits)


@pytest.mark.parametrize("name", ["llama", "bert"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing(name, reentrant):
    """transformers' gradient checkpointing recomputes each converted layer in the backward."""
    ref, ours = MODELS[name](), MODELS[name]()
    ff.convert(ours)
    for m in (ref, ours):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    _matches(ours, ref, expect_warning=False)


def test_gradient_checkpointing_regenerates_dropout():
    """With dropout, a checkpointed converted BERT's gradients are the uncheckpointed one's: the
    recomputed forward draws the same masks (torch's RNG state is restored, and the kernels'
    Philox seeds come from it)."""
    def model():
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=96, hidden_dropout_prob=0.1,
                                         attention_probs_dropout_prob=0.1)
        m = transformers.BertForMaskedLM(config).train()
        ff.convert(m)
        return m
    plain, checkpointed = model(), model()
    checkpointed.gradient_checkpointing_enable()
    for m in (plain, checkpointed):
        torch.manual_seed(3)
        m(input_ids=_ids(), labels=_ids()).loss.backward()
    for (n, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_a_pickled_converted_model_loads_in_a_fresh_process(tmp_path):
    """Unpickling registers the attention and experts implementations the model names."""
    import subprocess
    import sys
    model = FAMILIES["mixtral"]()
    ff.convert(model)
    torch.save(model, tmp_path / "model.pt")
    with torch.no_grad():
        torch.save((_ids(), model(input_ids=_ids()).logits), tmp_path / "expected.pt")
    script = ("import torch; m = torch.load('model.pt', weights_only=False); ids, want = torch.load('expected.pt');"
              "assert m.config._attn_implementation == 'fastformer';"
              "assert torch.equal(m(input_ids=ids).logits, want)")
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True)


class _Batches(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(3, V, (17,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(17, dtype=torch.long)}


def test_trainer_with_lora_and_gradient_checkpointing(tmp_path):
    """transformers' Trainer, four steps of LoRA fine-tuning with gradient checkpointing: the
    converted model logs the unconverted one's losses (the loss on ff.linear_cross_entropy with
    num_items_in_batch; the MLPs over LoRA layers on their own code)."""
    pytest.importorskip("peft", reason="PEFT is an optional test dependency")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

    def losses(convert):
        model = _llama()
        if convert:
            ff.convert(model)
        model = _peft(model, "llama")
        args = transformers.TrainingArguments(str(tmp_path / str(convert)), per_device_train_batch_size=4, max_steps=4,
                                              learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True,
                                              gradient_checkpointing=True, save_strategy="no", seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Batches())
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=FALLBACK)  # LoRA put in after the conversion
            trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    ours, ref = losses(True), losses(False)
    assert len(ours) == len(ref) == 4
    assert ours == pytest.approx(ref, rel=1e-5)
