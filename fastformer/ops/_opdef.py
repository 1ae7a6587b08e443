"""One op definition, used by every op family (attention, add+norm, FFN, rotary).

An op family describes itself once, with an :class:`OpDef`:

* ``inputs``: the tensors it differentiates (``"residual?"``: optional);
* ``options``: an :func:`options` dataclass holding every non-tensor option and optional
  tensor of one call. Its field order is the custom ops' schema order, and the C++ struct of
  the compiled backends mirrors it field for field (``csrc/options.h``, filled by pybind11);
  fields listed in ``differentiable`` are tensors that may require grad;
* ``outputs``: the forward's outputs; the first ``visible`` are the caller's, the rest are
  kept for the backward only (lse, mean / rstd, the FFN's pre-activation);
* ``save(inputs, o, outputs)``: the tensors the backward reads (the option tensors are saved
  as well, without being listed);
* ``fake_fwd(*inputs, o)`` / ``fake_bwd(grads, saved, o, needs)``: output shapes, for tracing
  (torch.compile, torch.export);
* ``call(inputs, o)``: the :class:`backends.Call` selection looks at;

and each backend implementation is an :class:`backends.Impl` subclass stating what it
supports beside its code, registered with ``@OPDEF.implementation``. Its methods:
``fwd(*inputs, o) -> outputs`` and ``bwd(grads, saved, o, needs) -> one gradient (or None) per
input, then per differentiable option``, where ``grads`` are the visible outputs' gradients,
``saved`` what ``save`` returned and ``needs`` which gradients are wanted.

From that the OpDef makes the ``torch.library`` custom-op pair ``fastformer::<op>_fwd`` /
``<op>_bwd`` with fake implementations and registered autograd (``torch.compile`` with
``fullgraph=True`` and dynamic shapes, ``torch.export``), and the eager route: one
``torch.autograd.Function`` shared by every op. A Python custom-op call costs ~36 us against
~16 us for ``Function.apply`` on a 2-core VM, a large share of a small kernel, so plain eager
calls take the Function; tracing, compiling, tensor subclasses and
``FASTFORMER_EAGER_VIA_OPS=1`` take the custom ops. Both run the same implementations.
An implementation may also define ``inference(*inputs, o) -> outputs``, the forward of calls
no backward follows (what only the backward reads may come back empty); calls without a
gradient take it on both routes (an op with one also gets ``fastformer::<op>_inference``).

The implementation the forward chose runs the backward on both routes: the Function keeps it
on its ctx; the custom-op forward returns its index as a CPU int64 token (one more output)
that the backward op reads, so no second selection happens (which could pick another backend
outside a ``use_backend`` block, or under another ``FASTFORMER_BACKEND``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import backends

_via_ops = False


def reload_env() -> None:
    """Re-read FASTFORMER_EAGER_VIA_OPS (fastformer.backends.reload_env() calls this)."""
    global _via_ops
    _via_ops = os.environ.get("FASTFORMER_EAGER_VIA_OPS", "0") == "1"


reload_env()
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter
_is_compiling = torch.compiler.is_compiling


def via_custom_op(inputs: tuple, more: tuple = ()) -> bool:
    """True when the call must go through torch.ops (tracing, compiling, tensor subclasses)."""
    if _via_ops or _is_compiling():
        return True
    for t in inputs:
        if t is not None and type(t) is not _Tensor and type(t) is not _Parameter:
            return True
    for t in more:
        if t is not None and type(t) is not _Tensor and type(t) is not _Parameter:
            return True
    return False


_grad_enabled = torch.is_grad_enabled


def needs_grad(tensors: tuple) -> bool:
    """Whether autograd must record a call on these tensors (plain loops: this runs on every
    op call)."""
    if not _grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def plain_tensor(t) -> bool:
    """A tensor or parameter, not a subclass that intercepts ops (FakeTensor, DTensor, ...)."""
    return type(t) in (Tensor, torch.nn.Parameter)


def rowwise(t: Optional[Tensor]) -> Optional[Tensor]:
    """A tensor whose last dim is contiguous; copies only when it is not.

    Used on incoming *gradients* only: autograd may hand a kernel an expanded (stride-0) grad,
    e.g. from ``y.sum().backward()``. Activations never go through here.
    """
    if t is None or t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1:
        return t
    return t.contiguous()


def owned(t):
    """What an autograd.Function's forward returns for an output t: t, or t.detach() when t is a
    view of a tensor made inside the forward (a transposed (B, L, H, D) attention buffer, a
    reshaped GEMM output). autograd refuses in-place ops on a custom Function's output that is
    such a view ("...is a view and is being modified inplace"): ``out += residual`` failed on
    every op's output. t.detach() is not a view to autograd, shares t's memory (no copy) and its
    version counter, so an in-place change of an output the forward saved is still caught."""
    return t.detach() if isinstance(t, Tensor) and t._base is not None else t


def compiled(name: str):
    """fastformer._C.<name> as an Impl method (a staticmethod: the call goes straight to C++,
    no Python frame in between), or None when the extension or the function is missing (the
    backend then says why it is unavailable)."""
    from .. import _ext
    fn = getattr(_ext.C, name, None) if _ext.C is not None else None
    return staticmethod(fn) if fn is not None else None


def seed_offset(rng_state: Optional[Tensor]) -> tuple:
    """(seed, offset) of a dropout RNG state (an int64 CPU tensor), (0, 0) without one."""
    if rng_state is None:
        return 0, 0
    seed, offset = rng_state.tolist()
    return int(seed), int(offset)


# ---- options ----------------------------------------------------------------------------------
# Option field annotations and the custom-op schema type each becomes.
_SCHEMA_TYPES = {"Optional[Tensor]": "Tensor?", "int": "int", "float": "float",
                 "Optional[float]": "float?", "bool": "bool"}


class Options:
    """Base of an op family's options (made with :func:`options`)."""

    __slots__ = ()
    fields: tuple = ()           # field names, in schema order
    _is_tensor: tuple = ()
    defaults: tuple = ()
    tensor_fields: tuple = ()
    differentiable: tuple = ()   # tensor fields that may require grad (get one from bwd)
    schema: str = ""             # the fields as custom-op schema arguments

    # Generated per class by options(), straight-line code (a loop over the fields costs
    # ~0.5 us a call, on every op call):
    def flat(self) -> tuple:
        """The field values, in schema order."""
        raise NotImplementedError

    def set_fields(self) -> frozenset:
        """Names of the fields set to something other than their default."""
        raise NotImplementedError

    def tensors(self) -> tuple:
        """The values of the tensor fields."""
        raise NotImplementedError

    def without_tensors(self):
        """The options with their tensor fields None (kept on an autograd ctx; the tensors are
        saved with save_for_backward and put back by :meth:`with_tensors`)."""
        if not self.tensor_fields:
            return self
        return type(self)(*[None if is_t else getattr(self, n)
                            for n, is_t in zip(self.fields, self._is_tensor)])

    def with_tensors(self, tensors):
        if not self.tensor_fields:
            return self
        it = iter(tensors)
        return type(self)(*[next(it) if is_t else getattr(self, n)
                            for n, is_t in zip(self.fields, self._is_tensor)])

    def replace(self, **changes):
        """A copy with some fields changed (construction is ~0.2 us; copy.copy is ~1.7)."""
        return type(self)(*[changes[n] if n in changes else getattr(self, n) for n in self.fields])


