"""The cuda backend (csrc/cuda) against the reference, two ways:

* on a GPU (``@pytest.mark.gpu``, skipped on CPU): every cuda-backend op through the public API
  (attention fwd/bwd, add+norm) and the FFN epilogues through fastformer._C, with the
  numerical policy of tests/oracle.py;
* on CPU, the same attention and FFN-epilogue launchers compiled with the system C++ compiler
  against a warp emulator (tests/cpp/emu: every thread a fiber, ldmatrix/mma/shuffles as warp
  collectives with PTX's fragment layouts, random scheduling, NaN-filled shared memory), so
  the kernels' indexing, masking and synchronization are exercised where there is no GPU.
"""
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from oracle import check, row_sum_tol

import fastformer as ff
from fastformer import _ext
from fastformer.ops.attention import AttentionOptions
from fastformer.reference import attention as ref

ROOT = Path(__file__).resolve().parents[1]
LOWP = [torch.float16, torch.bfloat16]
CAUSAL = {0: False, 1: "top_left", 2: "bottom_right"}
NO_WINDOW = (-1, -1)  # (window_left, window_right); -1: no limit on that side
ACTIVATIONS = {0: F.relu, 1: F.gelu, 2: lambda x: F.gelu(x, approximate="tanh"), 3: F.silu,
               4: lambda x: x * torch.sigmoid(1.702 * x), 5: lambda x: F.relu(x).square()}
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # fastformer::DType
gpu = pytest.mark.gpu


# ---- attention cases and oracles ------------------------------------------------------------
def attention_inputs(dtype, D, B, H, Hkv, Lq, Lk, pad, device="cpu", seed=0):
    """q as a (B, Lq, H, D) buffer seen as (B, H, Lq, D) (what multi-head attention passes),
    k, v slices of one packed (B, Hkv, Lk, 2, D) buffer (k._base), dout; key padding with
    batch 1 (if any) fully padded and key 0 of batch 0 padded (row 0 has no key under top-left
    causal)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, H, D, generator=g).to(dtype).transpose(1, 2)
    kv = torch.randn(B, Hkv, Lk, 2, D, generator=g).to(dtype)
    k, v = kv[..., 0, :], kv[..., 1, :]
    dout = torch.randn(B, H, Lq, D, generator=g).to(dtype)
    kpm = None
    if pad:
        kpm = torch.rand(B, Lk, generator=g) < 0.25
        kpm[0, 0] = True
        if B > 1:
            kpm[1] = True
    if device != "cpu":
        q = q.transpose(1, 2).to(device).transpose(1, 2)
        kv = kv.to(device)
        k, v = kv[..., 0, :], kv[..., 1, :]
        dout, kpm = dout.to(device), None if kpm is None else kpm.to(device)
    return q, k, v, dout, kpm


class _RoundTo(torch.autograd.Function):
    """Round to a low-precision dtype and back, in the forward and in the backward."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


def eager_attention(q, k, v, kpm, causal, scale, rnd=lambda t: t, window=NO_WINDOW, softcap=0.0):
    """What a PyTorch user writes; rnd(t) rounds each op's result (see eager_lowp_grads)."""
    H, Hkv, Lq, Lk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = rnd(rnd(q @ k.transpose(-1, -2)) * scale)
    if softcap:
        s = rnd(softcap * rnd(torch.tanh(rnd(s / softcap))))
    allowed = ref.allowed_mask(q.shape[0], H, Lq, Lk, None, kpm, causal, q.device, *window)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)  # rows without a key (also when Lk = 0)
    p = rnd(torch.softmax(s.masked_fill(empty, 0.0), -1)).masked_fill(empty, 0.0)
    return rnd(p @ v)


def eager_lowp_grads(q, k, v, dout, kpm, causal, scale, window=NO_WINDOW, softcap=0.0):
    """(out, dq, dk, dv) of eager attention in q's low precision (the policy's torch_lowp). On
    CPU, where fp16/bf16 matmuls are slow, the same thing as fp32 math rounded to the dtype after
    every op and every op's gradient (what the low-precision kernels do: fp32 accumulation, one
    rounding of each result)."""
    dtype = q.dtype
    if q.is_cuda:
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = eager_attention(*leaves, kpm, causal, scale, window=window, softcap=softcap)
    else:
        leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
        out = eager_attention(*leaves, kpm, causal, scale, lambda t: _RoundTo.apply(t, dtype),
                              window, softcap)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return tuple(t.detach().to(dtype) for t in (out, *grads))


