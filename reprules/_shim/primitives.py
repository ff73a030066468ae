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

from reprules._shim import _kernels, _rules, _verify
from reprules._shim._patches import Patches
from reprules._shim._rules import Opaque
from reprules._shim._types import TypeField, call_axes, cast_inputs, in_checked_shard_map


def attach(field: TypeField, op: Opaque, patches: Patches) -> None:
    """Types the outputs of ``op.prim`` by the rule of each equation (its
    abstract eval), and casts inputs up before binding (its bind).
    Equations without a rule are left exactly as JAX types them."""
    prim = op.prim
    original_abstract_eval = prim.abstract_eval
    original_bind = prim.bind  # may already be another reprules hook

    def abstract_eval(*avals: Any, **params: Any) -> Any:
        out, effects = original_abstract_eval(*avals, **params)
        reg = op.lookup(params)
        if reg is None or not in_checked_shard_map():
            return out, effects
        first, _ = op.layout(params, len(avals))
        outs = list(out) if prim.multiple_results else [out]
        in_vary = tuple(field.varying(a) for a in avals[first:])
        decided = _rules.decide_here(reg, in_vary, len(outs))
        if decided is None:
            return out, effects
        with call_axes(decided[1], avals[first:]):
            outs = [field.retype(o, v) for o, v in zip(outs, decided[0].outputs)]
        return (outs if prim.multiple_results else outs[0]), effects

    def bind(*args: Any, **params: Any) -> Any:
        reg = op.lookup(params)
        if reg is not None and in_checked_shard_map():
            _kernels.note_registered_call()
            first, num_out = op.layout(params, len(args))
            if num_out is None:  # a multiple-results primitive: count from its abstract eval
                num_out = len(original_abstract_eval(*(jax.typeof(a) for a in args), **params)[0])
            in_avals = [jax.typeof(a) for a in args[first:]]
            in_vary = tuple(field.varying(a) for a in in_avals)
            decided = _rules.decide_here(reg, in_vary, num_out)
            if decided is not None:
                with call_axes(decided[1], in_avals):
                    args = args[:first] + tuple(cast_inputs(args[first:], in_vary, decided[0].inputs))
                    out = original_bind(*args, **params)
                    _verify.check_outputs(field, reg, list(out) if prim.multiple_results else [out])
                return out
        return original_bind(*args, **params)

    patches.setattr(prim, "abstract_eval", abstract_eval)
    patches.setattr(prim, "bind", bind)
