"""Fused feed-forward block: ff.ffn and ff.swiglu_ffn, their op definition and backends.

One call, top to bottom:
  ff.ffn / ff.swiglu_ffn                                          checks (below), FfnOptions
    -> FFN((x, w1, b1, w2, b2, w_up, b_up), o)                    ops/_opdef.py (eager
                                                                  Function or custom ops)
    -> backends.select(Call("ffn", ...))                           the first Impl below
    -> cuda.cublas (cuBLAS + csrc/cuda/ffn_epilogue.cu) | ops/ffn_triton.py
       (triton_kernels/ffn.py) | cpu.onednn (torch's oneDNN GEMMs, bf16 on AMX; bf16 weight
       gradients on AMX: ops/linear.py) |
       _C.ffn_fwd (cpu: csrc/cpu/ffn.cpp) | reference/ffn.py

The gated variant is the same op with ``w_up`` given (w1/b1 = gate, w2/b2 = down). Each
implementation's ``fwd`` keeps the pre-activation for the backward and its ``inference`` (calls
without a gradient: OpDef takes it, eager or traced) does not. Saved for
the backward: x, the weights and the pre-activation (gated: [gate | up] as one (N, 2F) tensor;
the eager autograd of gated calls on cpu and cuda keeps gate and up as two) in x's dtype, never the
post-activation; the backward recomputes act() from it. Dropout keeps only (seed, offset) and
regenerates its mask (reference/rng.py, element index n * F + f).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _checks, _ext, backends
from ..backends import EVERY_OPTION, GPU_FLOAT, Impl
from ..reference import ffn as ref
from ..reference.ffn import ACTIVATIONS
from ..reference.rng import draw_rng_state
from . import prepack
from .cpu_gemm import ONEDNN_POST_OPS, fast_lowp_gemm, onednn_post_ops, torch_fp32_gemm_wins
from .linear import LOW_PRECISION, PackedLinear, linear, max_rows, rows_kernel_takes, rows_linear, weight_grad
from ._opdef import OpDef, Options, compiled, options, owned, rowwise

_ACT_CODE = {name: code for code, name in enumerate(ACTIVATIONS)}


@options
class FfnOptions(Options):
    """The options of one FFN call (csrc/options.h mirrors the fields)."""

    activation: int = 0                  # ACTIVATIONS index: relu, gelu, gelu_tanh, silu, quick_gelu, relu2
    dropout_p: float = 0.0               # on act(pre) (ffn only), in [0, 1)
    rng_state: Optional[Tensor] = None   # int64 CPU [seed, offset] of the dropout stream
    swiglu_limit: float = 0.0            # gated, > 0: gate clamped above, up to [-limit, limit] first


# ---- the op -----------------------------------------------------------------------------------
def _uniform_rows(t: Tensor) -> bool:
    """Whether t viewed as (-1, t.shape[-1]) has one row stride (a view, no copy)."""
    expected = None
    for size, st in reversed(list(zip(t.shape[:-1], t.stride()[:-1]))):
        if size == 1:
            continue
        if expected is not None and st != expected:
            return False
        expected = st * size
    return True


def _call(inputs, o: FfnOptions) -> backends.Call:
    x, w1, b1, w2, b2, w_up, b_up = inputs
    f = set()
    if b1 is not None or b2 is not None or b_up is not None:
        f.add("bias")
    if w_up is not None:
        f.add("gated")
    if not x.is_contiguous():
        if x.shape[-1] > 1 and x.stride(-1) != 1:
            f.add("last_dim_strided")
        if not _uniform_rows(x):
            f.add("rows_strided")
    if x.numel() <= max_rows(x.dtype if x.dtype in LOW_PRECISION else torch.float32) * x.shape[-1]:
        f.add("few_rows")  # the rows kernel's calls (ops/linear.py), whatever the GEMM rule
    return backends.Call("ffn", x.device.type, x.dtype, o.set_fields(), frozenset(f),
                         hidden=w1.shape[0])


def _fake_fwd(x, w1, b1, w2, b2, w_up, b_up, o):
    tokens = x.numel() // x.shape[-1]
    width = w1.shape[0] * (2 if w_up is not None else 1)
    return x.new_empty(x.shape), x.new_empty((tokens, width))


def _fake_bwd(grads, saved, o, needs):
    x, w1 = saved[:2]
    F_, D = w1.shape
    shapes = [x.shape, (F_, D), (F_,), (D, F_), (D,), (F_, D), (F_,)]
    return tuple(x.new_empty(s if need else (0,)) for s, need in zip(shapes, needs))


FFN = OpDef("ffn", inputs=("x", "w1", "b1?", "w2", "b2?", "w_up?", "b_up?"), options=FfnOptions,
            outputs=("y", "preactivation"), visible=1,
            save=lambda inputs, o, outputs: (inputs[0], inputs[1], inputs[3], inputs[5], outputs[1]),
            fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, call=_call)

# Calls with fewer token rows (decoding) go to torch's GEMMs in fp32 too: the packed kernel
# packs both weights on every call, which a handful of rows cannot repay. Measured on a 2-core
# Zen 5 (fp32, no dropout, forward): SwiGLU (N, 1024, 2816) N = 1: packed 2.14 ms, torch 1.75;
# N = 8: packed 2.27, torch 2.82; GELU (N, 768, 3072) N = 1: 1.23 vs 0.49, N = 8: 0.90 vs 1.26.
_FEATURES = frozenset({"bias", "gated", "few_rows"})
_NO_DROPOUT = frozenset({"activation"})
_LIMIT = frozenset({"swiglu_limit"})  # the clamped gate: reference, cpu.onednn, triton
_EVERY = _NO_DROPOUT | {"dropout_p", "rng_state"}


# ---- implementations ------------------------------------------------------------------------
def _joined_rows(first: Tensor, second: Tensor, b_first, b_second):
    """(weight, bias) spanning first's and second's rows when second starts where first ends in
    one contiguous tensor (and so do the biases, or neither has one), else None. The fused
    gate_up_proj of Phi-3 / GLM-4, read as two row halves (integrations/hf_mlp_forms.py), is
    one GEMM this way. The Phi-3-style bf16 MLP (1024 tokens, 2048 -> 2 x 5632 -> 2048, 2-core
    Xeon, module hooks in one process) took 50 ms per layer as two half GEMMs into [gate |
    up]'s strided halves against eager's 43, and 45 against eager's 48 as one."""
    def span(a, b):
        if a is None or b is None or a.shape != b.shape or not (a.is_contiguous() and b.is_contiguous()):
            return None
        if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() or \
                b.storage_offset() != a.storage_offset() + a.numel():
            return None
        return a.as_strided((2 * a.shape[0], *a.shape[1:]), a.stride())
    weight = span(first, second)
    if weight is None or (b_first is None) != (b_second is None):
        return None
    bias = None if b_first is None else span(b_first, b_second)
    return None if b_first is not None and bias is None else (weight, bias)


