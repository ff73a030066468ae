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

from reprules._decide import decide
from reprules._registry import Registration
from reprules._shim import _kernels, _rules, _verify
from reprules._shim._patches import Patches
from reprules._shim._rules import Opaque
from reprules._shim._types import TypeField, cast_inputs, checking, manual_axes
from reprules.rules import RuleContext


def attach(field: TypeField, op: Opaque, patches: Patches) -> None:
    """Types the outputs of ``op.prim`` by the rule of each equation (its
    abstract eval), and casts inputs up before binding (its bind).
    Equations without a rule are left exactly as JAX types them."""
    prim = op.prim
    original_abstract_eval = prim.abstract_eval
    original_bind = prim.bind  # may already be another reprules hook

    def context(reg: Registration, num_inputs: int, num_outputs: int) -> RuleContext:
        return _rules.rule_context(reg, manual_axes(), num_inputs, num_outputs)

    def abstract_eval(*avals: Any, **params: Any) -> Any:
        out, effects = original_abstract_eval(*avals, **params)
        reg = op.lookup(params)
        if reg is None or not checking() or not manual_axes():
            return out, effects
        first, _ = op.layout(params, len(avals))
        outs = list(out) if prim.multiple_results else [out]
        in_vary = tuple(field.varying(a) for a in avals[first:])
        decision = decide(reg, context(reg, len(in_vary), len(outs)), in_vary)
        outs = [field.retype(o, v) for o, v in zip(outs, decision.outputs)]
        return (outs if prim.multiple_results else outs[0]), effects

    def bind(*args: Any, **params: Any) -> Any:
        reg = op.lookup(params)
        if reg is not None and checking() and manual_axes():
            _kernels.note_registered_call()
            first, num_out = op.layout(params, len(args))
            if num_out is None:  # a multiple-results primitive: count from its abstract eval
                num_out = len(original_abstract_eval(*(jax.typeof(a) for a in args), **params)[0])
            in_vary = tuple(field.varying(jax.typeof(a)) for a in args[first:])
            decision = decide(reg, context(reg, len(in_vary), num_out), in_vary)
            args = args[:first] + tuple(cast_inputs(args[first:], in_vary, decision.inputs))
            out = original_bind(*args, **params)
            _verify.check_outputs(field, reg, list(out) if prim.multiple_results else [out])
            return out
        return original_bind(*args, **params)

    patches.setattr(prim, "abstract_eval", abstract_eval)
    patches.setattr(prim, "bind", bind)
