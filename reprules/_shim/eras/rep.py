"""The *rep* era: JAX 0.4.28 - 0.5.x (``shard_map(..., check_rep=True)``).

Replication is not in the types. ``jax.experimental.shard_map`` keeps two dicts
keyed by primitive: check rules (``_check_rules``, used by ``_check_rep`` and
eager tracing) and rewrite rules (``_rewrite_rules``, used by ``RewriteTrace``
to insert ``pbroadcast``s whose transposes are the needed psums). reprules
installs one check and one rewrite rule for ``pallas_call_p`` that dispatch to
the kernel's own rule (and for ``ffi_call`` and JAX's callbacks, which keep
JAX's own rules where none is registered). The ``register_*`` helpers are first-wins
(``setdefault``), so we write the dicts directly and restore them on removal.

Rules are told only the *manual* axes of the enclosing ``shard_map``
(``_types.rep_manual_axes``), as from 0.6; JAX's own rules see the whole mesh.

JAX's own ``cond`` / ``while_loop`` / ``pmax`` gaps (``rep_gaps``: a ``cond`` on a
varying predicate cast up before it, jax#40823) are this era's sound types,
installed at ``import reprules`` (``install_sound_types``), Pallas imported or not.
"""

from __future__ import annotations

from typing import Any

from reprules import _errors, _mode_state
from reprules._messages import advice
from reprules._decide import decide
from reprules._registry import Registration
from reprules.rules import Decision, VaryingSet
from reprules._shim.plumbing import _jax
from reprules._shim.inference import infer
from reprules._shim.rules import _resolve, callbacks
from reprules._shim.safety import _verify
from reprules._shim.cotangents import custom_vjp_rep
from reprules._shim.entry_points import _pallas_hooks
from reprules._shim.eras import rep_gaps
from reprules._shim.kernels._identity import PallasCall
from reprules._shim.plumbing._patches import Patches
from reprules._shim.rules._resolve import Opaque
from reprules._shim.plumbing._types import rep_manual_axes as manual_axes

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


def attach(op: Opaque, patches: Patches) -> None:
    """Installs check and rewrite rules for ``op.prim`` that dispatch to the
    rule of each equation. Equations without a rule keep JAX's own rules where
    JAX has them (``ffi_call`` from 0.4.38) and raise MissingRuleError otherwise."""
    from jax.experimental import shard_map as sm

    jax_check = sm._check_rules.get(op.prim)  # type: ignore[attr-defined]  # JAX <= 0.5 only
    jax_rewrite = sm._rewrite_rules.get(op.prim)  # type: ignore[attr-defined]  # JAX <= 0.5 only
    # A pallas_call has no transpose rule, so a cast of its inputs is never transposed
    # into a psum: the rewrite leaves them as they are (as the vma era does). Each output
    # then keeps the replication decided from the inputs as given: cast up for one
    # output, a shared input would make JAX's check pass type every output that depends
    # on it varying (out1 of a kernel returning (x * w, w + 1), w replicated).
    casts = op.prim is not _jax.pallas_call_p()

    def decide_eqn(mesh: Any, in_rep: tuple[Any, ...], params: dict[str, Any], num_results: int | None = None
                   ) -> tuple[int, tuple[VaryingSet, ...], Decision, frozenset[str], Registration] | None:
        # Reps are sets of *mesh* axes (automatic ones included: nothing varies
        # over those); the rule sees only the manual axes.
        all_axes = frozenset(mesh.axis_names)
        if op.prim is _jax.pallas_call_p():
            call = PallasCall.of(params)  # one lookup of the kernel for this equation
            # JAX refuses every rule-less pallas_call: the rule derived from its body, by default.
            reg = _resolve.registration_of(call)
            if reg is None:
                reg = _resolve.infer_by_default(call)
        else:
            reg = op.lookup(params)
        if reg is None:
            return None
        first, num_out = op.layout(params, len(in_rep))
        first = infer.rule_operands_start(reg, first)
        # A rep of None marks a literal: replicated everywhere.
        in_vary = tuple(all_axes - r if r is not None else frozenset() for r in in_rep[first:])
        # num_out None: a multiple-results primitive, counted from the equation or its operands.
        if num_out is None:
            num_out = num_results if num_results is not None else _num_results(op.prim)
        ctx = _resolve.rule_context(reg, manual_axes(mesh), len(in_vary), num_out)
        decision = decide(reg, ctx, in_vary)
        # JAX's check pass decides again from the inputs as the rewrite cast them; where an
        # output depends on an input cast up for another output (a derived rule), decide
        # until the casts change nothing, so that both passes agree. Rules only ever add
        # axes, so this ends; the bound only guards against a rule that does not. Without
        # casts (a pallas_call) both passes see the same inputs: nothing to reconcile.
        for _ in range(len(all_axes) * (len(in_vary) + 1) + 1 if casts else 0):
            if decision.inputs is None or tuple(decision.inputs) == in_vary:
                break
            again = decide(reg, ctx, tuple(decision.inputs))
            if again.outputs == decision.outputs and (again.inputs or decision.inputs) == decision.inputs:
                break
            decision = again
        return first, in_vary, decision, all_axes, reg

    def missing(mesh: Any, params: dict[str, Any]) -> _errors.MissingRuleError:
        jax_error = _jax_refusal(op.prim)
        call = PallasCall.of(params) if op.prim is _jax.pallas_call_p() else None
        error = _errors.MissingRuleError(
            advice.missing_rule_message(
                op.name(params), manual_axes(mesh), _jax.JAX_VERSION, kind=op.kind,
                jax_error=str(jax_error),
                inference=_resolve.inference_note(call, manual_axes(mesh)) if call is not None else "",
                site=call.site_text if call is not None else "",
                findings=_resolve.body_findings(call) if call is not None else None,
                function=call.function_name if call is not None else None,
            )
        )
        error.__cause__ = jax_error
        return error

    def out_reps(decision: Decision, all_axes: frozenset[str], num_outs: int) -> list[set[str]]:
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
        from jax.experimental.shard_map import pbroadcast  # type: ignore[attr-defined]  # JAX <= 0.5 only; not jax.lax.pbroadcast

        count = None
        if op.prim.multiple_results:
            outs_avals, _ = op.prim.abstract_eval(*(_jax.core.get_aval(a) for a in args), **params)  # type: ignore[attr-defined]
            count = len(outs_avals)
        decided = decide_eqn(mesh, tuple(in_rep), params, count)
        if decided is None:
            if jax_rewrite is not None:
                return jax_rewrite(mesh, in_rep, *args, **params)
            raise missing(mesh, params)
        first, in_vary, decision, all_axes, reg = decided
        cast_args = list(args)
        if casts and decision.inputs is not None:
            for i, (now, target) in enumerate(zip(in_vary, decision.inputs)):
                if target - now:
                    cast_args[first + i] = pbroadcast(cast_args[first + i], tuple(sorted(target - now)))
        outs = op.prim.bind(*cast_args, **params)
        outs = list(outs) if op.prim.multiple_results else [outs]
        reps = out_reps(decision, all_axes, len(outs))
        if _mode_state.verifying():
            manual = manual_axes(mesh)
            _verify.insert_checks(
                reg, outs, [all_axes - r for r in reps], manual,
                lambda x, axes: pbroadcast(x, axes), partial=len(manual) < len(all_axes),
            )
        return outs, reps

    patches.setitem(sm._check_rules, op.prim, check_rule,  # type: ignore[attr-defined]  # JAX <= 0.5 only
                    label=f"jax.experimental.shard_map._check_rules[{op.prim.name}]")
    patches.setitem(sm._rewrite_rules, op.prim, rewrite_rule,  # type: ignore[attr-defined]  # JAX <= 0.5 only
                    label=f"jax.experimental.shard_map._rewrite_rules[{op.prim.name}]")