class _VendorGemm(Impl):
    """GEMMs through the vendor library (torch.addmm / mm: cuBLAS on CUDA, oneDNN on CPU, the
    bias in its epilogue) and the activation / gate as one elementwise step on the GEMM output,
    forward and backward, with the hooks below. No dropout. Gated: the gate and up GEMMs write
    the two halves of one (N, 2F) buffer, the layout every backend saves."""

    options = _NO_DROPOUT
    features = _FEATURES
    # elementwise hooks, o the call's FfnOptions (the activation; dropout where the backend's
    # options take it): act_fwd(pre, o, over) -> h = act(pre) (* dropout's keep / (1 - p));
    # gated_fwd(g, u, o, over) -> act(g) * u, where `over` says h may be written over pre / g
    # (the forward does not keep them: no backward to come), which a backend is free to ignore;
    # act_bwd(dh, pre, o) -> d_pre; gated_bwd(dh, g, u, o) -> (d_g, d_u); dh is a temporary
    # of the backward that d_pre / d_g may be written over.
    act_fwd = act_bwd = gated_fwd = gated_bwd = None

    @staticmethod
    def _linear(a, w, b, out=None):
        if b is not None:
            return torch.addmm(b, a, w.t(), out=out)
        return torch.mm(a, w.t(), out=out)

    def fwd(self, x, w1, b1, w2, b2, w_up, b_up, o):
        return self.forward(x, w1, b1, w2, b2, w_up, b_up, o, keep=True)

    def inference(self, x, w1, b1, w2, b2, w_up, b_up, o):
        return self.forward(x, w1, b1, w2, b2, w_up, b_up, o, keep=False)

    def forward(self, x, w1, b1, w2, b2, w_up, b_up, o, keep):
        """(y, the pre-activation if keep (a backward follows) else empty)."""
        x2 = x.reshape(-1, x.shape[-1])
        lin = self._linear
        # Without a backward to come, h goes over the pre-activation: one (N, F) buffer fewer
        # at the forward's peak (a GELU (4096, 768, 3072) bf16 forward's extra memory 54 ->
        # 30 MiB; eager's 48, where pre and act(pre) coexist).
        over = not keep
        if w_up is None:
            pre = lin(x2, w1, b1)
            h = self.hidden(pre, None, o, over)
        else:
            F_ = w1.shape[0]
            gate_first, up_first = _joined_rows(w1, w_up, b1, b_up), _joined_rows(w_up, w1, b_up, b1)
            if gate_first is not None or (up_first is not None and not keep):
                # one tensor's two halves (a fused gate_up_proj: Phi-3, GLM-4, ...): one GEMM
                pre = lin(x2, *(gate_first or up_first))
                halves = pre[:, :F_], pre[:, F_:]
                gate, up = halves if gate_first is not None else halves[::-1]
            else:
                pre = x2.new_empty((x2.shape[0], 2 * F_))  # [gate | up]
                gate, up = pre[:, :F_], pre[:, F_:]
                lin(x2, w1, b1, out=gate)  # strided outputs: the GEMM writes them with ldc = 2F
                lin(x2, w_up, b_up, out=up)
            h = self.hidden(gate, up, o, over)  # over: a strided view of pre
        y = lin(h, w2, b2).reshape(x.shape)
        return y, (pre if keep else x.new_empty((0,)))

    def hidden(self, pre, up, o, over):
        """h = act(pre), gated (up given): act(pre) * up, through the backend's hooks."""
        return self.act_fwd(pre, o, over) if up is None else self.gated_fwd(pre, up, o, over)

    def autograd(self, x, w1, b1, w2, b2, w_up, b_up, o):
        """The eager route with autograd, as separate nodes where the op's shared Function
        makes one: the up-projections are torch's linear nodes (they save x and the weights)
        and _ActDown (activation / gate and the down projection) saves the pre-activation.
        The engine frees what a node saved when its backward returns, so gate and up are gone
        before the up-projections' weight gradients exist, as in eager PyTorch; one node kept
        [gate | up] alive beside all three weight gradients to its end. SwiGLU bf16 (2048,
        4096, 11008) forward+backward peak on a 2-core Zen 5: one node 425 MiB, these nodes
        353-354, eager 362-363. The custom-op route (tracing, torch.compile) keeps the one node of
        fwd() / bwd(): the compiler plans the saved tensors' lifetimes there."""
        x2 = x.reshape(-1, x.shape[-1])
        pre = linear(x2, w1, b1)
        up = None if w_up is None else linear(x2, w_up, b_up)
        return (_ActDown.apply(self, o, pre, up, w2, b2).reshape(x.shape),)

    def down_fwd(self, pre, up, w2, b2, o):
        """_ActDown's forward: act(pre) [* up] @ w2.T + b2."""
        return self._linear(self.hidden(pre, up, o, False), w2, b2)

    def act_grads(self, dy, pre, up, w2, o, need_pre, need_w2):
        """(d_pre, d_up, d_w2) of y = act(pre) [* up] @ w2.T, None where not needed, with
        at most two (N, F) temporaries beside what is saved: h is made for d W2 and dropped
        first, then dh = dy @ w2 becomes d_pre in place. Making h in the backward's activation
        pass instead (one pass, 3 temporaries) set the forward+backward peak above eager's (bf16
        relu (4096, 768, 3072) on the 2-core Xeon: 90 MiB vs 82; SwiGLU (2048, 4096, 11008) 366
        vs 360): the extra pass re-reads pre, ~1% of the step."""
        d_pre = d_up = dw2 = None
        if need_w2:
            h = self.hidden(pre, up, o, False)
            dw2 = weight_grad(dy, h)
            del h
        if need_pre:
            dh = dy @ w2
            if up is None:
                d_pre = self.act_bwd(dh, pre, o)
            else:
                d_pre, d_up = self.gated_bwd(dh, pre, up, o)
            del dh
        return d_pre, d_up, dw2

    def down_bwd(self, dy, pre, up, w2, o, need_pre, need_w2, need_b2):
        """_ActDown's backward: (d_pre, d_up, d_w2, d_b2), None where not needed."""
        return (*self.act_grads(dy, pre, up, w2, o, need_pre, need_w2),
                dy.sum(0) if need_b2 else None)

    def bwd(self, grads, saved, o, needs):
        x, w1, w2, w_up, pre = saved
        dy = rowwise(grads[0])
        x2 = x.reshape(-1, x.shape[-1])
        dy2 = dy.reshape(-1, dy.shape[-1])
        F_ = w1.shape[0]
        # Each (N, F) temporary is dropped as soon as its last GEMM has run: the saved
        # pre-activation stays alive through the whole backward (autograd holds it), so the
        # order sets the peak. SwiGLU bf16 (1024, 1024, 2816) forward+backward on a 2-core Zen 5:
        # peak 49.7 MiB with every temporary alive to the end, eager PyTorch 40.4.
        gate, up = (pre, None) if w_up is None else (pre[:, :F_], pre[:, F_:])
        d_pre, d_up, dw2 = self.act_grads(dy2, gate, up, w2, o, True, bool(needs[3]))
        dx = None
        if needs[0]:
            dx = d_pre @ w1
            if d_up is not None:
                dx = dx.addmm_(d_up, w_up)
            dx = dx.reshape(x.shape)
        dw1 = weight_grad(d_pre, x2) if needs[1] else None
        db1 = d_pre.sum(0) if needs[2] else None
        del d_pre
        dw_up = weight_grad(d_up, x2) if d_up is not None and needs[5] else None
        db_up = d_up.sum(0) if d_up is not None and needs[6] else None
        return dx, dw1, db1, dw2, dy2.sum(0) if needs[4] else None, dw_up, db_up


