"""Control flow retyped where the user's functions are still Python (vma and mat eras).

``control_flow`` types a ``cond`` on a device-varying predicate soundly at its
bind, by evaluating the traced branches again on wider types. That cannot
reach everything a branch may hold: a ``scan``, a ``custom_vjp``, a
``checkpoint`` or a Pallas kernel carries jaxprs typed for the old inputs. So
the public entry points are hooked too, and there JAX itself re-traces the
user's functions on the new types, whatever they hold:

* ``lax.cond`` / ``lax.switch`` on a predicate varying over axes ``A``: the
  operands are cast up to ``A`` before the call, and so is every value the
  branches close over (cast where it was made, outside the ``cond``: an outer
  tracer lifted into a branch is swapped for its cast, see
  :func:`_lift`); each branch's outputs are cast up to ``A`` too (a no-op
  but for constants, whose cast has no transpose). The replicated values'
  cotangents are then psummed once, outside the ``cond``, as with checking
  off, and never inside a branch only some devices take.
* ``lax.scan`` / ``lax.while_loop`` (and ``fori_loop`` and ``lax.map``, which
  call them): where a carry comes out of the body varying over more axes than
  it went in (``jnp.zeros`` accumulating a sharded value), or a ``while``'s
  predicate varies over axes its carries do not, the initial carry is cast up
  outside the loop and the loop traced again, to a fixed point: what JAX's
  binary operators do for their operands (the cast JAX's carry-type error
  suggests). A carry the body returns less varying than it came in is cast
  up at the end of the body.

Nothing is traced twice where JAX's types already hold; everything is left to
JAX under ``reprules.strict()``, with ``REPRULES_SOUND_TYPES=0`` or outside
a checked ``shard_map``.
"""

from __future__ import annotations

import functools
import threading
import weakref
from types import FunctionType, MethodType, ModuleType
from collections.abc import Callable, Sequence
from typing import Any

import jax

from reprules._shim.plumbing import _jax
from reprules._shim.plumbing._jax import core, lu, pe
from reprules._shim.plumbing._patches import Patches
from reprules._shim.plumbing._types import TypeField, cast_up, in_checked_shard_map, manual_axes, note_widened
from reprules._shim.sound_types import opaque_types, out_specs_note

_CONDITIONALS = "jax._src.lax.control_flow.conditionals"
_LOOPS = "jax._src.lax.control_flow.loops"
_PARALLEL = "jax._src.lax.parallel"
_NAMESPACES = ("jax._src.lax.control_flow", "jax.lax")
_CARRY_ERROR = "carry input and carry output must have equal types"
_BRANCHES_ERROR = "branches must have equal output types"


class Widen(Exception):
    """Raised by ``control_flow``'s ``while`` bind hook inside a loop this module
    traces: the predicate varies over ``axes`` that some carries do not."""

    def __init__(self, axes: frozenset[str]) -> None:
        super().__init__(sorted(axes))
        self.axes = axes


class _Scope:
    """A ``cond`` being traced: each outer value its branches close over, cast up."""

    def __init__(self, casts: dict[int, Any]) -> None:
        self.casts = casts  # id(outer tracer) -> its cast (the outer tracer is kept alive by the closure)


class _State(threading.local):
    def __init__(self) -> None:
        self.scopes: list[_Scope] = []
        self.loops: list[int] = []  # the traces of the while loops this module is tracing, innermost last


_state = _State()


def loop_widening() -> bool:
    """Whether a ``while`` bind may raise :class:`Widen`: it is the one a hooked
    ``while_loop`` is tracing (bound in the trace that loop was called in), which catches it."""
    return bool(_state.loops) and _state.loops[-1] == id(_current_trace())


