"""``ff.moe_ffn``: the experts of a mixture-of-experts layer (Mixtral, Qwen-MoE, OLMoE, gpt-oss,
DeepSeek, ...), each a gated FFN, forward and backward, grouped by expert.

    out[n] = sum_j  w[n, j] * down_e( act(gate_e(x[n])) * up_e(x[n]) ),   e = ids[n, j]

with expert e's weights the slices of three stacked tensors, Hugging Face's layout:
w_gate_up (E, 2F, D) = [gate rows; up rows], w_down (E, D, F), optional biases (E, 2F), (E, D).
Experts without a gate (gated=False: NemotronH) have w_gate_up (E, F, D), the up rows, and
h = act(up): the same loop with gu (n_e, F) and the pass without its gate.

Algorithm. The N * k (token, slot) pairs are sorted by expert (a stable sort: equal ids keep
their order); for each expert with rows, its gathered rows xs (n_e, D) run the expert's GEMMs:
  gu = xs w_gate_up[e]^T (+ b)        one GEMM for gate and up, (n_e, 2F), kept for the backward
  h  = act(gu[:, :F]) * gu[:, F:]     one elementwise pass (the FFN's, ffn_elementwise.cpp on CPU;
                                      gpt-oss's clamped SwiGLU there too, _Gate)
  ys = h w_down[e]^T (+ b)            (n_e, D)
then each pair's ys times its weight goes back to its slot (with weights_on="input", Llama 4's
form, the weight scales the gathered row xs instead), and the k slots of a token are summed
(in the promoted dtype, as transformers' grouped_mm experts do, with fp32 accumulation: one
batched GEMM per call; deterministic: no atomics, no index_add). The backward recomputes h from gu (with the activation's gradient in the same pass on
CPU) and writes each expert's weight gradients straight into its slice of one (E, ...) buffer:
autograd's own route for ``w[e]`` (what an eager loop over experts records) makes a zero-filled
full-size gradient per expert touched. Memory saved for the backward: gu (S, 2F) and ys (S, D)
for the routing weights' gradient, S = N * k; never h.

The experts' GEMMs (_ExpertGemms) are torch's, or, for bf16 / fp16 on CPUs where torch's GEMMs
in the dtype are generic code (AVX2-only: ops/linear.py's packed_gemm_wins()), the packed GEMM of
ops/linear.py, forward and backward.

Calls with no autograd and few rows per expert (decode steps) take ops/linear.py's few-row kernel
for both projections (bf16), or one torch grouped GEMM per projection over all experts (fp32, where
that kernel only matches MKL and the loop's per-expert calls would decide): the step's time is
reading the chosen experts' weights.
The experts' row counts are read on the host (the loop over experts): under torch.compile the
forward and the backward are two custom ops (fastformer::moe_ffn, fastformer::moe_ffn_bwd) that
the compiler calls as they are.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _checks, _ext
from ..reference import ffn as ref_ffn
from ._opdef import owned, plain_tensor as _plain, rowwise
from .linear import (LOW_PRECISION, linear, packed_gemm_wins, packed_input_grad, packed_mm, packed_weight_grad,
                     weight_grad, weight_grad_kernel_takes)

_ACT_CODE = {name: code for code, name in enumerate(ref_ffn.ACTIVATIONS)}
CLAMPED_SWIGLU = "clamped_swiglu"  # gpt-oss's gate (moe_ffn only)
GPT_OSS_LIMIT = 7.0


def _cpu_kernels(t: Tensor) -> bool:
    """The FFN's elementwise kernels (ffn_elementwise.cpp) take these rows."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16) and _ext.C is not None