class _ActDown(torch.autograd.Function):
    """y = h @ w2.T + b2 with h = act(pre) (gated: act(pre) * up), on an implementation's
    down_fwd / down_bwd. Saves pre (and up), never h: the backward recomputes h."""

    @staticmethod
    def forward(ctx, impl, o, pre, up, w2, b2):
        ctx.save_for_backward(pre, up, w2)
        ctx.impl, ctx.o, ctx.dispatch = impl, o, backends.last_dispatch()
        return owned(impl.down_fwd(pre, up, w2, b2, o))

    @staticmethod
    def backward(ctx, dy):
        backends.record(ctx.dispatch)
        pre, up, w2 = ctx.saved_tensors
        _, _, need_pre, need_up, need_w2, need_b2 = ctx.needs_input_grad
        return (None, None, *ctx.impl.down_bwd(rowwise(dy), pre, up, w2, ctx.o,
                                               need_pre or need_up, need_w2, need_b2))


class _PackedLinear(PackedLinear):
    """ops/linear.py's PackedLinear as the gated cpu route's gate and up projections, each its
    own node, keeping the FFN call's dispatch record for its backward."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.dispatch = backends.last_dispatch()
        return PackedLinear.forward(ctx, x, w, b)

    @staticmethod
    def backward(ctx, d_pre):
        backends.record(ctx.dispatch)
        return PackedLinear.backward(ctx, d_pre)


@FFN.implementation
class _CudaCublas(_VendorGemm):
    """cuda: cuBLAS GEMMs, the activation / gate fused in one kernel (csrc/cuda/ffn_epilogue.cu).
    Dropout goes to triton."""

    backend = "cuda"
    name = "cuda.cublas"
    dtypes = GPU_FLOAT
    act_fwd = staticmethod(lambda pre, o, over: _ext.C.cuda_ffn_bias_act_fwd(pre, None, o.activation))
    gated_fwd = staticmethod(lambda g, u, o, over: _ext.C.cuda_ffn_gated_act_fwd(g, u, o.activation))

    act_bwd = staticmethod(lambda dh, pre, o: _ext.C.cuda_ffn_bias_act_bwd(dh, pre, None, o.activation, False)[0])
    gated_bwd = staticmethod(lambda dh, g, u, o: tuple(_ext.C.cuda_ffn_gated_act_bwd(dh, g, u, o.activation)))


@FFN.implementation
class _Triton(Impl):
    """ops/ffn_triton.py (triton_kernels/ffn.py): every elementwise step inside a GEMM."""

    backend = "triton"
    dtypes = GPU_FLOAT
    options = _EVERY | _LIMIT
    features = _FEATURES | {"last_dim_strided"}

    def fwd(self, x, w1, b1, w2, b2, w_up, b_up, o):
        from . import ffn_triton
        return ffn_triton.ffn_fwd(x, w1, b1, w2, b2, w_up, b_up, o)

    def inference(self, x, w1, b1, w2, b2, w_up, b_up, o):
        from . import ffn_triton
        return ffn_triton.ffn_fwd(x, w1, b1, w2, b2, w_up, b_up, o, save_preactivation=False)

    def bwd(self, grads, saved, o, needs):
        from . import ffn_triton
        return ffn_triton.ffn_bwd(rowwise(grads[0]), *saved, o, needs)


@FFN.implementation
class _CpuOnednn(_VendorGemm):
    """cpu: torch's GEMMs (oneDNN / MKL) with the activation / gate (and dropout, the packed
    kernel's Philox mask) as one elementwise pass of ours (csrc/cpu/ffn_elementwise.cpp; the
    backward's recomputes h and the mask), for
      * bf16 where torch's bf16 GEMMs have hardware dot products (AVX512-BF16 or AMX-BF16):
        1.6-2.6 TFLOP/s on AMX (2-core Xeon, 5-7x the fp32 FMAs of csrc/cpu/ffn.cpp's packed
        GEMM); on a 2-core Zen 5 with AVX512-BF16, SwiGLU (2048, 1024, 2816) forward 53 ms vs
        the packed kernel's 104, forward+backward 140 vs 281;
      * fp32 where torch's fp32 GEMM is faster than the packed one (torch_fp32_gemm_wins);
      * fp32 calls with as few token rows as linear_rows.cpp takes (linear.max_rows: 64 on
        avx512, 32 on avx2), whose projections are that kernel's.
    Saves what the fused kernel saves (the pre-activation, never act(pre)); h is rounded to bf16
    before the second GEMM, as eager PyTorch's is."""

    backend = "cpu"
    name = "cpu.onednn"
    dtypes = frozenset({torch.bfloat16, torch.float32})
    options = _EVERY | _LIMIT
    features = _FEATURES | {"last_dim_strided", "rows_strided"}
    gated_fwd = staticmethod(lambda g, u, o, over: _ext.C.ffn_act_fwd(g, u, o.activation, over,
                                                                      limit=o.swiglu_limit))

    @staticmethod
    def act_fwd(pre, o, over):
        # The exact (erf) GELU alone is torch's: its CPU GELU is oneDNN's JIT eltwise kernel,
        # (4096, 3072) in place on 2 Xeon cores 2.2 ms against 2.8 for ours, bf16 and fp32.
        # The backward's fused pass (d pre and h at once) stays ours; with dropout, ours
        # (the mask in the same pass).
        if o.activation == _ACT_CODE["gelu"] and not o.dropout_p:
            return torch.ops.aten.gelu_(pre) if over else F.gelu(pre)
        return _ext.C.ffn_act_fwd(pre, None, o.activation, over, o.dropout_p, o.rng_state)

    # d_pre / d_g written over dh (need_h False)
    act_bwd = staticmethod(lambda dh, pre, o: _ext.C.ffn_act_bwd(dh, pre, None, o.activation, False,
                                                                 o.dropout_p, o.rng_state)[0])
    gated_bwd = staticmethod(lambda dh, g, u, o: tuple(_ext.C.ffn_act_bwd(dh, g, u, o.activation, False,
                                                                          limit=o.swiglu_limit)[:2]))

    @staticmethod
    def _linear(a, w, b, out=None):
        if rows_kernel_takes(a, w, b):  # decode-time rows: ops/linear.py
            y = rows_linear(a, w, b)
            return y if out is None else out.copy_(y)
        return _VendorGemm._linear(a, w, b, out)

    def forward(self, x, w1, b1, w2, b2, w_up, b_up, o, keep):
        """Without a backward to come, a bf16 FFN that is not gated takes its up projection,
        bias and activation as one oneDNN call (torch's mkldnn linear with the activation as a
        post-op: applied to the fp32 accumulator before the bf16 store, no second pass over
        the (N, F) hidden), on CPUs whose torch bf16 GEMMs have dot-product instructions
        (onednn_post_ops). bf16 forward, median of 9-11 interleaved, against torch's addmm and
        our activation pass: 2-core Xeon (AMX) relu (4096, 768, 3072) 24.6 -> 16.5 ms, GELU
        27.9 -> 21.0 (eager 25.8), GELU (8192, 1024, 4096) 92.8 -> 89.1, (1024, 768, 3072) 7.9
        -> 7.5; 2-core Zen 4 (AVX512-BF16) relu (4096, 768, 3072) 112.3 -> 104.8 (eager 111.2),
        GELU 110.3 -> 107.3, GELU (8192, 1024, 4096) 416 -> 404, GELU (1024, 768, 3072) 27.3
        -> 27.0, tanh GELU 28.0 -> 26.5. Gated, the gate as a binary post-op of the
        up projection measured 0.95-1.04x of the fused elementwise pass on the Xeon (SwiGLU
        (2048, 4096, 11008), (1024, 2048, 5632), (1024, 1024, 2816); GeGLU (2048, 2048, 5632)):
        not taken."""
        x2 = x.reshape(-1, x.shape[-1])
        post_op = ONEDNN_POST_OPS.get(ACTIVATIONS[o.activation])
        if (not (keep or o.dropout_p) and not rows_kernel_takes(x2, w1, b1)
                and (post_op is not None or w_up is not None)
                and prepack.takes(x2, (w1, w2, w_up), (b1, b2, b_up))):
            return self._prepacked_fwd(x2, w1, b1, w2, b2, w_up, b_up, o).reshape(x.shape), x.new_empty((0,))
        if (w_up is not None or keep or o.dropout_p or post_op is None
                or x2.dtype != torch.bfloat16 or not onednn_post_ops()
                or rows_kernel_takes(x2, w1, b1)
                or not all(t is None or t.is_contiguous() for t in (x2, w1, b1))):
            return super().forward(x, w1, b1, w2, b2, w_up, b_up, o, keep)
        h = torch.ops.mkldnn._linear_pointwise(x2, w1, b1, *post_op)
        return self._linear(h, w2, b2).reshape(x.shape), x.new_empty((0,))

    def _prepacked_fwd(self, x2, w1, b1, w2, b2, w_up, b_up, o):
        """The inference forward on the weights' blocked copies (ff.convert(model,
        prepack_weights=True), ops/prepack.py): not gated, the activation as the up projection's
        oneDNN post-op (quick_gelu and relu2 have none: they take the route without prepacked
        weights); gated, our gate pass over the two projections' outputs (written over the
        gate's). ff.last_dispatch() names the route."""
        last = backends.last_dispatch()
        if last is not None and last.op == "ffn":
            backends.record(dataclasses.replace(last, impl=f"{self.name} (prepacked weights)"))
        if w_up is None:
            h = prepack.linear(x2, w1, b1, ONEDNN_POST_OPS[ACTIVATIONS[o.activation]])
        else:
            h = self.gated_fwd(prepack.linear(x2, w1, b1), prepack.linear(x2, w_up, b_up), o, True)
        return prepack.linear(h, w2, b2)

    def reasons(self, call):
        why = super().reasons(call)
        if why or _LIMIT & call.options:  # no other cpu route clamps the gate: this one is best
            return why
        if call.dtype == torch.float32 and "few_rows" not in call.features:
            wins, why = torch_fp32_gemm_wins()
            if not wins:
                return [f"fp32 with more than {max_rows(torch.float32)} token rows: {why}"]
        if call.dtype == torch.bfloat16 and not fast_lowp_gemm(torch.bfloat16) and "few_rows" not in call.features:
            # Few rows take this route: its projections on ops/linear.py's few-row kernel, for which
            # csrc/cpu/ffn.cpp packs the weights on every call. SwiGLU (2048 -> 5632) bf16 without
            # autograd, 2-core Zen 3, median of 9: 1 row 15.8 -> 2.4 ms, 4 rows 15.3 -> 6.1, 8 16.1 -> 11.5.
            return [f"bf16 with more than {max_rows(torch.bfloat16)} token rows: torch's bf16 GEMMs have no "
                    "AVX512-BF16 / AMX-BF16 dot products on this CPU"]
        return []


