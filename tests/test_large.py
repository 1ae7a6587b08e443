"""64-bit index arithmetic.

Always run: views whose element offsets exceed 2^31 inside small, mostly untouched storages
(only the touched pages are ever allocated), through add+norm and attention.
Marked slow: add+norm over more than 2^31 elements for real (bf16, ~8.6 GB); it runs where
that much memory is free and is skipped with the reason otherwise.
"""
import pytest
import torch
import torch.nn.functional as F

import fastformer as ff

BIG = 2**31 + 64


def _free_bytes():
    try:
        with open("/proc/meminfo") as f:
            info = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f}
        return info.get("MemAvailable", 0)
    except OSError:
        return 0


def test_norm_rows_beyond_int32_offsets():
    storage = torch.empty(BIG + 256, dtype=torch.bfloat16)  # 4 GB virtual, ~0 resident
    x = storage.as_strided((2, 256), (BIG, 1))               # row 1 starts at element 2^31 + 64
    x[0] = torch.randn(256)
    x[1] = torch.randn(256)
    dense = x.clone()
    with ff.use_backend("cpu"):
        y = ff.layer_norm(x, None, None)
    torch.testing.assert_close(y.float(), F.layer_norm(dense.float(), (256,)), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y, ff.layer_norm(dense, None, None), atol=0, rtol=0)


def test_attention_batch_offsets_beyond_int32():
    L, D = 16, 8
    storage = torch.empty(BIG + L * D, dtype=torch.bfloat16)
    q = storage.as_strided((2, 1, L, D), (BIG, 0, D, 1))    # batch 1 at element 2^31 + 64
    q[0, 0] = torch.randn(L, D)
    q[1, 0] = torch.randn(L, D)
    k, v = torch.randn(2, 1, L, D, dtype=torch.bfloat16), torch.randn(2, 1, L, D, dtype=torch.bfloat16)
    dense = q.clone()
    with ff.use_backend("cpu"):
        out = ff.attention(q, k, v)
        expected = ff.attention(dense, k, v)
    assert torch.equal(out, expected)


@pytest.mark.slow
@pytest.mark.skipif(_free_bytes() < 14 * 2**30, reason="needs ~14 GiB of free memory")
def test_add_norm_over_2_pow_31_elements():
    rows, hidden = 2**21 + 3, 1024                         # 2.15e9 elements
    x = torch.empty(rows, hidden, dtype=torch.bfloat16)
    x.view(-1)[:hidden * 1024].normal_()
    x[1024:] = 1.5
    x[-1] = torch.arange(hidden, dtype=torch.bfloat16) / hidden
    with ff.use_backend("cpu"):
        y = ff.layer_norm(x, None, None)
    for r in (0, 1023, rows - 1):
        torch.testing.assert_close(y[r].float(), F.layer_norm(x[r].float(), (hidden,)), atol=2e-2, rtol=2e-2)
    assert torch.equal(y[2000], torch.zeros(hidden, dtype=torch.bfloat16))  # constant row