def options(cls):
    """Class decorator: an :class:`Options` dataclass (slots) with its field metadata."""
    cls = dataclasses.dataclass(slots=True)(cls)
    fields = dataclasses.fields(cls)
    for f in fields:
        if f.type not in _SCHEMA_TYPES:
            raise TypeError(f"{cls.__name__}.{f.name}: option type {f.type!r} is not one of "
                            f"{sorted(_SCHEMA_TYPES)}")
    cls.fields = tuple(f.name for f in fields)
    cls.defaults = tuple(f.default for f in fields)
    cls.tensor_fields = tuple(f.name for f in fields if "Tensor" in f.type)
    cls._is_tensor = tuple("Tensor" in f.type for f in fields)
    cls.schema = ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in fields)
    _generate_methods(cls, fields)
    for name in cls.differentiable:
        if name not in cls.tensor_fields:
            raise TypeError(f"{cls.__name__}.differentiable names {name!r}, not a tensor field")
    return cls


def _generate_methods(cls, fields) -> None:
    """flat(), tensors() and set_fields() of an options class as straight-line code."""
    defaults = {f"_d{i}": f.default for i, f in enumerate(fields)}
    is_set = []
    for i, f in enumerate(fields):
        if f.default is None:
            is_set.append(f"        if self.{f.name} is not None: out.append({f.name!r})")
        else:
            is_set.append(f"        if self.{f.name} != _d{i}: out.append({f.name!r})")
    tensors = "".join(f"self.{n}, " for n in cls.tensor_fields)
    source = "\n".join([
        "def flat(self):",
        "    return (" + "".join(f"self.{f.name}, " for f in fields) + ")",
        "def tensors(self):",
        f"    return ({tensors})",
        "def set_fields(self):",
        "    out = []",
        "    if True:",
        *is_set,
        "    return frozenset(out)",
    ])
    namespace: dict = {}
    exec(source, dict(defaults), namespace)  # noqa: S102  (source built from field names)
    for name in ("flat", "tensors", "set_fields"):
        fn = namespace[name]
        fn.__qualname__ = f"{cls.__name__}.{name}"
        fn.__doc__ = getattr(Options, name).__doc__
        setattr(cls, name, fn)


