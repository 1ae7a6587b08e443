"""Linear layer + cross-entropy fused and chunked over tokens (ff.linear_cross_entropy): the
chunk loop every backend runs, and the plain-PyTorch row pass (the reference backend's, and the
semantics of the kernels' row passes: csrc/cpu/linear_cross_entropy.cpp,
triton_kernels/linear_cross_entropy.py).

Semantics, for N tokens x (N, d), weight W (V, d), bias b (V,), targets t (N,):

    z = x W^T + b                      (N, V): never materialized whole
    s = softcap * tanh(z / softcap)    with a softcap, else s = z
    lse_i = log sum_j exp(s_ij)
    loss_i = lse_i - (1 - eps) s_{i t_i} - (eps / V) sum_j s_ij     (eps = label_smoothing)
           = F.cross_entropy(s, t, label_smoothing=eps, reduction="none")_i; 0 if t_i == ignore_index
    "mean": sum_i loss_i / #{i: t_i != ignore_index} (NaN if there is none, as torch);
    "sum": sum_i loss_i;  "none": the loss_i.
    d loss_i / d z_ij = (softmax(s_i)_j - eps / V - (1 - eps) [j == t_i]) (1 - (s_ij / softcap)^2)

The loss is returned in the accumulation dtype, fp32 (fp64 for fp64 inputs), as HF's
``loss_function`` (it upcasts the logits) and Liger-Kernel return it; gradients in the
dtypes of x, W and b.

Algorithm, per chunk of C tokens (``chunk_rows``):
  1. z_c = x_c W^T (+ b)                  GEMM (torch.mm / addmm: oneDNN or MKL on CPU, cuBLAS;
                                          TorchGemms below, or a backend's own: the cpu one's
                                          packed GEMM where torch's is generic code)
                                          into a (C, V) buffer in x's dtype, fp32 accumulation
  2. row pass over z_c                    max, log-sum-exp, loss_i, and for "mean" / "sum" with
                                          gradients, d loss / d z_c times 1 / #valid (mean)
                                          written over z_c in place (one sweep more)
  3. dx_c = dz_c W                        GEMM, written to dx's rows: complete per chunk
  4. dW += dz_c^T x_c,  db += sum_i dz_c  GEMM accumulated over the chunks (below)
The loss being a scalar, its upstream gradient g is one number: the backward only returns
g * (dx, dW, db) (the tensors themselves when g == 1 on the eager route, as Liger does).

``reduction="none"``: the upstream gradient differs per token and dW = sum_i g_i dz_i^T x_i
cannot be formed before it is known. The forward then runs steps 1-2 without gradients and
keeps lse (N,) fp32; the backward recomputes each chunk's z_c (step 1), writes
dz = g_i (softmax - one-hot ...) from the saved lse (no max / sum sweeps) and runs steps 3-4:
4 GEMMs in all instead of 3, and an evaluation forward does 1. Precomputing dx in the forward
would not save the backward's recomputation of z (dW needs g), only move a GEMM.

d weight accumulation, by dtype: fp32 / fp64, addmm_ into dW in place (beta = 1; with GEMMs
that return new tensors, the packed GEMM's, per vocab slice as below, added in fp32). bf16: the
chunk's partial products are bf16 GEMM outputs (torch's CPU GEMMs have no fp32 output for
bf16 inputs), computed over vocab slices of SLICE_ELEMENTS into a small temporary and added
into a compensated pair (hi, lo) of bf16 buffers (hi + lo carries ~16 significant bits:
t = hi + lo + p in fp32, hi = bf16(t), lo = bf16(t - hi)); at the end hi + lo is rounded once
into hi, the result. That is the accuracy of an fp32 accumulator (the partials themselves are
rounded once, as eager's single bf16 GEMM output is) in the memory of one fp32 buffer with no
separate copy for the output: an fp32 accumulator plus its bf16 copy would be 188 MiB at
(V, d) = (32000, 1024), 25% of eager's whole peak, and accumulating in bf16 rounds the running
sum once per chunk (2.5-4x eager's error, measured at 4-32 chunks). fp16: an fp32 accumulator
(an fp16 lo would underflow for small gradients), converted at the end.

Memory beyond the inputs, "mean" / "sum" with every gradient: the chunk C * V * elem, dx
(N, d), dW (V, d) (bf16: hi + lo, 2 * V * d * 2 bytes until the end, plus the vocab-slice
temporary SLICE_ELEMENTS * 2 bytes; fp16: + an fp32 V * d), db fp64 (V,). At
(N, d, V) = (4096, 1024, 32000), C = 512: fp32 125 MiB (dW) + 16 (dx) + 62 (chunk) = 203 MiB
measured; bf16 125 (hi + lo) + 8 (dx) + 31 (chunk) + 8 (slice) = 173 MiB measured. Eager's
F.cross_entropy(x @ W.T, t) keeps the logits, log_softmax and their gradients: 1500 / 750 MiB
measured (13.5% and 23% of it; benchmarks/loss.py). The backward adds nothing when the
upstream gradient is 1 on the eager route, else one scaled copy of each gradient.

Memory traffic, per chunk: W is read twice (steps 1 and 3: 2 V d elem bytes), dW read and
written once (step 4: 8 V d bytes, fp32 or the bf16 pair; the bf16 partial goes through an
L2 / L3-sized slice), x_c read twice and dx_c written once; the chunk z_c is written by step
1, read and rewritten by the row pass (one sweep from memory, the others from L2 per row) and
read by steps 3 and 4. Over the call: (N / C) (2 V d elem + 8 V d) + ~5 N V elem bytes, ~6 GB
in fp32 at the shape above, against 6 N d V = 805 GFLOP: GEMM-bound (measured ~160 GFLOP/s
fp32 and ~590 bf16, the rates of torch's own GEMMs on this machine). Fewer, larger chunks cut
the W / dW passes; the chunk's bytes bound the memory.

Chunk size (``chunk_rows``): the largest C with C * V * max(4, elem) <= CHUNK_BYTES (the
logits counted at fp32 size: a bf16 chunk holds as many tokens in half the bytes), at least
1, then evened out so that the chunks have the same size. CHUNK_BYTES = 64 MiB: 512 tokens at
V = 32000. Measured forward + backward at (4096, 1024, 32000) on a 2-core AMD EPYC (Zen 5,
AVX512-BF16; median of 3, other work on the machine), time / peak MiB by tokens per chunk:
    fp32:  64: 6.83 s / 149   128: 6.00 / 157   256: 5.21 / 172   512: 4.98 / 203   1024: 4.84 / 266
    bf16: 128: 1.68 s / 149   256: 1.43 / 157   512: 1.36 / 173  1024: 1.37 / 208   2048: 1.36 / 271
(eager: fp32 10.9 s / 1500 MiB, bf16 2.8 s / 750). Below 512 tokens the GEMMs are smaller and
the dW passes more; above, fp32 gains 3% for 63 MiB more and bf16 nothing, while its peak
passes 25% of eager's (208 / 750 at 1024).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

NONE, MEAN, SUM = 0, 1, 2
REDUCTIONS = {"none": NONE, "mean": MEAN, "sum": SUM}

# Bytes of one chunk of logits counted at max(4, element size) bytes per logit (fp32, the row
# pass's precision: a bf16 chunk holds as many tokens as an fp32 one, in half the bytes); see
# the module docstring for the measurement.
CHUNK_BYTES = 64 << 20
# Elements of one vocab slice of a bf16 / fp16 chunk's d weight partial (the temporary).
SLICE_ELEMENTS = 4 << 20


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows(tokens: int, vocab: int, element_size: int) -> int:
    """Tokens per chunk: the most whose logits fit CHUNK_BYTES (at max(4, element_size) bytes
    each), evened out over the chunks."""
    rows = max(1, CHUNK_BYTES // max(1, vocab * max(4, element_size)))
    if tokens <= rows:
        return max(1, tokens)
    n_chunks = -(-tokens // rows)
    return -(-tokens // n_chunks)


def check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    """Every target in [0, vocab) or ignore_index (a ValueError naming `target`; on CUDA an
    asynchronous device assert, no synchronization)."""
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if target.device.type == "cpu":
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"linear_cross_entropy: `target` must hold class indices in [0, "
                             f"{vocab}) (the rows of `weight`) or ignore_index={ignore_index}; "
                             f"got {int(target[i])} at flat index {i}")
    else:
        torch._assert_async(~bad.any(), "linear_cross_entropy: `target` out of range")


class TorchGemms:
    """The chunk loop's three GEMMs on torch's (oneDNN / MKL on CPU, cuBLAS). A backend may pass
    its own with the same methods (ops/linear_cross_entropy.py: the packed GEMM on CPUs whose
    torch GEMM in the dtype is generic code)."""

    # weight_grad_add() accumulates in place (addmm_); else WeightGrad adds vocab slices
    accumulates_in_place = True

    @staticmethod
    def logits(xc: Tensor, weight: Tensor, bias: Optional[Tensor], out: Tensor) -> Tensor:
        """out = xc W^T (+ b): the chunk's logits (C, V)."""
        if bias is None:
            return torch.mm(xc, weight.t(), out=out)
        return torch.addmm(bias, xc, weight.t(), out=out)

    @staticmethod
    def input_grad(dz: Tensor, xc: Tensor, weight: Tensor, out: Tensor) -> None:
        """out = dz W: the chunk's rows of dx (xc: the chunk's inputs, for the kernels' shapes)."""
        torch.mm(dz, weight, out=out)

    @staticmethod
    def weight_grad(dz: Tensor, xc: Tensor, out: Tensor) -> Tensor:
        """dz^T xc for a vocab slice dz (C, s) of the chunk's gradient; returns it (in out)."""
        return torch.mm(dz.t(), xc, out=out)

    @staticmethod
    def weight_grad_add(acc: Tensor, dz: Tensor, xc: Tensor) -> None:
        """acc += dz^T xc in place (accumulates_in_place)."""
        acc.addmm_(dz.t(), xc)


