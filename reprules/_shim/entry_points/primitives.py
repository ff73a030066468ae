"""User primitives, ``ffi_call`` and jax-triton's ``triton_call`` under checking (vma and mat eras).

Their abstract eval is their rule: reprules wraps it to type each equation's
outputs by the equation's rule, and wraps the bind to cast inputs up as the
rule says (these primitives can have transposes, so a cast's transpose, a
psum, runs where a gradient needs it). Equations without a rule are left
exactly as JAX types them.
"""

from __future__ import annotations

from typing import Any

import jax

from reprules._shim.kernels import _identity
from reprules._shim.rules import _resolve
from reprules._shim.safety import _verify
from reprules._shim.sound_types import opaque_types, out_specs_note
from reprules._shim.plumbing._patches import Patches
from reprules._shim.rules._resolve import Opaque
from reprules._shim.plumbing._types import TypeField, call_axes, cast_inputs, in_checked_shard_map


def attach(field: TypeField, op: Opaque, patches: Patches) -> None:
    """Types the outputs of ``op.prim`` by the rule of each equation (its
    abstract eval), and casts inputs up before binding (its bind). An equation
    without a rule is typed by :mod:`opaque_types` (JAX's types, or the union
    of the inputs' axes where JAX's are too small)."""
    prim = op.prim
    original_abstract_eval = prim.abstract_eval
    original_bind = opaque_types.jax_bind(prim)  # may already be another reprules hook

    def abstract_eval(*avals: Any, **params: Any) -> Any:
        out, effects = original_abstract_eval(*avals, **params)
        reg = op.lookup(params)
        if not in_checked_shard_map() or (reg is None and not opaque_types.widening_on()):
            return out, effects
        first, _ = op.layout(params, len(avals))
        outs = list(out) if prim.multiple_results else [out]
        if reg is None:
            outs = opaque_types.retype(field, avals[first:], outs)
            return (outs if prim.multiple_results else outs[0]), effects
        in_vary = tuple(field.varying(a) for a in avals[first:])
        decided = _resolve.decide_here(reg, in_vary, len(outs))
        if decided is None:
            return out, effects
        with call_axes(decided[1], avals[first:]):
            outs = [field.retype(o, v) for o, v in zip(outs, decided[0].outputs)]
        return (outs if prim.multiple_results else outs[0]), effects

    def bind(*args: Any, **params: Any) -> Any:
        reg = op.lookup(params)
        if reg is not None and in_checked_shard_map():
            _identity.note_registered_call()
            first, num_out = op.layout(params, len(args))
            if num_out is None:  # a multiple-results primitive: count from its abstract eval
                num_out = len(original_abstract_eval(*(jax.typeof(a) for a in args), **params)[0])
            in_avals = [jax.typeof(a) for a in args[first:]]
            in_vary = tuple(field.varying(a) for a in in_avals)
            decided = _resolve.decide_here(reg, in_vary, num_out)
            if decided is not None:
                with call_axes(decided[1], in_avals):
                    args = args[:first] + tuple(cast_inputs(args[first:], in_vary, decided[0].inputs))
                    out = original_bind(*args, **params)
                    _verify.check_outputs(field, reg, list(out) if prim.multiple_results else [out])
                return out
        elif reg is None and opaque_types.widening_on() and in_checked_shard_map():
            return _bind_widened(field, op, original_abstract_eval, original_bind, args, params)
        return original_bind(*args, **params)

    bind.reprules_opaque_hook = True  # type: ignore[attr-defined]  # the class hook sends stale binds here
    patches.setattr(prim, "abstract_eval", abstract_eval)
    patches.setattr(prim, "bind", bind)


def _bind_widened(field: TypeField, op: Opaque, abstract_eval: Any, bind: Any, args: tuple[Any, ...],
                  params: dict[str, Any]) -> Any:
    """A rule-less call: where JAX types an output with fewer axes than the inputs
    vary over, the inputs are cast up to their union (the abstract eval then types
    every output by it) and the call site is warned about once."""
    avals = [jax.typeof(a) for a in args]
    first, _ = op.layout(params, len(args))
    out_avals = abstract_eval(*avals, **params)[0]
    outs = list(out_avals) if op.prim.multiple_results else [out_avals]
    union = opaque_types.widening(field, avals[first:], outs)
    if union is None:
        return bind(*args, **params)
    # Typed as by a rule: a custom_vjp around it gets reprules' exact psum of a cotangent varying
    # over axes its primal does not (JAX 0.6 - 0.7 would send it on unpsummed, and its transpose refuses).
    _identity.note_registered_call()
    opaque_types.warn(op, params, union, outs, field)
    out_specs_note.record(f"the {op.kind} {op.name(params)!r}, which has no rule", union)
    in_vary = [field.varying(a) for a in avals[first:]]
    with call_axes(opaque_types.axes_here(field, avals[first:]), avals[first:]):
        cast = cast_inputs(args[first:], in_vary, [union] * len(in_vary))
    return bind(*args[:first], *cast, **params)
