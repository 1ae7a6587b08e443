"""ops/linear.py (csrc/cpu/linear_rows.cpp): x @ W^T + b for the few-row calls of decoding,
against the fp64 product, across rows 1-100 (fp32; 1-8 bf16 / fp16), odd feature counts (vector
tails), biases, strided weight rows, weights stored in-major (a transposed view) and the dtypes it
takes; the calls it does not take return F.linear's result."""
import contextlib

import pytest
import torch
import torch.nn.functional as F
from oracle import LOWP_ATOL, OUT_FACTOR, assert_lowp_rule

import fastformer as ff
from fastformer.ops import linear as lin

pytestmark = pytest.mark.skipif(ff._ext.C is None or not hasattr(ff._ext.C, "linear_rows"),
                                reason="fastformer._C is not built")


# fp32 from 3 rows: the transposed form (x^T packed, weight scalars broadcast), chunks of 64 rows
# (avx512) / 16 (avx2), zero-padded vectors of rows, weight-row blocks and their tails.
@pytest.mark.parametrize("dtype,rows", [(dt, r) for dt in (torch.float32, torch.bfloat16, torch.float16)
                                        for r in (1, 2, 3, 5, 8)]
                         + [(torch.float32, r) for r in (9, 16, 17, 33, 64, 65, 100)])