def _chunks(tokens: int, rows: int):
    for start in range(0, tokens, rows):
        yield start, min(tokens, start + rows)


# ---- the row pass ------------------------------------------------------------------------------
def rows(z: Tensor, target: Tensor, loss: Tensor, lse: Tensor, o, scale, row_scale: Optional[Tensor],
         compute_loss: bool, write_grad: bool, dbias: Optional[Tensor]) -> None:
    """The row pass over one chunk z (C, V) (semantics of every backend's row pass).

    compute_loss: write loss (C,) and lse (C,) (accumulation dtype; 0 at ignored rows); else
    read lse. write_grad: overwrite z with d loss_i / d z_i * scale (* row_scale_i), 0 at
    ignored rows, and add its column sums to dbias (fp64 (V,)) if given."""
    acc = acc_dtype(z.dtype)
    V = z.shape[1]
    zf = z.to(acc)
    cap, eps = o.softcap, o.label_smoothing
    s = cap * torch.tanh(zf / cap) if cap > 0 else zf
    ignored = target == o.ignore_index
    t = torch.where(ignored, 0, target)[:, None]
    if compute_loss:
        row_lse = torch.logsumexp(s, 1)
        l = row_lse - (1 - eps) * s.gather(1, t)[:, 0]
        if eps > 0:
            l = l - (eps / V) * s.sum(1)
        loss.copy_(l.masked_fill(ignored, 0))
        lse.copy_(row_lse.masked_fill(ignored, 0))
    else:
        row_lse = lse
    if not write_grad:
        return
    g = torch.exp(s - row_lse[:, None]) - eps / V
    g.scatter_add_(1, t, torch.full(t.shape, eps - 1, dtype=acc, device=z.device))
    if cap > 0:
        g = g * (1 - (s / cap) ** 2)
    if row_scale is not None:
        g = g * (scale * row_scale)[:, None]
    elif not (isinstance(scale, float) and scale == 1.0):
        g = g * scale
    z.copy_(torch.where(ignored[:, None], 0, g))
    if dbias is not None:
        dbias.add_(z.sum(0, dtype=torch.float64))


