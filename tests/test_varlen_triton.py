"""Packed sequences (ff.varlen_attention, FlashAttention's varlen layout) on the triton backend,
under Triton's interpreter (conftest sets TRITON_INTERPRET=1), against the oracle of
tests/test_varlen.py (_compare_varlen: each sequence alone through the eager oracle, fp32 vs
fp64 at 1e-5 / 1e-4, fp16/bf16 by the error-ratio rule), and dropout against the reference
backend's stream (reference/varlen.py). Some tests shrink the interpreter's blocks so that a
sequence spans several query and key blocks, and a band cuts them.
"""
import pytest
import torch
from oracle import check, row_sum_tol
from test_varlen import _compare_varlen, _cu, _oracle_varlen, _ours, _packed

import fastformer as ff
from fastformer import backends
from fastformer.ops.attention import ATTENTION, AttentionOptions

pytest.importorskip("triton")
tk = pytest.importorskip("fastformer.triton_kernels.attention")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 and 32 (mixed, as GPU configs): sequences of 17..203 rows start inside a
    block and span several."""
    monkeypatch.setitem(tk.INTERPRETER_CONFIGS, "fwd", dict(BLOCK_M=32, BLOCK_N=16))
    monkeypatch.setitem(tk.INTERPRETER_CONFIGS, "dkdv", dict(BLOCK_M=16, BLOCK_N=32))
    monkeypatch.setitem(tk.INTERPRETER_CONFIGS, "dq", dict(BLOCK_M=32, BLOCK_N=16))


LENGTHS = [
    ([1, 203, 0, 17], [1, 203, 0, 17]),      # an empty sequence among others
    ([3, 17, 60], [40, 17, 200]),            # cross attention: more keys than queries
    ([7, 0, 9], [7, 4, 0]),                  # keys without queries, queries without keys
]


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: "-".join(map(str, x[0])))
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_triton_matches_each_sequence_alone(lengths, causal):
    q_lens, k_lens = lengths
    _compare_varlen("triton", q_lens, k_lens, 4, 2, 40, F32, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_triton_many_blocks_per_sequence(small_blocks, causal):
    _compare_varlen("triton", [3, 17, 60], [40, 17, 200], 4, 2, 40, F32, causal=causal)


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_varlen_triton_head_dim_128(dtype):
    _compare_varlen("triton", [1, 113, 17], [1, 113, 17], 4, 2, 128, dtype, causal=True)


OPTIONS = ["window", "window_causal", "softcap", "alibi_heads", "alibi_sequences", "sinks"]


@pytest.mark.parametrize("option", OPTIONS)
def test_varlen_triton_options(small_blocks, option):
    """Each option on its own (causal, bottom-right per sequence, but the first window) with
    its gradient for the sinks; d = Lk - Lq differs between the sequences."""
    q_lens, k_lens, H = [17, 90, 1], [30, 90, 1], 4
    kw = {"window": dict(window=(5, 2)), "window_causal": dict(window=(20, 0)),
          "softcap": dict(softcap=3.0),
          "alibi_heads": dict(alibi=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
          "alibi_sequences": dict(alibi=torch.rand(3, H, generator=torch.Generator().manual_seed(1))),
          "sinks": dict(sinks=torch.randn(H, generator=torch.Generator().manual_seed(2)))}[option]
    _compare_varlen("triton", q_lens, k_lens, H, 2, 40, F32, causal=option != "window", **kw)


def _dropout_run(backend, q, k, v, go, cu_q, cu_k, max_q, max_k, sinks, **kw):
    torch.manual_seed(7)
    with ff.use_backend(backend):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        out = ff.varlen_attention(*leaves[:3], cu_q, cu_k, max_q, max_k, sinks=leaves[3],
                                  dropout_p=0.3, **kw)
        assert ff.last_dispatch().backend == backend
        return (out.detach(), *torch.autograd.grad(out, leaves, go))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_triton_dropout_matches_the_reference_stream(causal):
    """Same torch.manual_seed, same keep masks: sequence s's stream starts after the earlier
    sequences' H * Lq * Lk elements (an empty sequence and one without keys included)."""
    q_lens, k_lens, H = [17, 0, 40, 5], [30, 6, 40, 0], 4
    q, k, v, go = _packed(q_lens, k_lens, H, 2, 40, F32)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(3))
    got = {b: _dropout_run(b, q, k, v, go, cu_q, cu_k, 40, 40, sinks, causal=causal)
           for b in ("triton", "reference")}
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got["triton"], got["reference"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert (got["triton"][0] == 0).any(), "dropout dropped nothing"


def test_varlen_triton_strided_views_and_the_custom_op_route(monkeypatch):
    """(T, H, D) rows viewed from (1, H, T, D) tensors (Hugging Face's packed batch) run without
    copies and give what contiguous rows give, eagerly and through the custom ops."""
    q_lens, k_lens = [5, 30, 0, 9], [12, 30, 3, 9]
    q, k, v, go = _packed(q_lens, k_lens, 4, 2, 40, F32)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    kw = dict(causal=True, sinks=torch.randn(4))
    contiguous = _ours("triton", q, k, v, go, cu_q, cu_k, q_lens, k_lens, **kw)
    rows = lambda t: t.transpose(0, 1).contiguous()[None][0].transpose(0, 1)  # noqa: E731
    assert not rows(q).is_contiguous()
    monkeypatch.setenv("FASTFORMER_EAGER_VIA_OPS", "1")
    ff.backends.reload_env()
    try:
        viewed = _ours("triton", *map(rows, (q, k, v, go)), cu_q, cu_k, q_lens, k_lens, **kw)
    finally:
        monkeypatch.delenv("FASTFORMER_EAGER_VIA_OPS")
        ff.backends.reload_env()
    for a, b in zip(contiguous, viewed):
        assert torch.equal(a, b)


def test_varlen_triton_dispatch_and_declines():
    q, k, v, _ = _packed([4, 9], [4, 9], 2, 2, 16, F32)
    cu = _cu([4, 9])
    with ff.use_backend("triton"):
        ff.varlen_attention(q, k, v, cu, cu, 9, 9, causal=True)
    assert ff.last_dispatch().backend == "triton"
    (impl,) = backends.implementations("attention", "triton")
    assert {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"} <= impl.options
    assert not {"seqlens_k", "block_table"} & impl.options  # the KV cache: not yet
    o = AttentionOptions(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9, max_seqlen_k=9,
                         key_padding_mask=torch.zeros(2, 13, dtype=torch.bool))
    why = impl.reasons(ATTENTION.call((q, k, v), o))
    assert any("`key_padding_mask` with packed sequences" in w for w in why), why


# ---- the compiled kernels on a GPU -----------------------------------------------------------
# `TRITON_INTERPRET=0 pytest -m gpu tests` (benchmarks/gpu_check.sh), as test_attention_triton.py:
# one fixed config per kernel instead of autotuning.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_gpu_varlen(monkeypatch, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if tk.interpreter_mode():
        pytest.skip("TRITON_INTERPRET=1 interprets the kernels; run with TRITON_INTERPRET=0")
    monkeypatch.setattr(tk, "kernel_and_config", tk.fixed_config)
    gpu_case("cuda", dtype)


def gpu_case(device, dtype):
    """Every packed option at once (causal window, softcap, ALiBi per sequence, sinks), GQA,
    D = 128, sequences of 0..411 rows: ours on `device`, the oracle on CPU."""
    q_lens, k_lens, H, Hkv, D = [1, 300, 0, 17, 129], [1, 300, 5, 411, 129], 8, 2, 128
    q, k, v, go = _packed(q_lens, k_lens, H, Hkv, D, dtype)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(2))
    slopes = torch.rand(len(q_lens), H, generator=torch.Generator().manual_seed(1)) * 0.1
    kw = dict(causal=True, window=(100, 0), softcap=10.0)
    ours = _ours("triton", *(t.to(device) for t in (q, k, v, go, _cu(q_lens), _cu(k_lens))),
                 q_lens, k_lens, sinks=sinks.to(device), alibi_slopes=slopes.to(device), **kw)
    okw = dict(kw, causal="bottom_right")

    def oracle(dt):
        leaves = [t.to(dt).requires_grad_(True) for t in (q, k, v, sinks)]
        out, lse = _oracle_varlen(*leaves[:3], q_lens, k_lens, dt, alibi=slopes, sinks=leaves[3],
                                  **okw)
        return (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, go.to(dt)))
    ref, low = oracle(torch.float64 if dtype == F32 else F32), oracle(dtype)
    for name, o, r, lo in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], ours, ref, low):
        o = o.cpu()
        if name == "lse":
            finite = torch.isfinite(r)
            assert torch.equal(torch.isfinite(o), finite), "lse: rows without keys must be +inf"
            torch.testing.assert_close(o[finite].double(), r[finite].double(), atol=2e-3,
                                       rtol=1e-3 if dtype != F32 else 1e-5)
            continue
        tol = {"out": 1e-5, "dsinks": row_sum_tol(1e-4, sum(q_lens))}.get(name, 1e-4)
        check(name, o, r.to(o.dtype) if o.dtype == F32 else r, lo, grad=name != "out",
              atol=tol, rtol=tol)
