"""Backend declarations, selection, forcing, fallback reasons, info() and import hygiene."""
import os
import subprocess
import sys

import pytest
import torch

import fastformer as ff
from fastformer import backends


def test_use_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="backend must be one of"):
        with ff.use_backend("fast"):
            pass


def test_env_var_forces_backend(monkeypatch):
    x = torch.randn(4, 32)
    monkeypatch.setenv("FASTFORMER_BACKEND", "reference")
    backends.reload_env()
    ff.layer_norm(x, None, None)
    assert ff.last_dispatch().backend == "reference" and ff.last_dispatch().forced
    with ff.use_backend("cpu"):  # the context manager wins over the env var
        ff.layer_norm(x, None, None)
    assert ff.last_dispatch().backend == "cpu"
    monkeypatch.setenv("FASTFORMER_BACKEND", "nonsense")
    backends.reload_env()
    try:
        with pytest.raises(ValueError, match="backend must be one of"):
            ff.layer_norm(x, None, None)
    finally:
        monkeypatch.delenv("FASTFORMER_BACKEND")
        backends.reload_env()


def test_forcing_a_backend_that_cannot_run_raises_with_reasons():
    x = torch.randn(4, 32)
    with ff.use_backend("cuda"), pytest.raises(ValueError, match="backend 'cuda' cannot run"):
        ff.layer_norm(x, None, None)


def test_forcing_triton_on_cpu_without_interpreter_says_how(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(4, 32)
    with ff.use_backend("triton"), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ff.layer_norm(x, None, None)


def test_auto_falls_back_and_explains():
    q = torch.randn(1, 2, 9, 512)  # head dim 512: past the cpu kernels' 256, only the reference takes it
    y = ff.attention(q, q, q)
    d = ff.last_dispatch()
    assert d.backend == "reference" and not d.forced
    assert "head_dim 512" in "; ".join(d.rejected["cpu"])
    torch.testing.assert_close(y, torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_explain_lists_every_backend():
    call = backends.Call("add_norm", "cpu", torch.float32, hidden=64)
    text = backends.explain(call)
    for name in backends.BACKENDS:
        assert text.count(f"{name}:") == 1
    assert "cpu: ok" in text


def test_backward_uses_the_forward_backend_outside_the_block():
    x = torch.randn(8, 64, requires_grad=True)
    with ff.use_backend("reference"):
        y = ff.layer_norm(x, None, None)
    ff.layer_norm(torch.randn(2, 4), None, None)  # an auto call in between
    calls = []
    ref_impl = backends.implementations("add_norm", "reference")[0]
    original = ref_impl.bwd
    ref_impl.bwd = lambda *a: calls.append(1) or original(*a)
    try:
        y.sum().backward()
    finally:
        del ref_impl.bwd
    assert calls == [1]
    d = ff.last_dispatch()
    assert d.backend == "reference" and d.forced


def test_declarations_match_implementations():
    for op in ("add_norm", "attention", "ffn", "rotary", "linear_cross_entropy"):
        impls = backends.implementations(op)
        assert {i.backend for i in impls} >= {"cpu", "triton", "reference"}, op
        for impl in impls:
            assert impl.dtypes, f"{impl.name}.{op} declares no dtypes"
            assert impl.backend in backends.BACKENDS and impl.name.startswith(impl.backend)


def test_available_backends_and_info():
    avail = ff.available_backends()
    assert "reference" in avail and "cpu" in avail
    info = ff.info()
    for key in ("fastformer", "torch", "triton", "_C", "backends", "cpu"):
        assert key in info
    assert info["_C"] == "loaded"
    assert info["cpu"]["kernels"] in ("default", "avx2", "avx512")
    assert "cpu" in str(info)


def _run_python(code: str, **env) -> str:
    full_env = dict(os.environ, **env)
    full_env.pop("TRITON_INTERPRET", None)
    # run where the imported fastformer lives: `python -c` puts the cwd first on sys.path, and
    # from a source checkout with an installed package the cwd's copy has no _C
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(ff.__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                         timeout=300, cwd=pkg_parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_does_not_import_triton_or_touch_cuda():
    out = _run_python("import sys, fastformer; print('triton' in sys.modules, "
                      "__import__('torch').cuda.is_initialized())")
    assert out == "False False"


def test_import_works_without_the_extension():
    code = ("import sys; sys.modules['fastformer._C'] = None\n"
            "import torch, fastformer as ff\n"
            "x = torch.randn(3, 16)\n"
            "y = ff.layer_norm(x, None, None)\n"
            "print(ff.last_dispatch().backend, '|', ff.info()['_C'])")
    out = _run_python(code)
    backend, why = out.split(" | ")
    assert backend == "reference"
    assert why.startswith("missing:")


def test_cpu_arch_override_env():
    out = _run_python("import fastformer as ff; i = ff.info()['cpu']; print(i['kernels'], '|', i['note'])",
                      FASTFORMER_CPU_ARCH="default")
    level, note = out.split(" | ")
    assert level == "default" and "FASTFORMER_CPU_ARCH" in note
    out = _run_python("import fastformer as ff; print(ff.info()['cpu']['note'])",
                      FASTFORMER_CPU_ARCH="sse9")
    assert "ignored" in out


def test_option_structs_mirror_the_python_options():
    """csrc/options.h's structs have the Python option dataclasses' fields, in their order."""
    from fastformer.ops import attention, ffn, linear_cross_entropy, norm, relative_bias, rotary
    fields = ff._ext.C.option_fields()
    assert fields == {"attention": list(attention.AttentionOptions.fields),
                      "add_norm": list(norm.NormOptions.fields),
                      "ffn": list(ffn.FfnOptions.fields),
                      "rotary": list(rotary.RotaryOptions.fields),
                      "linear_cross_entropy":
                          list(linear_cross_entropy.LinearCrossEntropyOptions.fields),
                      "relative_bias": list(relative_bias.RelativeBiasOptions.fields)}


def test_an_option_an_implementation_does_not_list_is_declined_by_its_name():
    cuda = backends.implementations("attention", "cuda")[0]
    call = backends.Call("attention", "cuda", torch.float16, frozenset({"dropout_p"}), head_dim=64)
    assert "does not take option `dropout_p`" in "; ".join(cuda.reasons(call))
    # A field no kernel lists yet: every kernel declines it, auto falls back to the reference
    # and says why.
    call = backends.Call("attention", "cpu", torch.float32, frozenset({"a_new_option"}), head_dim=64)
    impl = backends.select(call)
    d = ff.last_dispatch()
    assert impl.backend == "reference" and "`a_new_option`" in "; ".join(d.rejected["cpu"])
    with ff.use_backend("cpu"), pytest.raises(ValueError, match="a_new_option"):
        backends.select(call)