@FFN.implementation
class _Cpu(Impl):
    """csrc/cpu/ffn.cpp: packed GEMMs with the bias, activation, gate and dropout fused."""

    backend = "cpu"
    options = _EVERY
    features = _FEATURES | {"last_dim_strided", "rows_strided"}

    fwd = compiled("ffn_fwd")

    @staticmethod
    def inference(x, w1, b1, w2, b2, w_up, b_up, o):
        return _ext.C.ffn_fwd(x, w1, b1, w2, b2, w_up, b_up, o, False)

    def bwd(self, grads, saved, o, needs):
        return _ext.C.ffn_bwd(rowwise(grads[0]), *saved, o, *needs)

    def autograd(self, x, w1, b1, w2, b2, w_up, b_up, o):
        """Gated calls with eager autograd: three nodes (the gate projection, the up projection,
        _ActDown) on the packed GEMM, where the op's shared Function makes one. As for
        _VendorGemm.autograd: the engine frees what a node saved when its backward returns, so
        gate and up are freed before the projections' weight gradients are made, and each
        projection's gradient before the other's weight gradient. One node held [gate | up] and
        its gradient beside all three weight gradients. SwiGLU fp32 (2048, 4096, 11008)
        forward+backward peak on a 2-core Zen 5: one node 924 MiB, eager 720, these nodes
        698. Not gated (one GEMM per layer, no such pair) or under tracing: the one node."""
        if w_up is None:
            return None
        gate = _PackedLinear.apply(x, w1, b1)
        up = _PackedLinear.apply(x, w_up, b_up)
        return (_ActDown.apply(self, o, gate, up, w2, b2).reshape(x.shape),)

    @staticmethod
    def down_fwd(pre, up, w2, b2, o):
        return _ext.C.ffn_down_fwd(pre, up, w2, b2, o)

    @staticmethod
    def down_bwd(dy, pre, up, w2, o, need_pre, need_w2, need_b2):
        d_pre, d_up, dw2, db2 = _ext.C.ffn_down_bwd(dy, pre, up, w2, o, need_pre, need_w2, need_b2)
        return (d_pre if need_pre else None, d_up if need_pre and up is not None else None,
                dw2 if need_w2 else None, db2 if need_b2 else None)


