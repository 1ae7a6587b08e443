"""Layers suite: ff.TransformerEncoderLayer / DecoderLayer vs torch.nn's, same weights.

Cases (B=8 (B=2 in the default run), L=512, d_model=512, nhead=8, dim_feedforward=2048,
batch_first, post-norm, ReLU):
  encoder layer; decoder layer (causal self-attention, cross-attention over a memory of
  L=512), each
  * train: one training step (forward + backward to every parameter and the input) in train
    mode with dropout 0.1, vs the nn layer in train mode;
  * inference: eval mode under torch.no_grad(), vs the nn layer there, which for the encoder
    is torch's fused fast path (torch._transformer_encoder_layer_fwd; the decoder has none).
FLOPs: the GEMMs (QKV, output and FFN projections) and attention (4*B*H*Lq*Lk*D, half when
causal); a training step counts 3x the forward (attention's backward: 2.5x its forward).

Baselines that would take longer than BUDGET_S per call are skipped with their estimate, from
their throughput on a calibration shape measured in this run (as benchmarks/attention.py does):
torch's bf16 GEMMs run at ~3 GFLOP/s per core on CPUs without AVX512-BF16/AMX.
"""
from __future__ import annotations

import copy
import os
import time

import torch
from torch import nn

import fastformer as ff

from .common import Row, max_abs_err, policy_tolerance

B, L, D_MODEL, NHEAD, FFD = 8, 512, 512, 8, 2048
CALIBRATION = (1, 128)  # (batch, length) with the same widths
BUDGET_S = float(os.environ.get("FASTFORMER_BENCH_BUDGET_S", "20"))
QUICK_BATCH = 2  # the default run: the encoder layer at B = 2 (a quarter of B's work)
# Verdict bound on max_err (common.policy_tolerance): the post-norm outputs reach |y| ~ 5.2;
# the nn layer's own max error on these inputs, bf16 0.054 and fp16 0.007 (the decoder's).
TOLERANCE = policy_tolerance(magnitude=5.5, eager_err={"bfloat16": 0.054, "float16": 0.007})


def flops(kind: str, batch: int, length: int, mode: str) -> float:
    rows = batch * length
    proj = 2 * rows * D_MODEL * D_MODEL
    attn = 4 * batch * length * length * D_MODEL  # summed over heads: H * D = d_model
    ffn = 2 * 2 * rows * D_MODEL * FFD
    if kind == "encoder":
        fwd = 4 * proj + attn + ffn
    else:  # self-attention (causal) + cross-attention (memory of the same length) + FFN
        fwd = (4 * proj + attn / 2) + (4 * proj + attn) + ffn
    return fwd * (3.0 if mode == "train" else 1.0)


def _layers(kind: str, dtype, device):
    cls_nn, cls_ff = ((nn.TransformerEncoderLayer, ff.TransformerEncoderLayer) if kind == "encoder"
                      else (nn.TransformerDecoderLayer, ff.TransformerDecoderLayer))
    torch.manual_seed(0)
    ref = cls_nn(D_MODEL, NHEAD, FFD, dropout=0.1, batch_first=True, device=device, dtype=dtype)
    ours = cls_ff(D_MODEL, NHEAD, FFD, dropout=0.1, batch_first=True, device=device, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    return {"ours": ours, "nn": ref}


def _inputs(kind: str, batch: int, length: int, dtype, device, grad: bool):
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda: torch.randn(batch, length, D_MODEL, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    x = mk().requires_grad_(grad)
    if kind == "encoder":
        return (x,), {}
    causal = nn.Transformer.generate_square_subsequent_mask(length, device=device, dtype=dtype)
    return (x, mk()), dict(tgt_mask=causal, tgt_is_causal=True)


def _step(layer, args, kwargs, mode):
    if mode == "inference":
        layer.eval()

        def run():
            with torch.no_grad():
                return layer(*args, **kwargs)
        return run
    layer.train()
    params = [p for p in layer.parameters()]
    grad_out = torch.randn_like(args[0])

    def run():
        out = layer(*args, **kwargs)
        return torch.autograd.grad(out, params + [args[0]], grad_out)
    return run


_rates: dict = {}


def _rate(name, kind, dtype, mode, device):
    """GFLOP/s of a candidate on the calibration shape (measured once per run)."""
    key = (name, kind, dtype, mode)
    if key not in _rates:
        layer = _layers(kind, dtype, device)[name]
        args, kwargs = _inputs(kind, *CALIBRATION, dtype, device, mode == "train")
        fn = _step(layer, args, kwargs, mode)
        fn()
        start = time.perf_counter()
        fn()
        _rates[key] = flops(kind, *CALIBRATION, mode) / (time.perf_counter() - start) / 1e9
    return _rates[key]


def cases(device: str, dtypes: list, quick: bool = False):
    """Every case; quick: the representative ones fastformer-bench runs without --full."""
    for kind in (("encoder",) if quick else ("encoder", "decoder")):
        for dtype in dtypes:
            for mode in ("train", "inference"):
                yield dict(kind=kind, dtype=dtype, mode=mode, device=device,
                           batch=QUICK_BATCH if quick else B)


def case_name(c: dict) -> str:
    """The row's case name, known before build() allocates anything (single_call filters on it)."""
    return f"{c['kind']} layer (B={c.get('batch', B)}, L={L}, d={D_MODEL}, h={NHEAD}, ff={FFD})"


def build(c: dict):
    kind, dtype, mode, device = c["kind"], c["dtype"], c["mode"], c["device"]
    batch = c.get("batch", B)
    layers = _layers(kind, dtype, device)
    args, kwargs = _inputs(kind, batch, L, dtype, device, mode == "train")
    work = flops(kind, batch, L, mode)
    fns, notes = {}, []
    for name, layer in layers.items():
        est = work / 1e9 / _rate(name, kind, dtype, mode, device)
        if name != "ours" and est > BUDGET_S:
            notes.append(f"{name} skipped (est. {est:.0f} s/call at "
                         f"{_rate(name, kind, dtype, mode, device):.1f} GFLOP/s measured on "
                         f"(B, L) = {CALIBRATION})")
            continue
        fns[name] = _step(layer, args, kwargs, mode)
    if kind == "encoder" and mode == "inference" and "nn" in fns:
        notes.append("nn = torch's fused encoder fast path")
    if mode == "train":
        notes.append("dropout 0.1; max err is of the eval-mode output")

    def error():
        ref_dtype = torch.float64 if device == "cpu" else torch.float32
        ref = _layers(kind, dtype, device)["nn"].to(ref_dtype).eval()
        ours = copy.deepcopy(layers["ours"]).eval()  # the timed layers keep their mode
        with torch.no_grad():
            out = ours(*(a.detach() for a in args), **kwargs)
            out_ref = ref(*(a.detach().to(ref_dtype) for a in args),
                          **{k: (v.to(ref_dtype) if torch.is_tensor(v) else v) for k, v in kwargs.items()})
        return max_abs_err(out, out_ref)

    row = Row("layers", case_name(c), str(dtype).replace("torch.", ""), mode,
              {}, {"flops": work}, note="; ".join(notes))
    return fns, row, error
