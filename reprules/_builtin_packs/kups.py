"""Rules for kups' custom JAX primitives.

kups (PyPI ``kups``, Cusp AI's molecular simulation library) defines four
``jax.extend.core.Primitive``s:

* ``kups_segment_sum`` and ``kups_segment_take`` (``kups.core.utils.segment``):
  a scatter-add into bins and the gather that is its adjoint. Their abstract
  evals return ``ShapedArray(shape, dtype)``, which JAX reads as replicated
  over every mesh axis: a gather of a replicated table by data-sharded ids is
  typed replicated, so the table's gradient misses its psum (silently wrong),
  and ``out_specs=P()`` over a data-varying sum is accepted (shard 0's sums).
  Each output is computed from its operands on one device: ``rules.same()``.
  The table, cast up to the ids' axes for free, then gets its gradient psummed
  over exactly those axes (the transpose of the cast), and the sum is typed
  varying, so JAX refuses ``out_specs=P()``.
* ``assertion`` and ``check_assertion`` (``kups.core.assertion``): a no-op
  passing its operands through (the runtime assertion) and a scalar ``True``
  shaped like its operand. Their abstract evals already keep the operands'
  types; the rules say the same (each output like its own operand; the scalar
  like its operand), so nothing depends on how reprules types a primitive
  without a rule.

Entry points ``kups.core.utils.segment`` and ``kups.core.assertion``: each
loaded right after its module is imported.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import reprules
from reprules import rules

# The primitives each pack function registers, by their names in the kups module.
PRIMITIVES: dict[str, tuple[str, ...]] = {
    "segment": ("segment_sum_p", "segment_take_p"),
    "assertion": ("assertion_p", "check_assertion_p"),
}


@dataclasses.dataclass(frozen=True)
class passthrough:
    """Output ``i`` varies like operand ``i`` (a no-op of several operands); no operand is cast."""

    def __call__(self, ctx: rules.RuleContext, in_varying: tuple[rules.VaryingSet, ...], /) -> rules.RuleResult:
        if ctx.num_outputs != len(in_varying):
            raise reprules.RuleError(
                f"kups' primitive {ctx.kernel_name!r} returned {ctx.num_outputs} outputs for "
                f"{len(in_varying)} operands (mesh axes {sorted(ctx.mesh_axes)}, JAX {ctx.jax_version}).\n"
                "Why: reprules' kups pack types it as a no-op, each output like its own operand.\n"
                "Fix: upgrade reprules (kups changed the primitive); until then register "
                "reprules.replication_rule(reprules.rules.same(), override=True) on it."
            )
        return in_varying

    def __repr__(self) -> str:
        return "each output like its own operand"


RULES: dict[str, rules.RuleLike] = {
    "segment_sum_p": rules.same(),
    "segment_take_p": rules.same(),
    "assertion_p": passthrough(),
    "check_assertion_p": rules.same(),
}


def _register(module: ModuleType, function: str) -> None:
    """Registers the rule of every primitive of ``PRIMITIVES[function]``; raises after if any is missing."""
    missing = []
    for name in PRIMITIVES[function]:
        primitive = getattr(module, name, None)
        if primitive is None:
            missing.append(name)
        else:
            reprules.replication_rule(RULES[name])(primitive)
    if missing:
        raise LookupError(
            f"{module.__name__} has no {', '.join(missing)}: renamed or removed in kups, so that "
            "primitive gets no rule (the module's others have theirs).\n"
            "Fix: upgrade reprules; until then register it yourself with "
            "reprules.replication_rule(reprules.rules.same())(primitive)."
        )


def segment(module: ModuleType) -> None:
    """``kups.core.utils.segment``: ``kups_segment_sum`` and ``kups_segment_take``."""
    _register(module, "segment")


def assertion(module: ModuleType) -> None:
    """``kups.core.assertion``: the ``assertion`` no-op and ``check_assertion``."""
    _register(module, "assertion")
