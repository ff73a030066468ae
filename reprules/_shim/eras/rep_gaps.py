"""JAX's own ``check_rep`` gaps on the rep regime (JAX 0.4.28 - 0.5.x), filled
from ``import reprules`` (the rep era's sound types, Pallas imported or not).

Ordinary programs fail under ``check_rep=True`` on these releases for reasons
that have nothing to do with kernels, so users turn checking off and the
defensive all-reduces come back. reprules installs the missing rules, and each
one changes behaviour only where JAX would otherwise raise, or (the ``cond``
rewrite on a varying predicate) put a collective inside a branch:

* ``cond`` / ``switch``: 0.4.28 has no rule at all ("No replication rule for
  cond"); 0.4.38 - 0.5.x raise when the branches' replication differs, and
  their rewrite of a ``cond`` on a varying predicate casts replicated operands
  inside each branch (jax#40823: the gradient psums inside the branch each
  device took, a collective only some devices run: XLA:CPU hangs). Filled, and
  that rewrite replaced, with JAX's own later rule: an output is replicated over
  the axes on which every branch's output, and the predicate, are replicated;
  operands are cast up before the ``cond`` over the axes the predicate varies
  over, so that no branch holds a collective that only some devices would reach.
* ``while_loop`` with a dynamic bound: no rule on any rep release. A carry is
  replicated over the axes on which its initial value, the body's output and
  the predicate all are (a fixed point, as JAX's ``scan`` rule computes it).
* ``pmax`` / ``pmin``: no rule on 0.4.28; the output is replicated over the
  reduced axes (JAX 0.4.38's rule).

Rules reprules adds where JAX has none are installed only in that case; JAX's
``cond`` check rule is called first and replaced only when it raises. With
``REPRULES_SOUND_TYPES=0`` (read when a function is traced) JAX's ``cond``
rewrite is used wherever JAX's rules accept the program; only what JAX would
refuse is still filled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reprules import _mode_state
from reprules._shim.plumbing import _jax
from reprules._shim.plumbing._patches import Patches

Rep = set[str] | None  # None: a literal, replicated everywhere
_MARK = "_reprules_rep_gaps"  # on the cond check rule installed here (kept by the patch guard's wraps)


def install(patches: Patches) -> None:
    parallel = _jax.module("jax._src.lax.parallel")
    conditionals = _jax.module("jax._src.lax.control_flow.conditionals")
    loops = _jax.module("jax._src.lax.control_flow.loops")
    from jax.experimental import shard_map as sm

    checks, rewrites = sm._check_rules, sm._rewrite_rules  # type: ignore[attr-defined]  # JAX <= 0.5 only
    cond_p, while_p = conditionals.cond_p, loops.while_p
    cond_check = _cond_check(checks.get(cond_p))
    setattr(cond_check, _MARK, True)
    patches.setitem(checks, cond_p, cond_check, label="shard_map._check_rules[cond]")
    patches.setitem(rewrites, cond_p, _cond_rewrite(rewrites.get(cond_p)), label="shard_map._rewrite_rules[cond]")
    if while_p not in checks and while_p not in rewrites:
        patches.setitem(checks, while_p, _while_check, label="shard_map._check_rules[while]")
        patches.setitem(rewrites, while_p, _while_rewrite, label="shard_map._rewrite_rules[while]")
    for prim in (parallel.pmax_p, parallel.pmin_p):
        if prim not in checks and prim not in rewrites:
            patches.setitem(checks, prim, _reduction_check, label=f"shard_map._check_rules[{prim}]")
            patches.setitem(rewrites, prim, _reduction_rewrite(prim), label=f"shard_map._rewrite_rules[{prim}]")


def held() -> bool:
    """Whether these rules are in place (live patches), so that they are never installed twice."""
    conditionals = _jax.module("jax._src.lax.control_flow.conditionals")
    from jax.experimental import shard_map as sm

    entry = sm._check_rules.get(conditionals.cond_p)  # type: ignore[attr-defined]  # JAX <= 0.5 only
    guard = getattr(entry, "_reprules_guard", None)  # the Patches that installed it (_patches.Patches.guard)
    return bool(getattr(entry, _MARK, False)) and (guard is None or guard.live)


def _full(mesh: Any, r: Rep) -> set[str]:
    return set(mesh.axis_names) if r is None else set(r)


def _meet(mesh: Any, reps: Sequence[Rep]) -> Rep:
    """Replicated over the axes every one of ``reps`` is replicated over."""
    if all(r is None for r in reps):
        return None
    out = set(mesh.axis_names)
    for r in reps:
        out &= _full(mesh, r)
    return out


# --- cond / switch ------------------------------------------------------------------


def _cond_check(jax_rule: Any) -> Any:
    def check(mesh: Any, /, *in_rep: Rep, branches: Any, **params: Any) -> Any:
        from jax.experimental import shard_map as sm

        if jax_rule is not None:
            try:
                return jax_rule(mesh, *in_rep, branches=branches, **params)
            except Exception as err:  # noqa: BLE001 - only JAX's branch-mismatch refusal is filled
                if "mismatched replication" not in str(err):
                    raise
        pred_rep, *args_rep = in_rep
        per_branch = [sm._check_rep(mesh, b.jaxpr, args_rep) for b in branches]  # type: ignore[attr-defined]
        return [_meet(mesh, [pred_rep, *outs]) for outs in zip(*per_branch)]

    return check


def _cond_rewrite(jax_rule: Any) -> Any:
    """JAX's rewrite where it has one, the branches agree and no operand is replicated
    over an axis the predicate varies over; otherwise (0.4.28, branches JAX's check
    refuses, a varying predicate) the operands are cast up *before* the
    ``cond`` over the axes the predicate varies over. Devices along such an
    axis may take different branches, so no branch may hold a collective over
    it: the casts' transposes (the psums) stay outside the ``cond``.
    ``REPRULES_SOUND_TYPES=0``: JAX's rewrite wherever it has one and the branches agree."""

    def rewrite(mesh: Any, in_rep: Any, /, *args: Any, branches: Any, **params: Any) -> Any:
        conditionals = _jax.module("jax._src.lax.control_flow.conditionals")
        from jax.experimental import shard_map as sm

        pred_rep, *args_rep = in_rep
        varying = set(mesh.axis_names) - set(pred_rep)
        # JAX's rewrite casts inside each branch: a replicated operand's cotangent is then psummed
        # inside the branch each device took (a collective only some devices run; jax#40823's
        # gradient came out 4, not 5). Only where no operand is replicated over such an axis.
        inside_is_safe = not any(set(r) & varying for r in args_rep)
        per_branch = [sm._replication_rewrite_nomatch(mesh, b, args_rep)[1] for b in branches]  # type: ignore[attr-defined]
        jax_typing = inside_is_safe or not _mode_state.sound_types()
        if jax_rule is not None and jax_typing and all(r == per_branch[0] for r in per_branch):
            return jax_rule(mesh, in_rep, *args, branches=branches, **params)
        operands = [args[0]] + [
            sm.pbroadcast(x, tuple(sorted(r & varying))) if r & varying else x  # type: ignore[attr-defined]
            for x, r in zip(args[1:], args_rep)
        ]
        args_rep = [set(r) - varying for r in args_rep]
        out_rep: list[set[str]] | None = None
        for branch in branches:
            _, reps = sm._replication_rewrite_nomatch(mesh, branch, args_rep)  # type: ignore[attr-defined]
            out_rep = list(reps) if out_rep is None else [a & b for a, b in zip(out_rep, reps)]
        out_rep = [set(pred_rep) & r for r in out_rep or []]
        branches_ = tuple(
            sm._replication_rewrite_match(mesh, b, args_rep, out_rep) for b in branches  # type: ignore[attr-defined]
        )
        return conditionals.cond_p.bind(*operands, branches=branches_, **params), out_rep

    return rewrite