def install(field: TypeField, patches: Patches) -> None:
    """Hooks ``cond``, ``switch``, ``scan`` and ``while_loop`` where JAX defines and
    exports them, and the lifting of outer values into a traced function."""
    conditionals, loops, parallel = _jax.module(_CONDITIONALS), _jax.module(_LOOPS), _jax.module(_PARALLEL)
    hooks = [(conditionals, "cond", _cond_entry(field, conditionals.cond)),
             (conditionals, "switch", _switch_entry(field, conditionals.switch)),
             (loops, "scan", _scan_entry(field, loops.scan)),
             (loops, "while_loop", _while_entry(field, loops.while_loop)),
             *((parallel, name, _reduction_entry(field, getattr(parallel, name))) for name in ("psum", "pmax", "pmin"))]
    for home, name, hook in hooks:
        patches.setattr(home, name, hook)
        for namespace in map(_jax.module, _NAMESPACES):
            if getattr(namespace, name, None) is getattr(hook, "__wrapped__", None):
                patches.setattr(namespace, name, hook)
    trace_type = pe.DynamicJaxprTrace
    patches.setattr(trace_type, "to_jaxpr_tracer", _lift(field, trace_type.to_jaxpr_tracer))


def _on() -> bool:
    return opaque_types.widening_on() and in_checked_shard_map()


def _array(x: Any) -> bool:
    """A value a cast applies to (not a ref, token, function or None)."""
    try:
        return type(jax.typeof(x)) is core.ShapedArray
    except TypeError:
        return False


def _up(field: TypeField, x: Any, axes: frozenset[str]) -> Any:
    """``x`` cast up to vary over ``axes`` too (``x`` itself where it already does)."""
    if not _array(x):
        return x
    missing = axes - field.varying(jax.typeof(x))
    if not missing:
        return x
    note_widened()
    return cast_up(x, missing)


def _tree_up(field: TypeField, tree: Any, axes: frozenset[str]) -> Any:
    return jax.tree.map(lambda x: _up(field, x, axes), tree)


def _current_trace() -> Any:
    return core.trace_ctx.trace


# ---------------------------------------------------------------- cond / switch


def _branches_traced(field: TypeField, funs: Sequence[Any], axes: frozenset[str], call: Callable[[], Any]) -> Any:
    """``call()`` (JAX's ``cond``) with each value the branches close over cast up to
    ``axes`` outside, and seen by the branches as the cast: its type while they are
    traced (so that ``jnp``'s own casts inside see it varying), the cast itself where JAX
    lifts it into a branch (:func:`_lift`)."""
    if not axes:
        return call()
    casts: dict[int, Any] = {}
    swapped: list[tuple[Any, str, Any]] = []
    here = _current_trace()
    try:
        # Every cast first, then every swap: values may share what is under them (two vmapped
        # arguments over one array), and a cast must see the types as they are.
        pending = {}
        for x in _closed_over(funs):
            if id(x) not in pending and _inside(x, axes, here) and axes - field.varying(x.aval):
                # (inside another cond's branch, x is typed as that cond's cast of it: cast the cast)
                pending[id(x)] = (x, _outer_cast(field, _substitute(x), axes))
        for key, (x, cast) in pending.items():
            held = _swap(field, x, field.varying(jax.typeof(cast)))
            if held is None:  # (a value whose type cannot be swapped: left to the bind hook)
                continue
            swapped.extend(held)
            casts[key] = cast
        _state.scopes.append(_Scope(casts))
        try:
            return call()
        finally:
            _state.scopes.pop()
    finally:
        _restore(swapped)


# One cast per value and axes in each trace, however many conds close over it: one
# psum of its cotangent, not one per cond.
_casts: weakref.WeakKeyDictionary[Any, dict[tuple[int, frozenset[str]], tuple[Any, Any]]] = weakref.WeakKeyDictionary()


def _outer_cast(field: TypeField, x: Any, axes: frozenset[str]) -> Any:
    """``x`` cast up to ``axes`` where it was made: outside the cond."""
    try:
        made = _casts.setdefault(x._trace, {})
    except TypeError:  # (a trace that takes no weak reference: cast each time)
        made = {}
    key = (id(x), axes | field.varying(x.aval))
    if key not in made:
        with core.set_current_trace(x._trace):
            made[key] = (x, _up(field, x, axes))  # (x kept alive: its id stays its own)
    return made[key][1]


