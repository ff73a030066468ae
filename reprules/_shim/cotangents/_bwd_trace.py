"""A ``custom_vjp`` bwd's equations, read where they are staged or traced once and replayed.

For the ``custom_vjp`` fix, which judges a bwd's cotangents from its equations
(``_taint``). Tracing a bwd to its own jaxpr and copying that into the
enclosing one costs a second trace per call. Where the enclosing trace is a
jaxpr being staged, the bwd runs straight into it (as with JAX alone) and the
equations it added are read back from JAX's trace frame (:class:`Staged`);
elsewhere, and for later calls, the bwd is traced once per function and input
types (:func:`trace`) and replayed (:func:`replay`).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from reprules import _mode_state
from reprules._registry import generation
from reprules._shim.rules import _resolve
from reprules._shim.cotangents import _taint
from reprules._shim.plumbing._jax import api_util, config, core, lu, pe, source_info_util
from reprules._shim.plumbing._types import TypeField, manual_axes


class BwdArgs(NamedTuple):
    """A bwd's arguments, flattened. Arrays in the residuals and cotangents are
    traced (``dynamic``: residuals first); anything else (the nondiff_argnums
    values first, Python constants, SymbolicZero) is closed over."""

    args: tuple[Any, ...]
    flat: list[Any]
    tree: Any
    dynamic: list[int]
    num_res: int

    @classmethod
    def of(cls, args: Sequence[Any], call: Any) -> BwdArgs:
        flat, tree = jax.tree_util.tree_flatten(tuple(args))
        children: list[Any] = jax.tree_util.treedef_children(tree)
        per_arg = [child.num_leaves for child in children]  # one flatten, not three
        first = sum(per_arg[: len(call.static)])
        dynamic = [i for i, x in enumerate(flat) if i >= first and is_traceable(x)]
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


class _Eqn(NamedTuple):
    primitive: Any
    params: dict[str, Any]
    invars: list[Any]
    outvars: list[Any]


@dataclasses.dataclass
class _Jaxpr:
    """The part of a jaxpr a bwd staged: what ``_taint.taint_flow`` and
    ``_resolve.jaxpr_calls_registered`` read of a jaxpr."""

    eqns: list[_Eqn]
    invars: list[Any]
    outvars: list[Any]


class Staged:
    """The jaxpr being staged where a bwd runs (``pe.DynamicJaxprTrace``), and
    the equations the bwd adds to it: JAX 0.6 keeps ``frame.eqns`` (variables
    found by ``frame.tracer_to_var``); 0.7+ keeps ``frame.tracing_eqns``
    (each a ``TracingEqn``, or a reference to one JAX may drop as dead code),
    whose tracers hold their variable as ``.val``."""

    def __init__(self, trace: Any, eqns: list[Any], legacy: bool) -> None:
        self.trace, self.frame, self._eqns, self._legacy = trace, trace.frame, eqns, legacy
        self._start = len(eqns)

    @classmethod
    def open(cls, bwd_args: BwdArgs) -> Staged | None:
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
        return _resolve.jaxpr_calls_registered(self.jaxpr((), ()))

    def taints(self, out: Any, bwd_args: BwdArgs, field: TypeField) -> Any:
        """Per leaf of the bwd's output ``out``, what ``_taint.taints`` says."""
        leaves, tree = jax.tree_util.tree_flatten(out)
        jaxpr = self.jaxpr(bwd_args.dyn_args, leaves)
        return jax.tree_util.tree_unflatten(tree, _taint.taints(jaxpr, bwd_args.num_res, field))


_FLAT_SIGNATURE = inspect.signature(lambda *args: None)


def source_info(fn: Any) -> str:
    """``name at file:line`` of ``fn``, as JAX's debug info says it."""
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__name__", None) or "bwd"
    return f"{name} at {code.co_filename}:{code.co_firstlineno}" if code is not None else name


def trace(fn: Callable[..., Any], args: Sequence[Any], source: str) -> tuple[Any, Any]:
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


def replay(closed: Any, args: Sequence[Any]) -> list[Any]:
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
class BwdTrace:
    closed: Any
    out_tree: Any
    taints: list[frozenset[str] | None]
    involved: bool  # the bwd calls a registered (or inferred) kernel


SEEN = object()  # a bwd and input types run once, straight into the staged jaxpr


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


traces = _TraceCache()


def clear_traces() -> None:
    """Forgets every cached bwd trace (with JAX's own caches)."""
    traces.clear()


def trace_key(tree: Any, flat: Sequence[Any], dynamic: Sequence[int], dyn_args: Sequence[Any],
               num_res: int) -> Any:
    """What a bwd's jaxpr depends on besides the function; None if not hashable."""
    dyn = set(dynamic)
    try:
        key = (
            tree, tuple(x for i, x in enumerate(flat) if i not in dyn), tuple(jax.typeof(x) for x in dyn_args),
            num_res, manual_axes(), generation(), _mode_state.modes(), config.trace_context(),
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


def is_traceable(x: Any) -> bool:
    return isinstance(x, (jax.Array, core.Tracer, np.ndarray, np.generic))
