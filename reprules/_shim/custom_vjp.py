"""``custom_vjp`` cotangents of registered kernels (vma and mat regimes).

A replicated weight used on sharded activations gets, from a kernel's bwd, a
cotangent that varies over the activations' axes. JAX <= 0.5 psums it; from
0.6.2 JAX refuses it (the bwd output must have the primal's type). reprules
psums it, but only where that is provably exact and only for ``custom_vjp``s
that involve a registered kernel:

* **Which ``custom_vjp``s.** One whose fwd or bwd, while being traced, calls a
  kernel that has a rule (``_common.note_registered_call``). Every other
  ``custom_vjp`` runs exactly as with JAX alone, JAX's refusals included. The
  fwd is always traced before the bwd runs, so the bwd knows.
* **When the psum is exact.** Judged from the bwd's equations: those its run
  added to the jaxpr being staged (its first run for given input types), or its
  own trace (later runs, which replay it; see ``_traced_and_fixed``). A cotangent
  varying over axis ``a`` where its primal does not is psummed over ``a`` only
  if no part of it that depends on the incoming cotangents was replicated over
  ``a`` and then made varying (an explicit or automatic ``pvary``, a kernel whose
  rule casts it up, any equation turning an ``a``-replicated input into an
  ``a``-varying output), and no collective over ``a`` touched it. Such a part
  would be counted once per device. Otherwise reprules raises
  :class:`reprules.CotangentError`, naming the fix.
* **A cotangent varying over fewer axes than its primal** (a kernel's rule
  typed it replicated; JAX >= 0.8 refuses it) is cast up to the primal's type,
  every device's value kept. A rule that lies is then caught by
  ``reprules.verify()`` where its kernel ran.

Covers every ``custom_vjp`` entry point: ``jax.custom_vjp.__call__`` (which,
on 0.12, also builds the ``jax_custom_vjp3`` implementation from ``fwd``/``bwd``)
and ``custom_vjp3.__call__`` (0.9.1 - 0.11, where the flag picks the class when
the function is decorated). ``defvjp_with_accums`` (0.12) pushes cotangents into
accumulators rather than returning them; reprules leaves those to JAX.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import functools
import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax._src import api_util, config, core, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe

from reprules import _errors, _mode_state
from reprules._registry import generation
from reprules._shim import _common, _source, vma  # vma imports this module too: names are read at call time

Field = Any  # vma.TypeField: reads the varying axes of a type


@dataclasses.dataclass
class _Call:
    """One call of a ``custom_vjp`` function: what its bwd needs to know."""

    fun: Any  # the decorated function: its names are read only for an error message
    bwd: Any  # the user's bwd: what reprules adds to its cotangents is attributed to it
    static: frozenset[int]  # nondiff_argnums: no cotangent is returned for these
    with_logs: bool
    watch: _common.Watch = dataclasses.field(default_factory=_common.Watch)
    primal_types: tuple[Any, ...] | None = None  # per differentiable argument, a pytree of types
    # The fwd's arguments, flattened (arrays as their types), and their tree: read only
    # on the rare path that traces the fwd again (_fwd_involves_registered).
    fwd_leaves: list[Any] = dataclasses.field(default_factory=list)
    fwd_tree: Any = None

    @property
    def name(self) -> str:
        return str(getattr(self.fun, "__qualname__", None) or getattr(self.fun, "__name__", "custom_vjp"))

    @property
    def arg_names(self) -> tuple[str, ...]:
        try:
            return tuple(inspect.signature(self.fun).parameters)
        except (TypeError, ValueError):
            return ()

    def record_args(self, args: Sequence[Any], type_of: Callable[[Any], Any]) -> None:
        """Remembers the fwd's arguments as types (arrays) and values (the rest)."""
        flat, tree = jax.tree_util.tree_flatten(tuple(args))
        types = [type_of(x) for x in flat]
        typed = jax.tree_util.tree_unflatten(tree, types)
        self.primal_types = tuple(t for i, t in enumerate(typed) if i not in self.static)
        self.fwd_leaves, self.fwd_tree = [t or x for t, x in zip(types, flat)], tree