class _Gate:
    """How an expert's [gate | up] projection (rows, 2F) becomes h (rows, F), and its gradient,
    on the FFN's fused pass (ffn_elementwise.cpp) on CPU: act(gate) * up, with DeepSeek-V4's
    clamps when limit > 0, and gpt-oss's clamped SwiGLU as quick_gelu(gate') * (up' + 1)
    (quick_gelu is g * sigmoid(1.702 g): gpt-oss's alpha). Interleaved gate / up columns are
    copied into halves first (one pass). Experts without a gate (gated=False: NemotronH) have
    an up projection (rows, F) alone and h = act(up). Elsewhere (another alpha, other dtypes and
    devices) torch ops at fp32 (fp64 for fp64)."""

    def __init__(self, activation: str, interleaved: bool, alpha: float, limit: float, gated: bool = True):
        self.clamped = activation == CLAMPED_SWIGLU
        self.code = _ACT_CODE["quick_gelu"] if self.clamped else _ACT_CODE[activation]
        self.interleaved, self.alpha, self.limit, self.gated = interleaved, alpha, limit, gated
        self.up_shift = 1.0 if self.clamped else 0.0

    def _split(self, gu: Tensor):
        if self.interleaved:
            return gu[:, 0::2], gu[:, 1::2]
        F_ = gu.shape[1] // 2
        return gu[:, :F_], gu[:, F_:]

    def _kernel(self, gu: Tensor) -> bool:
        return _cpu_kernels(gu) and (not self.clamped or self.alpha == ref_ffn.QUICK_GELU_SCALE)

    def _halves(self, gu: Tensor):
        """(gate, up) with contiguous rows, for the kernel."""
        if self.interleaved:
            n, width = gu.shape
            gu = gu.reshape(n, width // 2, 2).transpose(1, 2).reshape(n, width)  # one copy
        F_ = gu.shape[1] // 2
        return gu[:, :F_], gu[:, F_:]

    def _math(self, g: Tensor, u: Tensor):
        """(h, d h / d gate, d h / d up) in the accumulation dtype."""
        if not self.clamped:
            return ref_ffn.gate_terms(g, u, self.code, self.limit)
        L, a = self.limit, self.alpha
        gc, uc = g.clamp(max=L), u.clamp(min=-L, max=L)
        sig = torch.sigmoid(a * gc)
        glu = gc * sig
        d_g = (uc + 1) * (sig + a * glu * (1 - sig)) * (g <= L)   # clamp passes the gradient
        d_u = glu * ((u >= -L) & (u <= L))                          # where the bounds hold
        return (uc + 1) * glu, d_g, d_u

    def fwd(self, gu: Tensor) -> Tensor:
        if not self.gated:
            if _cpu_kernels(gu):
                return _ext.C.ffn_act_fwd(gu, None, self.code, False, 0.0, None, 0.0, 0.0)
            return ref_ffn.activation(gu.to(ref_ffn.acc_dtype(gu.dtype)), self.code).to(gu.dtype)
        if self._kernel(gu):
            return _ext.C.ffn_act_fwd(*self._halves(gu), self.code, False, 0.0, None, self.limit, self.up_shift)
        gate, up = self._split(gu)
        acc = ref_ffn.acc_dtype(gu.dtype)
        if not self.clamped:
            return ref_ffn.gate_value(gate.to(acc), up.to(acc), self.code, self.limit).to(gu.dtype)
        # in place on fp32 copies: gpt-oss-style bf16 experts (16 of 1024 -> 1024, top 4, 1024
        # tokens) forward 55.6 -> 39.7 ms with the gradient terms of _math left out and these passes
        g = gate.to(acc, copy=True).clamp_(max=self.limit)
        g.mul_(g.mul(self.alpha).sigmoid_())
        return g.mul_(up.to(acc, copy=True).clamp_(min=-self.limit, max=self.limit).add_(1)).to(gu.dtype)

    def bwd(self, dh: Tensor, gu: Tensor):
        """(parts, h): parts [(rows of w_gate_up[e], their gradient (n, rows))]: the two halves
        (no (n, 2F) copy of their gradients), or all rows interleaved as one (n, 2F)."""
        if not self.gated:  # h = act(up): d up = dh * act'(up)
            if _cpu_kernels(gu):  # one pass; h written over dh
                d_up, _, h = _ext.C.ffn_act_bwd(dh, gu, None, self.code, True, 0.0, None, 0.0, 0.0)
                return [(slice(None), d_up)], h
            u = gu.to(ref_ffn.acc_dtype(gu.dtype))
            d_up = dh.to(u.dtype) * ref_ffn.activation_grad(u, self.code)
            return [(slice(None), d_up.to(gu.dtype))], ref_ffn.activation(u, self.code).to(gu.dtype)
        F_ = gu.shape[1] // 2
        if self._kernel(gu):  # one pass; h written over dh
            d_gate, d_up, h = _ext.C.ffn_act_bwd(dh, *self._halves(gu), self.code, True, 0.0, None, self.limit,
                                                 self.up_shift)
            if self.interleaved:
                return [(slice(None), torch.stack((d_gate, d_up), -1).reshape(gu.shape))], h
            return [(slice(0, F_), d_gate), (slice(F_, 2 * F_), d_up)], h
        gate, up = self._split(gu)
        acc = ref_ffn.acc_dtype(gu.dtype)
        d = dh.to(acc)
        h, dg, du = self._math(gate.to(acc), up.to(acc))
        h = h.to(gu.dtype)
        if not self.interleaved:
            return [(slice(0, F_), (d * dg).to(gu.dtype)), (slice(F_, 2 * F_), (d * du).to(gu.dtype))], h
        return [(slice(None), torch.stack((d * dg, d * du), -1).reshape(gu.shape).to(gu.dtype))], h


class _ExpertGemms:
    """The experts' GEMMs of one call: torch's (oneDNN / MKL), or, for bf16 / fp16 where torch's
    GEMMs in the dtype are generic code (ops/linear.py's packed_gemm_wins(): AVX2-only CPUs; on a
    2-core Zen 3 torch's bf16 GEMM ran 19 GFLOP/s forward and ~2 backward, the packed GEMM
    135-151), csrc/cpu/ffn.cpp's packed GEMM, which converts to fp32 as it packs (any strides of
    the weights: transposed expert stacks too)."""

    def __init__(self, x: Tensor, *weights: Optional[Tensor]):
        self.packed = (x.device.type == "cpu" and x.dtype in LOW_PRECISION and _plain(x)
                       and all(w is None or (_plain(w) and w.dtype == x.dtype) for w in weights)
                       and packed_gemm_wins(x.dtype))

    def mm(self, a: Tensor, w: Tensor, b: Optional[Tensor], out: Optional[Tensor]) -> Tensor:
        """a w^T (+ b), written into `out` (contiguous rows of a buffer) when given."""
        if self.packed:
            return packed_mm(a, w, b, out)
        if b is not None:
            return torch.addmm(b, a, w.t(), out=out)
        return torch.mm(a, w.t(), out=out)

    def input_grad(self, d: Tensor, w: Tensor, x: Tensor) -> Tensor:
        """d w: the input gradient of a w^T for a's (n, in) rows x (only their shape is read)."""
        if self.packed:
            return packed_input_grad(d, x, w)
        return d @ w

    def weight_grad_into(self, out: Tensor, dy: Tensor, x: Tensor) -> None:
        if self.packed:
            out.copy_(packed_weight_grad(dy, x, out))
        else:
            _weight_grad_into(out, dy, x)


class _Routing:
    """The (token, slot) pairs sorted by expert: `order` (S,) pair indices, `token` (S,) their
    tokens, `spans` [(expert, start, end)] of the experts with rows."""

    def __init__(self, ids: Tensor, n_experts: int):
        flat = ids.reshape(-1)
        self.k = ids.shape[1]
        self.order = torch.argsort(flat, stable=True)
        self.token = torch.div(self.order, self.k, rounding_mode="floor")
        self.inverse = None  # order's inverse permutation, made by combine()
        counts = torch.bincount(flat, minlength=n_experts).tolist()
        self.counts = counts
        self.spans, start = [], 0
        for e, n in enumerate(counts):
            if n:
                self.spans.append((e, start, start + n))
            start += n

    def combine(self, rows: Tensor, n_tokens: int, weights: Optional[Tensor] = None) -> Tensor:
        """(S, C) rows in sorted order -> (N, C): each pair back to its slot (a gather by the
        inverse permutation), the k slots summed, each times its weight (N, k) when given, as one
        batched GEMM (fp32 accumulation, one rounding; in the promoted dtype of rows and weights).
        1024 tokens, k = 4, D = 1024, bf16 rows, 2-core Xeon: 2.0 ms against 8.3 for a scatter, a
        product and a sum (torch's bf16 elementwise ops), 7.8 with the gather and those two."""
        if self.inverse is None:
            self.inverse = torch.empty_like(self.order)
            self.inverse[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        pairs = rows.index_select(0, self.inverse).view(n_tokens, self.k, rows.shape[1])
        dtype = rows.dtype if weights is None else torch.promote_types(rows.dtype, weights.dtype)
        if weights is None:
            weights = torch.ones((), dtype=dtype, device=rows.device).expand(n_tokens, self.k)
        return torch.bmm(weights.reshape(n_tokens, 1, self.k).to(dtype), pairs.to(dtype)).view(n_tokens, rows.shape[1])


def _scaled(xs: Tensor, w_sorted: Tensor) -> Tensor:
    """Each routed row times its weight, rounded to x's dtype (what Llama 4's experts read)."""
    return (xs * w_sorted[:, None]).to(xs.dtype)


def _experts_fwd(x, r: _Routing, w_gate_up, b_gate_up, w_down, b_down, gate: _Gate, keep_gu: bool,
                 w_on_input: Optional[Tensor]):
    """ys (S, D) in sorted order, and gu (S, 2F; F without a gate) when keep_gu; w_on_input: the sorted routing
    weights when they scale the experts' inputs (weights_on="input")."""
    xs = x.index_select(0, r.token)
    if w_on_input is not None:
        xs = _scaled(xs, w_on_input)
    S = xs.shape[0]
    few_rows = not keep_gu and not torch.is_grad_enabled()
    if few_rows and _grouped_decode(xs, r, w_gate_up, w_down):
        return _grouped_fwd(xs, r, w_gate_up, b_gate_up, w_down, b_down, gate), None
    ys = x.new_empty((S, x.shape[1]))
    gu_all = x.new_empty((S, w_gate_up.shape[1])) if keep_gu else None
    gemms = _ExpertGemms(x, w_gate_up, w_down, b_gate_up, b_down)
    for e, lo, hi in r.spans:
        bg = None if b_gate_up is None else b_gate_up[e]
        bd = None if b_down is None else b_down[e]
        if few_rows and hi - lo <= 8:
            # decode: the few-row kernel reads the expert's weights (ops/linear.py)
            ys[lo:hi] = linear(gate.fwd(linear(xs[lo:hi], w_gate_up[e], bg)), w_down[e], bd)
            continue
        gu = gemms.mm(xs[lo:hi], w_gate_up[e], bg, gu_all[lo:hi] if keep_gu else None)
        gemms.mm(gate.fwd(gu), w_down[e], bd, ys[lo:hi])
    return ys, gu_all


# fp32 decode steps (no autograd, at most this many rows per expert) run both projections of all
# experts as one torch grouped GEMM each: the few-row kernel only matches MKL's fp32 GEMV, and the
# loop's per-expert calls (~26 us each) then decide. Experts alone, (16 of 1024 -> 2 x 512, top 4),
# (8 of 1024 -> 2 x 3584, top 2), (64 of 1024 -> 2 x 256, top 8), 1-8 tokens, 2-core AMX Xeon: the
# loop ran 0.74-0.98x transformers' grouped_mm. bf16 steps keep the loop (1.37-1.64x grouped_mm:
# linear_rows.cpp reads bf16 weights faster than torch's GEMM).
GROUPED_DECODE_ROWS = 8


def _grouped_decode(xs: Tensor, r: _Routing, w_gate_up: Tensor, w_down: Tensor) -> bool:
    """fp32 decode rows that torch's grouped GEMM takes: its operands' strides and addresses
    multiples of 16 bytes."""
    if not (xs.dtype == torch.float32 and xs.device.type == "cpu" and max(r.counts) <= GROUPED_DECODE_ROWS
            and hasattr(torch.nn.functional, "grouped_mm") and not torch.compiler.is_compiling()):
        return False
    return all(t.data_ptr() % 16 == 0 and all(st % 4 == 0 for st, n in zip(t.stride(), t.shape) if n > 1 and st != 1)
               for t in (xs, w_gate_up, w_down)) and w_down.shape[2] % 4 == 0


def _grouped_fwd(xs, r: _Routing, w_gate_up, b_gate_up, w_down, b_down, gate: _Gate) -> Tensor:
    """ys (S, D) of the sorted rows xs, each expert's GEMMs as one torch grouped GEMM."""
    offs = torch.tensor(r.counts, dtype=torch.int32).cumsum_(0, dtype=torch.int32)
    expert = None if b_gate_up is None and b_down is None else \
        torch.repeat_interleave(torch.arange(len(r.counts)), torch.tensor(r.counts))
    gu = torch.nn.functional.grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)
    if b_gate_up is not None:
        gu += b_gate_up.index_select(0, expert)
    ys = torch.nn.functional.grouped_mm(gate.fwd(gu), w_down.transpose(1, 2), offs=offs)
    if b_down is not None:
        ys += b_down.index_select(0, expert)
    return ys


def _forward(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, gate: _Gate, on_input: bool, keep: bool):
    """(out (N, D), gu (S, 2F) and ys (S, D) for the backward (None unless keep; ys only where the
    routing weights' gradient needs it), the routing)."""
    r = _Routing(ids, w_gate_up.shape[0])
    w_sorted = weights.reshape(-1)[r.order]
    ys, gu = _experts_fwd(x, r, w_gate_up, b_gate_up, w_down, b_down, gate, keep_gu=keep,
                          w_on_input=w_sorted if on_input else None)
    out = _combine_outputs(r, ys, None if on_input else weights, x)
    return out, gu, ys if keep and not on_input else None, r


def _backward(d_out, x, r: _Routing, weights, w_gate_up, w_down, gu, ys, gate: _Gate, on_input: bool, needs):
    """(dx, d_weights, d_w_gate_up, d_w_down, d_b_gate_up, d_b_down), None where not needed."""
    need_x, need_w, need_wgu, need_wd, need_bgu, need_bd = needs
    d_out = rowwise(d_out)
    w_sorted = weights.reshape(-1)[r.order]
    d_pairs = d_out.index_select(0, r.token)                       # (S, D), sorted
    d_weights = None
    if need_w and not on_input:
        d_weights = _routing_weight_grad(r, d_pairs.to(ys.dtype), ys, weights)
    xs = x.index_select(0, r.token)
    if on_input:  # the experts read w * x: their input gradient gives dx and d w
        dys, xs_in = d_pairs.to(x.dtype), _scaled(xs, w_sorted)
    else:
        dys, xs_in = (d_pairs * w_sorted[:, None]).to(x.dtype), xs
    dxs = torch.empty_like(xs) if need_x or (need_w and on_input) else None
    dw_gu = _expert_grad_buffer(w_gate_up, r) if need_wgu else None
    dw_d = _expert_grad_buffer(w_down, r) if need_wd else None
    db_gu = x.new_zeros(w_gate_up.shape[:2], dtype=w_gate_up.dtype) if need_bgu else None
    db_d = x.new_zeros((w_down.shape[0], w_down.shape[1]), dtype=w_down.dtype) if need_bd else None
    gemms = _ExpertGemms(x, w_gate_up, w_down)
    F_ = w_down.shape[2]
    for e, lo, hi in r.spans:
        dy, x_e = dys[lo:hi], xs_in[lo:hi]
        dh = gemms.input_grad(dy, w_down[e], gu[lo:hi, :F_])       # (n, F)
        parts, h = gate.bwd(dh, gu[lo:hi])
        del dh
        if need_wd:
            gemms.weight_grad_into(dw_d[e], dy, h)
        if need_bd:
            db_d[e] = dy.sum(0)
        del h
        for i, (rows, d) in enumerate(parts):
            if need_wgu:
                gemms.weight_grad_into(dw_gu[e, rows], d, x_e)
            if need_bgu:
                db_gu[e, rows] = d.sum(0)
            if dxs is not None and gemms.packed:
                dx_e = gemms.input_grad(d, w_gate_up[e, rows], x_e)
                if i == 0:
                    dxs[lo:hi] = dx_e
                else:
                    dxs[lo:hi] += dx_e
            elif dxs is not None and i == 0:
                torch.mm(d, w_gate_up[e, rows], out=dxs[lo:hi])
            elif dxs is not None:
                dxs[lo:hi].addmm_(d, w_gate_up[e, rows])
    if on_input and need_w:
        d_weights = _routing_weight_grad(r, dxs, xs, weights)
    if on_input and need_x:
        dxs = _scaled(dxs, w_sorted)
    dx = r.combine(dxs, x.shape[0]).to(x.dtype) if need_x else None
    return dx, d_weights, dw_gu, dw_d, db_gu, db_d


class _MoEFFN(torch.autograd.Function):
    """Eager calls with autograd (torch.compile traces the custom-op pair below instead)."""

    @staticmethod
    def forward(ctx, x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, gate, on_input):
        out, gu, ys, r = _forward(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, gate, on_input,
                                  keep=True)
        ctx.save_for_backward(x, weights, w_gate_up, w_down, gu, ys if weights.requires_grad else None)
        ctx.routing, ctx.gate, ctx.on_input = r, gate, on_input
        return owned(out)

    @staticmethod
    def backward(ctx, d_out):
        x, weights, w_gate_up, w_down, gu, ys = ctx.saved_tensors
        need_x, _, need_w, need_wgu, need_wd, need_bgu, need_bd, _, _ = ctx.needs_input_grad
        grads = _backward(d_out, x, ctx.routing, weights, w_gate_up, w_down, gu, ys, ctx.gate, ctx.on_input,
                          (need_x, need_w, need_wgu, need_wd, need_bgu, need_bd))
        dx, d_weights, *weight_grads = grads
        return dx, None, d_weights, *weight_grads, None, None


# ---- under torch.compile: a custom-op pair (the loop over experts reads row counts on the host,
# which would break the graph; as ops the compiler sees two opaque calls) ----------------------
@torch.library.custom_op("fastformer::moe_ffn", mutates_args=())
def _moe_op(x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
            b_gate_up: Optional[Tensor], b_down: Optional[Tensor], activation: str, interleaved: bool,
            alpha: float, limit: float, gated: bool, on_input: bool, keep: bool) -> list[Tensor]:
    """[out, gu, ys]; gu and ys empty unless keep (and on_input: ys empty)."""
    gate = _Gate(activation, interleaved, alpha, limit, gated)
    out, gu, ys, _ = _forward(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, gate, on_input, keep)
    return [out, x.new_empty((0,)) if gu is None else gu, x.new_empty((0,)) if ys is None else ys]


@_moe_op.register_fake
def _(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, activation, interleaved, alpha, limit, gated,
      on_input, keep):
    S = ids.numel()
    gu = x.new_empty((S, w_gate_up.shape[1])) if keep else x.new_empty((0,))
    ys = x.new_empty((S, x.shape[1])) if keep and not on_input else x.new_empty((0,))
    return [x.new_empty(x.shape), gu, ys]


@torch.library.custom_op("fastformer::moe_ffn_bwd", mutates_args=())
def _moe_bwd_op(d_out: Tensor, x: Tensor, ids: Tensor, weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
                gu: Tensor, ys: Tensor, activation: str, interleaved: bool, alpha: float, limit: float,
                gated: bool, on_input: bool, needs: list[bool]) -> list[Tensor]:
    gate = _Gate(activation, interleaved, alpha, limit, gated)
    r = _Routing(ids, w_gate_up.shape[0])
    grads = _backward(d_out, x, r, weights, w_gate_up, w_down, gu, ys, gate, on_input, needs)
    return [g if g is not None else x.new_empty((0,)) for g in grads]


@_moe_bwd_op.register_fake
def _(d_out, x, ids, weights, w_gate_up, w_down, gu, ys, activation, interleaved, alpha, limit, gated, on_input,
      needs):
    E, F2, D = w_gate_up.shape
    like = (x.new_empty(x.shape), weights.new_empty(weights.shape), torch.empty_like(w_gate_up),
            torch.empty_like(w_down), w_gate_up.new_empty((E, F2)), w_down.new_empty((E, D)))
    return [t if need else x.new_empty((0,)) for t, need in zip(like, needs)]


def _moe_op_setup(ctx, inputs, output):
    x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, *options, keep = inputs
    ctx.save_for_backward(x, ids, weights, w_gate_up, w_down, output[1], output[2])
    ctx.options = options
    ctx.needs = [t is not None and t.requires_grad
                 for t in (x, weights, w_gate_up, w_down, b_gate_up, b_down)]


def _moe_op_backward(ctx, grads):
    x, ids, weights, w_gate_up, w_down, gu, ys = ctx.saved_tensors
    out = _moe_bwd_op(grads[0], x, ids, weights, w_gate_up, w_down, gu, ys, *ctx.options, ctx.needs)
    dx, d_weights, dw_gu, dw_d, db_gu, db_d = (g if need else None for g, need in zip(out, ctx.needs))
    return dx, None, d_weights, dw_gu, dw_d, db_gu, db_d, None, None, None, None, None, None, None


_moe_op.register_autograd(_moe_op_backward, setup_context=_moe_op_setup)


def _combine_outputs(r: _Routing, ys: Tensor, weights: Optional[Tensor], x: Tensor) -> Tensor:
    """(N, D) in x's dtype: each token's slots summed, each times its weight (N, k) unless the
    weights scaled the inputs (None)."""
    return r.combine(ys, x.shape[0], weights).to(x.dtype)


def _routing_weight_grad(r: _Routing, a: Tensor, b: Tensor, weights: Tensor) -> Tensor:
    """d expert_weights (N, k): the row dot products of a and b (S, D, sorted order) in the
    accumulation dtype, back in the (token, slot) order."""
    d_sorted = (a * b).sum(1, dtype=ref_ffn.acc_dtype(b.dtype))
    d_weights = torch.empty_like(d_sorted)
    d_weights[r.order] = d_sorted
    return d_weights.view(weights.shape).to(weights.dtype)


def _expert_grad_buffer(w: Tensor, r: _Routing) -> Tensor:
    """The (E, ...) gradient of stacked expert weights, in w's layout (a transposed view of
    weights stored (E, D, 2F) gets a buffer whose transpose is contiguous: the parameter's
    gradient then needs no transposing copy, 127 ms for gpt-oss-style (16, 1024, 2048) bf16
    experts on the 2-core Xeon); the slices of experts without rows are zero, the others are
    written whole by _weight_grad_into."""
    buf = torch.empty_like(w)
    used = torch.zeros(w.shape[0], dtype=torch.bool)
    for e, _, _ in r.spans:
        used[e] = True
    if not bool(used.all()):
        buf[~used.to(w.device)] = 0
    return buf


def _weight_grad_into(out: Tensor, dy: Tensor, x: Tensor) -> None:
    """out = dy^T x (an expert's (out, in) weight gradient): weight_grad.cpp where it takes the
    call (bf16 on AMX) and out is contiguous, else torch's GEMM writing the slice (a transposed
    one too: torch computes out^T = x^T dy in place)."""
    if out.is_contiguous() and weight_grad_kernel_takes(dy, x):
        out.copy_(weight_grad(dy, x))
    else:
        torch.mm(dy.t(), x, out=out)


def _check(fn, x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, gated: bool = True) -> None:
    _checks.tensor(fn, "x", x, dims=(2,))
    _checks.tensor(fn, "w_gate_up", w_gate_up, dims=(3,))
    _checks.tensor(fn, "w_down", w_down, dims=(3,))
    _checks.tensor(fn, "b_gate_up", b_gate_up, dims=(2,), optional=True)
    _checks.tensor(fn, "b_down", b_down, dims=(2,), optional=True)
    _checks.tensor(fn, "expert_weights", weights, dims=(2,))
    if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32):
        got = ids.dtype if isinstance(ids, Tensor) else type(ids).__name__
        raise TypeError(f"{fn}: `expert_ids` must be an int64 or int32 tensor, got {got}")
    _checks.same_device(fn, "x", x, expert_ids=ids, expert_weights=weights, w_gate_up=w_gate_up,
                        w_down=w_down, b_gate_up=b_gate_up, b_down=b_down)
    _checks.same_dtype(fn, "x", x, w_gate_up=w_gate_up, w_down=w_down)
    N, D = x.shape
    E, F2, Dg = w_gate_up.shape
    if not gated:
        if Dg != D:
            raise ValueError(f"{fn}: `w_gate_up` must be (E, F, D) with D = {D} (x's last dim), the up "
                             f"rows (gated=False); got {tuple(w_gate_up.shape)}")
    elif Dg != D or F2 % 2:
        raise ValueError(f"{fn}: `w_gate_up` must be (E, 2F, D) with D = {D} (x's last dim), the gate "
                         f"rows then the up rows; got {tuple(w_gate_up.shape)}")
    F_ = F2 // 2 if gated else F2
    if tuple(w_down.shape) != (E, D, F_):
        raise ValueError(f"{fn}: `w_down` must be (E, D, F) = {(E, D, F_)} to match `w_gate_up` "
                         f"{tuple(w_gate_up.shape)}; got {tuple(w_down.shape)}")
    for name, b, want in (("b_gate_up", b_gate_up, (E, F2)), ("b_down", b_down, (E, D))):
        if b is not None and tuple(b.shape) != want:
            raise ValueError(f"{fn}: `{name}` must have shape {want}, got {tuple(b.shape)}")
    if ids.dim() != 2 or ids.shape[0] != N:
        raise ValueError(f"{fn}: `expert_ids` must be (N, k) with N = {N} rows of x, got {tuple(ids.shape)}")
    if tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"{fn}: `expert_weights` must have `expert_ids`'s shape {tuple(ids.shape)}, "
                         f"got {tuple(weights.shape)}")
    if ids.numel() and not torch.compiler.is_compiling():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"{fn}: `expert_ids` must be in [0, {E}) (E = w_gate_up.shape[0]), got "
                             f"values in [{lo}, {hi}]")