# ---- the op definition ------------------------------------------------------------------------
class OpDef:
    """One op family's definition (see the module docstring)."""

    def __init__(self, name: str, *, inputs: tuple, options: type, outputs: tuple, visible: int,
                 save: Callable, fake_fwd: Callable, fake_bwd: Callable, call: Callable,
                 grad_aliases: Optional[dict] = None, non_differentiable: tuple = ()):
        self.name = name
        self.inputs = tuple(i.rstrip("?") for i in inputs)
        self.n_inputs = len(inputs)
        self.options = options
        self.outputs = tuple(outputs)
        self.visible = visible
        self.non_differentiable = tuple(non_differentiable)  # indices of visible outputs
        self.save, self.fake_fwd, self.fake_bwd, self.call = save, fake_fwd, fake_bwd, call
        # {input index: input index}: the gradient of the first is the same tensor as the
        # second's (add+norm: d residual = d x), filled in after the backward.
        self.grad_aliases = dict(grad_aliases or {})
        self.n_grads = self.n_inputs + len(options.differentiable)
        self._diff_positions = tuple(options.fields.index(n) for n in options.differentiable)
        self.impls: list = []
        self._define_custom_ops(inputs)
        self.inference_op = None  # fastformer::<op>_inference, once an implementation has `inference`

    # -- implementations ---------------------------------------------------------------------
    def implementation(self, cls):
        """Class decorator: register an implementation (tried in registration order within
        its backend)."""
        impl = cls()
        impl.index = len(self.impls)
        self.impls.append(impl)
        if impl.inference is not None and self.inference_op is None:
            self._define_inference_op()
        backends.register(self.name, impl)
        return cls

    def select(self, inputs: tuple, o) -> backends.Impl:
        return backends.select(self.call(inputs, o))

    # -- the public entry ------------------------------------------------------------------------
    def __call__(self, inputs: tuple, o):
        """Run the op on validated inputs; returns the visible outputs (a sequence)."""
        diff = ()
        if o.differentiable:
            diff = tuple(getattr(o, n) for n in o.differentiable)
        grad = needs_grad(inputs) or bool(diff and needs_grad(diff))
        if via_custom_op(inputs, o.tensors()):
            if grad or self.inference_op is None:
                return self.fwd_op(*inputs, *o.flat())[:self.visible]
            out = self.inference_op(*inputs, *o.flat())
            return (out,) if isinstance(out, torch.Tensor) else out
        impl = backends.select(self.call(inputs, o))
        if grad:
            out = impl.autograd(*inputs, o) if impl.autograd is not None else None
            if out is not None:  # None: this call takes the shared Function
                return out
            out = _EagerFunction.apply(self, impl, o, *inputs, *diff)
            return out if isinstance(out, tuple) else (out,)
        return (impl.inference or impl.fwd)(*inputs, o)[:self.visible]

    def _complete(self, grads: tuple, needs) -> list:
        """The backward's gradients with aliases filled in and None where not needed."""
        grads = list(grads)
        for dst, src in self.grad_aliases.items():
            grads[dst] = grads[src]
        return [g if need else None for g, need in zip(grads, needs)]

    # -- custom ops --------------------------------------------------------------------------
    def _define_custom_ops(self, inputs: tuple) -> None:
        n_in, n_out, opts = self.n_inputs, len(self.outputs), self.options
        args = ", ".join(("Tensor? " if i.endswith("?") else "Tensor ") + i.rstrip("?") for i in inputs)
        self._arg_schema = f"({args}, {opts.schema})"  # (the inference op's too)
        fwd_schema = f"{self._arg_schema} -> ({', '.join(['Tensor'] * (n_out + 1))})"
        bwd_schema = (f"(Tensor?[] grads, Tensor?[] saved, {opts.schema}, bool[] needs, "
                      "Tensor token) -> Tensor[]")

        def fwd_impl(*args):
            inputs, o = args[:n_in], opts(*args[n_in:])
            impl = self.select(inputs, o)
            token = torch.full((), 2 * impl.index + int(backends.last_dispatch().forced),
                               dtype=torch.int64)
            return (*impl.fwd(*inputs, o), token)

        def fwd_fake(*args):
            return (*self.fake_fwd(*args[:n_in], opts(*args[n_in:])),
                    torch.empty((), dtype=torch.int64, device="cpu"))

        def bwd_impl(grads, saved, *rest):
            o, needs, token = opts(*rest[:-2]), rest[-2], int(rest[-1])
            impl = self.impls[token // 2]
            backends.record(backends.Dispatch(self.name, impl.backend, bool(token % 2), {},
                                              impl.name))
            out = impl.bwd(tuple(grads), tuple(saved), o, tuple(needs))
            ref = next(t for t in (*grads, *saved) if t is not None)
            return [g if g is not None else ref.new_empty((0,)) for g in out]

        def bwd_fake(grads, saved, *rest):
            out = self.fake_bwd(tuple(grads), tuple(saved), opts(*rest[:-2]), tuple(rest[-2]))
            ref = next(t for t in (*grads, *saved) if t is not None)
            return [g if g is not None else ref.new_empty((0,)) for g in out]

        self.fwd_op = torch.library.custom_op(f"fastformer::{self.name}_fwd", fwd_impl,
                                              mutates_args=(), schema=fwd_schema)
        self.fwd_op.register_fake(fwd_fake)
        self.bwd_op = torch.library.custom_op(f"fastformer::{self.name}_bwd", bwd_impl,
                                              mutates_args=(), schema=bwd_schema)
        self.bwd_op.register_fake(bwd_fake)

        def setup_context(ctx, inputs, output):
            o = opts(*inputs[n_in:])
            saved = self.save(tuple(inputs[:n_in]), o, tuple(output[:n_out]))
            ctx.save_for_backward(*saved, *o.tensors(), output[-1])
            ctx.o, ctx.n_saved = o.without_tensors(), len(saved)
            ctx.mark_non_differentiable(*(output[i] for i in self.non_differentiable), output[-1],
                                        *output[self.visible:n_out])

        def backward(ctx, *grads):
            tensors = ctx.saved_tensors
            n = ctx.n_saved
            o = ctx.o.with_tensors(tensors[n:-1])
            flags = ctx.needs_input_grad
            needs = [bool(flags[i]) for i in range(n_in)]
            needs += [bool(flags[n_in + p]) for p in self._diff_positions]
            out = self.bwd_op(list(grads[:self.visible]), list(tensors[:n]), *o.flat(), needs,
                              tensors[-1])
            grads_in = self._complete(out, needs)
            per_option = [None] * len(opts.fields)
            for k, p in enumerate(self._diff_positions):
                per_option[p] = grads_in[n_in + k]
            return (*grads_in[:n_in], *per_option)

        self.fwd_op.register_autograd(backward, setup_context=setup_context)

    def _define_inference_op(self) -> None:
        """fastformer::<op>_inference: the forward of calls without a gradient (no autograd),
        returning the visible outputs (one: a Tensor, as the schema says)."""
        n_in, opts, visible = self.n_inputs, self.options, self.visible
        out_schema = f"{self._arg_schema} -> " + ("Tensor" if visible == 1 else f"({', '.join(['Tensor'] * visible)})")

        def visible_outputs(outputs):
            outputs = tuple(outputs)
            return outputs[0] if visible == 1 else outputs[:visible]

        def inference_impl(*args):
            inputs, o = args[:n_in], opts(*args[n_in:])
            impl = self.select(inputs, o)
            return visible_outputs((impl.inference or impl.fwd)(*inputs, o))

        self.inference_op = torch.library.custom_op(f"fastformer::{self.name}_inference", inference_impl,
                                                    mutates_args=(), schema=out_schema)
        self.inference_op.register_fake(lambda *args: visible_outputs(self.fake_fwd(*args[:n_in], opts(*args[n_in:]))))

    def op_args(self, inputs: tuple, o) -> tuple:
        """The forward custom op's arguments for a call (torch.library.opcheck in the tests)."""
        return (*inputs, *o.flat())


class _EagerFunction(torch.autograd.Function):
    """The eager route of every op: forward(op, impl, o, *inputs, *differentiable options)."""

    @staticmethod
    def forward(ctx, op, impl, o, *tensors):
        inputs = tensors[:op.n_inputs]
        outputs = impl.fwd(*inputs, o)
        saved = op.save(inputs, o, tuple(outputs))
        ctx.save_for_backward(*saved, *o.tensors())
        ctx.op, ctx.impl, ctx.o, ctx.n_saved = op, impl, o.without_tensors(), len(saved)
        ctx.dispatch = backends.last_dispatch()
        visible = tuple(owned(t) for t in outputs[:op.visible])
        if op.non_differentiable:
            ctx.mark_non_differentiable(*(visible[i] for i in op.non_differentiable))
        return visible if len(visible) > 1 else visible[0]

    @staticmethod
    def backward(ctx, *grads):
        backends.record(ctx.dispatch)  # the forward's implementation runs the backward
        op, n = ctx.op, ctx.n_saved
        tensors = ctx.saved_tensors
        o = ctx.o.with_tensors(tensors[n:])
        needs = tuple(ctx.needs_input_grad[3:])
        out = ctx.impl.bwd(grads, tensors[:n], o, needs)
        return (None, None, None, *op._complete(out, needs))