def install(patches: _common.Patches, field: Field) -> None:
    from jax._src import custom_derivatives

    classes: list[tuple[Any, str]] = [(custom_derivatives.custom_vjp, "nondiff_argnums")]
    try:  # 0.9.1+: the jax_custom_vjp3 implementation
        from jax._src.hijax import custom_vjp3

        classes.append((custom_vjp3, "static_argnums"))
    except ImportError:
        pass
    for cls, static_attr in classes:
        patches.setattr(cls, "__call__", _wrap_call(cls.__call__, static_attr, field))
    _install_psum_batching_fix(patches)


# JAX 0.8.x: psum of a vmapped value inside shard_map fails in JAX's own
# batcher (it binds psum_invariant with a stray axis_index_groups). reprules'
# cotangent psum runs under vmap when the custom_vjp is vmapped, so it uses a
# corrected batcher -- only for its own psum, so user code sees JAX unchanged.
_own_psum: contextvars.ContextVar[bool] = contextvars.ContextVar("reprules_own_psum", default=False)


def _install_psum_batching_fix(patches: _common.Patches) -> None:
    if _common.version_tuple()[:2] != (0, 8):
        return
    from jax._src.interpreters import batching
    from jax._src.lax import parallel

    prim = parallel.psum_invariant_p
    original = batching.fancy_primitive_batchers[prim]

    def batcher(axis_data: Any, vals_in: Any, dims_in: Any, axes: Any) -> Any:
        (value,), (dim,) = vals_in, dims_in
        names_only = all(isinstance(a, str) for a in axes)
        if _own_psum.get() and dim is not None and names_only and axis_data.name not in axes:
            return prim.bind(value, axes=axes), dim
        return original(axis_data, vals_in, dims_in, axes)

    patches.setitem(batching.fancy_primitive_batchers, prim, batcher)


def _psum(x: Any, axes: frozenset[str]) -> Any:
    token = _own_psum.set(True)
    try:
        return vma.psum(x, axes)
    finally:
        _own_psum.reset(token)


def _wrap_call(original: Callable[..., Any], static_attr: str, field: Field) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        fwd, bwd = getattr(self, "fwd", None), getattr(self, "bwd", None)
        if fwd is None or bwd is None or getattr(self, "with_accums", False):
            return original(self, *args, **kwargs)
        if getattr(bwd, "_reprules_fixed", False):
            # Wrapped already: 0.12's custom_vjp.__call__ hands its (wrapped) fwd
            # and bwd to the jax_custom_vjp3 implementation, which is patched too.
            return original(self, *args, **kwargs)
        call = _Call(
            fun=getattr(self, "fun", None) or getattr(self, "f", None),
            bwd=bwd,
            static=frozenset(getattr(self, static_attr, ()) or ()),
            with_logs=bool(getattr(self, "with_logs", False)),
        )
        proxy = object.__new__(type(self))  # the user's object is left as it was
        proxy.__dict__.update(self.__dict__)  # (copy.copy would call custom_vjp.__new__)
        proxy.fwd = _watched_fwd(fwd, call)
        proxy.bwd = _fixed_bwd(fwd, bwd, call, field)
        return original(proxy, *args, **kwargs)

    return __call__


def _watched_fwd(fwd: Callable[..., Any], call: _Call) -> Callable[..., Any]:
    @_wraps(fwd)
    def watched(*args: Any) -> Any:
        call.record_args(args, _type_of)
        with _common.watching(call.watch):
            return fwd(*args)

    return watched


