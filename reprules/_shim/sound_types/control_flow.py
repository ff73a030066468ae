"""Sound types for control flow on a device-varying predicate (vma and mat eras).

JAX types a ``cond``/``switch`` by its branches' outputs and ignores the
predicate (jax#40823, open): with a predicate that varies over ``data`` and
branches that compute replicated values, the output is typed replicated while
each device took its own branch. ``out_specs=P()`` then returns device 0's
value, and ``lax.cond(axis_index("i") == 0, 2x, 3x)`` differentiates to 4
where the truth (and checking off) is 5. A ``while_loop`` whose predicate
varies runs a different number of steps per device, with the same typing.
JAX <= 0.5 typed such a ``cond`` varying (its ``check_rep`` rewrite rule).

Where the predicate (or index) varies over axes an output is not typed with,
reprules casts the operands (the loop's carries) up to those axes *before*
the control flow, so a replicated operand's cotangent is psummed once, outside
it, as checking off does (JAX's own transpose psums it inside the branch each
device took: a collective only some devices run, which hangs XLA:CPU; so a
``cond`` whose outputs are typed soundly gets its replicated operands cast up
too, where its branches can be retyped); and retraces the branches (the loop's cond and body)
on the new types, casting up only outputs that depend on no operand (a
constant: no cotangent flows through it). Nothing changes where JAX's types
already hold the predicate's axes (a JAX that fixes this), under
``reprules.strict()`` or with ``REPRULES_SOUND_TYPES=0``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from reprules import _errors
from reprules._messages import out_types
from reprules._shim.plumbing import _frames, _jax
from reprules._shim.safety import strict
from reprules._shim.sound_types import opaque_types, out_specs_note, retrace
from reprules._shim.plumbing._jax import core, lu, pe
from reprules._shim.plumbing._patches import Patches
from reprules._shim.plumbing._types import TypeField, cast_inputs, in_checked_shard_map, manual_axes

_CONDITIONALS = "jax._src.lax.control_flow.conditionals"
_LOOPS = "jax._src.lax.control_flow.loops"


def install(field: TypeField, patches: Patches) -> None:
    """Hooks the binds of ``cond_p`` and ``while_p``, and (``retrace``) the public entry points."""
    retrace.install(field, patches)
    cond_p = _jax.primitive(_CONDITIONALS, "cond_p")
    while_p = _jax.primitive(_LOOPS, "while_p")
    if cond_p is not None:
        patches.setattr(cond_p, "bind", _cond_bind(field, cond_p.bind))
    if while_p is not None:
        patches.setattr(while_p, "bind", _while_bind(field, while_p.bind))


def _inexact(aval: Any) -> bool:
    """A value with a cotangent; one with no dtype (a token, a ref) counts too (``_values`` decides it)."""
    dtype = getattr(aval, "dtype", None)
    return dtype is None or bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))


def _values(avals: Sequence[Any]) -> bool:
    """Only arrays can be cast (a ref or a token is left to JAX)."""
    return all(type(a) is core.ShapedArray for a in avals)


def _cond_bind(field: TypeField, bind: Callable[..., Any]) -> Callable[..., Any]:
    def cond_bind(index: Any, *operands: Any, branches: Sequence[Any], **params: Any) -> Any:
        if not opaque_types.widening_on() or not in_checked_shard_map():
            return bind(index, *operands, branches=branches, **params)
        axes = field.varying(jax.typeof(index))
        outs = branches[0].out_avals
        avals = [jax.typeof(o) for o in operands]
        # Only values with a cotangent (inexact ones): an integer output typed replicated is at
        # worst JAX's own typing (the cond's public entry casts a user's outputs up; what reaches
        # this hook with one is JAX's own, e.g. partial evaluation's residual index of a switch,
        # which only its other half reads, on the same device), and an integer operand has no
        # cotangent to psum. Casting those up made the half that reads them need retyping.
        short = bool(axes) and any(axes - field.varying(o) for o in outs if _inexact(o))
        # A replicated operand's cotangent would be psummed inside the branch each device
        # took (JAX's cond transpose): a collective only some devices run. Cast up outside.
        replicated = bool(axes) and any(axes - field.varying(a) for a in avals if _inexact(a))
        retyped = _retyped(field, avals, branches[0].in_avals)
        if not ((short or replicated or retyped) and _values([*avals, *outs])):
            return bind(index, *operands, branches=branches, **params)
        cast = tuple(_cast(field, operands, avals, axes)) if short or replicated else operands
        targets = [field.varying(o) | axes for o in outs]
        try:
            new_branches = tuple(_retrace(field, b, [jax.typeof(o) for o in cast], targets) for b in branches)
        except _NotRetypable as err:
            if short or retyped:
                raise _refusal("lax.cond / lax.switch", axes, outs, field, str(err), operands) from None
            return bind(index, *operands, branches=branches, **params)  # its types were sound: JAX's cond
        if short:
            out_specs_note.record(f"a lax.cond / lax.switch whose predicate varies over {sorted(axes)} "
                                  "(jax#40823)", axes)
        return bind(index, *cast, branches=new_branches, **params)

    return cond_bind


def _while_bind(field: TypeField, bind: Callable[..., Any]) -> Callable[..., Any]:
    def while_bind(*args: Any, cond_jaxpr: Any, body_jaxpr: Any, cond_nconsts: int, body_nconsts: int,
                   **params: Any) -> Any:
        if opaque_types.widening_on() and in_checked_shard_map():
            if retrace.loop_widening():  # traced by retrace's while_loop: it casts the carries and traces again
                axes = field.varying(cond_jaxpr.out_avals[0])
                carries = [jax.typeof(c) for c in args[cond_nconsts + body_nconsts:]]
                if _values(carries) and any(axes - field.varying(a) for a in carries):
                    raise retrace.Widen(axes)
            try:
                args, cond_jaxpr, body_jaxpr = _retype_loop(field, args, cond_jaxpr, body_jaxpr, cond_nconsts,
                                                            body_nconsts)
            except _NotRetypable as err:
                raise _refusal("lax.while_loop", field.varying(cond_jaxpr.out_avals[0]), body_jaxpr.out_avals,
                               field, str(err), args) from None
        return bind(*args, cond_jaxpr=cond_jaxpr, body_jaxpr=body_jaxpr, cond_nconsts=cond_nconsts,
                    body_nconsts=body_nconsts, **params)

    return while_bind


def _retype_loop(field: TypeField, args: tuple[Any, ...], cond_jaxpr: Any, body_jaxpr: Any, cond_nconsts: int,
                 body_nconsts: int) -> tuple[tuple[Any, ...], Any, Any]:
    """The carries cast up to the predicate's axes, to a fixpoint (carries cast up
    may make the predicate vary over more axes), and both jaxprs retyped for them."""
    nconsts = cond_nconsts + body_nconsts
    cond_consts, body_consts, carries = args[:cond_nconsts], args[cond_nconsts:nconsts], list(args[nconsts:])
    cond_avals = [jax.typeof(c) for c in cond_consts]
    body_avals = [jax.typeof(c) for c in body_consts]
    avals = [jax.typeof(c) for c in carries]
    if not _values([*cond_avals, *body_avals, *avals]):
        return args, cond_jaxpr, body_jaxpr
    changed = _retyped(field, [*cond_avals, *avals], cond_jaxpr.in_avals) or _retyped(
        field, [*body_avals, *avals], body_jaxpr.in_avals)
    for _ in range(len(manual_axes()) + 1):  # each round adds an axis, or ends
        axes = field.varying(cond_jaxpr.out_avals[0])
        if not (changed or any(axes - field.varying(a) for a in avals)):
            break
        if any(axes - field.varying(a) for a in avals):
            out_specs_note.record(f"a lax.while_loop whose predicate varies over {sorted(axes)} (jax#40823)", axes)
        carries = _cast(field, carries, avals, axes)
        avals = [jax.typeof(c) for c in carries]
        cond_jaxpr = _retrace(field, cond_jaxpr, [*cond_avals, *avals], None)
        body_jaxpr = _retrace(field, body_jaxpr, [*body_avals, *avals], [field.varying(a) for a in avals])
        changed = False
    return (*cond_consts, *body_consts, *carries), cond_jaxpr, body_jaxpr


def _retyped(field: TypeField, avals: Sequence[Any], typed_for: Sequence[Any]) -> bool:
    """Whether values reach a jaxpr varying over other axes than it was typed for
    (only where reprules itself retyped the code around it)."""
    return any(field.varying(a) != field.varying(b) for a, b in zip(avals, typed_for))


class _NotRetypable(Exception):
    """A jaxpr holds an equation reprules cannot retype (named in the message)."""


def _refusal(what: str, axes: frozenset[str], outs: Sequence[Any], field: TypeField, inner: str,
             operands: Sequence[Any] = ()) -> Exception:
    """The refusal of a cond / while whose jaxprs hold ``inner``; with a replicated predicate, one whose
    ``operands`` an enclosing retyping cast up."""
    enclosing = not axes
    if enclosing:
        axes = frozenset().union(*(field.varying(jax.typeof(o)) for o in operands))
    missing = sorted(frozenset(axes) - frozenset().union(*(field.varying(o) for o in outs))) or sorted(axes)
    return _errors.RuleError(out_types.control_flow_message(
        what, _frames.annotation_site(depth=3), sorted(axes), missing, inner, manual_axes(), _jax.JAX_VERSION,
        enclosing=enclosing))


def _cast(field: TypeField, values: Sequence[Any], avals: Sequence[Any], axes: frozenset[str]) -> list[Any]:
    vary = [field.varying(a) for a in avals]
    return cast_inputs(values, vary, [v | axes for v in vary])


def _retrace(field: TypeField, closed: Any, in_avals: Sequence[Any], targets: Sequence[frozenset[str]] | None) -> Any:
    """``closed`` traced again on ``in_avals`` (which may vary over more axes than
    its own inputs), each output cast up to its target."""

    def fun(*args: Any) -> list[Any]:
        outs = _evaluate(field, closed, args)
        if targets is None:
            return outs
        vary = [field.varying(jax.typeof(o)) for o in outs]
        return cast_inputs(outs, vary, [v | t for v, t in zip(vary, targets)])

    debug: Any = getattr(closed.jaxpr, "debug_info", None)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(lu.wrap_init(fun, debug_info=debug), list(in_avals))[:3]
    return _jax.ClosedJaxpr(jaxpr, consts)


def _evaluate(field: TypeField, closed: Any, args: Sequence[Any]) -> list[Any]:
    """Evaluates ``closed`` on ``args`` that may vary over more axes than it was
    typed for, as JAX's own ops would have typed it: each equation's operands cast
    up to their union first (what ``jnp``'s ops do before they bind). Calls are
    inlined, a nested ``cond`` or ``while`` retypes itself (its bind is hooked);
    any other equation that holds a jaxpr typed for the old inputs is refused."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else env[v]

    for var, value in zip(closed.jaxpr.constvars, closed.consts):
        env[var] = value
    for var, value in zip(closed.jaxpr.invars, args):
        env[var] = value
    for eqn in closed.jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        prim, params = eqn.primitive, eqn.params
        same = not _retyped(field, [jax.typeof(v) for v in invals], [v.aval for v in eqn.invars])
        inner = _called_jaxpr(prim, params)
        if same:
            outs = prim.bind(*invals, **params)  # typed for these very inputs: as it was
        elif inner is not None:
            outs = _evaluate(field, inner, invals)
        elif prim is _custom_jvp_call():
            outs = _custom_jvp(field, prim, params, invals)
        elif prim is getattr(core, "pvary_p", None):
            have = frozenset().union(*(field.varying(jax.typeof(v)) for v in invals))
            axes = tuple(a for a in params["axes"] if a not in have)
            outs = eqn.primitive.bind(*invals, **{**params, "axes": axes}) if axes else invals
        elif (_holds_jaxpr(params) or "_prim" in params) and prim not in _self_typing():
            # (a hijax call, e.g. a custom_jvp under jax_custom_jvp3: its rules were traced for the old types)
            raise _NotRetypable(f"{prim.name} at {_line(eqn)}")
        else:
            if prim not in strict.jax_collectives() and prim not in _self_typing():
                invals = _unify(field, invals)
            outs = prim.bind(*invals, **params)
        outs = outs if prim.multiple_results or isinstance(outs, list) else [outs]
        for var, value in zip(eqn.outvars, outs):
            env[var] = value
    return [read(v) for v in closed.jaxpr.outvars]


def _custom_jvp(field: TypeField, prim: Any, params: dict[str, Any], invals: Sequence[Any]) -> Any:
    """A ``custom_jvp`` call (``jax.nn.relu``) bound again on retyped operands: its
    function and its JVP rule's jaxpr evaluated as :func:`_evaluate` does, the rule
    kept (what JAX's ``lift_jvp`` does, with this evaluator instead of ``eval_jaxpr``)."""
    call, num_consts, jvp_jaxpr_fun = params["call_jaxpr"], params["num_consts"], params["jvp_jaxpr_fun"]
    symbolic_zero = _jax.module("jax._src.custom_derivatives").SymbolicZero
    fun = lu.wrap_init(lambda *args: _evaluate(field, call, args), debug_info=call.jaxpr.debug_info)

    def jvp(*xs: Any) -> list[Any]:
        n = len(xs) // 2
        primals, tangents = xs[num_consts:n], xs[n + num_consts:]
        jvp_jaxpr, consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*(type(t) is symbolic_zero for t in tangents))
        nonzero = [t for t in tangents if type(t) is not symbolic_zero]
        out = _evaluate(field, _jax.ClosedJaxpr(jvp_jaxpr, consts), [*primals, *nonzero])
        out_primals, nonzero_out = out[:len(out_zeros)], iter(out[len(out_zeros):])
        out_tangents = [symbolic_zero(jax.typeof(p).to_tangent_aval()) if zero else next(nonzero_out)
                        for p, zero in zip(out_primals, out_zeros)]
        return [*out_primals, *out_tangents]

    rule = lu.wrap_init(jvp, debug_info=jvp_jaxpr_fun.debug_info)
    bind_params = prim.get_bind_params(params)
    if isinstance(bind_params, dict):  # 0.10+: the functions are a parameter
        return prim.bind(*invals, **{**bind_params, "subfuns": (fun, rule)})
    return prim.bind(fun, rule, *invals, **bind_params[1])  # 0.6 - 0.9: they come first