@pytest.mark.parametrize("in_f,out_f", [(1, 1), (17, 203), (40, 113), (128, 72), (80, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_fp64_product(dtype, rows, in_f, out_f, bias):
    g = torch.Generator().manual_seed(rows * 1000 + in_f + out_f)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    w_full = torch.randn(out_f, in_f + 5, generator=g).to(dtype)
    w = w_full[:, 2:2 + in_f]  # row stride in_f + 5: strided rows, contiguous columns
    b = torch.randn(out_f, generator=g).to(dtype) if bias else None
    got = ff._ext.C.linear_rows(x, w, b)
    want = F.linear(x.double(), w.double(), b.double() if bias else None)
    assert got.dtype == dtype and got.shape == (rows, out_f)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, atol=1e-5 * (in_f ** 0.5), rtol=1e-5)
    else:  # one rounding of an fp32 sum: at or below torch's own low-precision error
        assert_lowp_rule("y", got, want, F.linear(x, w, b), OUT_FACTOR, LOWP_ATOL[dtype])


@contextlib.contextmanager
def _at_level(level):
    """The kernels of `level` for the block (skips where they are not built or the CPU lacks them)."""
    if level not in ff._ext.cpu_info()["built"] or level == "avx512" and ff._ext.cpu_info()["max_capability"] != "avx512":
        pytest.skip(f"the {level} kernels are not built or this CPU lacks them")
    before = ff._ext.cpu_level()
    ff._ext.set_cpu_capability(level)
    try:
        yield
    finally:
        ff._ext.set_cpu_capability(before)


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_transposed_form_at_each_level_matches_fp64(level):
    """The transposed form's blocks depend on the vector width: both levels, rows across
    their chunk sizes, against the fp64 product."""
    with _at_level(level):
        g = torch.Generator().manual_seed(7)
        # from 3 rows; x beyond L1 (3 x 5600, 8 x 2113) too
        for rows, in_f in ((3, 5600), (8, 2113), (9, 203), (15, 203), (16, 203), (31, 203), (32, 203),
                           (47, 203), (70, 203)):
            x, w, b = (torch.randn(*s, generator=g) for s in ((rows, in_f), (113, in_f), (113,)))
            torch.testing.assert_close(ff._ext.C.linear_rows(x, w, b).double(),
                                       F.linear(x.double(), w.double(), b.double()),
                                       atol=1e-5 * in_f ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("level", ["avx2", "avx512"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_in_major_form_matches_fp64_product(level, dtype):
    """Weights stored (in, out) and passed as their transpose (GPT-2's Conv1D, stacked experts):
    1-8 rows (the row passes of 1-2, the register strips of 3-8), odd in / out counts (vector
    and strip tails, in-blocks over threads), a row stride beyond out (a column slice), bias."""
    with _at_level(level):
        g = torch.Generator().manual_seed(11)
        for rows in range(1, 9):
            for in_f, out_f in ((2, 3), (17, 203), (203, 113), (40, 72), (130, 80), (1000, 17)):
                store = torch.randn(in_f, out_f + 9, generator=g).to(dtype)
                w = store[:, 4:4 + out_f].t()  # (out, in), column stride out_f + 9
                x = torch.randn(rows, in_f, generator=g).to(dtype)
                b = torch.randn(out_f, generator=g).to(dtype) if rows % 2 else None
                got = ff._ext.C.linear_rows(x, w, b)
                want = F.linear(x.double(), w.double(), None if b is None else b.double())
                assert got.dtype == dtype and got.shape == (rows, out_f)
                if dtype == torch.float32:
                    torch.testing.assert_close(got.double(), want, atol=1e-5 * in_f ** 0.5, rtol=1e-5)
                else:
                    assert_lowp_rule(f"y {rows}x{in_f}x{out_f}", got, want, F.linear(x, w, b), OUT_FACTOR,
                                     LOWP_ATOL[dtype])


def test_in_major_weights_take_the_kernel_by_the_measured_rule():
    from fastformer.ops import cpu_gemm
    level = ff._ext.cpu_level()
    w = torch.randn(1024, 2048).t()  # stored (in, out)
    wb = w.bfloat16()
    assert wb.stride(0) == 1
    most = lin.IN_MAJOR_MAX_ROWS.get(level, {})
    if not most:
        assert not lin.rows_kernel_takes(torch.randn(2, 1024), w, None)
        return
    assert lin.rows_kernel_takes(torch.randn(1, 1024), w, None) == (not cpu_gemm.mkl_on_intel())
    assert lin.rows_kernel_takes(torch.randn(most[torch.float32], 1024), w, None)
    assert not lin.rows_kernel_takes(torch.randn(most[torch.float32] + 1, 1024), w, None)
    assert lin.rows_kernel_takes(torch.randn(most[torch.bfloat16], 1024).bfloat16(), wb, None)
    assert not lin.rows_kernel_takes(torch.randn(most[torch.bfloat16] + 1, 1024).bfloat16(), wb, None)
    assert not lin.rows_kernel_takes(torch.randn(1, 1024).half(), w.half(), None)  # not measured
    odd = torch.randn(2048, 3072)[:, ::3]  # neither rows nor columns contiguous
    assert not lin.rows_kernel_takes(torch.randn(2, 1024), odd, None)
    with torch.no_grad():  # through linear(): the kernel's answer
        x = torch.randn(2, 1024)
        torch.testing.assert_close(lin.linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_kernel_refuses_more_than_8_reduced_precision_rows():
    with pytest.raises(RuntimeError, match="1..8 rows unless the weight is f32"):
        ff._ext.C.linear_rows(torch.randn(9, 32).half(), torch.randn(4, 32).half(), None)
    with pytest.raises(RuntimeError, match="1..8 rows unless the weight is f32"):  # not tile rows
        ff._ext.C.linear_rows(torch.randn(9, 40).bfloat16(), torch.randn(4, 40).bfloat16(), None)
    with pytest.raises(RuntimeError, match="1..8 rows unless the weight is f32 with contiguous rows"):
        ff._ext.C.linear_rows(torch.randn(9, 40), torch.randn(40, 4).t(), None)  # in-major: 1..8


@contextlib.contextmanager
def _bf16_form(form):
    """bf16 calls on AMX tiles ("amx") or AVX512-BF16 dot products ("dot", AMX off) for the block;
    skips where the CPU lacks the instructions."""
    with _at_level("avx512"):
        info = ff._ext.cpu_info()
        try:
            if form == "amx":
                ff._ext.set_cpu_amx(True)
            else:
                ff._ext.set_cpu_avx512_bf16(True)
                ff._ext.set_cpu_amx(False)
        except ValueError as exc:  # the switch refuses what the CPU does not have
            pytest.skip(f"this CPU cannot run bf16 on {form}: {exc}")
        try:
            yield
        finally:
            ff._ext.set_cpu_amx(info["amx_bf16"])
            ff._ext.set_cpu_avx512_bf16(info["avx512_bf16"])


@pytest.mark.parametrize("form", ["amx", "dot"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16, 17, 33, 64, 65, 100])
@pytest.mark.parametrize("in_f,out_f", [(32, 1), (64, 17), (96, 113), (128, 203), (512, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_amx_and_dot_forms_match_fp64_product(form, rows, in_f, out_f, bias):
    """bf16 weights read in place (strided rows here): on AMX as A tiles against x^T as pair-word
    panels (rows padded to 16), blocks of 32 / 16 weight rows and the zero-padded tail block; on
    AVX512-BF16 the dot form for 1-4 rows (8 / 4 / 2 weight rows per step, chunks of 8 rows of x)
    and from 5 rows 8-row dot blocks over the panels, tails of either."""
    g = torch.Generator().manual_seed(rows * 1000 + in_f + out_f)
    x = torch.randn(rows, in_f, generator=g).bfloat16()
    w = torch.randn(out_f, in_f + 32, generator=g).bfloat16()[:, 16:16 + in_f]
    b = torch.randn(out_f, generator=g).bfloat16() if bias else None
    with _bf16_form(form):
        got = ff._ext.C.linear_rows(x, w, b)
    want = F.linear(x.double(), w.double(), b.double() if bias else None)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_f)
    assert_lowp_rule("y", got, want, F.linear(x, w, b), OUT_FACTOR, LOWP_ATOL[torch.bfloat16])


def test_linear_uses_the_kernel_only_where_it_is_measured_faster():
    from fastformer.ops import cpu_gemm
    w = torch.randn(2048, 1024)  # 8 MiB of fp32 weights
    most = lin.max_rows(torch.float32)
    assert most == {"avx512": 64, "avx2": 32}.get(ff._ext.cpu_level(), 0)
    if most == 0:
        assert not lin.rows_kernel_takes(torch.randn(1, 1024), w, None)  # default level: never
        return
    fewest = 4 if cpu_gemm.mkl_on_intel() else 1  # MKL on Intel: 1-3 rows and small weights torch's
    assert lin.min_rows(torch.float32) == fewest
    assert lin.rows_kernel_takes(torch.randn(fewest, 1024), w, None)
    assert not lin.rows_kernel_takes(torch.randn(fewest - 1, 1024), w, None)
    assert lin.rows_kernel_takes(torch.randn(most, 1024), w, None)
    assert not lin.rows_kernel_takes(torch.randn(most + 1, 1024), w, None)  # more rows: GEMM
    assert lin.rows_kernel_takes(torch.randn(fewest, 1024), w[:1024], None) == (not cpu_gemm.mkl_on_intel())
    small = torch.randn(64, 32)
    assert lin.rows_kernel_takes(torch.randn(fewest, 32), small, None) == (not cpu_gemm.mkl_on_intel())
    w = small
    wb = w.bfloat16()
    assert lin.rows_kernel_takes(torch.randn(1, 32).bfloat16(), wb, None)
    if ff._ext.amx_in_use() or ff._ext.bf16_dot_in_use():  # up to 64 rows, in features a multiple of 32
        assert lin.max_rows(torch.bfloat16) == 64
        assert lin.rows_kernel_takes(torch.randn(64, 32).bfloat16(), wb, None)
        assert not lin.rows_kernel_takes(torch.randn(65, 32).bfloat16(), wb, None)
        w40 = torch.randn(8, 40).bfloat16()
        assert not lin.rows_kernel_takes(torch.randn(2, 40).bfloat16(), w40, None)
    elif not cpu_gemm.fast_lowp_gemm(torch.bfloat16):  # torch's bf16 GEMM is generic code here
        assert lin.max_rows(torch.bfloat16) == lin.SLOW_LOWP_MAX_ROWS == 8
        assert lin.rows_kernel_takes(torch.randn(8, 32).bfloat16(), wb, None)
        assert lin.rows_kernel_takes(torch.randn(3, 40).bfloat16(), torch.randn(8, 40).bfloat16(), None)
        assert not lin.rows_kernel_takes(torch.randn(9, 32).bfloat16(), wb, None)
    else:
        assert not lin.rows_kernel_takes(torch.randn(2, 32).bfloat16(), wb, None)
    assert not lin.rows_kernel_takes(torch.randn(1, 32).double(), w.double(), None)
    w = torch.randn(2048, 1024)
    assert not lin.rows_kernel_takes(torch.randn(fewest, 512), w[:, ::2], None)  # column stride 2


def test_linear_with_autograd_is_f_linear_and_has_gradients():
    x = torch.randn(2, 1, 24, requires_grad=True)
    w = torch.randn(40, 24, requires_grad=True)
    y = lin.linear(x, w)
    assert y.grad_fn is not None
    y.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(2, 1, 24))
    with torch.no_grad():
        got = lin.linear(x, w, torch.zeros(40))
    torch.testing.assert_close(got, F.linear(x, w).detach(), atol=1e-5, rtol=1e-5)
    assert got.shape == (2, 1, 40)


def test_converted_llama_decode_step_runs_the_kernel(monkeypatch):
    """ff.convert's nn.Linear and MLP take the kernel for a decode step (parameters included),
    and the logits match the unconverted model's (the rule of CPUs whose torch GEMM is not
    Intel's MKL: from one row, any weight size)."""
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    from fastformer.ops import cpu_gemm
    monkeypatch.setattr(cpu_gemm, "mkl_on_intel", lambda: False)
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ours = ff.convert(model, inplace=False).model
    calls = []
    real = ff._ext.C.linear_rows
    monkeypatch.setattr(ff._ext.C, "linear_rows", lambda *a: calls.append(1) or real(*a), raising=False)
    ids = torch.tensor([[5]])
    with torch.no_grad():
        got, want = ours(ids).logits, model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 * (4 + 3) + 1  # per layer q, k, v, o and the MLP's three; the LM head
