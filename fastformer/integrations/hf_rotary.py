"""ff.convert for Hugging Face attention modules: the rotary embedding of q and k on ff.apply_rotary.

transformers' Llama-family attention (Llama, Mistral, Qwen2/3, Gemma 1/2/3) rotates q and k
with its module's ``apply_rotary_pos_emb(q, k, cos, sin)``: ``q * cos + rotate_half(q) * sin``,
five elementwise passes over each (a multiply, the half slices, a negation, a concatenation, a
multiply and an add), each writing a (B, H, L, D) temporary. ``ff.apply_rotary`` reads q once
and writes it once, the angles from an (L, D/2) fp32 table, one rounding.

How: a converted attention module's class is swapped (as for every converted module: no
parameter changes) for one whose ``forward`` is a copy of the original's code that sees, as
its global ``apply_rotary_pos_emb``, :func:`_fused` (the original's globals otherwise, taken
when the class was first converted). Only modules whose ``apply_rotary_pos_emb`` is the
rotate_half form above (compared by bytecode with Llama's) are converted. A call the kernel does
not take runs the original function: cos / sin that differ between the rows of a batch
(per-row positions, e.g. left-padded generation), tables whose two halves differ (not the
rotate_half form), tables that require grad and ``unsqueeze_dim`` other than 1. Under
torch.compile the converted forward is the original one (see :func:`_eager_only`): inductor
fuses its elementwise chain itself.

Llama-style 4 x 2048 (32 heads of 64), 1 x 1024 tokens, bf16 inference on the 2-core Xeon: the
rotary's multiplies, adds, negations and concatenations took 10-15 ms of the converted model's
~350 ms forward (torch profiler, one run).
"""
from __future__ import annotations

import functools
import types
from typing import Callable, Optional

import torch
from torch import nn

from ..ops.rotary import apply_rotary
from ..reference.rotary import acc_dtype

GLOBAL = "apply_rotary_pos_emb"

# (cos, sin, (their versions, the dtype), the (L, D/2) tables or None): the last tables made. Every layer of
# a forward gets the same cos / sin tensors (the model's rotary module makes them once), so the
# tables are made, and the tensors compared, once per forward.
_last: Optional[tuple] = None


def _half_tables(cos: torch.Tensor, sin: torch.Tensor, acc: torch.dtype):
    """(cos, sin) as (L, D/2) tables in acc, if every batch row of HF's (B, L, D) tables is the
    same and each row's two halves are equal (the rotate_half form); else None."""
    global _last
    key = (cos._version, sin._version, acc)
    last = _last
    if last is not None and last[0] is cos and last[1] is sin and last[2] == key:
        return last[3]
    tables = None
    half = cos.shape[-1] // 2
    c, s = cos[0], sin[0]
    if (torch.equal(cos, c.expand_as(cos)) and torch.equal(sin, s.expand_as(sin))
            and torch.equal(c[:, :half], c[:, half:]) and torch.equal(s[:, :half], s[:, half:])):
        tables = (c[:, :half].to(acc).contiguous(), s[:, :half].to(acc).contiguous())
    _last = (cos, sin, key, tables)
    return tables


def _kernel_takes(q, k, cos, sin, unsqueeze_dim) -> bool:
    if unsqueeze_dim != 1:  # traced calls never get here: _eager_only
        return False
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    B, _, L, D = q.shape
    return (k.shape[0] == B and k.shape[2] == L and k.shape[3] == D and D % 2 == 0
            and cos.shape[1:] == (L, D) and cos.shape[0] in (1, B) and q.dtype == k.dtype
            and q.dtype.is_floating_point and q.device == k.device == cos.device == sin.device
            and cos.dtype.is_floating_point and sin.dtype == cos.dtype
            and not (cos.requires_grad or sin.requires_grad))


def _fused(original: Callable) -> Callable:
    """apply_rotary_pos_emb with the original's signature, on ff.apply_rotary where it takes
    the call, else the original."""
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _kernel_takes(q, k, cos, sin, unsqueeze_dim):
            tables = _half_tables(cos, sin, acc_dtype(q.dtype))
            if tables is not None:
                return apply_rotary(q, *tables), apply_rotary(k, *tables)
        return original(q, k, cos, sin, unsqueeze_dim)
    apply_rotary_pos_emb._fastformer_original = original
    return apply_rotary_pos_emb


@functools.lru_cache(maxsize=None)
def fused_rotary(original: Callable) -> Callable:
    """_fused(original), made once per function (for forwards that call it themselves)."""
    return _fused(original)