@FFN.implementation
class _Reference(Impl):
    backend = "reference"
    options = EVERY_OPTION
    features = _FEATURES | {"last_dim_strided", "rows_strided"}

    def fwd(self, x, w1, b1, w2, b2, w_up, b_up, o):
        return ref.ffn_fwd(x, w1, b1, w2, b2, w_up, b_up, o)

    def inference(self, x, w1, b1, w2, b2, w_up, b_up, o):
        return ref.ffn_fwd(x, w1, b1, w2, b2, w_up, b_up, o, keep=False)

    def bwd(self, grads, saved, o, needs):
        return ref.ffn_bwd(grads[0], *saved, o, needs)


# ---- public API ---------------------------------------------------------------------------
def _check_linear(fn: str, x: Tensor, pairs) -> None:
    """pairs: (name, tensor, expected shape, what the shape means, optional)."""
    for name, t, shape, why, optional in pairs:
        _checks.tensor(fn, name, t, optional=optional)
        if t is None:
            continue
        _checks.same_device(fn, "x", x, **{name: t})
        _checks.same_dtype(fn, "x", x, **{name: t})
        if t.dim() != len(shape):
            raise ValueError(f"{fn}: `{name}` must be {len(shape)}-D with shape {shape}{why}, "
                             f"got {t.dim()}-D with shape {tuple(t.shape)}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{fn}: `{name}` must have shape {tuple(shape)}{why} to match `x` "
                             f"of shape {tuple(x.shape)} (d_model = its last dim), got "
                             f"{tuple(t.shape)}")