def _gate(fn: str, activation, interleaved, alpha, limit, gated) -> _Gate:
    _checks.flag(fn, "gated", gated)
    names = (*ref_ffn.ACTIVATIONS, CLAMPED_SWIGLU) if gated else ref_ffn.ACTIVATIONS
    if activation not in names:
        raise ValueError(f"{fn}: `activation` must be one of {', '.join(names)}"
                         f"{'' if gated else ' with gated=False'}, got {activation!r}")
    _checks.flag(fn, "interleaved", interleaved)
    if not gated and (interleaved or limit is not None):
        raise ValueError(f"{fn}: experts without a gate (gated=False) take neither `interleaved` nor "
                         f"`swiglu_limit`, got interleaved={interleaved!r}, swiglu_limit={limit!r}")
    alpha = _checks.number(fn, "swiglu_alpha", alpha, finite=True)
    if limit is None:  # gpt-oss's limit for its gate; no clamp for the others
        limit = GPT_OSS_LIMIT if activation == CLAMPED_SWIGLU else 0.0
    else:
        limit = _checks.number(fn, "swiglu_limit", limit, lo=0.0, lo_open=True, finite=True)
    return _Gate(activation, interleaved, alpha, float(limit), gated)


def moe_ffn(x: Tensor, expert_ids: Tensor, expert_weights: Tensor, w_gate_up: Tensor, w_down: Tensor,
            b_gate_up: Optional[Tensor] = None, b_down: Optional[Tensor] = None, *,
            activation: str = "silu", interleaved: bool = False, swiglu_alpha: float = 1.702,
            swiglu_limit: Optional[float] = None, weights_on: str = "output", gated: bool = True) -> Tensor:
    """The routed experts of a mixture-of-experts layer, each a gated FFN (SwiGLU with "silu",
    GeGLU with "gelu" / "gelu_tanh") or, with ``gated=False``, a plain one (NemotronH's relu2
    experts), grouped by expert.

    Args:
        x: (N, D) token rows.
        expert_ids: (N, k) int64 / int32: the experts each token is routed to, in [0, E).
        expert_weights: (N, k): each routed expert's weight (the router's top-k probabilities);
            may require grad.
        w_gate_up: (E, 2F, D): expert e's gate projection (rows 0..F) and up projection (rows
            F..2F), Hugging Face's concatenated layout; with ``interleaved=True`` gate and up rows
            alternate (gate at even rows: gpt-oss). w_down: (E, D, F). Any strides (a transposed
            view of weights stored (E, D, 2F) / (E, F, D) included).
        b_gate_up: (E, 2F), in w_gate_up's row order; b_down: (E, D); optional.
        activation: "silu", "gelu", "gelu_tanh", "relu", "quick_gelu" or "relu2", applied to the gate
            (h = act(gate) * up); or "clamped_swiglu", gpt-oss's: gate clamped above at
            swiglu_limit, up to [-swiglu_limit, swiglu_limit], h = (up + 1) * gate *
            sigmoid(swiglu_alpha * gate).
        swiglu_limit: "clamped_swiglu"'s limit (None: gpt-oss's 7.0); with the other
            activations None (no clamp) or L > 0: the gate clamped above at L and up to [-L, L]
            before act(gate) * up (DeepSeek-V4's experts), the clamps passing the gradient where
            their bounds hold.
        weights_on: "output" (Mixtral, ...: each expert's output times its weight) or "input"
            (Llama 4: the expert reads its weight times x, rounded to x's dtype, and the outputs
            are summed unweighted).
        gated: False for experts without a gate projection: ``w_gate_up`` (E, F, D) (and
            ``b_gate_up`` (E, F)) is the up projection alone and h = act(up); ``activation`` then one
            of the FFN's (not "clamped_swiglu"), no ``interleaved`` or ``swiglu_limit``.

    Returns:
        (N, D) in x's dtype: ``sum_j expert_weights[n, j] * expert_{expert_ids[n, j]}(x[n])``
        (``sum_j expert_{expert_ids[n, j]}(expert_weights[n, j] * x[n])`` with
        weights_on="input"), the slots summed in the promoted dtype of the experts' outputs and
        the weights. Gradients for x, expert_weights and every weight and bias.
    """
    fn = "moe_ffn"
    gate = _gate(fn, activation, interleaved, swiglu_alpha, swiglu_limit, gated)
    if weights_on not in ("output", "input"):
        raise ValueError(f"{fn}: `weights_on` must be 'output' or 'input', got {weights_on!r}")
    on_input = weights_on == "input"
    _check(fn, x, expert_ids, expert_weights, w_gate_up, w_down, b_gate_up, b_down, gated)
    tensors = (x, expert_weights, w_gate_up, w_down, b_gate_up, b_down)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if torch.compiler.is_compiling():
        return _moe_op(x, expert_ids, expert_weights, w_gate_up, w_down, b_gate_up, b_down, activation,
                       interleaved, float(swiglu_alpha), gate.limit, gated, on_input, grad)[0]
    if grad:
        return _MoEFFN.apply(x, expert_ids, expert_weights, w_gate_up, w_down, b_gate_up, b_down, gate, on_input)
    return _forward(x, expert_ids, expert_weights, w_gate_up, w_down, b_gate_up, b_down, gate, on_input,
                    keep=False)[0]


__all__ = ["moe_ffn"]