def _num_results(prim: Any) -> int:
    """The number of results of the ``prim`` equation whose check rule is
    running: read from JAX's ``_check_rep`` (the equation ``e``) or eager
    ``process_primitive`` (its ``tracers``), the two callers of check rules."""
    import sys
    from types import FrameType

    frame: FrameType | None = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            break
        local = frame.f_locals
        eqn: Any = local.get("e")
        if getattr(eqn, "primitive", None) is prim:
            return len(eqn.outvars)
        tracers: Any = local.get("tracers")
        caller_prim: Any = local.get("prim")
        if caller_prim is prim and tracers is not None:
            outs, _ = caller_prim.abstract_eval(*(t.aval for t in tracers), **local.get("params", {}))
            return len(outs)
        frame = frame.f_back
    raise _errors.UnsupportedJaxError(
        f"reprules could not count the results of the multiple-results primitive {prim} in a "
        f"check_rep rule (JAX {_jax.JAX_VERSION}).\n"
        "Why: JAX's check rules are told the operands' replication only; reprules reads the "
        "equation from JAX's caller, which was not found.\n"
        "Fix: please report this with the program; as a workaround give the primitive one result."
    )


def _jax_refusal(prim: Any) -> Exception:
    """The error JAX itself raises for a primitive without rules (quoted in ours)."""
    from jax.experimental import shard_map as sm

    try:
        sm._rule_missing(prim)  # type: ignore[attr-defined]  # JAX <= 0.5 only
    except NotImplementedError as err:
        return err
    return NotImplementedError(f"No replication rule for {prim}.")


def install(patches: Patches) -> None:
    attach(_resolve.pallas_opaque(), patches)
    ffi = _resolve.ffi_opaque()
    if ffi is not None:
        attach(ffi, patches)
    from jax.experimental import shard_map as sm  # lazy: JAX <= 0.5's module, as attach() does

    for callback in sorted(callbacks.callbacks(), key=lambda p: p.name):
        if callback in sm._check_rules:  # type: ignore[attr-defined]  # JAX <= 0.5 only
            # A rule registered on the host function, else JAX's own rules (every mesh axis).
            attach(_resolve.callback_opaque(callback), patches)
    _pallas_hooks.install_pallas_hooks(patches)  # rules dispatch by kernel jaxpr: nothing to apply at bind
    custom_vjp_rep.install(patches)  # mixed cotangents JAX would over-count: refused
    if not rep_gaps.held():  # REPRULES_DORMANT=1 (not armed at import): held while rules are, as before
        rep_gaps.install(patches)


def install_sound_types(patches: Patches) -> None:
    """``cond`` / ``switch`` on a varying predicate cast up before the ``cond`` (jax#40823),
    and JAX's missing ``cond`` / ``while_loop`` / ``pmax`` rules (``rep_gaps``): installed at
    ``import reprules``, Pallas imported or not, as the vma and mat eras' sound types are."""
    rep_gaps.install(patches)