def _check_x(fn: str, x) -> int:
    _checks.tensor(fn, "x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{fn}: `x` must have shape (..., d_model) with d_model >= 1, got "
                         f"{tuple(x.shape)}")
    return x.shape[-1]


def _check_activation(fn: str, activation) -> int:
    if not isinstance(activation, str) or activation not in _ACT_CODE:
        raise ValueError(f"{fn}: `activation` must be one of {', '.join(map(repr, ACTIVATIONS))}; "
                         f"got {activation!r}")
    return _ACT_CODE[activation]


def _weight_rows(fn: str, name: str, w, what: str) -> int:
    _checks.tensor(fn, name, w)
    if w.dim() != 2 or w.shape[0] < 1:
        raise ValueError(f"{fn}: `{name}` must be 2-D ({what}, d_model) in nn.Linear's "
                         f"(out_features, in_features) layout, got shape {tuple(w.shape)}")
    return w.shape[0]


def _run(x, w1, b1, w2, b2, w_up, b_up, act: int, dropout_p: float, limit: float = 0.0) -> Tensor:
    o = FfnOptions(activation=act, dropout_p=dropout_p, swiglu_limit=limit,
                   rng_state=draw_rng_state() if dropout_p > 0 else None)
    return FFN((x, w1, b1, w2, b2, w_up, b_up), o)[0]


