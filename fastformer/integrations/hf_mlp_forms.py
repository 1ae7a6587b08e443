"""Feed-forward modules of any transformers family on ff.ffn / ff.swiglu_ffn, recognized by what
their forward computes, not by their class name.

transformers writes one MLP class per family, under as many attribute names: CLIP's and
SigLIP's ``fc2(act(fc1(x)))``, GPT-NeoX's ``dense_4h_to_h(act(dense_h_to_4h(x)))``, GPT-J's
``dropout(fc_out(act(fc_in(x))))``, Phi-3's and GLM-4's ``gate, up = gate_up_proj(x).chunk(2)``,
ModernBERT's ``Wo(drop(act(input) * gate))``, Llama 4's ``down(act(gate(x)) * up(x))`` under
other names, ... A module qualifies here when its class comes from transformers, its children
are two or three linears (nn.Linear, or transformers' Conv1D read transposed), activations and
dropouts, and its forward, traced by torch.fx with those children as leaves, is exactly one of

  plain    out(act(inp(x)))                              -> ff.ffn
  gated    out(act(gate(x)) * up(x))                     -> ff.swiglu_ffn
  packed   a, b = inp(x).chunk(2, dim=-1); out(act(a) * b) -> ff.swiglu_ffn on the weight's two
                                                           halves (row views: no copy), when the
                                                           weight takes no gradient

and, gated or packed, with DeepSeek-V4's clamps on both gate factors (``gate.clamp(max=L)``,
``up.clamp(min=-L, max=L)``, the same constant L: ff.swiglu_ffn's swiglu_limit)

where act is relu, exact or tanh GELU or SiLU (a module or torch function), a dropout may stand
between act and out (ff.ffn fuses it; a gated call with a live one runs the original forward)
and another on the result. Every node of the graph must be one of these: anything else (a
scale, a norm, a residual, a reshape) leaves the module as it is. The forward is traced in
training and in eval mode and must give the same form both times, with a functional dropout's
``training`` following the mode (it reads ``self.training``; dropout modules are called as
they are). The converted forward computes the same function on the module's own parameters,
and runs the original for a call it does not cover (another dtype, more than one input).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..ops.dropout import dropout
from ..ops.ffn import ACTIVATIONS, ffn, swiglu_ffn
from ..ops.linear import linear
from ..reference.ffn import activation as ref_activation, gate_value


# ---- the MLP call of a converted model ---------------------------------------------------------
# A decode step's MLP call (no autograd, a token per sequence) is three small GEMMs, where
# ff.ffn's per-call validation and dispatch cost as much as the arithmetic: a Marian-size MLP
# (one row, 512 -> 2048 -> 512, fp32, 2-core Xeon) took 307 us through ff.ffn against 200 for
# the same three calls made directly. Such calls (CPU, at most DECODE_ROWS rows, no dropout)
# run ops/linear.py's linear per projection (its few-row kernel where measured faster) and
# torch's activation; every other call is ff.ffn / ff.swiglu_ffn.
DECODE_ROWS = 8


def _decode_call(x, dropout_p: float) -> bool:
    return (not torch.is_grad_enabled() and not dropout_p and x.device.type == "cpu" and x.dim() >= 1
            and x.numel() <= DECODE_ROWS * x.shape[-1] and not torch.compiler.is_compiling())


def model_ffn(x, w1, b1, w2, b2, activation: str, dropout_p: float = 0.0):
    """ff.ffn(x, w1, b1, w2, b2, activation, dropout_p) for a converted module's parameters."""
    if _decode_call(x, dropout_p):
        return linear(ref_activation(linear(x, w1, b1), ACTIVATIONS.index(activation)), w2, b2)
    return ffn(x, w1, b1, w2, b2, activation, dropout_p)


def model_swiglu_ffn(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, *, activation: str,
                     swiglu_limit: Optional[float] = None):
    """ff.swiglu_ffn(...) for a converted module's parameters."""
    if _decode_call(x, 0.0):
        h = gate_value(linear(x, w_gate, b_gate), linear(x, w_up, b_up), ACTIVATIONS.index(activation),
                       swiglu_limit or 0.0)
        return linear(h, w_down, b_down)
    return swiglu_ffn(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation=activation,
                      swiglu_limit=swiglu_limit)


def same_dtype(x, *params) -> bool:
    return isinstance(x, torch.Tensor) and all(p is None or p.dtype == x.dtype for p in params)


