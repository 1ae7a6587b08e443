"""Reference feed-forward block, forward and backward, in fp32 (fp64 for fp64 inputs).

Conventions shared by every backend (csrc/cpu/ffn.cpp and triton_kernels/ffn.py derive the same
formulas), with x viewed as (N, D) and weights in nn.Linear's (out_features, in_features) layout:

* ffn:   pre = x W1^T + b1 (N, F);  h = act(pre) * keep / (1 - p);  y = h W2^T + b2.
  keep[n, f] comes from reference/rng.py with element index n * F + f (the (N, F) hidden
  activation, row-major).
* gated: g = x Wg^T + bg, u = x Wu^T + bu;  h = act(g) * u;  y = h Wd^T + bd  (no dropout).
  Arguments: w1/b1 = gate, w_up/b_up = up, w2/b2 = down. With a limit L > 0 (swiglu_limit:
  DeepSeek-V4's clamped SwiGLU), g' = min(g, L) and u' = clamp(u, -L, L) stand for g and u in
  h and in the gradients below, which the clamps pass only where their bounds hold (g <= L,
  -L <= u <= L), as torch.clamp's backward does.
* Saved for the backward (``saved``): the pre-activation, rounded to x's dtype, (N, F); gated:
  [g | u] as one (N, 2F) tensor. Never act(pre). The second GEMM and the backward recompute the
  activation from it.
* Backward, hd = act(pre) * keep / (1 - p) (gated: act(g) * u):
      dW2 = dy^T hd,  db2 = sum_n dy,  dh = dy W2
      ffn:   dpre = dh * keep / (1 - p) * act'(pre)
      gated: dg = dh * u * act'(g),  du = dh * act(g)
      dx = dpre W1 (gated: dg Wg + du Wu),  dW1 = dpre^T x,  db1 = sum_n dpre (gated: both parts)
  d(pre) is rounded to x's dtype before the last two GEMMs, as the kernels store it.
* Activations (codes are csrc/common/activations.h's): relu, gelu (exact erf), gelu_tanh, silu,
  quick_gelu (x * sigmoid(1.702 x), OpenAI CLIP's), relu2 (relu(x)^2: Nemotron, Persimmon, Arcee).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .rng import keep_mask

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "quick_gelu", "relu2")  # index = code of fastformer::Activation


QUICK_GELU_SCALE = 1.702


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def activation(x: Tensor, code: int) -> Tensor:
    if code == 0:
        return torch.relu(x)
    if code == 1:
        return F.gelu(x)
    if code == 2:
        return F.gelu(x, approximate="tanh")
    if code == 4:
        return x * torch.sigmoid(QUICK_GELU_SCALE * x)
    if code == 5:
        return torch.relu(x).square()
    return F.silu(x)


def activation_grad(x: Tensor, code: int) -> Tensor:
    """act'(x), the formulas of activations.h (relu'(0) = 0, as torch)."""
    if code == 0:
        return (x > 0).to(x.dtype)
    if code == 1:
        cdf = 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))
        return cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    if code == 2:
        k = math.sqrt(2.0 / math.pi)
        t = torch.tanh(k * (x + 0.044715 * x ** 3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x)
    if code == 5:
        return 2.0 * torch.relu(x)
    if code == 4:
        x = QUICK_GELU_SCALE * x
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def gate_value(g: Tensor, u: Tensor, code: int, limit: float = 0.0) -> Tensor:
    """h = act(g) * u, with g and u clamped first when limit > 0 (see the module docstring)."""
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return activation(g, code) * u


def gate_terms(g: Tensor, u: Tensor, code: int, limit: float = 0.0):
    """(h, dh/dg, dh/du) of the gate h = act(g) * u, with g and u clamped first when limit > 0
    (see the module docstring), in g's dtype."""
    if limit > 0:
        g_pass, u_pass = g <= limit, (u >= -limit) & (u <= limit)
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    act = activation(g, code)
    d_g, d_u = u * activation_grad(g, code), act
    if limit > 0:
        d_g, d_u = d_g * g_pass, d_u * u_pass
    return act * u, d_g, d_u


