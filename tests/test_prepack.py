"""ops/prepack.py (ff.convert(model, prepack_weights=True)): bf16 calls without a gradient on a
weight's blocked oneDNN copy, against the fp64 product by the error-ratio rule; the copy follows
every kind of weight update; the calls outside the rule never make a copy; converted models
(gated and plain MLPs, decode steps with a cache) match the fp64 oracle; bad arguments and CPUs
without the route are reported."""
import copy

import pytest
import torch
import torch.nn.functional as F
from oracle import LOWP_ATOL, OUT_FACTOR, assert_lowp_rule

import fastformer as ff
from fastformer.ops import linear as lin
from fastformer.ops import prepack

needs_route = pytest.mark.skipif(not prepack.available(),
                                 reason="the blocked-weight route runs on CPUs with AMX-BF16 only")


def _weights(out_f, in_f, bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16() if bias else None
    return w, b, g


def _copy_made(w) -> bool:
    return prepack._REGISTRY[w][3] is not None


@needs_route
@pytest.mark.parametrize("rows", [2, 17, 113, 203, 2047])
@pytest.mark.parametrize("in_f,out_f", [(40, 72), (80, 128), (128, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_fp64_product(rows, in_f, out_f, bias):
    w, b, g = _weights(out_f, in_f, bias, rows + in_f + out_f)
    prepack.register(w)
    x = torch.randn(rows, in_f, generator=g).bfloat16()
    with torch.no_grad():
        got = lin.linear(x.view(1, rows, in_f), w, b)
    # bf16 calls of up to 64 rows whose in features fill AMX tile rows are linear_rows.cpp's
    assert _copy_made(w) == (not lin.rows_kernel_takes(x, w, b)) and got.shape == (1, rows, out_f)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert_lowp_rule("y", got[0], want, F.linear(x, w, b), OUT_FACTOR, LOWP_ATOL[torch.bfloat16])


@needs_route
def test_the_copy_follows_weight_updates():
    lin_layer = torch.nn.Linear(48, 40).bfloat16()
    prepack.register(lin_layer.weight)
    x = torch.randn(9, 48).bfloat16()

    def check():
        with torch.no_grad():
            got = lin.linear(x, lin_layer.weight, lin_layer.bias)
            torch.testing.assert_close(got, F.linear(x, lin_layer.weight, lin_layer.bias), atol=0.05, rtol=0.02)

    check()
    with torch.no_grad():
        lin_layer.weight.add_(1.0)           # an optimizer step: the version counter
    check()
    lin_layer.weight.data = torch.randn(40, 48).bfloat16()  # new storage, same parameter
    check()
    lin_layer.load_state_dict({"weight": torch.randn(40, 48), "bias": torch.randn(40)})  # copy_
    check()
    lin_layer.float()                        # the dtype: fp32 calls take F.linear, no copy
    with torch.no_grad():
        y = lin.linear(x.float(), lin_layer.weight, lin_layer.bias)
    torch.testing.assert_close(y, F.linear(x.float(), lin_layer.weight, lin_layer.bias))
    assert prepack._REGISTRY[lin_layer.weight][2] == torch.bfloat16  # the fp32 call made none


@needs_route
def test_calls_outside_the_rule_make_no_copy():
    w, b, g = _weights(24, 32, True, 0)
    prepack.register(w)
    x = torch.randn(4, 32, generator=g).bfloat16()
    with torch.no_grad():
        lin.linear(x[:1], w, b)              # one row: csrc/cpu/linear_rows.cpp
        lin.linear(torch.randn(2048, 32).bfloat16(), w, b)  # 2048 rows: the plain GEMM
    assert not _copy_made(w)
    w32 = w.float()
    prepack.register(w32)
    with torch.no_grad():
        lin.linear(x.float(), w32, b.float())  # fp32: MKL's GEMM, not packed (module doc)
    assert not _copy_made(w32)
    wg = w.clone().requires_grad_()
    prepack.register(wg)
    y = lin.linear(x, wg, b)                 # a gradient to come
    y.float().sum().backward()
    assert not _copy_made(wg) and wg.grad is not None
    torch.testing.assert_close(wg.grad, torch.ones(24, 4).bfloat16() @ x)
    with torch.inference_mode():             # no version counter: the plain route
        w_inf = w.clone()
    prepack.register(w_inf)
    with torch.inference_mode():
        torch.testing.assert_close(lin.linear(x, w_inf, b), F.linear(x, w_inf, b))
    assert not _copy_made(w_inf)
    unregistered, _, _ = _weights(24, 32, False, 1)
    with torch.no_grad():
        lin.linear(x, unregistered)
    assert unregistered not in prepack._REGISTRY


@needs_route
@pytest.mark.parametrize("gated,activation", [(False, "relu"), (False, "gelu"), (False, "gelu_tanh"),
                                              (True, "silu"), (True, "gelu_tanh")])
@pytest.mark.parametrize("rows", [2, 113])
def test_prepacked_ffn_matches_fp64(gated, activation, rows):
    g = torch.Generator().manual_seed(rows)
    D, F_ = 40, 72
    x = torch.randn(rows, D, generator=g).bfloat16()
    w1, w_up, w2 = (torch.randn(*s, generator=g).mul(0.2).bfloat16() for s in ((F_, D), (F_, D), (D, F_)))
    b1, b_up, b2 = (torch.randn(n, generator=g).bfloat16() for n in (F_, F_, D))

    def call(*t):
        if gated:
            return ff.swiglu_ffn(t[0], t[1], t[2], t[3], t[4], t[5], t[6], activation=activation)
        return ff.ffn(t[0], t[1], t[4], t[3], t[6], activation)

    args = (x, w1, w_up, w2, b1, b_up, b2)
    for w in (w1, w_up, w2):
        prepack.register(w)
    with torch.no_grad():
        got = call(*args)
    assert _copy_made(w1) and _copy_made(w2) and _copy_made(w_up) == gated
    assert ff.last_dispatch().impl == "cpu.onednn (prepacked weights)"
    want = call(*(t.double() for t in args))
    low = _eager_ffn(gated, activation, *args)
    assert_lowp_rule("y", got, want, low, OUT_FACTOR, LOWP_ATOL[torch.bfloat16] * want.abs().max().item())


def _eager_ffn(gated, activation, x, w1, w_up, w2, b1, b_up, b2):
    """The bf16 FFN as eager PyTorch writes it (the error-ratio rule's torch_lowp)."""
    act = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
           "silu": F.silu}[activation]
    h = act(F.linear(x, w1, b1))
    if gated:
        h = h * F.linear(x, w_up, b_up)
    return F.linear(h, w2, b2)


transformers = pytest.importorskip("transformers", reason="needs transformers")


def _llama(**kw):
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager",
                                   **kw)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _bert():
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=96, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


def _out(o):
    return o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state


@needs_route
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_prepacked_model_matches_fp64_prompt_and_decode_step(family):
    """A bf16 prompt of 2 x 40 tokens (past the few-row kernel's 64 rows), then (Llama) one
    decode step of 2 sequences on the cache: every linear and the gated / GELU MLPs of the
    prompt on the blocked copies, within the error-ratio rule of the fp64 model; eager bf16 is
    the rule's torch_lowp."""
    model = _llama() if family == "llama" else _bert()
    report = ff.convert(copy.deepcopy(model).bfloat16(), prepack_weights=True)
    ours, low, exact = report.model, copy.deepcopy(model).bfloat16(), copy.deepcopy(model).double()
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert len(report.prepacked) == n_linear and "prepacked" in str(report)
    ids = torch.randint(2, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    atol = LOWP_ATOL[torch.bfloat16]
    with torch.no_grad():
        if family == "bert":
            got, lo, ref = (_out(m(input_ids=ids)) for m in (ours, low, exact))
            assert_lowp_rule("out", got, ref, lo, OUT_FACTOR, atol * ref.abs().max().item())
        else:
            caches = [transformers.DynamicCache() for _ in range(3)]
            got, ref, lo = (m(input_ids=ids, cache=c, use_cache=True).logits
                            for m, c in zip((ours, exact, low), caches))
            assert_lowp_rule("prompt logits", got, ref, lo, OUT_FACTOR, atol * ref.abs().max().item())
            step = torch.tensor([[7], [9]])
            got, ref, lo = (m(input_ids=step, cache=c, use_cache=True).logits
                            for m, c in zip((ours, exact, low), caches))
            assert_lowp_rule("decode logits", got, ref, lo, OUT_FACTOR, atol * ref.abs().max().item())
    assert prepack.copies_bytes() > 0
    # BERT's pooler reads the first token of each row, a strided view: F.linear's, not copied
    assert all(_copy_made(m.weight) for n, m in ours.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "pooler.dense")


@needs_route
def test_prepacked_model_trains_and_serves_the_updated_weights():
    """Training calls take the plain route (a gradient to come); after an optimizer step the
    inference forward reads copies remade from the new weights."""
    model = _llama()
    ours = ff.convert(copy.deepcopy(model).bfloat16(), prepack_weights=True).model
    plain = ff.convert(copy.deepcopy(model).bfloat16()).model
    ids = torch.randint(2, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    for m in (ours, plain):
        with torch.no_grad():
            m(input_ids=ids)               # copies made (ours)
        m.train()
        m(input_ids=ids, labels=ids).loss.backward()
        torch.optim.SGD(m.parameters(), lr=1.0).step()
        m.eval()
    for (n, p), q in zip(ours.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, msg=n, atol=0, rtol=0)  # the same step on both
    with torch.no_grad():
        got, want = ours(input_ids=ids).logits, plain(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0)
    stale_w = ours.model.layers[0].mlp.down_proj.weight
    assert prepack._REGISTRY[stale_w][0] == stale_w._version


def test_prepack_weights_argument_and_where_it_does_not_apply(monkeypatch):
    model = _llama()
    with pytest.raises(TypeError, match="prepack_weights"):
        ff.convert(model, prepack_weights=1)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    report = ff.convert(plain, prepack_weights=True)
    assert not report.prepacked and any("not a transformers model" in why for _, _, why in report.left)
    monkeypatch.setattr(prepack, "available", lambda: False)
    report = ff.convert(copy.deepcopy(model), prepack_weights=True)
    assert not report.prepacked and any("AMX-BF16" in why for _, _, why in report.left)
    assert report.model.model.layers[0].mlp.down_proj.weight not in prepack._REGISTRY


def test_prepacked_model_compiles_fullgraph_with_a_one_row_batch():
    """Compiled calls skip the registry (dynamo does not trace its weak dictionary) and the
    attention function's position-id restart search (data-dependent): a one-row bf16 batch with
    a cache, as the models benchmark runs it, compiles as one graph and matches eager."""
    torch._dynamo.reset()
    model = ff.convert(_llama().bfloat16(), prepack_weights=True).model
    ids = torch.randint(2, 100, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = torch.compile(model, fullgraph=True)(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)