@functools.cache
def _custom_jvp_call() -> Any:
    return _jax.primitive("jax._src.custom_derivatives", "custom_jvp_call_p")


def _unify(field: TypeField, values: Sequence[Any]) -> list[Any]:
    """Each value cast up to the union of their varying axes (JAX's own rule)."""
    vary = [field.varying(jax.typeof(v)) for v in values]
    union = frozenset().union(*vary)
    return cast_inputs(values, vary, [union] * len(values))


@functools.cache
def _self_typing() -> frozenset[Any]:
    """``cond`` and ``while``: their binds are hooked here, and retype themselves."""
    return _jax.primitives(((_CONDITIONALS, "cond_p"), (_LOOPS, "while_p")))


@functools.cache
def _calls() -> frozenset[Any]:
    return _jax.primitives((("jax._src.pjit", "pjit_p"), ("jax._src.pjit", "jit_p"),
                            ("jax._src.core", "closed_call_p"), ("jax._src.core", "call_p")))


def _called_jaxpr(prim: Any, params: dict[str, Any]) -> Any:
    """The closed jaxpr a call (``jit``, ``closed_call``) runs, to inline; else None."""
    if prim not in _calls():
        return None
    inner = params.get("jaxpr", params.get("call_jaxpr"))
    if not hasattr(inner, "consts"):  # a bare Jaxpr (closed_call, up to 0.11)
        return _jax.ClosedJaxpr(inner, ())
    return inner


def _holds_jaxpr(params: dict[str, Any]) -> bool:
    def holds(value: Any) -> bool:
        if isinstance(value, _jax.JAXPR_TYPES):
            return True
        return isinstance(value, (tuple, list)) and any(holds(v) for v in value)

    return any(holds(v) for v in params.values())


def _line(eqn: Any) -> str:
    """The user's line an equation was traced from."""
    return str(_jax.source_info_util.summarize(eqn.source_info))