def _swap(field: TypeField, x: Any, varying: frozenset[str]) -> list[tuple[Any, str, Any]] | None:
    """Types ``x`` as varying over ``varying``, and the values under it (a JVP's or
    linearization's primal and tangent, a batch's value), whichever hold their own
    type; returns what to restore, or None (nothing changed) where some part's type
    cannot be set (an eager ``shard_map``'s values: the bind hook retypes those)."""
    held: list[tuple[Any, str, Any]] = []
    pval, val = _own(x, "pval"), _own(x, "val")
    if val is not None and not isinstance(val, (core.Tracer, _jax.core.Var)):
        return None  # an eager shard_map's or vmap's value: its type is read from its layout
    if pval is not None and not pval.is_known():  # a partial evaluation's unknown (JAX <= 0.7's grad)
        held.append((x, "pval", pval))
        x.pval = pe.PartialVal.unknown(field.retype(pval.get_aval(), varying))
    elif _own(x, "_aval") is not None:  # JAX 0.9: the type behind a read-only `aval`
        held.append((x, "_aval", x._aval))
        x._aval = field.retype(x._aval, varying)
    else:
        try:
            old = x.aval
            x.aval = field.retype(old, varying)
            held.append((x, "aval", old))
        except AttributeError:  # a type computed from the values under it
            pass
    inner = [v for v in (_own(x, name) for name in ("primal", "tangent", "val")) if isinstance(v, core.Tracer)]
    parts = [_swap(field, v, varying) for v in inner]
    held += [entry for part in parts if part is not None for entry in part]
    if (held or inner) and None not in parts:
        return held
    _restore(held)  # all or nothing
    return None


def _own(x: Any, name: str) -> Any:
    """``x``'s own attribute ``name`` (a tracer's ``__getattr__`` would ask its type)."""
    try:
        return object.__getattribute__(x, name)
    except AttributeError:
        return None


def _restore(held: Sequence[tuple[Any, str, Any]]) -> None:
    for obj, attr, old in reversed(held):
        setattr(obj, attr, old)


def _inside(x: Any, axes: frozenset[str], here: Any) -> bool:
    """Whether ``x`` is a live value of the ``shard_map`` the ``cond`` is in: made in the
    trace the ``cond`` is called in, or typed on a mesh manual over ``axes`` (not a value
    of a ``jit`` around the ``shard_map``, where no cast applies). An opaque call's output
    may be typed on no mesh at all."""
    mesh = getattr(getattr(x.aval, "sharding", None), "mesh", None)
    return (type(x.aval) is core.ShapedArray and x._trace.is_valid()
            and (_made_here(x._trace, here) or axes <= frozenset(getattr(mesh, "manual_axes", ()))))


def _made_here(trace: Any, here: Any) -> bool:
    """``trace`` is ``here``, or is reached from it through the transformations (JVP, linearize,
    vmap) of the same staged function: a value with no tangent, or unbatched, stays in the trace
    below (under ``grad``, a callback's output of ``stop_gradient``-ed inputs)."""
    t = here
    for _ in range(32):  # (a short chain; a bound against a cycle)
        if t is trace:
            return True
        if t is None or (t is not here and isinstance(t, pe.DynamicJaxprTrace)):
            return False  # the staged function's own trace: nothing below it is its value
        t = getattr(t, "parent_trace", None)
    return False


