"""The *rep* regime: JAX 0.4.28 - 0.5.x (``shard_map(..., check_rep=True)``).

Replication is not in the types. ``jax.experimental.shard_map`` keeps two dicts
keyed by primitive: check rules (``_check_rules``, used by ``_check_rep`` and
eager tracing) and rewrite rules (``_rewrite_rules``, used by ``RewriteTrace``
to insert ``pbroadcast``s whose transposes are the needed psums). reprules
installs one check and one rewrite rule for ``pallas_call_p`` that dispatch to
the kernel's own rule. The ``register_*`` helpers are first-wins
(``setdefault``), so we write the dicts directly and restore them on removal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reprules import _errors, _modes
from reprules._decide import decide
from reprules._registry import lookup
from reprules._shim import _common, _verify

NAME = "rep"
VERSIONS = "0.4.28 - 0.5.x"
MECHANISM = "check_rep: check + rewrite rules in jax.experimental.shard_map"
CHECK_FLAG = "check_rep"


def detect() -> bool:
    try:
        from jax.experimental import shard_map as sm
    except ImportError:
        return False
    return hasattr(sm, "_check_rules") and hasattr(sm, "_rewrite_rules")


def attach(op: _common.Opaque, patches: _common.Patches) -> None:
    """Installs check and rewrite rules for ``op.prim`` that dispatch to the
    rule of each equation. Equations without a rule keep JAX's own rules where
    JAX has them (``ffi_call`` from 0.4.38) and raise MissingRuleError otherwise."""
    from jax.experimental import shard_map as sm

    jax_check = sm._check_rules.get(op.prim)
    jax_rewrite = sm._rewrite_rules.get(op.prim)

    def decide_eqn(mesh: Any, in_rep: tuple[Any, ...], params: dict[str, Any]):
        all_axes = frozenset(mesh.axis_names)
        reg = op.lookup(params)
        if reg is None:
            return None
        first, num_out = op.layout(params, len(in_rep))
        # A rep of None marks a literal: replicated everywhere.
        in_vary = tuple(all_axes - r if r is not None else frozenset() for r in in_rep[first:])
        # num_out None: a multiple-results primitive, whose count is unknown here.
        ctx = _common.rule_context(reg, mesh.axis_names, len(in_vary), 1 if num_out is None else num_out)
        return first, in_vary, decide(reg, ctx, in_vary), all_axes, reg

    def missing(mesh: Any, params: dict[str, Any]) -> _errors.MissingRuleError:
        return _errors.MissingRuleError(
            _errors.missing_rule_message(
                op.name(params), mesh.axis_names, _common.JAX_VERSION, kind=op.kind
            )
        )

    def out_reps(decision, all_axes, num_outs: int) -> list[set[str]]:
        reps = [set(all_axes - o) for o in decision.outputs]
        return reps * num_outs if len(reps) == 1 and num_outs != 1 else reps

    # Both rules take `mesh` (and `in_rep`) positional-only: since 0.5.0
    # pallas_call_p has a param named `mesh` too.
    def check_rule(mesh: Any, /, *in_rep: Any, **params: Any) -> Any:
        decided = decide_eqn(mesh, in_rep, params)
        if decided is None:
            if jax_check is not None:
                return jax_check(mesh, *in_rep, **params)
            raise missing(mesh, params)
        _, _, decision, all_axes, _ = decided
        reps = [set(all_axes - o) for o in decision.outputs]
        if not op.prim.multiple_results:
            return reps[0]
        return reps if len(reps) > 1 else reps[0]  # one set: JAX applies it to every output

    def rewrite_rule(mesh: Any, in_rep: Any, /, *args: Any, **params: Any) -> Any:
        from jax.experimental.shard_map import pbroadcast  # not jax.lax.pbroadcast

        decided = decide_eqn(mesh, tuple(in_rep), params)
        if decided is None:
            if jax_rewrite is not None:
                return jax_rewrite(mesh, in_rep, *args, **params)
            raise missing(mesh, params)
        first, in_vary, decision, all_axes, reg = decided
        args = list(args)
        if decision.inputs is not None:
            for i, (now, target) in enumerate(zip(in_vary, decision.inputs)):
                if target - now:
                    args[first + i] = pbroadcast(args[first + i], tuple(sorted(target - now)))
        outs = op.prim.bind(*args, **params)
        outs = list(outs) if op.prim.multiple_results else [outs]
        reps = out_reps(decision, all_axes, len(outs))
        if _modes.verifying():
            _verify.insert_checks(
                reg, outs, [all_axes - r for r in reps], mesh.axis_names,
                lambda x, axes: pbroadcast(x, axes),
            )
        return outs, reps

    patches.setitem(sm._check_rules, op.prim, check_rule)
    patches.setitem(sm._rewrite_rules, op.prim, rewrite_rule)


def install(patches: _common.Patches) -> None:
    attach(_common.pallas_opaque(), patches)
    ffi = _common.ffi_opaque()
    if ffi is not None:
        attach(ffi, patches)
    _common.install_pallas_hooks(patches, _wrap_call)


def _wrap_call(
    kernel: Any,
    out_shape: Any,
    make_call: Callable[[Any], Callable[..., Any]],
    call: Callable[..., Any],
) -> Callable[..., Any]:
    def traced_call(*args: Any) -> Any:
        reg = lookup(kernel)
        if reg is None:
            return call(*args)  # the primitive-level rules report a missing rule themselves
        with _common.tracing(reg):
            return call(*args)

    return traced_call