def pair_add(hi: Tensor, lo: Optional[Tensor], p: Tensor, read_lo: bool = True,
             write_lo: bool = True) -> None:
    """hi + lo += p in place (t = hi + lo + p in fp32; hi = t rounded; lo = (t - hi) rounded).
    read_lo False: lo holds nothing yet (taken as 0); write_lo False: the last addition, lo is
    left as it is (hi is the result)."""
    t = hi.float() + p.float()
    if read_lo:
        t += lo.float()
    hi.copy_(t)
    if write_lo:
        lo.copy_(t - hi.float())


RowsFn = Callable[..., None]


class WeightGrad:
    """dW = sum over chunks of dz_c^T x_c (the module docstring's accumulation by dtype). No
    buffer is zero-filled: the first chunk's GEMM writes the accumulator (bf16: hi) itself, the
    pair's lo is first written by the second chunk's addition, and the last chunk's addition
    (add(..., last=True)) rounds hi + lo + p into hi, the result. Filling the (V, d) buffers
    took 35 ms each at (32000, 2048) bf16 on a 2-core Xeon (fresh pages), 7% of a Llama-style
    bf16 training step's time with the final hi + lo pass."""

    def __init__(self, weight: Tensor, pair_add_fn: Callable, gemms=TorchGemms):
        V, d = weight.shape
        self.dtype = weight.dtype
        self.pair_add = pair_add_fn
        self.gemms = gemms
        self.chunks = 0          # chunks added so far
        self.lo_written = False  # the pair's lo holds the running low part
        opts = dict(dtype=weight.dtype, device=weight.device)
        self.slice = max(1, SLICE_ELEMENTS // max(1, d))
        direct = weight.dtype in (torch.float32, torch.float64)
        if not (direct and gemms.accumulates_in_place):
            self.tmp = torch.empty((min(self.slice, V), d), **opts)
        if direct:
            self.mode = "direct"
            self.acc = torch.empty((V, d), **opts)
        elif weight.dtype == torch.bfloat16:
            self.mode = "pair"
            self.hi = torch.empty((V, d), **opts)
            self.lo = None
        else:
            self.mode = "fp32"
            self.acc = torch.empty((V, d), dtype=torch.float32, device=weight.device)

    def add(self, dz: Tensor, xc: Tensor, last: bool = False) -> None:
        first = self.chunks == 0
        self.chunks += 1
        if self.gemms.accumulates_in_place:
            if self.mode == "direct" and not first:
                self.gemms.weight_grad_add(self.acc, dz, xc)
                return
            if self.mode in ("direct", "pair") and first:
                self.gemms.weight_grad(dz, xc, self.acc if self.mode == "direct" else self.hi)
                return
        V = dz.shape[1]
        write_lo = self.mode == "pair" and not (first or last)  # a first chunk's p is copied to hi
        if write_lo and self.lo is None:
            self.lo = torch.empty_like(self.hi)
        for v0 in range(0, V, self.slice):
            v1 = min(V, v0 + self.slice)
            p = self.gemms.weight_grad(dz[:, v0:v1], xc, self.tmp[:v1 - v0])
            if self.mode == "pair" and first:
                self.hi[v0:v1].copy_(p)
            elif self.mode == "pair":
                lo = self.lo[v0:v1] if self.lo is not None else None
                self.pair_add(self.hi[v0:v1], lo, p, self.lo_written, write_lo)
            elif first:
                self.acc[v0:v1].copy_(p)
            else:
                self.acc[v0:v1].add_(p)
        self.lo_written = write_lo

    def result(self) -> Tensor:
        self.tmp = None
        if self.chunks == 0:  # no tokens: nothing was written, the gradient is 0
            return (self.hi if self.mode == "pair" else self.acc).zero_().to(self.dtype)
        if self.mode == "direct":
            return self.acc
        if self.mode == "pair":
            hi, lo, written = self.hi, self.lo, self.lo_written
            self.lo = None
            return hi.add_(lo) if written else hi  # one rounding of hi + lo
        return self.acc.to(self.dtype)


# ---- forward and backward ------------------------------------------------------------------
def _sweep(x: Tensor, weight: Tensor, bias: Optional[Tensor], dx: Optional[Tensor],
           dw: Optional["WeightGrad"], row_pass: Callable, gemms=TorchGemms):
    """The chunk loop: per chunk of rows, its logits z = x W^T + b into one reused (C, V)
    buffer, row_pass(z, span) (which may overwrite z with its gradient), then dx[span] = z W
    and dW += z^T x[span] when asked."""
    N = x.shape[0]
    V = weight.shape[0]
    C = chunk_rows(N, V, x.element_size())
    buf = x.new_empty((C, V)) if N else None
    for start, end in _chunks(N, C):
        z, xc, span = buf[:end - start], x[start:end], slice(start, end)
        gemms.logits(xc, weight, bias, z)
        row_pass(z, span)
        if dx is not None:
            gemms.input_grad(z, xc, weight, dx[span])
        if dw is not None:
            dw.add(z, xc, last=end == N)


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], o, rows_fn: RowsFn = rows,
            pair_add_fn: Callable = pair_add, gemms=TorchGemms):
    """Returns (loss, dx, dweight, dbias, lse): the loss ((N,) for "none", else 0-dim) and lse
    (N,) in the accumulation dtype; for "mean" / "sum", the gradients the options ask for
    (grad_x, grad_weight, grad_bias), else empty tensors."""
    N, d = x.shape
    V = weight.shape[0]
    acc = acc_dtype(x.dtype)
    target = o.target
    check_targets(target, V, o.ignore_index)
    valid = (target != o.ignore_index).sum()
    need_dx = o.reduction != NONE and o.grad_x
    need_dw = o.reduction != NONE and o.grad_weight
    need_db = o.reduction != NONE and o.grad_bias and bias is not None
    grads = need_dx or need_dw or need_db
    loss_rows = torch.empty(N, dtype=acc, device=x.device)
    lse = torch.empty(N, dtype=acc, device=x.device)
    dx = x.new_empty((N, d) if need_dx else (0,))
    dw = WeightGrad(weight, pair_add_fn, gemms) if need_dw else None
    db = torch.zeros(V, dtype=torch.float64, device=x.device) if need_db else None
    scale = 1.0
    if grads and o.reduction == MEAN:
        scale = 1.0 / valid.to(acc)
    _sweep(x, weight, bias, dx if need_dx else None, dw,
           lambda z, span: rows_fn(z, target[span], loss_rows[span], lse[span], o, scale, None,
                                   True, grads, db), gemms)
    if o.reduction == NONE:
        loss = loss_rows
    elif o.reduction == SUM:
        loss = loss_rows.sum(dtype=torch.float64).to(acc)
    else:
        loss = (loss_rows.sum(dtype=torch.float64) / valid).to(acc)
    dweight = dw.result() if dw is not None else weight.new_empty((0,))
    dbias = db.to(bias.dtype) if db is not None else weight.new_empty((0,))
    return loss, dx, dweight, dbias, lse