def _wraps(wrapped: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``functools.wraps`` without copying ``__dict__`` and ``__doc__`` (it runs at
    every call): JAX finds a fwd's or bwd's name, source and signature through
    ``__wrapped__``."""

    def decorate(wrapper: Callable[..., Any]) -> Callable[..., Any]:
        wrapper.__wrapped__ = wrapped  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(wrapped, "__name__", wrapper.__name__)
        wrapper.__qualname__ = getattr(wrapped, "__qualname__", wrapper.__qualname__)
        return wrapper

    return decorate


def _type_of(x: Any) -> Any:
    if not isinstance(x, core.Tracer):  # (a tracer's getattr would ask its type for .value)
        x = getattr(x, "value", x)  # symbolic_zeros: fwd gets CustomVJPPrimal(value, perturbed)
    try:
        return jax.typeof(x)
    except TypeError:
        return None


def _fixed_bwd(fwd: Callable[..., Any], bwd: Callable[..., Any], call: _Call, field: Field) -> Callable[..., Any]:
    @_wraps(bwd)
    def fixed(*args: Any) -> Any:
        if not vma.checking():  # no types to fix: exactly what JAX alone does
            return bwd(*args)
        bwd_args = _BwdArgs.of(args, call)
        staged = _Staged.open(bwd_args)  # None: the bwd's equations cannot be read where they are staged
        if call.watch.involved:  # the fwd traced a registered kernel's call
            return _traced_and_fixed(bwd, call, field, bwd_args, staged)
        own = _common.Watch()
        with _common.watching(own):
            out = bwd(*args)
        if not _mistyped(out, call, field):
            return out  # nothing to fix: exactly what JAX alone does
        # JAX alone refuses this cotangent. Fix it only if a registered kernel
        # is involved: one the bwd traced, or one in the fwd's or the bwd's
        # jaxpr (a cached trace is reused without tracing the kernel again).
        if staged is not None:  # the bwd's equations are there to read: no second trace
            if own.involved or _fwd_involves_registered(fwd, call) or staged.calls_registered():
                return _fixed_cts(out, staged.taints(out, bwd_args, field), call, field)
            return out  # JAX's own refusal stands
        if own.involved or _fwd_involves_registered(fwd, call):
            return _traced_and_fixed(bwd, call, field, bwd_args, None)
        fixed_out = _traced_and_fixed(bwd, call, field, bwd_args, None, only_if_registered=True)
        return out if fixed_out is None else fixed_out  # None: JAX's own refusal stands

    fixed._reprules_fixed = True  # type: ignore[attr-defined]
    return fixed


def _fwd_involves_registered(fwd: Callable[..., Any], call: _Call) -> bool:
    flat, tree = call.fwd_leaves, call.fwd_tree
    dynamic = [i for i, x in enumerate(flat) if isinstance(x, core.AbstractValue)]

    def flat_fwd(*xs: Any) -> Any:
        leaves = list(flat)
        for i, x in zip(dynamic, xs):
            leaves[i] = x
        return fwd(*jax.tree_util.tree_unflatten(tree, leaves))

    watch = _common.Watch()
    try:
        with _common.watching(watch):
            closed = jax.make_jaxpr(flat_fwd)(*[flat[i] for i in dynamic])
    except Exception:  # noqa: BLE001 - e.g. symbolic-zeros primals: cannot tell, so JAX decides
        return watch.involved
    return watch.involved or _common.jaxpr_calls_registered(closed.jaxpr)


def _split_logs(out: Any, call: _Call) -> tuple[Any, Any]:
    if call.with_logs and isinstance(out, (tuple, list)) and len(out) == 2:
        return out[0], out[1]
    return out, None


def _cts_and_types(out: Any, call: _Call) -> list[tuple[Any, Any]] | None:
    """(cotangent leaf, primal type) pairs, or None for a malformed output
    (JAX's own check then reports it)."""
    cts, _ = _split_logs(out, call)
    if isinstance(cts, list):
        cts = tuple(cts)
    if call.primal_types is None or not isinstance(cts, tuple) or len(cts) != len(call.primal_types):
        return None
    pairs: list[tuple[Any, Any]] = []
    try:
        jax.tree_util.tree_map(
            lambda ct, t: pairs.append((ct, t)), cts, call.primal_types, is_leaf=lambda x: x is None
        )
    except (ValueError, TypeError):
        return None
    return pairs


def _ct_varying(field: Field, ct: Any) -> frozenset[str]:
    try:
        return field.varying(jax.typeof(ct)) if ct is not None else frozenset()
    except TypeError:  # not a JAX value: JAX's own check reports it
        return frozenset()


def _mistyped(out: Any, call: _Call, field: Field) -> bool:
    """Whether a cotangent of ``out`` has other varying axes than its primal: more
    (JAX refuses it from 0.6.2; psummed where exact), or, for an array, fewer
    (JAX refuses it from 0.8), as when a kernel's rule types its output
    replicated: cast up, a free cast that keeps every device's values, as for
    a kernel in the fwd. A rule that lies is then caught where its kernel ran
    by ``reprules.verify()``, which names it, rather than by JAX's bwd type
    check, which names neither (issue 30)."""
    pairs = _cts_and_types(out, call) or []  # None: malformed, JAX's own check reports it
    for ct, t in pairs:
        if t is None:
            continue
        have, want = _ct_varying(field, ct), field.varying(t)
        if have - want or (want - have and isinstance(ct, (jax.Array, core.Tracer))):
            return True
    return False


class _BwdArgs(NamedTuple):
    """A bwd's arguments, flattened. Arrays in the residuals and cotangents are
    traced (``dynamic``: residuals first); anything else (the nondiff_argnums
    values first, Python constants, SymbolicZero) is closed over."""

    args: tuple[Any, ...]
    flat: list[Any]
    tree: Any
    dynamic: list[int]
    num_res: int

    @classmethod
    def of(cls, args: Sequence[Any], call: _Call) -> _BwdArgs:
        flat, tree = jax.tree_util.tree_flatten(tuple(args))
        children: list[Any] = jax.tree_util.treedef_children(tree)
        per_arg = [child.num_leaves for child in children]  # one flatten, not three
        first = sum(per_arg[: len(call.static)])
        dynamic = [i for i, x in enumerate(flat) if i >= first and _is_traceable(x)]
        num_leaves_before_cts = sum(per_arg[:-1])
        num_res = len([i for i in dynamic if i < num_leaves_before_cts])
        return cls(tuple(args), flat, tree, dynamic, num_res)

    @property
    def dyn_args(self) -> list[Any]:
        return [self.flat[i] for i in self.dynamic]

    def flat_fn(self, bwd: Callable[..., Any]) -> Callable[..., Any]:
        """``bwd`` as a function of the traced leaves alone."""
        def flat_bwd(*xs: Any) -> Any:
            leaves = list(self.flat)
            for i, x in zip(self.dynamic, xs):
                leaves[i] = x
            return bwd(*jax.tree_util.tree_unflatten(self.tree, leaves))

        return flat_bwd


def _traced_and_fixed(bwd: Callable[..., Any], call: _Call, field: Field, bwd_args: _BwdArgs,
                      staged: _Staged | None, only_if_registered: bool = False) -> Any:
    """Runs the bwd, and psums each cotangent over the axes it varies over and
    its primal does not, where that is exact (judged from the bwd's jaxpr).

    The first call for given input types runs straight into the jaxpr being
    staged (``staged``) and reads its equations there; a second one traces the
    bwd to a jaxpr, which it and later calls replay (a model calls the same
    bwd once per layer). Without ``staged``, every call takes the second way.

    With ``only_if_registered``, returns None (nothing evaluated) unless the
    bwd's jaxpr calls a registered kernel."""
    dyn_args = bwd_args.dyn_args
    key = _trace_key(bwd_args.tree, bwd_args.flat, bwd_args.dynamic, dyn_args, bwd_args.num_res)
    traced = _bwd_traces.get(bwd, key)
    if traced is None and staged is not None and not only_if_registered:
        _bwd_traces.put(bwd, key, _SEEN)
        staged.begin()
        out = bwd(*bwd_args.args)
        return _fixed_cts(out, staged.taints(out, bwd_args, field), call, field)
    if not isinstance(traced, _BwdTrace):
        watch = _common.Watch()
        with _common.watching(watch):
            closed, out_tree = _trace(bwd_args.flat_fn(bwd), dyn_args, _source_info(bwd))
        involved = watch.involved or _common.jaxpr_calls_registered(closed.jaxpr)
        traced = _BwdTrace(closed, out_tree, _taints(closed.jaxpr, bwd_args.num_res, field), involved)
        _bwd_traces.put(bwd, key, traced)
    elif traced.involved:
        _common.note_registered_call()  # as tracing it again would
    if only_if_registered and not traced.involved:
        return None
    out = jax.tree_util.tree_unflatten(traced.out_tree, _replay(traced.closed, dyn_args))
    return _fixed_cts(out, jax.tree_util.tree_unflatten(traced.out_tree, traced.taints), call, field)


def _fixed_cts(out: Any, taint_tree: Any, call: _Call, field: Field) -> Any:
    """The bwd's output ``out`` with each cotangent fixed by :func:`_fix_leaf`
    (``taint_tree``: the taint of each leaf of ``out``)."""
    cts, logs = _split_logs(out, call)
    ct_taints, _ = _split_logs(taint_tree, call)
    if call.primal_types is None or not isinstance(cts, (tuple, list)) or len(cts) != len(call.primal_types):
        return out
    manual = vma.manual_axes()
    fixed: list[Any] = []
    for index, (ct, taint, types) in enumerate(zip(cts, ct_taints, call.primal_types)):
        if ct is None:
            fixed.append(None)
        elif isinstance(types, core.AbstractValue) and isinstance(ct, (jax.Array, core.Tracer)):
            fixed.append(_fix_leaf(ct, taint, types, index, call, field, manual))  # an array: a leaf
        else:
            fixed.append(jax.tree_util.tree_map(
                lambda c, t, ty, i=index: _fix_leaf(c, t, ty, i, call, field, manual),
                ct, taint, types, is_leaf=lambda x: x is None,
            ))
    fixed_cts = tuple(fixed)
    return (fixed_cts, logs) if call.with_logs else fixed_cts


# --- a bwd run straight into the jaxpr being staged -----------------------------
#
# Tracing a bwd to its own jaxpr and copying that into the enclosing one costs
# a second trace per call. Where the enclosing trace is a jaxpr being staged,
# the bwd runs straight into it (as with JAX alone) and the equations it added
# are read back from JAX's trace frame, for the same analysis.


class _Eqn(NamedTuple):
    primitive: Any
    params: dict[str, Any]
    invars: list[Any]
    outvars: list[Any]


@dataclasses.dataclass
class _Jaxpr:
    """The part of a jaxpr a bwd staged: what :func:`_taint_flow` and
    ``_common.jaxpr_calls_registered`` read of a jaxpr."""

    eqns: list[_Eqn]
    invars: list[Any]
    outvars: list[Any]


class _Staged:
    """The jaxpr being staged where a bwd runs (``pe.DynamicJaxprTrace``), and
    the equations the bwd adds to it: JAX 0.6 keeps ``frame.eqns`` (variables
    found by ``frame.tracer_to_var``); 0.7+ keeps ``frame.tracing_eqns``
    (each a ``TracingEqn``, or a reference to one JAX may drop as dead code),
    whose tracers hold their variable as ``.val``."""

    def __init__(self, trace: Any, eqns: list[Any], legacy: bool) -> None:
        self.trace, self.frame, self._eqns, self._legacy = trace, trace.frame, eqns, legacy
        self._start = len(eqns)

    @classmethod
    def open(cls, bwd_args: _BwdArgs) -> _Staged | None:
        """The staged jaxpr, if the bwd's cotangents are its variables (their uses
        are then equations in it); None elsewhere (vmap, jvp, eager, dynamic shapes)."""
        trace = core.trace_ctx.trace
        if not isinstance(trace, pe.DynamicJaxprTrace) or getattr(jax.config, "jax_dynamic_shapes", False):
            return None
        frame = trace.frame
        eqns, legacy = getattr(frame, "tracing_eqns", None), False
        if eqns is None:
            eqns, legacy = getattr(frame, "eqns", None), True
        consts = getattr(frame, "constvar_to_val", None)
        if not isinstance(eqns, list) or not isinstance(consts, dict):
            return None
        staged = cls(trace, eqns, legacy)
        for x in bwd_args.dyn_args[bwd_args.num_res:]:
            var = staged.var(x)
            if var is None or var in consts:  # a constant: JAX may fold its uses away
                return None
        return staged

    def begin(self) -> None:
        """Equations added from now on are the bwd's."""
        self._start = len(self._eqns)

    def var(self, x: Any) -> Any:
        """The variable of ``x`` in the staged jaxpr, or None."""
        if not isinstance(x, pe.DynamicJaxprTracer) or x._trace is not self.trace:
            return None
        if self._legacy:
            return self.frame.tracer_to_var.get(id(x))
        var = x.val
        return var if isinstance(var, core.Var) else None

    def jaxpr(self, ins: Sequence[Any], outs: Sequence[Any]) -> _Jaxpr:
        eqns: list[_Eqn] = []
        for e in self._eqns[self._start:]:
            if not self._legacy:
                e = e if isinstance(e, pe.TracingEqn) else e()
                if e is None:  # dropped as dead code: nothing the bwd returns uses it
                    continue
                e = _Eqn(e.primitive, e.params, [getattr(t, "val", None) for t in e.in_tracers], e.outvars)
            eqns.append(e)
        return _Jaxpr(eqns, [self.var(x) for x in ins], [self.var(x) for x in outs])

    def calls_registered(self) -> bool:
        return _common.jaxpr_calls_registered(self.jaxpr((), ()))

    def taints(self, out: Any, bwd_args: _BwdArgs, field: Field) -> Any:
        """Per leaf of the bwd's output ``out``, what :func:`_taints` says."""
        leaves, tree = jax.tree_util.tree_flatten(out)
        jaxpr = self.jaxpr(bwd_args.dyn_args, leaves)
        return jax.tree_util.tree_unflatten(tree, _taints(jaxpr, bwd_args.num_res, field))


_FLAT_SIGNATURE = inspect.signature(lambda *args: None)


def _source_info(fn: Any) -> str:
    """``name at file:line`` of ``fn``, as JAX's debug info says it."""
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__name__", None) or "bwd"
    return f"{name} at {code.co_filename}:{code.co_firstlineno}" if code is not None else name


def _trace(fn: Callable[..., Any], args: Sequence[Any], source: str) -> tuple[Any, Any]:
    """``fn``'s closed jaxpr on ``args`` (flat), and its output tree: what
    ``jax.make_jaxpr(fn, return_shape=True)`` gives, without building a ``jit``
    around it (a third of a small bwd's trace on 0.12)."""
    # The names JAX would find by inspecting fn (a third of the trace's own cost): fn is flat.
    debug = api_util.debug_info("reprules custom_vjp bwd", fn, tuple(args), {},
                                sourceinfo=source, signature=_FLAT_SIGNATURE)
    flat_fn, out_tree = api_util.flatten_fun_nokwargs(lu.wrap_init(fn, debug_info=debug),
                                                      jax.tree_util.tree_structure(tuple(args)))
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(flat_fn, [jax.typeof(x) for x in args])[:3]
    return _Closed(jaxpr, tuple(consts)), out_tree()


@dataclasses.dataclass(frozen=True)
class _Closed:
    jaxpr: Any
    consts: tuple[Any, ...]


def _replay(closed: Any, args: Sequence[Any]) -> list[Any]:
    """Evaluates ``closed`` on ``args`` in the current trace. Into a jaxpr being
    staged, its equations are copied as they are (as JAX inlines a ``jit``):
    they were typed when traced, with the same inputs. Elsewhere (vmap, jvp,
    eager, or hijax equations that JAX must lower as they are bound) they are
    bound one by one."""
    trace = core.trace_ctx.trace
    if (isinstance(trace, pe.DynamicJaxprTrace)
            and not getattr(closed.jaxpr, "is_high", False)  # 0.12 hijax: lowered by JAX's own binds
            and all(isinstance(x, pe.DynamicJaxprTracer) and x._trace is trace for x in args)
            and not any(isinstance(c, core.Tracer) for c in closed.consts)
            and not getattr(jax.config, "jax_dynamic_shapes", False)):
        src = source_info_util.current()
        out = pe.inline_jaxpr_into_trace(trace, src, closed.jaxpr, closed.consts, *args)
        return [trace.to_jaxpr_tracer(x, src) for x in out]
    return list(core.eval_jaxpr(closed.jaxpr, closed.consts, *args))


# --- the bwd's jaxpr, traced once per function and input types -------------------
#
# A model calls one custom_vjp per op in every layer: tracing its bwd to a
# jaxpr (for the taints) and then evaluating it would bind every bwd equation
# twice per call. The jaxpr depends only on the bwd function, its static
# arguments, the input types (varying axes included), the manual axes, the
# rules registered, reprules' modes and JAX's trace context: with all of those
# in the key it is reused, as jax.jit reuses a trace.


@dataclasses.dataclass(frozen=True)
class _BwdTrace:
    closed: Any
    out_tree: Any
    taints: list[frozenset[str] | None]
    involved: bool  # the bwd calls a registered (or inferred) kernel


_SEEN = object()  # a bwd and input types run once, straight into the staged jaxpr


class _TraceCache:
    """Per bwd function (held weakly), a bounded LRU of its traces (or _SEEN)."""

    def __init__(self, per_function: int = 32) -> None:
        self._by_fn: weakref.WeakKeyDictionary[Any, collections.OrderedDict[Any, Any]] = (
            weakref.WeakKeyDictionary())
        self._per_function = per_function
        self._lock = threading.Lock()

    def get(self, fn: Any, key: Any) -> Any:
        if key is None:
            return None
        with self._lock:
            try:
                entries = self._by_fn.get(fn)
            except TypeError:  # not weakly referenceable
                return None
            if entries is None or key not in entries:
                return None
            entries.move_to_end(key)
            return entries[key]

    def put(self, fn: Any, key: Any, value: Any) -> None:
        if key is None:
            return
        with self._lock:
            try:
                entries = self._by_fn.setdefault(fn, collections.OrderedDict())
            except TypeError:
                return
            entries[key] = value
            while len(entries) > self._per_function:
                entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._by_fn.clear()


_bwd_traces = _TraceCache()


def clear_traces() -> None:
    """Forgets every cached bwd trace (with JAX's own caches)."""
    _bwd_traces.clear()


def _trace_key(tree: Any, flat: Sequence[Any], dynamic: Sequence[int], dyn_args: Sequence[Any],
               num_res: int) -> Any:
    """What a bwd's jaxpr depends on besides the function; None if not hashable."""
    dyn = set(dynamic)
    try:
        key = (
            tree, tuple(x for i, x in enumerate(flat) if i not in dyn), tuple(jax.typeof(x) for x in dyn_args),
            num_res, vma.manual_axes(), generation(), _mode_state.modes(), config.trace_context(),
        )
        return _HashedKey(key)
    except TypeError:  # an unhashable static argument: trace every time
        return None


class _HashedKey(tuple):  # type: ignore[type-arg]
    """A key hashed once (a get and a put would each hash its types again)."""

    __slots__ = ()

    def __new__(cls, key: tuple[Any, ...]) -> _HashedKey:
        return super().__new__(cls, (hash(key), key))

    def __hash__(self) -> int:
        return self[0]  # type: ignore[no-any-return]


def _is_traceable(x: Any) -> bool:
    return isinstance(x, (jax.Array, core.Tracer, np.ndarray, np.generic))


def _fix_leaf(ct: Any, taint: frozenset[str] | None, primal_type: Any, index: int, call: _Call,
              field: Field, manual: tuple[str, ...]) -> Any:
    if ct is None or primal_type is None or not hasattr(primal_type, "shape"):
        return ct
    have, want = _ct_varying(field, ct), field.varying(primal_type)
    excess = have - want
    if excess & (taint or frozenset()):
        raise _errors.CotangentError(
            _errors.mixed_cotangent_message(
                call.name, _input_name(call, index), str(primal_type.str_short()),
                excess & (taint or frozenset()), manual, _common.JAX_VERSION,
            )
        )
    if excess or want - have:
        # Attributed to the user's bwd and marked as reprules' (_source): reports
        # then name the bwd rather than this module.
        with _source.added_in(call.bwd):
            if excess:
                ct = _psum(ct, excess)
            if want - have:  # a replicated cotangent for a varying input: a free cast (its transpose: a psum)
                ct = vma.cast_up(ct, want - have)
    return ct


def _input_name(call: _Call, index: int) -> str:
    dynamic = [n for i, n in enumerate(call.arg_names) if i not in call.static]
    return f"input {index} ({dynamic[index]!r})" if index < len(dynamic) else f"input {index}"


# --- which cotangent outputs mix replicated and varying parts ------------------


def _taints(jaxpr: Any, num_res: int, field: Field) -> list[frozenset[str] | None]:
    """Per output of the bwd ``jaxpr``: the axes over which a part of it that
    depends on the incoming cotangents (inputs ``num_res`` on) was replicated
    and then made varying, or went through a collective; None if the output
    does not depend on the cotangents at all."""
    ins: list[frozenset[str] | None] = [None] * num_res + [frozenset()] * (len(jaxpr.invars) - num_res)
    return _taint_flow(jaxpr, ins, field)


# Call-like primitives whose body takes the equation's operands and gives its
# results: followed inside, so that a cast of a value that does not depend on
# the cotangents (a kernel's replicated operand cast up inside a jitted
# wrapper) is not mistaken for one that does.
# A custom_vjp or custom_vmap call inside the bwd runs its body there (a library
# op's own rules apply only when it is differentiated or batched, and compute the
# same values), so it is followed too, not taken for a collective over every axis
# its body casts over.
_CALL_BODIES = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
                "remat": "jaxpr", "checkpoint": "jaxpr", "custom_jvp_call": "call_jaxpr",
                "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
                "custom_vmap_call": "call"}


def _taint_flow(jaxpr: Any, in_taints: Sequence[frozenset[str] | None], field: Field
                ) -> list[frozenset[str] | None]:
    from reprules._shim import core_map

    manual = frozenset(vma.manual_axes())
    taint: dict[Any, frozenset[str]] = {v: t for v, t in zip(jaxpr.invars, in_taints) if t is not None}
    for eqn in jaxpr.eqns:
        deps = [v for v in eqn.invars if isinstance(v, core.Var) and v in taint]
        if not deps:
            continue
        body = _call_body(eqn)
        if body is not None:
            inner = _taint_flow(body, [taint.get(v) if isinstance(v, core.Var) else None for v in eqn.invars], field)
            for o, t in zip(eqn.outvars, inner):
                if t is not None:
                    taint[o] = t
            continue
        found = frozenset().union(*(taint[v] for v in deps))
        replicated_in = frozenset().union(*(manual - field.varying(v.aval) for v in deps))
        varying_out = frozenset().union(*(field.varying(o.aval) for o in eqn.outvars))
        found |= replicated_in & varying_out
        found |= core_map.collective_axes(eqn, _collective_axes)  # pl.kernel: its own casts aside
        for o in eqn.outvars:
            taint[o] = found
    return [taint.get(v) if isinstance(v, core.Var) else None for v in jaxpr.outvars]


def _call_body(eqn: Any) -> Any:
    """The body jaxpr of a call-like equation, if its inputs and outputs match the equation's."""
    key = _CALL_BODIES.get(eqn.primitive.name)
    value = eqn.params.get(key) if key else None
    body: Any = getattr(value, "jaxpr", value)
    if (not hasattr(body, "eqns") or len(body.invars) != len(eqn.invars)
            or len(body.outvars) != len(eqn.outvars)):
        return None
    return body


def _collective_axes(eqn: Any) -> frozenset[str]:
    """Every axis name an equation (or any jaxpr inside it) communicates or
    casts over, judged conservatively from its params."""
    return _params_axes(eqn.params)


def _params_axes(params: dict[str, Any]) -> frozenset[str]:
    found: set[str] = set()
    for key, value in params.items():
        if key in ("axes", "axis_name"):
            names = value if isinstance(value, (tuple, list, set, frozenset)) else (value,)
            found.update(n for n in names if isinstance(n, str))
        if type(value) in _PLAIN:  # most params: checked first, as this runs per bwd equation
            continue
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(sub, _NO_JAXPR):
                continue
            sub = getattr(sub, "jaxpr", sub)
            if hasattr(sub, "eqns"):
                found |= _jaxpr_axes(sub)
    return frozenset(found) if found else _NO_AXES


_PLAIN = (str, int, float, bool, type(None))  # param values that hold no jaxpr
_NO_JAXPR = (*_PLAIN, core.AbstractValue)  # ... nor do types (e.g. a pallas_call's out_avals)
_NO_AXES: frozenset[str] = frozenset()


# A kernel's jaxpr is shared by all its calls (JAX caches its trace): scanned once.
_axes_of_jaxpr: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def _jaxpr_axes(jaxpr: Any) -> frozenset[str]:
    try:
        found = _axes_of_jaxpr.get(jaxpr)
    except TypeError:  # not weakly referenceable
        found = None
    if found is None:
        found = frozenset().union(*(_params_axes(e.params) for e in jaxpr.eqns))
        try:
            _axes_of_jaxpr[jaxpr] = found
        except TypeError:
            pass
    return found
