"""Bitwise determinism across runs and thread counts, and concurrent calls.

The cpu backend is deterministic by construction (a thread count changes only which thread runs
a block, never how a sum is split): add+norm sums dw/db over fixed row blocks in
order; attention's forward tasks are independent rows; its backward splits keys into a number
of chunks that depends on the shape only and sums the dQ partials in chunk order; the FFN's GEMMs split output tiles over threads, never the
reduction dimension, and sum bias gradients over fixed row blocks in order.
"""
import threading

import pytest
import torch

import fastformer as ff


def _norm_step(x, r, w, b):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, r, w, b)]
    y, res = ff.add_layer_norm(*leaves, return_residual=True)
    gen = torch.Generator().manual_seed(5)
    (y * torch.randn(y.shape, generator=gen)).sum().backward()
    return [y.detach(), res.detach()] + [t.grad for t in leaves]


def _attention_step(q, k, v, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    torch.manual_seed(11)
    out = ff.attention(*leaves, **kw)
    gen = torch.Generator().manual_seed(6)
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


def _ffn_step(x, w1, b1, w2, b2, w_up=None, p=0.0):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None
              for t in (x, w1, b1, w2, b2, w_up)]
    x, w1, b1, w2, b2, w_up = leaves
    torch.manual_seed(12)
    y = (ff.swiglu_ffn(x, w1, w_up, w2, b1, None, b2) if w_up is not None
         else ff.ffn(x, w1, b1, w2, b2, activation="gelu", dropout_p=p))
    gen = torch.Generator().manual_seed(7)
    (y * torch.randn(y.shape, generator=gen)).sum().backward()
    return [y.detach()] + [t.grad for t in leaves if t is not None]


def _rotary_step(x):
    leaf = x.detach().clone().requires_grad_(True)
    rope = ff.RotaryEmbedding(x.shape[-1])
    y = rope(leaf)
    gen = torch.Generator().manual_seed(8)
    (y * torch.randn(y.shape, generator=gen)).sum().backward()
    return [y.detach(), leaf.grad]


CASES = {
    "ffn_gelu_dropout": lambda: _ffn_step(torch.randn(300, 96), torch.randn(200, 96), torch.randn(200),
                                          torch.randn(96, 200), torch.randn(96), p=0.1),
    "swiglu": lambda: _ffn_step(torch.randn(2, 150, 64), torch.randn(130, 64), torch.randn(130),
                                torch.randn(64, 130), torch.randn(64), torch.randn(130, 64)),
    "rotary": lambda: _rotary_step(torch.randn(2, 3, 77, 40)),
    "add_layer_norm": lambda: _norm_step(torch.randn(300, 257), torch.randn(300, 257),
                                         torch.randn(257), torch.randn(257)),
    "attention_causal_gqa": lambda: _attention_step(torch.randn(2, 4, 150, 40), torch.randn(2, 2, 170, 40),
                                                   torch.randn(2, 2, 170, 40), causal="bottom_right"),
    "attention_chunked_keys": lambda: _attention_step(torch.randn(1, 2, 64, 32), torch.randn(1, 1, 700, 32),
                                                     torch.randn(1, 1, 700, 32)),  # B*Hkv = 1: dQ partials
    "attention_dropout_mask": lambda: _attention_step(torch.randn(1, 2, 90, 16), torch.randn(1, 2, 90, 16),
                                                     torch.randn(1, 2, 90, 16), dropout_p=0.2,
                                                     attn_mask=torch.randn(90, 90)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bitwise_identical_across_runs_and_thread_counts(case):
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 1, 2):
            torch.set_num_threads(n)
            torch.manual_seed(0)
            with ff.use_backend("cpu"):
                results.append(CASES[case]())
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b), f"{case}: results differ between runs/thread counts"


def test_four_python_threads_at_once():
    torch.manual_seed(0)
    inputs = [(torch.randn(2, 4, 77, 32), torch.randn(2, 2, 93, 32), torch.randn(2, 2, 93, 32),
               torch.randn(64, 300), torch.randn(64, 300)) for _ in range(4)]
    expected = [(ff.attention(q, k, v, causal=True), ff.layer_norm(x + r, None, None))
                for q, k, v, x, r in inputs]
    results, errors = [None] * 4, []

    def work(i):
        try:
            q, k, v, x, r = inputs[i]
            for _ in range(20):
                results[i] = (ff.attention(q, k, v, causal=True), ff.add_layer_norm(x, r, None, None))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for (a, n), (ea, en) in zip(results, expected):
        assert torch.equal(a, ea) and torch.equal(n, en)