def attention_options(causal, scale, kpm, window=NO_WINDOW, softcap=0.0):
    return AttentionOptions(causal=causal, scale=scale, key_padding_mask=kpm,
                            window_left=window[0], window_right=window[1], softcap=softcap)


def check_attention(ours, q, k, v, dout, kpm, causal, scale, window=NO_WINDOW, softcap=0.0):
    """ours = (out, lse or None, dq, dk, dv); oracle: the fp32 reference, torch_lowp: eager."""
    f32 = [t.float() for t in (q, k, v, dout)]
    o = attention_options(causal, scale, kpm, window, softcap)
    out32, lse32 = ref.attention_fwd(*f32[:3], o)
    grads32 = ref.attention_bwd(f32[3], *f32[:3], out32, lse32, o)
    lowp = eager_lowp_grads(q, k, v, dout, kpm, causal, scale, window, softcap)
    out, lse, *grads = ours
    check("out", out, out32, lowp[0])
    if lse is not None:
        assert torch.equal(torch.isinf(lse), torch.isinf(lse32)), "rows without keys: lse = +inf"
        finite = torch.isfinite(lse32)
        torch.testing.assert_close(lse[finite], lse32[finite], atol=1e-4, rtol=1e-5)
    for name, g, g32, g_lowp in zip(("dq", "dk", "dv"), grads, grads32, lowp[1:]):
        check(name, g, g32, g_lowp, grad=True)


# ---- GPU: the backend through the public API -------------------------------------------------
def _need_cuda_backend():
    if not _ext.has_cuda_kernels():
        pytest.skip("fastformer._C was built without CUDA kernels")