def ffn(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
        activation: str = "relu", dropout_p: float = 0.0) -> Tensor:
    """``Linear -> activation -> dropout -> Linear`` with the bias and activation fused into the
    GEMMs: ``y = dropout(act(x @ w1.T + b1)) @ w2.T + b2``.

    Args:
        x: (..., d_model) float16/bfloat16/float32/float64, any leading dims and strides.
        w1: (dim_feedforward, d_model), b1: (dim_feedforward,) or None (``nn.Linear`` layout).
        w2: (d_model, dim_feedforward), b2: (d_model,) or None. All in x's dtype and device.
        activation: ``"relu"``, ``"gelu"`` (exact erf, torch's default), ``"gelu_tanh"``,
            ``"silu"``, ``"quick_gelu"`` (``x * sigmoid(1.702 x)``, OpenAI CLIP's), ``"relu2"``
            (``relu(x)^2``, squared ReLU: Nemotron, Persimmon, Arcee, NanoChat).
        dropout_p: dropout on the hidden activation, in [0, 1) (applied whenever > 0, like
            ``F.dropout(training=True)``; modules pass 0 in eval mode). The mask comes from a
            counter-based RNG seeded from torch's default generator (torch.manual_seed
            reproduces it) and is regenerated, not stored, for the backward.

    Returns:
        (..., d_model) in x's dtype. With autograd, only the pre-activation (..., dim_feedforward)
        is saved besides x and the weights; act() is recomputed in the backward.
    """
    fn = "ffn"
    D = _check_x(fn, x)
    F_ = _weight_rows(fn, "w1", w1, "dim_feedforward")
    _check_linear(fn, x, [
        ("w1", w1, (F_, D), " (dim_feedforward, d_model)", False),
        ("b1", b1, (F_,), " (dim_feedforward,)", True),
        ("w2", w2, (D, F_), " (d_model, dim_feedforward)", False),
        ("b2", b2, (D,), " (d_model,)", True)])
    act = _check_activation(fn, activation)
    dropout_p = _checks.number(fn, "dropout_p", dropout_p, lo=0.0, hi=1.0, hi_open=True)
    return _run(x, w1, b1, w2, b2, None, None, act, dropout_p)