def _closed_over(funs: Sequence[Any]) -> list[Any]:
    """The staged values (tracers of the traces a ``cond`` may be called in) that
    ``funs`` hold: in closures, defaults, ``functools.partial`` arguments, bound
    methods' objects, pytrees and objects' attributes, a few levels down. What is missed here is left
    to the bind hook (``control_flow``), which retypes the traced branches."""
    found: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if depth > 5 or id(obj) in seen or isinstance(obj, (type, ModuleType, str, bytes, int, float, bool)):
            return
        seen.add(id(obj))
        if isinstance(obj, core.Tracer):
            found.append(obj)
        elif isinstance(obj, functools.partial):
            for part in (obj.func, obj.args, obj.keywords):
                visit(part, depth + 1)
        elif isinstance(obj, MethodType):
            for bound in (obj.__func__, obj.__self__):
                visit(bound, depth + 1)
        elif isinstance(obj, FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
            visit(obj.__defaults__, depth + 1)
            visit(getattr(obj, "__wrapped__", None), depth + 1)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
        elif obj is not None:
            leaves = jax.tree.leaves(obj)
            if leaves != [obj]:
                visit(leaves, depth + 1)
            elif isinstance(getattr(obj, "__dict__", None), dict):  # an object holding values
                visit(obj.__dict__, depth + 1)

    for fun in funs:
        visit(fun, 0)
    return found


def _branch(field: TypeField, fun: Callable[..., Any], axes: frozenset[str],
            joined: Sequence[frozenset[str]] | None = None) -> Callable[..., Any]:
    """``fun`` with its outputs cast up to ``axes`` (and each to its ``joined`` axes)."""
    @functools.wraps(fun)
    def branch(*operands: Any) -> Any:
        out = fun(*operands)
        if joined is None:
            return _tree_up(field, out, axes)
        return _cast_each(field, out, [axes | j for j in joined])

    return branch


def _varying_index(field: TypeField, index: Any) -> frozenset[str]:
    return field.varying(jax.typeof(index)) if _on() and _array(index) else frozenset()


def _note(what: str, axes: frozenset[str]) -> None:
    out_specs_note.record(f"a {what} whose predicate varies over {sorted(axes)} (jax#40823)", axes)


def _cond_entry(field: TypeField, cond: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(cond)
    def entry(pred: Any, *args: Any, **kwargs: Any) -> Any:
        if not _on() or len(args) < 2 or not (callable(args[0]) and callable(args[1])):
            return cond(pred, *args, **kwargs)  # (the old five-argument form is left to JAX)
        true_fun, false_fun, *operands = args
        return _conditional(field, "lax.cond", pred, (true_fun, false_fun), operands, kwargs,
                            lambda b, ops, kw: cond(pred, *b, *ops, **kw))

    return entry


def _switch_entry(field: TypeField, switch: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(switch)
    def entry(index: Any, branches: Sequence[Callable[..., Any]], *operands: Any, **kwargs: Any) -> Any:
        if not _on():
            return switch(index, branches, *operands, **kwargs)
        return _conditional(field, "lax.switch", index, tuple(branches), list(operands), kwargs,
                            lambda b, ops, kw: switch(index, list(b), *ops, **kw))

    return entry


def _conditional(field: TypeField, what: str, index: Any, branches: tuple[Callable[..., Any], ...],
                 operands: list[Any], kwargs: dict[str, Any], call: Callable[..., Any]) -> Any:
    """JAX's ``cond`` / ``switch`` (``call``), its operands and the values its branches close
    over cast up to the axes the predicate varies over; where the branches then return
    differently typed outputs (one holds a loop reprules widened), each output is cast up
    to the union of the branches' types and the call traced again."""
    axes = _varying_index(field, index)
    if axes:
        operands = _tree_up(field, operands, axes)
        kwargs = {k: _tree_up(field, v, axes) if k == "operand" else v for k, v in kwargs.items()}
        _note(what, axes)
    args = [kwargs["operand"]] if "operand" in kwargs else operands
    joined: list[frozenset[str]] | None = None
    while True:
        wrapped = tuple(_branch(field, b, axes, joined) for b in branches) if axes or joined else branches
        try:
            return _branches_traced(field, branches, axes, lambda: call(wrapped, operands, kwargs))
        except TypeError as err:
            if joined is not None or _BRANCHES_ERROR not in str(err):
                raise
            joined = _branch_types(field, branches, axes, args, err)


def _branch_types(field: TypeField, branches: Sequence[Callable[..., Any]], axes: frozenset[str],
                  args: list[Any], err: TypeError) -> list[frozenset[str]]:
    """Each output's axes joined over every branch (one trace of each; ``err``, JAX's
    refusal, raised again where the branches differ in more than their axes)."""
    leaves, treedef = jax.tree.flatten(args)
    if not all(_array(x) for x in leaves):
        raise err
    avals = [jax.typeof(x) for x in leaves]
    outs = _branches_traced(field, branches, axes, lambda: [
        _trace_out_avals(lambda *flat, b=b: _branch(field, b, axes)(*jax.tree.unflatten(treedef, list(flat))), avals)
        for b in branches])
    if len({len(o) for o in outs}) != 1 or not all(type(a) is core.ShapedArray for o in outs for a in o):
        raise err
    return [frozenset().union(*(field.varying(o[i]) for o in outs)) for i in range(len(outs[0]))]


def _reduction_entry(field: TypeField, reduce: Callable[..., Any]) -> Callable[..., Any]:
    """``psum`` / ``pmax`` / ``pmin`` over axes a value varies over only in part (a value
    reprules widened, JAX alone typed replicated): cast up over the rest first, which is
    what JAX does for a value replicated over all of them (JAX refuses the mix)."""

    @functools.wraps(reduce)
    def entry(x: Any, axis_name: Any, *args: Any, **kwargs: Any) -> Any:
        if _on():
            names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
            named = frozenset(names) & frozenset(manual_axes())
            x = jax.tree.map(lambda v: _mixed_up(field, v, named), x)
        return reduce(x, axis_name, *args, **kwargs)

    return entry


def _mixed_up(field: TypeField, x: Any, axes: frozenset[str]) -> Any:
    if not _array(x):
        return x
    have = field.varying(jax.typeof(x))
    return _up(field, x, axes) if have & axes and axes - have else x


def _substitute(x: Any) -> Any:
    """What an enclosing cond's branches see for ``x``: its cast, or ``x`` itself."""
    for scope in reversed(_state.scopes):
        cast = scope.casts.get(id(x))
        if cast is not None:
            return cast
    return x


def _lift(field: TypeField, to_jaxpr_tracer: Callable[..., Any]) -> Callable[..., Any]:
    """JAX's lifting of a value into a traced function: inside a branch of a
    ``cond`` on a varying predicate, a value the branches close over is swapped
    for its cast (made outside the ``cond``), so that its cotangent is psummed
    outside the ``cond``."""

    def lift(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        return to_jaxpr_tracer(self, _substitute(x) if _state.scopes else x, *args, **kwargs)

    return lift


# ---------------------------------------------------------------- loops


def _carry_error(err: BaseException) -> bool:
    return isinstance(err, TypeError) and _CARRY_ERROR in str(err)


def _rounds() -> int:
    return len(manual_axes()) + 1


def _scan_entry(field: TypeField, scan: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(scan)
    def entry(f: Callable[..., Any], init: Any, *args: Any, **kwargs: Any) -> Any:
        if not _on():
            return scan(f, init, *args, **kwargs)
        xs = args[0] if args else kwargs.get("xs")
        body = f
        for _ in range(_rounds() * max(1, len(jax.tree.leaves(init)))):
            try:
                return scan(body, init, *args, **kwargs)
            except TypeError as err:
                if not _carry_error(err):
                    raise
                wider = _scan_carry_types(field, f, init, xs, err)
                init = _cast_each(field, init, wider)
                body = _scan_body(field, f, wider)
        return scan(body, init, *args, **kwargs)

    return entry


def _while_entry(field: TypeField, while_loop: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(while_loop)
    def entry(cond_fun: Callable[..., Any], body_fun: Callable[..., Any], init_val: Any) -> Any:
        if not _on():
            return while_loop(cond_fun, body_fun, init_val)
        body = body_fun
        for _ in range(_rounds() * max(1, len(jax.tree.leaves(init_val)))):
            _state.loops.append(id(_current_trace()))
            try:
                return while_loop(cond_fun, body, init_val)
            except Widen as widen:  # the predicate varies over axes the carries do not
                _note("lax.while_loop", widen.axes)
                wider = [field.varying(jax.typeof(x)) | widen.axes if _array(x) else None
                         for x in jax.tree.leaves(init_val)]
            except TypeError as err:
                if not _carry_error(err):
                    raise
                wider = _carry_types(field, body_fun, [init_val], init_val, err)
            finally:
                _state.loops.pop()
            init_val = _cast_each(field, init_val, wider)
            body = _while_body(field, body_fun, wider)
        return while_loop(cond_fun, body, init_val)

    return entry


def _cast_each(field: TypeField, tree: Any, axes: Sequence[frozenset[str] | None]) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [x if a is None else _up(field, x, a) for x, a in zip(leaves, axes)])


def _scan_body(field: TypeField, f: Callable[..., Any], carry: Sequence[frozenset[str] | None]) -> Callable[..., Any]:
    @functools.wraps(f)
    def body(c: Any, x: Any) -> Any:
        new, y = f(c, x)
        return _cast_each(field, new, carry), y

    return body


def _while_body(field: TypeField, f: Callable[..., Any], carry: Sequence[frozenset[str] | None]) -> Callable[..., Any]:
    @functools.wraps(f)
    def body(c: Any) -> Any:
        return _cast_each(field, f(c), carry)

    return body


def _scan_carry_types(field: TypeField, f: Callable[..., Any], init: Any, xs: Any,
                      err: TypeError) -> list[frozenset[str] | None]:
    def carry_of(c: Any, x: Any) -> Any:
        return f(c, x)[0]

    return _carry_types(field, carry_of, [init, _slices(xs)], init, err)


def _slices(xs: Any) -> Any:
    """Abstract stand-ins for one step's slice of ``xs`` (the same axes as ``xs``)."""
    return jax.tree.map(lambda v: _Slice(jax.typeof(v)) if _array(v) else v, xs)


class _Slice:
    """An aval placeholder for :func:`_carry_types`: traced as ``aval`` minus its leading axis."""

    def __init__(self, aval: Any) -> None:
        self.aval = aval.update(shape=aval.shape[1:])


def _carry_types(field: TypeField, fun: Callable[..., Any], args: list[Any], init: Any,
                 err: TypeError) -> list[frozenset[str] | None]:
    """Each carry leaf's axes joined with those the body returns it varying over
    (one trace of the body on the current types; ``err`` is JAX's refusal, raised
    again if tracing shows nothing to widen)."""
    leaves, treedef = jax.tree.flatten(args, is_leaf=lambda v: isinstance(v, _Slice))
    avals = [v.aval if isinstance(v, _Slice) else jax.typeof(v) if _array(v) else None for v in leaves]
    if any(a is None for a in avals):
        raise err
    out_avals = _trace_out_avals(lambda *flat: fun(*jax.tree.unflatten(treedef, list(flat))), avals)
    init_leaves = jax.tree.leaves(init)
    if len(out_avals) != len(init_leaves):
        raise err
    wider: list[frozenset[str] | None] = []
    grew = False
    for x, out in zip(init_leaves, out_avals):
        if not _array(x) or type(out) is not core.ShapedArray:
            wider.append(None)
            continue
        have, want = field.varying(jax.typeof(x)), field.varying(out)
        grew |= bool(want - have)
        wider.append(have | want)
    if not grew:
        raise err
    return wider


def _trace_out_avals(fun: Callable[..., Any], avals: Sequence[Any]) -> list[Any]:
    def flat(*args: Any) -> list[Any]:
        return jax.tree.leaves(fun(*args))

    debug = _jax.api_util.debug_info("reprules carry fixpoint", fun, tuple(avals), {})
    jaxpr = pe.trace_to_jaxpr_dynamic(lu.wrap_init(flat, debug_info=debug), list(avals))[0]
    return [v.aval for v in jaxpr.outvars]