def _linear(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    y = x @ w.to(x.dtype).t()
    return y + b.to(x.dtype) if b is not None else y


def _dropout_scale(rng_state, shape, dropout_p, device, dtype) -> Optional[Tensor]:
    if dropout_p <= 0:
        return None
    return keep_mask(rng_state, shape, dropout_p, device=device).to(dtype) / (1.0 - dropout_p)


def _hidden(saved: Tensor, F_: int, gated: bool, code: int, drop: Optional[Tensor], limit: float):
    """(hd, d hd / d pre (gated: / d gate), gated: d hd / d up) in the accumulation dtype, from
    the saved tensor."""
    if gated:
        return gate_terms(saved[:, :F_], saved[:, F_:], code, limit)
    hd, d_pre = activation(saved, code), activation_grad(saved, code)
    if drop is not None:
        hd, d_pre = hd * drop, d_pre * drop
    return hd, d_pre, None


def ffn_fwd(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
            w_up: Optional[Tensor], b_up: Optional[Tensor], o, keep: bool = True):
    """o: ops/ffn.py's FfnOptions. Returns (y shaped like x, saved: (N, F) or gated (N, 2F) in
    x's dtype when keep (a backward follows), else empty)."""
    activation_code, dropout_p, rng_state = o.activation, o.dropout_p, o.rng_state
    acc = acc_dtype(x.dtype)
    D, F_ = x.shape[-1], w1.shape[0]
    xf = x.reshape(-1, D).to(acc)
    pre = _linear(xf, w1, b1)
    if w_up is not None:
        pre = torch.cat([pre, _linear(xf, w_up, b_up)], dim=1)
    saved = pre.to(x.dtype)
    drop = _dropout_scale(rng_state, (xf.shape[0], F_), dropout_p, x.device, acc)
    saved_acc = saved.to(acc)
    if w_up is not None:  # h alone: the gradient terms are the backward's
        hd = gate_value(saved_acc[:, :F_], saved_acc[:, F_:], activation_code, o.swiglu_limit)
    else:
        hd = activation(saved_acc, activation_code)
        hd = hd * drop if drop is not None else hd
    y = _linear(hd, w2, b2).to(x.dtype).reshape(x.shape)
    return y, (saved if keep else x.new_empty((0,)))


def ffn_bwd(dy: Tensor, x: Tensor, w1: Tensor, w2: Tensor, w_up: Optional[Tensor], saved: Tensor,
            o, needs: tuple):
    """needs: 7 bools for (dx, dw1, db1, dw2, db2, dw_up, db_up). Returns those 7 gradients
    (empty tensors for the ones not asked for)."""
    activation_code, dropout_p, rng_state = o.activation, o.dropout_p, o.rng_state
    acc = acc_dtype(x.dtype)
    D, F_ = x.shape[-1], w1.shape[0]
    gated = w_up is not None
    xf = x.reshape(-1, D).to(acc)
    dyf = dy.reshape(-1, D).to(acc)
    drop = _dropout_scale(rng_state, (xf.shape[0], F_), dropout_p, x.device, acc)
    hd, d_hd_pre, d_hd_up = _hidden(saved.to(acc), F_, gated, activation_code, drop, o.swiglu_limit)
    dh = dyf @ w2.to(acc)
    d_pre = (dh * d_hd_pre).to(x.dtype).to(acc)
    d_up = (dh * d_hd_up).to(x.dtype).to(acc) if gated else None
    grads = [
        lambda: (d_pre @ w1.to(acc) + (d_up @ w_up.to(acc) if gated else 0)).reshape(x.shape),
        lambda: d_pre.t() @ xf, lambda: d_pre.sum(0), lambda: dyf.t() @ hd, lambda: dyf.sum(0),
        lambda: d_up.t() @ xf, lambda: d_up.sum(0),
    ]
    return tuple(g().to(x.dtype) if need and (gated or i < 5) else x.new_empty((0,))
                 for i, (g, need) in enumerate(zip(grads, needs)))
