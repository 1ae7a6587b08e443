"""ff.convert: swap torch.nn Transformer building blocks in an existing model for fastformer's.

Replaced (exact types only): ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer``, ``nn.LayerNorm`` (and ``nn.RMSNorm``). A replacement adopts the
original's parameter and buffer *objects* (no copy: same values, device, dtype,
``requires_grad``, and an optimizer built before the conversion keeps working), its
``nn.Linear`` and ``nn.Dropout`` children, its hyper-parameters (eps, dropout probabilities,
activation, norm_first, batch_first) and its train/eval mode. Containers such as
``nn.TransformerEncoder`` stay as they are and call the converted layers.

Left alone, with the reason in the report: subclasses of those types (their forward may
differ), modules with forward hooks (they would silently stop firing), and
``nn.MultiheadAttention`` with ``add_bias_kv`` / ``add_zero_attn``. Their children are still
visited.

Hugging Face transformers models get the fastformer attention backend and their norms, MLPs,
residual adds and (with labels) LM-head loss on fused kernels first: integrations/hf_convert.py.
So do the ones a wrapper holds (PEFT's ``PeftModel``, a user's module): a LoRA-wrapped linear is
not an ``nn.Linear``, and the modules reading it are left with the reason. A converted module
whose parts change afterwards (``get_peft_model`` after ``convert``, hooks) runs its original
code: integrations/hf_parts.py.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from .modules.attention import MultiheadAttention
from .modules.norm import LayerNorm, RMSNorm
from .modules.transformer import TransformerDecoderLayer, TransformerEncoderLayer

_META = torch.device("meta")


@dataclass
class ConversionReport:
    """What :func:`convert` did. ``model`` is the converted model (the argument itself when
    converted in place, unless the argument's own type was replaced)."""

    model: nn.Module
    replaced: list = field(default_factory=list)  # (path, old type, new type)
    left: list = field(default_factory=list)      # (path, type, reason)
    prepacked: list = field(default_factory=list)  # names of the weights given blocked copies

    def __str__(self) -> str:
        lines = [f"fastformer.convert: replaced {len(self.replaced)} module(s), left "
                 f"{len(self.left)}"]
        if self.prepacked:
            lines.append(f"  prepacked {len(self.prepacked)} nn.Linear weight(s) for bf16 calls "
                         "without a gradient (ops/prepack.py)")
        rows = [("replaced", path or "<root>", f"{old} -> {new}") for path, old, new in self.replaced]
        rows += [("left", path or "<root>", f"{kind}: {why}") for path, kind, why in self.left]
        width = max((len(r[1]) for r in rows), default=0)
        lines += [f"  {verb:<8}  {path:<{width}}  {what}" for verb, path, what in rows]
        return "\n".join(lines)


def _type_name(m: nn.Module) -> str:
    cls = type(m)
    prefix = "nn" if cls.__module__.startswith("torch.nn") else cls.__module__
    return f"{prefix}.{cls.__name__}"


def _adopt_state(new: nn.Module, old: nn.Module) -> nn.Module:
    """Give `new` the parameter and buffer objects of `old` (same names), and its mode."""
    for name in list(new._parameters):
        new._parameters[name] = old._parameters.get(name)
    for name in list(new._buffers):
        new._buffers[name] = old._buffers.get(name)
    new.train(old.training)
    return new


def _norm(old: nn.Module) -> nn.Module:
    if isinstance(old, nn.RMSNorm):
        new = RMSNorm(old.normalized_shape, old.eps, old.elementwise_affine, device=_META)
    else:
        new = LayerNorm(old.normalized_shape, old.eps, old.elementwise_affine,
                        bias=old.bias is not None, device=_META)
    return _adopt_state(new, old)


def _mha(old: nn.MultiheadAttention) -> MultiheadAttention:
    new = MultiheadAttention(old.embed_dim, old.num_heads, old.dropout, old.in_proj_bias is not None,
                             kdim=old.kdim, vdim=old.vdim, batch_first=old.batch_first,
                             device=_META)
    _adopt_state(new, old)
    new.out_proj = old.out_proj
    return new


_CHILDREN_KEPT = ("linear1", "dropout", "linear2", "dropout1", "dropout2", "dropout3")


def _layer(old: nn.Module, new_cls, convert_child) -> nn.Module:
    """An ff layer holding old's children (attention and norms converted when possible)."""
    attn = old.self_attn
    new = new_cls(attn.embed_dim, attn.num_heads, old.linear1.out_features, device=_META,
                  batch_first=attn.batch_first, bias=old.linear1.bias is not None)
    for name, child in old.named_children():
        if name not in new._modules:
            raise AssertionError(f"fastformer.convert: unexpected child {name!r} of "
                                 f"{_type_name(old)}")
        setattr(new, name, child if name in _CHILDREN_KEPT else convert_child(name, child))
    new.norm_first = old.norm_first
    new.activation = old.activation
    new.activation_relu_or_gelu = getattr(old, "activation_relu_or_gelu", 0)
    return new.train(old.training)


_CONVERTERS = {
    nn.MultiheadAttention: lambda old, convert_child: _mha(old),
    nn.TransformerEncoderLayer: lambda old, convert_child: _layer(old, TransformerEncoderLayer,
                                                                  convert_child),
    nn.TransformerDecoderLayer: lambda old, convert_child: _layer(old, TransformerDecoderLayer,
                                                                  convert_child),
    nn.LayerNorm: lambda old, convert_child: _norm(old),
    nn.RMSNorm: lambda old, convert_child: _norm(old),
}
_FASTFORMER = (MultiheadAttention, LayerNorm, RMSNorm, TransformerEncoderLayer,
               TransformerDecoderLayer)


def _why_not(m: nn.Module):
    """None if `m` is replaced; else the reason (or '' for a module that is no candidate)."""
    if isinstance(m, _FASTFORMER) or getattr(type(m), "_fastformer_original", None) is not None:
        return ""  # ours, or converted in place already (integrations/hf_convert.py)
    base = next((t for t in _CONVERTERS if isinstance(m, t)), None)
    if base is None:
        return ""
    if type(m) is not base:
        return f"a subclass of nn.{base.__name__} (its forward may differ)"
    if m._forward_hooks or m._forward_pre_hooks:
        return "has forward hooks, which a replacement would not run"
    if isinstance(m, nn.MultiheadAttention) and (m.bias_k is not None or m.add_zero_attn):
        return "add_bias_kv / add_zero_attn are not supported by ff.MultiheadAttention"
    return None


def convert(model: nn.Module, inplace: bool = True, *, fused_loss: bool = True,
            prepack_weights: bool = False) -> ConversionReport:
    """Replace torch.nn Transformer blocks inside ``model`` by fastformer's (see module doc).

    Args:
        model: any nn.Module.
        inplace: convert ``model`` itself (default); ``False`` converts a deep copy.
        fused_loss: for a transformers CausalLM, compute the loss of calls with ``labels`` with
            ``ff.linear_cross_entropy`` (no logits returned then); ``False`` keeps the logits.
        prepack_weights: for inference on CPUs with AMX: every ``nn.Linear`` weight of a
            transformers model gets a second copy in oneDNN's blocked layout, which its bf16
            calls without a gradient of 2 to 2047 token rows read instead (prompts and batched
            decode steps: 1.05-1.7x per GEMM; see ops/prepack.py), except the few-row calls
            ops/linear.py's kernel reads faster in place. Costs the weights' memory
            once more; copies follow weight updates and are freed with their weights (a deep
            copy of the model has new weights, not registered). Where the CPU or torch lacks
            the route, ``.left`` says so and nothing is copied.

    Returns:
        A :class:`ConversionReport`: ``.model`` (the converted model), ``.replaced`` and
        ``.left`` (path, type, reason); ``print(report)`` shows both. When ``model`` itself is
        one of the replaced types, ``.model`` is the new module and ``model`` is unchanged.

    Example::

        report = ff.convert(model)      # model's layers now run fastformer kernels
        print(report)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: `model` must be an nn.Module, got {type(model).__name__}")
    for name, flag in (("inplace", inplace), ("fused_loss", fused_loss),
                       ("prepack_weights", prepack_weights)):
        if not isinstance(flag, bool):
            raise TypeError(f"convert: `{name}` must be a bool, got {type(flag).__name__}")
    if not inplace:
        model = copy.deepcopy(model)
    report = ConversionReport(model)
    from .integrations import hf_convert, hf_parts
    hf_models = _transformers_models(model, hf_convert.is_transformers_model)
    for prefix, hf_model in hf_models:
        replaced, left = [], []
        hf_convert.convert_transformers(hf_model, replaced, left, loss=fused_loss)
        report.replaced += [(_join(prefix, path), *rest) for path, *rest in replaced]
        report.left += [(_join(prefix, path), *rest) for path, *rest in left]
        if prepack_weights:
            _prepack(hf_model, report, prefix)
    if prepack_weights and not hf_models:
        report.left.append(("", _type_name(model), "prepack_weights: not a transformers model "
                            "(its nn.Linear layers run torch's F.linear)"))

    def visit(path: str, module: nn.Module) -> nn.Module:
        why = _why_not(module)
        if why is None:
            entry = len(report.replaced)  # listed before the children it converts
            report.replaced.append(None)
            new = _CONVERTERS[type(module)](
                module, lambda name, child: visit(f"{path}.{name}" if path else name, child))
            report.replaced[entry] = (path, _type_name(module), f"ff.{type(new).__name__}")
            return new
        if why:
            report.left.append((path, _type_name(module), why))
        for name, child in list(module.named_children()):
            new_child = visit(f"{path}.{name}" if path else name, child)
            if new_child is not child:
                setattr(module, name, new_child)
        return module

    report.model = visit("", model)
    reverted = hf_parts.record(report.model)
    if reverted:
        paths = {id(m): path for path, m in report.model.named_modules()}
        for m, what, why in reverted:
            path = paths[id(m)]
            report.replaced = [r for r in report.replaced if r != (path, type(m).__name__, what)]
            report.left.append((path, type(m).__name__, why))
    return report


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _transformers_models(model: nn.Module, is_transformers_model) -> list:
    """(path, module) of the outermost transformers models in model (model itself, or those a
    wrapper holds: PEFT's PeftModel, a user's module around one or several)."""
    found = []
    for path, m in model.named_modules():
        if is_transformers_model(m) and not any(path.startswith(f"{p}.") or not p for p, _ in found):
            found.append((path, m))
    return found


def _prepack(model: nn.Module, report: ConversionReport, prefix: str = "") -> None:
    """Register every nn.Linear weight of the model with ops/prepack.py (the copies are made on
    first use, in the dtype the model then has)."""
    from .ops import prepack
    if not prepack.available():
        report.left.append((prefix, _type_name(model), "prepack_weights: the blocked-weight route "
                            "needs AMX-BF16 and torch's oneDNN linear ops"))
        return
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear):
            prepack.register(m.weight)
            report.prepacked.append(_join(prefix, f"{path}.weight" if path else "weight"))


__all__ = ["convert", "ConversionReport"]
