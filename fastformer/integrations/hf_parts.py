"""Converted modules whose parts change after ff.convert run their original code.

A converted forward reads some of its children's parameters itself instead of calling them: the
Llama MLP hands ``gate_proj.weight``, ``up_proj.weight`` and ``down_proj.weight`` to
``ff.swiglu_ffn``, a decoder layer reads ``post_attention_layernorm.weight`` for the fused
residual norm. That is right for the children the conversion saw, and wrong for a child put in
afterwards whose forward does more than its weights say: PEFT's LoRA / IA3 layers (a wrapper
whose forward adds the adapter; ``.weight`` is the base layer's), a hook, accelerate's offloading
forward set on the instance. The adapter would silently be missing from the output (small
random-weight models, LoRA put in after ff.convert, largest difference from PEFT's unconverted
model: Llama's gate_proj / down_proj 0.58 / 0.45 on its logits, BERT's dense layers 0.58, GPT-2's
c_fc / c_proj 0.91 / 0.76). So:

- at the end of ff.convert, :func:`record` notes the type of each part of every converted module,
  and undoes a conversion whose parts are not plain torch.nn / transformers modules (a model
  wrapped by PEFT before the conversion: GPT-2's MLP over LoRA'd Conv1Ds);
- every method a conversion overrides checks the parts first (:func:`guarded`): where one has
  another type, hooks, or an instance forward, it runs the class's original method, which calls
  the children as modules, with a warning.

The parts of a converted module are the children its code reads (the mixin's ``_ff_reads``:
dotted paths, or a method returning them), else every module below it. A mixin whose code reads
them only for some calls says which in ``_ff_reads_when(args, kwargs)`` (the LM loss: calls with
labels). transformers' own output-capturing hooks, put on layers and attention modules at a
model's first call with hidden states or attentions asked for and idle otherwise, are not
changes: the converted code calls those modules.

Cost, 2-core Zen 4: 0.3-0.4 us per part and call (the Llama MLP's four parts 1.7 us; its call
with one token takes ~60 us at d_model 128, ~1 ms at 2048); no tensor work.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional

import torch
from torch import nn
from torch.nn.modules import module as _module_globals

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_CAPTURING_HOOKS_MODULE = "transformers.utils.output_capturing"


def _unswapped(kind: type) -> type:
    """A converted module's original class (a part read by its weights may be either: a new
    nn.Linear in place of a converted one is read alike); recorded so, the record pickles."""
    return getattr(kind, "_fastformer_original", None) or kind


def _part(module: nn.Module, path: tuple) -> Optional[nn.Module]:
    """The module at path (names) below module, None where it is gone."""
    for name in path:
        module = module._modules.get(name)
        if module is None:
            return None
    return module


def _hooks_that_count(m: nn.Module) -> bool:
    """Whether m has a hook its converted parent would skip (not transformers' capturing ones)."""
    for name in _HOOK_DICTS:
        for hook in getattr(m, name).values():
            if getattr(hook, "__module__", None) != _CAPTURING_HOOKS_MODULE:
                return True
    return False


def changed(module: nn.Module) -> Optional[str]:
    """Why `module`'s converted code must not run now (a part changed since ff.convert), or None."""
    if (_module_globals._global_forward_hooks or _module_globals._global_forward_pre_hooks
            or _module_globals._global_backward_hooks or _module_globals._global_backward_pre_hooks):
        return "global module hooks are registered (torch.nn.modules.module.register_module_*_hook)"
    for path, kind in module._ff_parts:
        part = _part(module, path)
        if part is None:
            return f"its part {'.'.join(path)} was removed"
        if _unswapped(type(part)) is not kind:
            return (f"its part {'.'.join(path)} is now {type(part).__module__}.{type(part).__qualname__}, not the "
                    f"{kind.__qualname__} it read")
        if "forward" in part.__dict__:
            return f"its part {'.'.join(path)} has a forward set on the instance (accelerate's hooks)"
        if (part._forward_hooks or part._forward_pre_hooks or part._backward_hooks or part._backward_pre_hooks) \
                and _hooks_that_count(part):
            return f"its part {'.'.join(path)} has hooks"
    return None


def _warn(module: nn.Module, why: str) -> None:
    """Python's default filter shows a message once (per class and reason here)."""
    if not torch.compiler.is_compiling():
        warnings.warn(f"fastformer: a converted {type(module).__name__} runs its original code: {why}",
                      stacklevel=3)


def guarded(method: Callable, original: Callable) -> Callable:
    """`method` where the module's parts are as ff.convert saw them, else `original`."""
    def run(self, *args, **kwargs):
        if self._ff_parts and (self._ff_reads_when is None or self._ff_reads_when(args, kwargs)):
            why = changed(self)
            if why is not None:
                _warn(self, why)
                return original(self, *args, **kwargs)
        return method(self, *args, **kwargs)
    return functools.update_wrapper(run, method)


def _read_paths(module: nn.Module):
    reads = getattr(module, "_ff_reads", None)
    if callable(reads):
        reads = reads()
    if reads is None:
        return [name for name, _ in module.named_modules() if name]
    return reads


def _plain(kind: type) -> bool:
    """A module type whose parameters mean what a conversion reads them as: torch.nn's and
    transformers' model code (and fastformer's, and our swaps of them), not a wrapper (PEFT, a
    user's module), a quantized linear (bitsandbytes, transformers.integrations) or a hook."""
    name = kind.__module__
    return (name.startswith(("torch.nn.", "transformers.", "fastformer."))
            and not name.startswith(("transformers.integrations.", "transformers.quantizers.")))


def record(model: nn.Module) -> list:
    """Note the parts of every module ff.convert converted (once: a second convert keeps the
    first's record, so parts changed between the two still count). A module with a part that is
    not plain (_plain) gets its class back; returns [(module, what it was converted to, why)]."""
    reverted = []
    for m in model.modules():
        original = getattr(type(m), "_fastformer_original", None)
        if original is None or "_ff_parts" in m.__dict__:
            continue
        parts = []
        for path in _read_paths(m):
            part = _part(m, tuple(path.split(".")))
            if part is not None:
                parts.append((tuple(path.split(".")), _unswapped(type(part))))
        odd = next(((".".join(p), kind) for p, kind in parts if not _plain(kind)), None)
        if odd is not None:
            what = getattr(type(m), "_ff_what", None)
            m.__class__ = original
            reverted.append((m, what, f"its {odd[0]} is {odd[1].__module__}.{odd[1].__qualname__}, whose "
                                      "parameters the converted code would read without its forward"))
            continue
        m._ff_parts = tuple(parts)
    return reverted


__all__ = ["changed", "guarded", "record"]