def swiglu_ffn(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
               b_gate: Optional[Tensor] = None, b_up: Optional[Tensor] = None,
               b_down: Optional[Tensor] = None, activation: str = "silu", *,
               swiglu_limit: Optional[float] = None) -> Tensor:
    """Gated feed-forward: ``y = (act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)) @ w_down.T
    + b_down``: SwiGLU with ``"silu"``, GeGLU with ``"gelu"`` / ``"gelu_tanh"``, ReGLU with
    ``"relu"``.

    Args:
        x: (..., d_model), any leading dims and strides.
        w_gate, w_up: (hidden, d_model); w_down: (d_model, hidden) (``nn.Linear`` layout);
            b_gate, b_up: (hidden,) or None; b_down: (d_model,) or None. x's dtype and device.
        activation: as :func:`ffn`.
        swiglu_limit: None, or L > 0: the gate clamped above at L and the up projection to
            [-L, L] before ``act(gate) * up`` (DeepSeek-V4's SwiGLU); the clamps pass the
            gradient where their bounds hold, as torch.clamp's. Runs on the cpu (cpu.onednn),
            triton and reference backends (cuda's cuBLAS route: triton).

    Returns:
        (..., d_model). Without autograd the two gated projections run as one GEMM; with it they
        are separate nodes, so each is freed as soon as its backward has run, and the gate and
        up projections are saved (2 tensors of (..., hidden), eager keeps 4).
    """
    fn = "swiglu_ffn"
    D = _check_x(fn, x)
    F_ = _weight_rows(fn, "w_gate", w_gate, "hidden")
    _check_linear(fn, x, [
        ("w_gate", w_gate, (F_, D), " (hidden, d_model)", False),
        ("w_up", w_up, (F_, D), " (hidden, d_model), the shape of `w_gate`", False),
        ("w_down", w_down, (D, F_), " (d_model, hidden)", False),
        ("b_gate", b_gate, (F_,), " (hidden,)", True),
        ("b_up", b_up, (F_,), " (hidden,)", True),
        ("b_down", b_down, (D,), " (d_model,)", True)])
    act = _check_activation(fn, activation)
    limit = 0.0 if swiglu_limit is None else _checks.number(fn, "swiglu_limit", swiglu_limit, lo=0.0,
                                                            lo_open=True, finite=True)
    return _run(x, w_gate, b_gate, w_down, b_down, w_up, b_up, act, 0.0, float(limit))


__all__ = ["ffn", "swiglu_ffn", "ACTIVATIONS"]
