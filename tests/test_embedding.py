"""ops/embedding.py: the lookup and its gradient against F.embedding, eager and under a fullgraph
torch.compile (where the custom-op pair runs aten's backward), padding_idx (negative too) and
scale_grad_by_freq; opcheck of both ops; ff.convert's swap of transformers' nn.Embedding modules."""
import pytest
import torch
import torch.nn.functional as F

import fastformer as ff
from fastformer.ops.embedding import embedding


def _grads(fn, weight, ids, g):
    w = weight.detach().clone().requires_grad_(True)
    out = fn(ids, w)
    out.backward(g)
    return out.detach(), w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx,scale", [(None, False), (3, False), (-2, True)])
@pytest.mark.parametrize("compiled", [False, True])
def test_matches_f_embedding(dtype, padding_idx, scale, compiled):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(17, 40, generator=gen).to(dtype)
    ids = torch.randint(0, 17, (3, 113), generator=gen)
    ids[0, :5] = 3  # repeated ids, and the padding row
    ids[1, :4] = 15
    g = torch.randn(3, 113, 40, generator=gen).to(dtype)

    def ours(i, w):
        return embedding(i, w, padding_idx, scale)
    fn = torch.compile(ours, fullgraph=True, backend="aot_eager") if compiled else ours
    out, d_weight = _grads(fn, weight, ids, g)
    want, want_d = _grads(lambda i, w: F.embedding(i, w, padding_idx, scale_grad_by_freq=scale),
                          weight, ids, g)
    assert torch.equal(out, want)
    # the same aten kernel on the same inputs: the gradient is the same bit for bit
    assert torch.equal(d_weight, want_d)


def test_compiled_graphs_call_the_custom_ops():
    """The backward graph calls fastformer::embedding_backward, not a decomposed aten one."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    graphs = []

    def record(gm, _):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    weight = torch.randn(11, 8, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5))
    fn = torch.compile(lambda i: embedding(i, weight), fullgraph=True,
                       backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    fn(ids).sum().backward()
    assert len(graphs) == 2
    assert "fastformer.embedding.default" in graphs[0]
    assert "fastformer.embedding_backward.default" in graphs[1]
    assert not any("aten.embedding" in g for g in graphs)


def test_opcheck():
    weight, ids = torch.randn(11, 8), torch.randint(0, 11, (2, 5))
    torch.library.opcheck(torch.ops.fastformer.embedding, (weight, ids, -1, False))
    torch.library.opcheck(torch.ops.fastformer.embedding_backward,
                          (torch.randn(2, 5, 8), ids, 11, 2, True))


def test_convert_swaps_hf_embeddings():
    transformers = pytest.importorskip("transformers", reason="the conversion of HF models needs transformers")
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    report = ff.convert(model)
    assert ("model.embed_tokens", "Embedding",
            "ops/embedding.py (aten's embedding backward under torch.compile)") in report.replaced