def activation_name(act) -> Optional[str]:
    """ff's name for an activation module (transformers' ACT2FN's or torch.nn's), None if it has
    no fused kernel."""
    name = type(act).__name__
    if name == "GELUActivation":
        return "gelu" if getattr(act, "act", None) is F.gelu else None
    if isinstance(act, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    return {"NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
            "FastGELUActivation": "gelu_tanh", "SiLU": "silu", "SiLUActivation": "silu",
            "ReLU": "relu", "QuickGELUActivation": "quick_gelu",
            "ReLUSquaredActivation": "relu2"}.get(name)


def _function_activation(node: fx.Node) -> Optional[str]:
    if node.target in (F.relu, torch.relu):
        return "relu" if len(node.args) == 1 and not node.kwargs.get("inplace") else None
    if node.target is F.silu:
        return "silu" if len(node.args) == 1 and not node.kwargs.get("inplace") else None
    if node.target is F.gelu and len(node.args) == 1 and set(node.kwargs) <= {"approximate"}:
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(node.kwargs.get("approximate", "none"))
    return None


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers.")


def _linear_like(m: nn.Module) -> bool:
    """nn.Linear, Conv1D, or Falcon's FalconLinear (nn.Linear's x @ W.T + b, the bias added after)."""
    return type(m) is nn.Linear or _is_conv1d(m) or (
        type(m).__name__ == "FalconLinear" and type(m).__module__.startswith("transformers.")
        and isinstance(m, nn.Linear))


# ---- the forms -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MLPForm:
    """What a module's forward computes. Names are its children's attribute names; a dropout is
    a child's name or ("p", its probability) for F.dropout(..., training=self.training)."""

    kind: str                       # "plain" | "gated" | "packed"
    inp: str                        # plain: the first linear; gated: gate; packed: gate and up
    out: str
    act: str                        # ff's activation name
    up: Optional[str] = None        # gated: the up projection
    act_half: int = 0               # packed: the half of inp's output that act takes
    mid_dropout: object = None      # between act (* up) and out
    post_dropout: object = None     # on out's result
    conv1d: frozenset = frozenset()  # the linears that are transformers' Conv1D: (in, out) weights
    limit: Optional[float] = None   # gated / packed: the clamps' L (swiglu_limit)

    def weight_bias(self, m: nn.Module, name: str):
        """(child name's weight in nn.Linear's (out, in) layout, its bias); Conv1D's transposed
        (a view). Decided when matched: the children are converted to subclasses later."""
        child = getattr(m, name)
        return (child.weight.t() if name in self.conv1d else child.weight), child.bias


class _NoForm(Exception):
    pass


def _need(cond: bool) -> None:
    if not cond:
        raise _NoForm


class _ChildrenAsLeaves(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return True  # the root's children are called, never traced into


class _Matcher:
    """Matches one traced graph (the module in one mode) against the forms, top down from the
    output; every node it accepts is recorded, and the graph must hold no other."""

    def __init__(self, module: nn.Module, graph: fx.Graph, training: bool):
        self.module, self.training, self.seen = module, training, set()
        nodes = list(graph.nodes)
        self.inputs = [n for n in nodes if n.op == "placeholder"]
        self.body = {n for n in nodes if n.op not in ("placeholder", "output")}
        self.output = next(n for n in nodes if n.op == "output")

    def _accept(self, node) -> fx.Node:
        _need(isinstance(node, fx.Node) and node in self.body and node not in self.seen)
        self.seen.add(node)
        return node

    def _child(self, node) -> Optional[nn.Module]:
        return getattr(self.module, node.target, None) if node.op == "call_module" else None

    def _dropout(self, node):
        """(the dropout's spec, its input) if node is a dropout, else None."""
        if not isinstance(node, fx.Node):
            return None
        child = self._child(node)
        if isinstance(child, nn.Dropout) and len(node.args) == 1 and not node.kwargs:
            return node.target, node.args[0]
        if node.op == "call_function" and node.target is F.dropout:
            args = dict(zip(("input", "p", "training", "inplace"), node.args), **node.kwargs)
            _need(set(args) <= {"input", "p", "training", "inplace"} and not args.get("inplace", False))
            _need(args.get("training", True) == self.training)  # follows self.training
            return ("p", float(args.get("p", 0.5))), args["input"]
        return None

    def _linear(self, node, x=None) -> tuple:
        """(the linear child's name, its input); its input must be x when x is given."""
        child = self._child(self._accept(node))
        _need(child is not None and _linear_like(child) and len(node.args) == 1 and not node.kwargs
              and (x is None or node.args[0] is x))
        return node.target, node.args[0]

    def _activation(self, node) -> tuple:
        """(ff's activation name, the activation's input)."""
        self._accept(node)
        child = self._child(node)
        name = activation_name(child) if child is not None else (
            _function_activation(node) if node.op == "call_function" else None)
        _need(name is not None and len(node.args) == 1 and (child is None or not node.kwargs)
              and isinstance(node.args[0], fx.Node))
        return name, node.args[0]

    def _clamp(self, node):
        """(the clamp's input, its min, its max) if node is x.clamp(...) / torch.clamp(x, ...)
        with constant bounds, else None; accepted when it is one."""
        if not isinstance(node, fx.Node) or not (
                (node.op == "call_method" and node.target == "clamp") or
                (node.op == "call_function" and node.target is torch.clamp)):
            return None
        self._accept(node)
        args = dict(zip(("input", "min", "max"), node.args), **node.kwargs)
        _need(set(args) <= {"input", "min", "max"} and isinstance(args["input"], fx.Node)
              and all(v is None or isinstance(v, (int, float)) for k, v in args.items() if k != "input"))
        return args["input"], args.get("min"), args.get("max")

    def _clamped_factors(self, a, b):
        """(g, u, L) for DeepSeek-V4's clamped factors a = act(g.clamp(max=L)), b =
        u.clamp(min=-L, max=L); None without clamps; any other clamp: no form."""
        if not isinstance(a, fx.Node) or a.op not in ("call_module", "call_function") or len(a.args) != 1:
            return None
        inner = self._clamp(a.args[0])
        if inner is None:
            return None
        g, lo, hi = inner
        outer = self._clamp(b)
        _need(lo is None and isinstance(hi, (int, float)) and hi > 0 and outer is not None
              and outer[1] == -hi and outer[2] == hi)
        return g, outer[0], float(hi)

    def _product(self, node):
        """The two factors of a product node, or None."""
        if (node.op == "call_function" and node.target in (operator.mul, torch.mul)) or \
                (node.op == "call_method" and node.target == "mul"):
            _need(len(node.args) == 2 and not node.kwargs)
            return node.args
        return None

    def _half(self, node):
        """(the chunk node, the half's index) for getitem(x.chunk(2, dim=-1), i)."""
        self._accept(node)
        _need(len(node.args) == 2)
        _need(node.op == "call_function" and node.target is operator.getitem and node.args[1] in (0, 1))
        chunk = node.args[0]
        _need(isinstance(chunk, fx.Node) and chunk in self.body)
        if chunk not in self.seen:
            self._accept(chunk)
            is_chunk = (chunk.op == "call_method" and chunk.target == "chunk") or \
                (chunk.op == "call_function" and chunk.target is torch.chunk)
            args = dict(zip(("input", "chunks", "dim"), chunk.args), **chunk.kwargs)
            _need(is_chunk and set(args) <= {"input", "chunks", "dim"} and args.get("chunks") == 2
                  and args.get("dim", 0) == -1)
        return chunk, node.args[1]

    def match(self) -> MLPForm:
        used = [n for n in self.inputs if n.users]
        _need(len(used) == 1 and len(self.output.args) == 1)
        x, node = used[0], self.output.args[0]
        post = self._dropout(node)
        if post is not None:
            self._accept(node)
            node = post[1]
        out, node = self._linear(node)
        mid = self._dropout(node)
        if mid is not None:
            self._accept(node)
            node = mid[1]
        factors = self._product(node) if isinstance(node, fx.Node) else None
        if factors is not None:
            self._accept(node)
            form = self._gated(x, factors)
        else:
            act, pre = self._activation(node)
            form = MLPForm("plain", self._linear(pre, x)[0], "", act)
        _need(self.seen == self.body)
        conv1d = frozenset(n for n in (form.inp, out, form.up) if n and _is_conv1d(getattr(self.module, n)))
        return dataclasses.replace(form, out=out, mid_dropout=mid and mid[0], post_dropout=post and post[0],
                                   conv1d=conv1d)

    def _gated(self, x, factors) -> MLPForm:
        for a, b in (factors, factors[::-1]):  # act(gate) * up or up * act(gate)
            seen = set(self.seen)
            try:
                clamped = self._clamped_factors(a, b)
                act, pre = self._activation(a)
                limit = None
                if clamped is not None:
                    pre, b, limit = clamped
                if pre.op == "call_module":
                    return MLPForm("gated", self._linear(pre, x)[0], "", act, up=self._linear(b, x)[0],
                                   limit=limit)
                chunk, i = self._half(pre)
                chunk2, j = self._half(b)
                _need(chunk2 is chunk and i != j)
                return MLPForm("packed", self._linear(chunk.args[0], x)[0], "", act, act_half=i, limit=limit)
            except _NoForm:
                self.seen = seen
        raise _NoForm


def mlp_candidate(m: nn.Module) -> bool:
    """Whether m is worth tracing: a transformers module of two or three linears, activations
    and dropouts, with no parameters of its own."""
    if not type(m).__module__.startswith("transformers.") or any(True for _ in m.parameters(recurse=False)):
        return False
    children = list(m.children())
    linears = sum(_linear_like(c) for c in children)
    others = all(_linear_like(c) or isinstance(c, nn.Dropout) or activation_name(c) is not None
                 or type(c).__name__.endswith(("Activation", "GELU", "SiLU", "ReLU")) for c in children)
    return linears in (2, 3) and others


def mlp_form(m: nn.Module) -> Optional[MLPForm]:
    """m's form (above), or None."""
    if not mlp_candidate(m):
        return None
    forms = []
    mode = m.training
    try:
        for training in (True, False):
            m.training = training
            graph = _ChildrenAsLeaves().trace(m)
            forms.append(_Matcher(m, graph, training).match())
    except Exception:  # untraceable (control flow on the input, ...) or no form: left as it is
        return None
    finally:
        m.training = mode
    if forms[0] != forms[1] or not _shapes_fit(m, forms[0]):
        return None
    return forms[0]


def _shapes_fit(m: nn.Module, form: MLPForm) -> bool:
    w_in, _ = form.weight_bias(m, form.inp)
    w_out, _ = form.weight_bias(m, form.out)
    hidden = w_in.shape[0] // 2 if form.kind == "packed" else w_in.shape[0]
    if form.kind == "packed" and w_in.shape[0] % 2:
        return False
    if form.kind == "gated" and form.weight_bias(m, form.up)[0].shape != w_in.shape:
        return False
    return tuple(w_out.shape) == (w_in.shape[1], hidden)


# ---- the converted forward -------------------------------------------------------------------------
def _dropout_p(m: nn.Module, spec) -> float:
    if spec is None:
        return 0.0
    if isinstance(spec, tuple):
        return spec[1] if m.training else 0.0
    d = getattr(m, spec)
    return d.p if d.training else 0.0


class _MLPByForm:

    def forward(self, *args, **kwargs):
        x = args[0] if len(args) == 1 and not kwargs else (
            next(iter(kwargs.values())) if not args and len(kwargs) == 1 else None)
        form: MLPForm = self._ff_mlp_form
        w_in, b_in = form.weight_bias(self, form.inp)
        w_out, b_out = form.weight_bias(self, form.out)
        p_mid = _dropout_p(self, form.mid_dropout)
        if not same_dtype(x, w_in, w_out) or (form.kind != "plain" and p_mid) or \
                (form.kind == "packed" and torch.is_grad_enabled() and w_in.requires_grad):
            # packed with a weight gradient: the two halves' gradients would be scattered into
            # the one parameter's (two zero-filled copies of it) and each half's GEMMs run at
            # half size; the Phi-3-style bf16 training step (4 x 2048, 1024 tokens, 2-core Xeon)
            # took 1870 ms so against 1758 with the original forward.
            return super().forward(*args, **kwargs)
        if form.kind == "plain":
            y = model_ffn(x, w_in, b_in, w_out, b_out, form.act, p_mid)
        else:
            if form.kind == "gated":
                (w_g, b_g), (w_u, b_u) = (w_in, b_in), form.weight_bias(self, form.up)
            else:
                f = w_in.shape[0] // 2
                halves = [(w_in[:f], None if b_in is None else b_in[:f]),
                          (w_in[f:], None if b_in is None else b_in[f:])]
                (w_g, b_g), (w_u, b_u) = halves[form.act_half], halves[1 - form.act_half]
            if not same_dtype(x, w_u):
                return super().forward(*args, **kwargs)
            y = model_swiglu_ffn(x, w_g, w_u, w_out, b_g, b_u, b_out, activation=form.act,
                                 swiglu_limit=form.limit)
        post = form.post_dropout
        if isinstance(post, str):
            return getattr(self, post)(y)
        p_post = _dropout_p(self, post)
        return dropout(y, p_post) if p_post else y


class _PlainMLPByForm(_MLPByForm):
    _ff_what = "ff.ffn (an MLP recognized by its traced forward)"


class _GatedMLPByForm(_MLPByForm):
    _ff_what = "ff.swiglu_ffn (a gated MLP recognized by its traced forward)"


def convert_mlp_by_form(m: nn.Module, swap: Callable) -> Optional[str]:
    """Swap m's class for one whose forward runs m's form on the fused kernels, or say why not."""
    form = mlp_form(m)
    if form is None:
        return ("its forward is none of the fused MLP forms (relu / GELU / SiLU between two linears, "
                "or a gated pair; integrations/hf_mlp_forms.py)")
    m._ff_mlp_form = form
    swap(m, _PlainMLPByForm if form.kind == "plain" else _GatedMLPByForm)
    return None


__all__ = ["MLPForm", "activation_name", "convert_mlp_by_form", "mlp_candidate", "mlp_form", "model_ffn",
           "model_swiglu_ffn", "same_dtype"]