@gpu
@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Lq,Lk", [(113, 203), (203, 113)])
@pytest.mark.parametrize("causal", [0, 1, 2])
@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("Hkv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attention_gpu(dtype, D, Lq, Lk, causal, pad, Hkv):
    _need_cuda_backend()
    q, k, v, dout, kpm = attention_inputs(dtype, D, 2, 4, Hkv, Lq, Lk, pad, device="cuda")
    scale = D ** -0.5
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with ff.use_backend("cuda"):
        out = ff.attention(*leaves, causal=CAUSAL[causal], key_padding_mask=kpm)
        assert ff.last_dispatch().backend == "cuda"
        grads = torch.autograd.grad(out, leaves, dout)
    _, lse = _ext.C.cuda_attention_fwd(q, k, v, AttentionOptions(causal=causal, scale=scale,
                                                                key_padding_mask=kpm))
    check_attention((out.detach(), lse, *grads), q, k, v, dout, kpm, causal, scale)


@gpu
@pytest.mark.parametrize("case", ["gqa_long", "decode", "misaligned_view", "lk_zero"])
def test_attention_gpu_shapes(case):
    _need_cuda_backend()
    dtype, causal = torch.bfloat16, 2
    if case == "gqa_long":      # many key/query blocks on both sides, 4 query heads per kv head
        q, k, v, dout, kpm = attention_inputs(dtype, 128, 2, 8, 2, 1031, 1500, True, "cuda")
        causal = 1
    elif case == "decode":      # one query row against a KV cache
        q, k, v, dout, kpm = attention_inputs(dtype, 64, 3, 4, 2, 1, 203, False, "cuda")
    elif case == "misaligned_view":  # an odd offset: the glue copies it once
        q, k, v, dout, kpm = attention_inputs(dtype, 64, 1, 2, 2, 40, 77, True, "cuda")
        base = torch.randn(1 * 2 * 40 * 64 + 3, dtype=dtype, device=q.device)
        q = base[3:].view(1, 2, 40, 64).copy_(q)
    else:                       # no keys at all: zeros, lse = +inf
        q, k, v, dout, kpm = attention_inputs(dtype, 64, 1, 2, 2, 17, 0, False, "cuda")
    scale = q.shape[-1] ** -0.5
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with ff.use_backend("cuda"):
        out = ff.attention(*leaves, causal=CAUSAL[causal], key_padding_mask=kpm)
        grads = torch.autograd.grad(out, leaves, dout)
    _, lse = _ext.C.cuda_attention_fwd(q, k, v, AttentionOptions(causal=causal, scale=scale,
                                                                key_padding_mask=kpm))
    check_attention((out.detach(), lse, *grads), q, k, v, dout, kpm, causal, scale)


# (Lq, Lk, causal, window, softcap): windows of 0 and 1, one-sided, two-sided, wider than the
# sequences, under every causal alignment (causal keeps right = 0 whatever the window says) and
# Lq != Lk both ways; softcap alone and with a window.
GPU_VARIANTS = [
    (203, 113, 0, (0, 0), 0.0),
    (113, 203, 0, (1, 1), 0.0),
    (113, 203, 1, (17, -1), 0.0),
    (203, 113, 2, (1, -1), 0.0),       # rows 0..89 see no key
    (113, 203, 0, (-1, 5), 0.0),
    (203, 113, 0, (40, 70), 0.0),
    (113, 203, 1, (10, 7), 0.0),
    (1031, 1500, 2, (256, -1), 0.0),   # most key blocks skipped by every query block
    (113, 203, 2, (1000, 1000), 0.0),  # wider than the sequences: causality alone
    (113, 203, 0, NO_WINDOW, 5.0),
    (203, 113, 1, NO_WINDOW, 0.75),    # scores well into tanh's saturation
    (113, 203, 2, (64, 0), 2.5),
]


@gpu
@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Lq,Lk,causal,window,softcap", GPU_VARIANTS, ids=str)
@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
def test_attention_gpu_window_softcap(dtype, D, Lq, Lk, causal, window, softcap, pad):
    _need_cuda_backend()
    q, k, v, dout, kpm = attention_inputs(dtype, D, 2, 4, 2, Lq, Lk, pad, device="cuda")
    scale = D ** -0.5
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with ff.use_backend("cuda"):
        out = ff.attention(*leaves, causal=CAUSAL[causal], key_padding_mask=kpm,
                           window=None if window == NO_WINDOW else window,
                           softcap=softcap or None)
        assert ff.last_dispatch().backend == "cuda"
        grads = torch.autograd.grad(out, leaves, dout)
    _, lse = _ext.C.cuda_attention_fwd(q, k, v, attention_options(causal, scale, kpm, window,
                                                                  softcap))
    check_attention((out.detach(), lse, *grads), q, k, v, dout, kpm, causal, scale, window,
                    softcap)


@gpu
def test_attention_gpu_falls_back_for_unsupported():
    _need_cuda_backend()
    q = torch.randn(1, 2, 16, 80, device="cuda", dtype=torch.float16)
    ff.attention(q, q, q)
    assert ff.last_dispatch().backend != "cuda"
    assert "head_dim 80" in str(ff.last_dispatch())


@gpu
@pytest.mark.parametrize("dtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 7), (17, 1000), (4096, 384), (33, 8192)])
@pytest.mark.parametrize("mode", ["add_layer_norm", "add_rms_norm", "layer_norm", "rms_norm"])
def test_add_norm_gpu(dtype, rows, hidden, mode):
    _need_cuda_backend()
    g = torch.Generator().manual_seed(0)
    x, r, gy, gr = (torch.randn(rows, hidden, generator=g).to(dtype).cuda() for _ in range(4))
    w = (torch.randn(hidden, generator=g) * 0.5 + 1).to(dtype).cuda()
    b = (torch.randn(hidden, generator=g) * 0.1).to(dtype).cuda()
    residual = mode.startswith("add")
    inputs = {"x": x, "residual": r if residual else None, "weight": w,
              "bias": None if "rms" in mode else b}
    used = [n for n, t in inputs.items() if t is not None]

    def ours(x, residual=None, weight=None, bias=None):
        with ff.use_backend("cuda"):
            if mode == "add_layer_norm":
                return ff.add_layer_norm(x, residual, weight, bias, return_residual=True)
            if mode == "layer_norm":
                return ff.layer_norm(x, weight, bias), None
            if mode == "add_rms_norm":
                return ff.rms_norm(x, weight, residual=residual, return_residual=True)
            return ff.rms_norm(x, weight), None

    def eager(x, residual=None, weight=None, bias=None):
        z = x + residual if residual is not None else x
        if "rms" in mode:
            return F.rms_norm(z, (hidden,), weight, 1e-6), (z if residual is not None else None)
        return F.layer_norm(z, (hidden,), weight, bias, 1e-5), (z if residual is not None else None)

    def run(fn, cast):
        leaves = {n: cast(inputs[n]).detach().clone().requires_grad_(True) for n in used}
        y, res = fn(**leaves)
        loss = (y.double() * gy.double()).sum()
        if res is not None:
            loss = loss + (res.double() * gr.double()).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
        return {"y": y.detach(), **dict(zip(used, grads))}

    got = run(ours, lambda t: t)
    oracle = run(eager, lambda t: t.double() if dtype == torch.float32 else t.float())
    lowp = run(eager, lambda t: t) if dtype != torch.float32 else {}
    for name, o in got.items():
        tol = row_sum_tol(2e-5, rows) if name in ("weight", "bias") else 1e-5
        check(name, o, oracle[name], lowp.get(name), grad=name != "y", atol=tol, rtol=tol)


# ---- FFN epilogues (oracle: torch autograd) ---------------------------------------------------
def ffn_oracle(act, a, b, c, bias, dtype):
    """(y, dx, dbias, h, dgate, dup) of: y = act(a + bias) with upstream b, and
    h = act(a) * b with upstream c, computed by torch autograd in dtype."""
    fn = ACTIVATIONS[act]
    A, B, C = (t.to(dtype) for t in (a, b, c))
    leaves = [A.clone().requires_grad_(True), bias.to(dtype).requires_grad_(True)]
    y = fn(leaves[0] + leaves[1])
    dx, dbias = torch.autograd.grad(y, leaves, B)
    gate, up = A.clone().requires_grad_(True), B.clone().requires_grad_(True)
    h = fn(gate) * up
    dgate, dup = torch.autograd.grad(h, (gate, up), C)
    return y.detach(), dx, dbias, h.detach(), dgate, dup


def check_ffn(ours, act, a, b, c, bias):
    dtype = a.dtype
    oracle_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    oracle = ffn_oracle(act, a, b, c, bias, oracle_dtype)
    lowp = ffn_oracle(act, a, b, c, bias, dtype) if dtype != torch.float32 else [None] * 6
    rows = a.numel() // a.shape[-1]
    for name, o, e, lp in zip(("y", "dx", "dbias", "h", "dgate", "dup"), ours, oracle, lowp):
        tol = row_sum_tol(1e-5, rows) if name == "dbias" else 1e-5
        check(name, o, e.to(o.device), None if lp is None else lp.to(o.device),
              grad=name not in ("y", "h"), atol=tol, rtol=tol)


FFN_SHAPES = [(37, 100, 100), (33, 1000, 1000), (17, 1003, 1010), (40, 7, 9), (64, 384, 392),
              (5, 3000, 3000)]  # (rows, cols, row stride): vector and element paths


def ffn_inputs(dtype, rows, cols, stride, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, b, c = ((torch.randn(rows, stride, generator=g) * 2).to(dtype) for _ in range(3))
    bias = torch.randn(cols, generator=g).to(dtype)
    return a, b, c, bias


@gpu
@pytest.mark.parametrize("dtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("act", sorted(ACTIVATIONS), ids=["relu", "gelu", "gelu_tanh", "silu", "quick_gelu", "relu2"])
@pytest.mark.parametrize("rows,cols,stride", FFN_SHAPES)
def test_ffn_epilogues_gpu(dtype, act, rows, cols, stride):
    _need_cuda_backend()
    if not hasattr(_ext.C, "ffn_bias_act_fwd"):
        pytest.skip("the FFN epilogues are not bound in fastformer._C yet")
    a, b, c, bias = (t.cuda() for t in ffn_inputs(dtype, rows, cols, stride))
    a, b, c = a[:, :cols], b[:, :cols], c[:, :cols]  # rows `stride` apart
    y = _ext.C.ffn_bias_act_fwd(a, bias, act)
    dx, dbias = _ext.C.ffn_bias_act_bwd(b, a, bias, act, True)
    h = _ext.C.ffn_gated_act_fwd(a, b, act)
    dgate, dup = _ext.C.ffn_gated_act_bwd(c, a, b, act)
    check_ffn((y, dx, dbias, h, dgate, dup), act, a, b, c, bias)


# ---- CPU: the same kernels under the warp emulator -------------------------------------------
CXX = shutil.which("c++") or shutil.which("g++")


def _cuda_include():
    """The CUDA headers' directory, searched as .ci/nvcc_check.sh does."""
    nvcc = shutil.which(os.environ.get("NVCC", "nvcc"))
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda",
                 nvcc and str(Path(nvcc).resolve().parent.parent)):
        if cand and Path(cand, "include", "cuda_runtime.h").exists():
            return Path(cand, "include")
    return None


def emu_source(src: str) -> str:
    """A .cu file as C++ for the emulator: `k<<<grid, block, smem, stream>>>(args)` becomes
    ::emu::launch(k, grid, block, smem, stream, args), dynamic shared memory a pointer."""
    src = re.sub(r"extern __shared__ __align__\(16\) unsigned char (\w+)\[\];",
                 r"unsigned char* \1 = ::emu::dynamic_smem();", src)
    out, pos = [], 0
    while (start := src.find("<<<", pos)) >= 0:
        i = start  # walk back over the kernel: identifier<balanced template arguments>
        while src[i - 1].isspace():
            i -= 1
        if src[i - 1] == ">":
            depth = 0
            while True:
                i -= 1
                depth += {">": 1, "<": -1}.get(src[i], 0)
                if depth == 0:
                    break
        while src[i - 1].isalnum() or src[i - 1] in "_:":
            i -= 1
        end = src.index(">>>", start)
        j, depth = src.index("(", end) + 1, 1
        while depth:
            depth += {"(": 1, ")": -1}.get(src[j], 0)
            j += 1
        out.append(f"{src[pos:i]}::emu::launch({src[i:start].strip()}, {src[start + 3:end]}, "
                   f"{src[end + 4:j - 1]})")
        pos = j
    return "".join(out) + src[pos:]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """Builds the emulated attention and FFN programs; returns {name: executable}."""
    cuda_inc = _cuda_include()
    if CXX is None or cuda_inc is None:
        pytest.skip("the kernel emulator needs a C++ compiler and the CUDA headers "
                    f"(compiler: {CXX}, CUDA include dir: {cuda_inc})")
    if os.uname().machine not in ("x86_64", "AMD64"):
        pytest.skip("the kernel emulator's fiber switch is written for x86-64")
    flags = [CXX, "-std=c++17", "-O1", "-include", str(ROOT / "tests/cpp/emu/emu_prelude.h"),
             "-I", str(ROOT / "tests/cpp/emu"), "-I", str(ROOT / "csrc"), "-I", str(cuda_inc)]
    programs = {"attention": (["attention_fwd", "attention_bwd"], "attention_emu_main.cpp"),
                "ffn": (["ffn_epilogue"], "ffn_emu_main.cpp")}
    # Builds are cached by the hash of everything they are made of (a clean build: ~10 s CPU).
    inputs = [p for d in ("csrc", "tests/cpp") for p in sorted((ROOT / d).rglob("*.[ch]*"))]
    digest = hashlib.sha256(" ".join(flags).encode())
    for path in inputs:
        digest.update(path.name.encode() + path.read_bytes())
    cache = Path(tempfile.gettempdir()) / f"fastformer-emu-{digest.hexdigest()[:16]}"
    exes = {name: cache / name for name in programs}
    if all(exe.exists() for exe in exes.values()):
        return exes
    build = tmp_path_factory.mktemp("emu")
    procs = []
    for name, (kernels, main) in programs.items():
        sources = []
        for k in kernels:
            sources.append(build / f"{k}.cpp")
            sources[-1].write_text(emu_source((ROOT / "csrc/cuda" / f"{k}.cu").read_text()))
        procs.append(subprocess.Popen(flags + [*map(str, sources), str(ROOT / "tests/cpp" / main),
                                               "-o", str(build / name)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        log = p.communicate()[0]
        assert p.returncode == 0, log[-4000:]
    cache.mkdir(exist_ok=True)
    for name, exe in exes.items():  # copy, then rename: a concurrent run never sees half a file
        shutil.copy2(build / name, build / f"{name}.done")
        os.replace(build / f"{name}.done", exe)
    return exes


def _run_emulated(exe, workdir, env):
    proc = subprocess.run([str(exe), str(workdir)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _load(path, dtype, shape):
    raw = np.fromfile(path, dtype={1: np.int16, 2: np.int16, 4: np.int32}[dtype.itemsize])
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()]).numpy()


# (dtype, D, B, H, Hkv, Lq, Lk, causal, pad, cp.async mode, scheduling seed)
EMU_BASE_CASES = [
    (torch.float16, 64, 2, 4, 2, 113, 203, 1, True, "eager", 1),
    (torch.bfloat16, 64, 1, 2, 1, 203, 113, 2, False, "lazy", 2),
    (torch.float16, 128, 2, 2, 2, 203, 113, 1, True, "lazy", 3),
    (torch.bfloat16, 128, 2, 4, 2, 113, 203, 2, True, "eager", 4),
    (torch.bfloat16, 128, 1, 2, 1, 113, 203, 0, False, "lazy", 5),
    (torch.float16, 64, 2, 2, 2, 203, 113, 0, True, "eager", 6),
    (torch.float16, 64, 1, 2, 2, 113, 17, 2, False, "lazy", 7),   # most rows without a key
    (torch.bfloat16, 64, 2, 3, 1, 1, 203, 2, True, "eager", 8),   # decode: one query row
    (torch.float16, 128, 1, 2, 1, 17, 0, 0, False, "lazy", 9),    # no keys at all
]
# The same, then (window, softcap, unread): unread = None or keys [j0, j1) that no query block
# of the forward and no key block of the backward may read (their k and v are NaN in the
# kernels' input, the oracle sees the real values): the key blocks wholly outside the band are
# not visited.
EMU_VARIANT_CASES = [
    # windows of 0 and 1 key, two-sided, under no causality; Lq != Lk both ways
    (torch.float16, 64, 2, 4, 2, 113, 203, 0, True, "eager", 11, (0, 0), 0.0, None),
    (torch.bfloat16, 128, 1, 2, 1, 203, 113, 0, False, "lazy", 12, (1, 1), 0.0, None),
    (torch.bfloat16, 64, 1, 2, 2, 203, 113, 0, True, "lazy", 13, (40, 70), 0.0, None),
    # one-sided windows
    (torch.float16, 128, 2, 2, 1, 113, 203, 0, False, "eager", 14, (-1, 5), 0.0, None),
    (torch.bfloat16, 64, 1, 4, 2, 203, 113, 1, True, "eager", 15, (17, -1), 0.0, None),
    (torch.float16, 64, 1, 2, 1, 203, 113, 2, False, "lazy", 16, (1, -1), 0.0, None),
    (torch.bfloat16, 128, 2, 2, 2, 113, 203, 2, True, "lazy", 17, (0, -1), 0.0, None),
    # causal keeps right = 0 whatever the window says
    (torch.float16, 128, 1, 2, 1, 113, 203, 1, False, "eager", 18, (10, 7), 0.0, None),
    (torch.bfloat16, 64, 2, 2, 1, 203, 113, 2, True, "eager", 19, (3, 9), 0.0, None),
    # wider than the sequences: the window changes nothing
    (torch.float16, 64, 1, 2, 2, 113, 203, 2, True, "lazy", 20, (1000, 1000), 0.0, None),
    (torch.bfloat16, 128, 1, 2, 1, 203, 113, 0, False, "eager", 21, (500, -1), 0.0, None),
    # key blocks outside every band are skipped: a window on the few first keys (the
    # forward's key loop and the backward's grid end early), decoding with a sliding window
    # (the loop starts late), many query and key blocks with blocks skipped at both ends
    (torch.float16, 64, 1, 2, 1, 64, 400, 0, False, "eager", 22, (0, 10), 0.0, (128, 400)),
    (torch.bfloat16, 128, 2, 3, 1, 1, 400, 2, True, "lazy", 23, (50, -1), 0.0, (0, 320)),
    (torch.float16, 128, 1, 2, 2, 300, 420, 2, False, "lazy", 24, (30, -1), 0.0, (0, 64)),
    (torch.bfloat16, 64, 1, 2, 1, 350, 300, 1, True, "eager", 25, (60, -1), 0.0, None),
    # softcap: alone, strong (0.75: saturated scores), with causality and padding, with a window
    (torch.float16, 64, 2, 4, 2, 113, 203, 0, True, "eager", 26, NO_WINDOW, 5.0, None),
    (torch.bfloat16, 64, 1, 2, 1, 203, 113, 1, False, "lazy", 27, NO_WINDOW, 0.75, None),
    (torch.float16, 128, 2, 2, 2, 203, 113, 2, True, "lazy", 28, NO_WINDOW, 0.75, None),
    (torch.bfloat16, 128, 2, 4, 2, 113, 203, 0, True, "eager", 29, NO_WINDOW, 2.5, None),
    (torch.float16, 64, 1, 2, 1, 203, 113, 2, False, "eager", 30, (20, -1), 2.5, None),
    (torch.bfloat16, 128, 1, 2, 2, 113, 203, 0, True, "lazy", 31, (7, 3), 30.0, None),
]
EMU_ATTENTION_CASES = [c + (NO_WINDOW, 0.0, None) for c in EMU_BASE_CASES] + EMU_VARIANT_CASES


@pytest.mark.parametrize("dtype,D,B,H,Hkv,Lq,Lk,causal,pad,copies,seed,window,softcap,unread",
                         EMU_ATTENTION_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_attention_kernels_emulated(emulator, tmp_path, dtype, D, B, H, Hkv, Lq, Lk, causal, pad,
                                    copies, seed, window, softcap, unread):
    q, k, v, dout, kpm = attention_inputs(dtype, D, B, H, Hkv, Lq, Lk, pad, seed=seed)
    scale = D ** -0.5
    kv = k._base
    if unread is not None:
        kv = kv.clone()
        kv[:, :, unread[0]:unread[1]] = float("nan")
    # each tensor: the storage it views (q's (B, Lq, H, D) buffer, the packed kv buffer) + strides
    _bits(q.transpose(1, 2)).tofile(tmp_path / "q.bin")
    _bits(kv).tofile(tmp_path / "kv.bin")
    _bits(dout).tofile(tmp_path / "dout.bin")
    if pad:
        kpm.numpy().astype(np.uint8).tofile(tmp_path / "kpm.bin")
    code = {torch.float16: 1, torch.bfloat16: 2}[dtype]
    lines = [f"{code} {D} {B} {H} {Hkv} {Lq} {Lk} {causal} {scale!r} {int(pad)} "
             f"{window[0]} {window[1]} {softcap!r}"]
    for name, t, offset in (("q", q, 0), ("kv", k, 0), ("kv", v, D), ("dout", dout, 0)):
        lines.append(f"{name}.bin {offset} " + " ".join(map(str, t.stride()[:3])))
    (tmp_path / "params.txt").write_text("\n".join(lines) + "\n")
    _run_emulated(emulator["attention"], tmp_path, {"EMU_CP_ASYNC": copies, "EMU_SEED": str(seed)})
    out = _load(tmp_path / "out.bin", dtype, (B, Lq, H, D)).transpose(1, 2)
    lse = _load(tmp_path / "lse.bin", torch.float32, (B, H, Lq))
    dq = _load(tmp_path / "dq.bin", dtype, (B, H, Lq, D))
    dk = _load(tmp_path / "dk.bin", dtype, (B, Hkv, Lk, D))
    dv = _load(tmp_path / "dv.bin", dtype, (B, Hkv, Lk, D))
    check_attention((out, lse, dq, dk, dv), q, k, v, dout, kpm, causal, scale, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float32] + LOWP, ids=str)
@pytest.mark.parametrize("act", sorted(ACTIVATIONS), ids=["relu", "gelu", "gelu_tanh", "silu", "quick_gelu", "relu2"])
def test_ffn_kernels_emulated(emulator, tmp_path, dtype, act):
    for i, (rows, cols, stride) in enumerate(FFN_SHAPES):
        a, b, c, bias = ffn_inputs(dtype, rows, cols, stride, seed=i)
        groups = 1 + i % 3
        (tmp_path / "params.txt").write_text(
            f"{DTYPE_CODE[dtype]} {act} {rows} {cols} {stride} 1 {groups}\n")
        for name, t in (("a", a), ("b", b), ("c", c), ("bias", bias)):
            _bits(t).tofile(tmp_path / f"{name}.bin")
        _run_emulated(emulator["ffn"], tmp_path, {"EMU_SEED": str(i)})
        ours = [_load(tmp_path / f"{n}.bin", dtype, (cols,) if n == "dbias" else (rows, cols))
                for n in ("y", "dx", "dbias", "h", "dgate", "dup")]
        check_ffn(ours, act, a[:, :cols], b[:, :cols], c[:, :cols], bias)