def _with_global(fn: Callable, name: str, value) -> tuple[Callable, bool]:
    """(a copy of fn that reads the global `name` as `value`, whether any code read it), through
    the decorators that wrap fn (functools.wraps wrappers whose closure holds the function)."""
    inner = getattr(fn, "__wrapped__", None)
    closure, found = fn.__closure__, False
    if inner is not None and closure:
        new_inner, found = _with_global(inner, name, value)
        cells = []
        for cell in closure:
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                held = None
            cells.append(types.CellType(new_inner) if held is inner else cell)
        closure = tuple(cells)
    globals_ = fn.__globals__
    if name in fn.__code__.co_names:
        globals_, found = {**globals_, name: value}, True
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(new, fn), found


def _eager_only(patched: Callable, forward: Callable) -> Callable:
    """`patched` (the forward's copy with its own globals) on eager calls, the class's own
    `forward` under torch.compile. Dynamo reads a function's globals as its module's
    (sys.modules[__globals__["__name__"]]), so tracing the copy guarded on the module's
    ``apply_rotary_pos_emb``, which is transformers' function, not ours: every converted
    Llama-family model failed to compile ("'NoneType' object is not subscriptable" building a
    closure guard). Compiled, inductor fuses the original's elementwise rotation itself."""
    @functools.wraps(forward)
    def forward_(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return forward(self, *args, **kwargs)
        return patched(self, *args, **kwargs)
    return forward_


def _innermost(fn: Callable) -> Callable:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def code_form(fn: Callable, owner: Optional[type] = None, _seen: Optional[set] = None):
    """A function's bytecode, constants (less its docstring), global names and local names (None
    without code), with the forms of the functions it reaches by those names: a transformers
    model module's functions among its globals (a family's own rotate_half: NanoChat's flips the
    signs of Llama's, under the same apply_rotary_pos_emb) and, with `owner`, that class's
    methods (``self._norm``). Equal for two functions that run the same instructions on the same
    names and numbers."""
    fn = _innermost(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    seen = set() if _seen is None else _seen
    seen.add(fn)
    consts = code.co_consts  # the first is the docstring (None without one): not compared
    consts = consts[1:] if consts and isinstance(consts[0], str) else consts
    reached = []
    for name in code.co_names:
        target = fn.__globals__.get(name)
        if not (isinstance(target, types.FunctionType) and target.__module__.startswith("transformers.models.")):
            target = getattr(owner, name, None) if owner is not None else None
            if not (isinstance(target, types.FunctionType) and target.__module__.startswith("transformers.")):
                continue
        if _innermost(target) not in seen:
            reached.append((name, code_form(target, owner, seen)))
    return code.co_code, consts, code.co_names, code.co_varnames, tuple(reached)


def class_form(cls: type, method: str = "forward"):
    """code_form of cls's method, with the forms of the class's methods it calls."""
    return code_form(getattr(cls, method), owner=cls)


@functools.lru_cache(maxsize=None)
def _llama_form():
    from transformers.models.llama import modeling_llama
    return code_form(modeling_llama.apply_rotary_pos_emb)


@functools.lru_cache(maxsize=None)
def calls_attention_interface(cls: type) -> bool:
    """cls's forward (or a module-level function it calls) reads transformers'
    ALL_ATTENTION_FUNCTIONS: its attention follows config._attn_implementation."""
    forward = getattr(cls, "forward", None)
    code = getattr(_innermost(forward), "__code__", None) if forward is not None else None
    if code is None or not cls.__module__.startswith("transformers."):
        return False
    if "ALL_ATTENTION_FUNCTIONS" in code.co_names:
        return True
    globals_ = _innermost(forward).__globals__
    return any("ALL_ATTENTION_FUNCTIONS" in getattr(getattr(globals_.get(name), "__code__", None), "co_names", ())
               for name in code.co_names)


_MIXINS: dict = {}


def rotary_mixin(cls: type):
    """(the mixin whose forward rotates q and k on ff.apply_rotary for attention class cls,
    None) or (None, why not)."""
    if cls in _MIXINS:
        return _MIXINS[cls]
    forward = getattr(cls, "forward", None)
    original = None if forward is None else _innermost(forward).__globals__.get(GLOBAL)
    if original is None:
        result = None, f"its forward does not call a module-level {GLOBAL}"
    elif code_form(original) != _llama_form():
        result = None, f"its module's {GLOBAL} is not Llama's rotate_half form"
    else:
        patched, found = _with_global(forward, GLOBAL, _fused(original))
        result = ((type("_RotaryAttention", (), {"forward": _eager_only(patched, forward),
                                                 "_ff_what": "the rotary embedding of q and k on ff.apply_rotary",
                                                 "_ff_reads": (),  # it calls its projections
                                                 "_ff_rotary": True}), None)
                  if found else (None, f"its forward does not call {GLOBAL}"))
    _MIXINS[cls] = result
    return result


def convert_rotary_attention(m: nn.Module, swap: Callable) -> Optional[str]:
    mixin, why = rotary_mixin(type(m))
    if mixin is None:
        return why
    swap(m, mixin)
    return None


__all__ = ["calls_attention_interface", "class_form", "code_form", "convert_rotary_attention", "fused_rotary"]