def backward_none(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], lse: Tensor, o,
                  needs, rows_fn: RowsFn = rows, pair_add_fn: Callable = pair_add, gemms=TorchGemms):
    """reduction="none": (dx, dweight, dbias) for the upstream gradient (N,) of the losses,
    each chunk's logits recomputed (None where not needed)."""
    N, d = x.shape
    V = weight.shape[0]
    need_dx, need_dw = bool(needs[0]), bool(needs[1])
    need_db = bool(needs[2]) and bias is not None
    if not (need_dx or need_dw or need_db):
        return None, None, None
    g = grad.reshape(-1).to(acc_dtype(x.dtype)).contiguous()
    dx = x.new_empty((N, d)) if need_dx else None
    dw = WeightGrad(weight, pair_add_fn, gemms) if need_dw else None
    db = torch.zeros(V, dtype=torch.float64, device=x.device) if need_db else None
    target = o.target
    _sweep(x, weight, bias, dx, dw,
           lambda z, span: rows_fn(z, target[span], lse[span], lse[span], o, 1.0, g[span],
                                   False, True, db), gemms)
    return (dx, dw.result() if dw is not None else None,
            db.to(bias.dtype) if db is not None else None)


def scale_grads(grad: Tensor, precomputed, needs, alias: bool):
    """"mean" / "sum": the forward's gradients times the upstream gradient (a scalar). alias:
    return the tensors themselves when it is 1 (the eager route; a custom op must not return
    an alias of its input)."""
    one = alias and bool(grad == 1)
    return tuple(None if not need or t is None else (t if one else t * grad)
                 for t, need in zip(precomputed, needs))