# --- while_loop ------------------------------------------------------------------------


def _split(seq: Sequence[Any], cond_nconsts: int, body_nconsts: int) -> tuple[list[Any], list[Any], list[Any]]:
    return (list(seq[:cond_nconsts]), list(seq[cond_nconsts:cond_nconsts + body_nconsts]),
            list(seq[cond_nconsts + body_nconsts:]))


def _while_check(mesh: Any, /, *in_rep: Rep, cond_jaxpr: Any, body_jaxpr: Any, cond_nconsts: int,
                 body_nconsts: int, **_params: Any) -> list[Rep]:
    from jax.experimental import shard_map as sm

    cconst, bconst, carry = _split(in_rep, cond_nconsts, body_nconsts)
    carry = [_full(mesh, r) for r in carry]
    for _ in range(len(carry) + 2):
        pred, = sm._check_rep(mesh, cond_jaxpr.jaxpr, [*cconst, *carry])  # type: ignore[attr-defined]
        body = sm._check_rep(mesh, body_jaxpr.jaxpr, [*bconst, *carry])  # type: ignore[attr-defined]
        new = [c & _full(mesh, b) & _full(mesh, pred) for c, b in zip(carry, body)]
        if new == carry:
            break
        carry = new
    return list(carry)


def _while_rewrite(mesh: Any, in_rep: Any, /, *args: Any, cond_jaxpr: Any, body_jaxpr: Any,
                   cond_nconsts: int, body_nconsts: int, **params: Any) -> Any:
    loops = _jax.module("jax._src.lax.control_flow.loops")
    from jax.experimental import shard_map as sm

    cconst, bconst, carry_in = _split(list(in_rep), cond_nconsts, body_nconsts)
    carry = [set(r) for r in carry_in]
    for _ in range(len(carry) + 2):
        _, (pred,) = sm._replication_rewrite_nomatch(mesh, cond_jaxpr, [*cconst, *carry])  # type: ignore[attr-defined]
        _, body = sm._replication_rewrite_nomatch(mesh, body_jaxpr, [*bconst, *carry])  # type: ignore[attr-defined]
        new = [c & b & pred for c, b in zip(carry, body)]
        if new == carry:
            break
        carry = new
    first = cond_nconsts + body_nconsts
    args_ = list(args)
    for i, (src, dst) in enumerate(zip(carry_in, carry)):
        if src - dst:  # the initial value is more replicated than the loop keeps it
            args_[first + i] = sm.pbroadcast(args_[first + i], tuple(sorted(src - dst)))  # type: ignore[attr-defined]
    cond_, _ = sm._replication_rewrite_nomatch(mesh, cond_jaxpr, [*cconst, *carry])  # type: ignore[attr-defined]
    body_ = sm._replication_rewrite_match(mesh, body_jaxpr, [*bconst, *carry], carry)  # type: ignore[attr-defined]
    outs = loops.while_p.bind(*args_, cond_jaxpr=cond_, body_jaxpr=body_, cond_nconsts=cond_nconsts,
                              body_nconsts=body_nconsts, **params)
    return outs, carry


# --- pmax / pmin (0.4.28) ----------------------------------------------------------------


def _axes(axes: Any) -> tuple[Any, ...]:
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _reduction_check(mesh: Any, /, *in_rep: Rep, axes: Any, **_: Any) -> list[Rep]:
    return [None if r is None else set(r) | set(_axes(axes)) for r in in_rep]


def _reduction_rewrite(prim: Any) -> Any:
    def rewrite(mesh: Any, in_rep: Any, /, *args: Any, axes: Any, **params: Any) -> Any:
        from jax.experimental import shard_map as sm

        names = set(_axes(axes))
        args_ = [sm.pbroadcast(x, tuple(sorted(names & r))) if names & r else x  # type: ignore[attr-defined]
                 for x, r in zip(args, in_rep)]
        outs = prim.bind(*args_, axes=axes, **params)
        return list(outs), [set(r) | names for r in in_rep]

    return rewrite

