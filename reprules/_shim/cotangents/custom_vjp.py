"""``custom_vjp`` cotangents of registered kernels (vma and mat regimes).

A replicated weight used on sharded activations gets, from a kernel's bwd, a
cotangent that varies over the activations' axes. JAX <= 0.5 psums it; from
0.6.2 JAX refuses it (the bwd output must have the primal's type). reprules
psums it, but only where that is provably exact and only for ``custom_vjp``s
that involve a registered kernel:

* **Which ``custom_vjp``s.** One whose fwd or bwd, while being traced, calls a
  kernel that has a rule (``_identity.note_registered_call``). Every other
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

import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax

from reprules import _errors
from reprules._messages import gradients
from reprules._shim.plumbing import _jax, _source, _types
from reprules._shim.kernels import _identity
from reprules._shim.rules import _resolve
from reprules._shim.cotangents import _bwd_trace, _taint
from reprules._shim.cotangents._bwd_trace import BwdArgs, Staged
from reprules._shim.plumbing._jax import core
from reprules._shim.plumbing._patches import Patches
from reprules._shim.plumbing._types import TypeField


@dataclasses.dataclass
class Call:
    """One call of a ``custom_vjp`` function: what its bwd needs to know."""

    fun: Any  # the decorated function: its names are read only for an error message
    bwd: Any  # the user's bwd: what reprules adds to its cotangents is attributed to it
    static: frozenset[int]  # nondiff_argnums: no cotangent is returned for these
    with_logs: bool
    watch: _identity.Watch = dataclasses.field(default_factory=_identity.Watch)
    primal_types: tuple[Any, ...] | None = None  # per differentiable argument, a pytree of types
    # The fwd's arguments, flattened (arrays as their types), and their tree: read only
    # on the rare path that traces the fwd again (fwd_involves_registered).
    fwd_leaves: list[Any] = dataclasses.field(default_factory=list)
    fwd_tree: Any = None
    # Called where sound types cast values up (_types.widened_here): its inputs may vary
    # over more axes than JAX alone types them, and its cotangents are fixed as a kernel's.
    widened: bool = False

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


def install(patches: Patches, field: TypeField) -> None:
    classes: list[tuple[Any, str]] = [(_jax.module("jax._src.custom_derivatives").custom_vjp, "nondiff_argnums")]
    custom_vjp3 = getattr(_jax.module("jax._src.hijax"), "custom_vjp3", None)  # 0.9.1+: jax_custom_vjp3
    if custom_vjp3 is not None:
        classes.append((custom_vjp3, "static_argnums"))
    for cls, static_attr in classes:
        patches.setattr(cls, "__call__", _wrap_call(cls.__call__, static_attr, field))
    _install_psum_batching_fix(patches)


# JAX 0.8.x: psum of a vmapped value inside shard_map fails in JAX's own
# batcher (it binds psum_invariant with a stray axis_index_groups). reprules'
# cotangent psum runs under vmap when the custom_vjp is vmapped, so it uses a
# corrected batcher -- only for its own psum, so user code sees JAX unchanged.
_own_psum: contextvars.ContextVar[bool] = contextvars.ContextVar("reprules_own_psum", default=False)


def _install_psum_batching_fix(patches: Patches) -> None:
    if _jax.version_tuple()[:2] != (0, 8):
        return
    batching, parallel = _jax.module("jax._src.interpreters.batching"), _jax.module("jax._src.lax.parallel")
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
        return _types.psum(x, axes)
    finally:
        _own_psum.reset(token)


def _wrap_call(original: Callable[..., Any], static_attr: str, field: TypeField) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        fwd, bwd = getattr(self, "fwd", None), getattr(self, "bwd", None)
        if fwd is None or bwd is None or getattr(self, "with_accums", False):
            return original(self, *args, **kwargs)
        if getattr(bwd, "_reprules_fixed", False):
            # Wrapped already: 0.12's custom_vjp.__call__ hands its (wrapped) fwd
            # and bwd to the jax_custom_vjp3 implementation, which is patched too.
            return original(self, *args, **kwargs)
        call = Call(
            fun=getattr(self, "fun", None) or getattr(self, "f", None),
            bwd=bwd,
            static=frozenset(getattr(self, static_attr, ()) or ()),
            with_logs=bool(getattr(self, "with_logs", False)),
            widened=_types.widened_here(),
        )
        proxy = object.__new__(type(self))  # the user's object is left as it was
        proxy.__dict__.update(self.__dict__)  # (copy.copy would call custom_vjp.__new__)
        proxy.fwd = _watched_fwd(fwd, call)
        proxy.bwd = _fixed_bwd(fwd, bwd, call, field)
        return original(proxy, *args, **kwargs)

    return __call__


def _watched_fwd(fwd: Callable[..., Any], call: Call) -> Callable[..., Any]:
    @_wraps(fwd)
    def watched(*args: Any) -> Any:
        call.record_args(args, _type_of)
        with _identity.watching(call.watch):
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


def _fixed_bwd(fwd: Callable[..., Any], bwd: Callable[..., Any], call: Call, field: TypeField) -> Callable[..., Any]:
    @_wraps(bwd)
    def fixed(*args: Any) -> Any:
        if not _types.checking():  # no types to fix: exactly what JAX alone does
            return bwd(*args)
        bwd_args = BwdArgs.of(args, call)
        staged = Staged.open(bwd_args)  # None: the bwd's equations cannot be read where they are staged
        if call.watch.involved or call.widened:  # the fwd traced a registered kernel, or sound types widened
            return _traced_and_fixed(bwd, call, field, bwd_args, staged)
        own = _identity.Watch()
        with _identity.watching(own):
            out = bwd(*args)
        if not _mistyped(out, call, field):
            return out  # nothing to fix: exactly what JAX alone does
        # JAX alone refuses this cotangent. Fix it only if a registered kernel
        # is involved: one the bwd traced, or one in the fwd's or the bwd's
        # jaxpr (a cached trace is reused without tracing the kernel again).
        if staged is not None:  # the bwd's equations are there to read: no second trace
            if own.involved or fwd_involves_registered(fwd, call) or staged.calls_registered():
                return _fixed_cts(out, staged.taints(out, bwd_args, field), call, field,
                                  _staged_jaxpr(staged, bwd_args, out))
            return out  # JAX's own refusal stands
        if own.involved or fwd_involves_registered(fwd, call):
            return _traced_and_fixed(bwd, call, field, bwd_args, None)
        fixed_out = _traced_and_fixed(bwd, call, field, bwd_args, None, only_if_registered=True)
        return out if fixed_out is None else fixed_out  # None: JAX's own refusal stands

    fixed._reprules_fixed = True  # type: ignore[attr-defined]
    return fixed


def fwd_involves_registered(fwd: Callable[..., Any], call: Call) -> bool:
    flat, tree = call.fwd_leaves, call.fwd_tree
    dynamic = [i for i, x in enumerate(flat) if isinstance(x, core.AbstractValue)]

    def flat_fwd(*xs: Any) -> Any:
        leaves = list(flat)
        for i, x in zip(dynamic, xs):
            leaves[i] = x
        return fwd(*jax.tree_util.tree_unflatten(tree, leaves))

    watch = _identity.Watch()
    try:
        with _identity.watching(watch):
            closed = jax.make_jaxpr(flat_fwd)(*[flat[i] for i in dynamic])
    except Exception:  # noqa: BLE001 - e.g. symbolic-zeros primals: cannot tell, so JAX decides
        return watch.involved
    return watch.involved or _resolve.jaxpr_calls_registered(closed.jaxpr)


def _split_logs(out: Any, call: Call) -> tuple[Any, Any]:
    if call.with_logs and isinstance(out, (tuple, list)) and len(out) == 2:
        return out[0], out[1]
    return out, None


def _cts_and_types(out: Any, call: Call) -> list[tuple[Any, Any]] | None:
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


def _ct_varying(field: TypeField, ct: Any) -> frozenset[str]:
    try:
        return field.varying(jax.typeof(ct)) if ct is not None else frozenset()
    except TypeError:  # not a JAX value: JAX's own check reports it
        return frozenset()


def _mistyped(out: Any, call: Call, field: TypeField) -> bool:
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


def _traced_and_fixed(bwd: Callable[..., Any], call: Call, field: TypeField, bwd_args: BwdArgs,
                      staged: Staged | None, only_if_registered: bool = False) -> Any:
    """Runs the bwd, and psums each cotangent over the axes it varies over and
    its primal does not, where that is exact (judged from the bwd's jaxpr).

    The first call for given input types runs straight into the jaxpr being
    staged (``staged``) and reads its equations there; a second one traces the
    bwd to a jaxpr, which it and later calls replay (a model calls the same
    bwd once per layer). Without ``staged``, every call takes the second way.

    With ``only_if_registered``, returns None (nothing evaluated) unless the
    bwd's jaxpr calls a registered kernel."""
    dyn_args = bwd_args.dyn_args
    key = _bwd_trace.trace_key(bwd_args.tree, bwd_args.flat, bwd_args.dynamic, dyn_args, bwd_args.num_res)
    traced = _bwd_trace.traces.get(bwd, key)
    if traced is None and staged is not None and not only_if_registered:
        _bwd_trace.traces.put(bwd, key, _bwd_trace.SEEN)
        staged.begin()
        out = bwd(*bwd_args.args)
        return _fixed_cts(out, staged.taints(out, bwd_args, field), call, field, _staged_jaxpr(staged, bwd_args, out))
    if not isinstance(traced, _bwd_trace.BwdTrace):
        watch = _identity.Watch()
        with _identity.watching(watch):
            closed, out_tree = _bwd_trace.trace(bwd_args.flat_fn(bwd), dyn_args, _bwd_trace.source_info(bwd))
        involved = watch.involved or _resolve.jaxpr_calls_registered(closed.jaxpr)
        traced = _bwd_trace.BwdTrace(closed, out_tree, _taint.taints(closed.jaxpr, bwd_args.num_res, field), involved)
        _bwd_trace.traces.put(bwd, key, traced)
    elif traced.involved:
        _identity.note_registered_call()  # as tracing it again would
    if only_if_registered and not traced.involved:
        return None
    out = jax.tree_util.tree_unflatten(traced.out_tree, _bwd_trace.replay(traced.closed, dyn_args))
    return _fixed_cts(out, jax.tree_util.tree_unflatten(traced.out_tree, traced.taints), call, field,
                      lambda: (traced.closed.jaxpr, bwd_args.num_res))


BwdJaxpr = Callable[[], tuple[Any, int]]  # the bwd's jaxpr and its residual count, for an error's Why


def _staged_jaxpr(staged: Staged, bwd_args: BwdArgs, out: Any) -> BwdJaxpr:
    return lambda: (staged.jaxpr(bwd_args.dyn_args, jax.tree_util.tree_leaves(out)), bwd_args.num_res)


def _fixed_cts(out: Any, taint_tree: Any, call: Call, field: TypeField, bwd_jaxpr: BwdJaxpr | None = None) -> Any:
    """The bwd's output ``out`` with each cotangent fixed by :func:`_fix_leaf`
    (``taint_tree``: the taint of each leaf of ``out``)."""
    cts, logs = _split_logs(out, call)
    ct_taints, _ = _split_logs(taint_tree, call)
    if call.primal_types is None or not isinstance(cts, (tuple, list)) or len(cts) != len(call.primal_types):
        return out
    # Where code around the call hid the shard_map's manual axes, those the
    # cotangents and primals vary over are known to be manual (see _types.hidden_axes).
    avals = [jax.typeof(c) for c in jax.tree_util.tree_leaves(cts) if isinstance(c, (jax.Array, core.Tracer))]
    hidden = _types.hidden_axes([field.varying(a) for a in avals] + [
        field.varying(t) for t in jax.tree_util.tree_leaves(call.primal_types) if isinstance(t, core.AbstractValue)])
    manual = hidden.known if hidden is not None else _types.manual_axes()
    with _types.call_axes(manual, avals):
        fixed_cts = _fix_leaves(cts, ct_taints, call, field, manual, bwd_jaxpr)
    return (fixed_cts, logs) if call.with_logs else fixed_cts


def _fix_leaves(cts: Sequence[Any], ct_taints: Sequence[Any], call: Call, field: TypeField,
                manual: tuple[str, ...], bwd_jaxpr: BwdJaxpr | None = None) -> tuple[Any, ...]:
    fixed: list[Any] = []
    assert call.primal_types is not None
    for index, (ct, taint, types) in enumerate(zip(cts, ct_taints, call.primal_types)):
        if ct is None:
            fixed.append(None)
        elif isinstance(types, core.AbstractValue) and isinstance(ct, (jax.Array, core.Tracer)):
            fixed.append(_fix_leaf(ct, taint, types, index, call, field, manual, bwd_jaxpr))  # an array: a leaf
        else:
            fixed.append(jax.tree_util.tree_map(
                lambda c, t, ty, i=index: _fix_leaf(c, t, ty, i, call, field, manual, bwd_jaxpr, leaf=False),
                ct, taint, types, is_leaf=lambda x: x is None,
            ))
    return tuple(fixed)


def _fix_leaf(ct: Any, taint: frozenset[str] | None, primal_type: Any, index: int, call: Call,
              field: TypeField, manual: tuple[str, ...], bwd_jaxpr: BwdJaxpr | None = None,
              leaf: bool = True) -> Any:
    if ct is None or primal_type is None or not hasattr(primal_type, "shape"):
        return ct
    have, want = _ct_varying(field, ct), field.varying(primal_type)
    excess = have - want
    if excess & (taint or frozenset()):
        bad = excess & (taint or frozenset())
        causes: list[tuple[str, str]] = []
        if bwd_jaxpr is not None:
            try:  # only to explain: an error here must not hide the CotangentError
                jaxpr, num_res = bwd_jaxpr()
                ins: list[frozenset[str] | None] = [None] * num_res + [frozenset()] * (len(jaxpr.invars) - num_res)
                causes = list(dict.fromkeys(_taint_origins(jaxpr, ins, field, bad)))
            except Exception:  # noqa: BLE001
                causes = []
        raise _errors.CotangentError(
            gradients.mixed_cotangent_message(
                call.name, input_name(call, index), str(primal_type.str_short()),
                bad, manual, _jax.JAX_VERSION, bwd=call.bwd, position=index if leaf else None,
                causes=causes,
            )
        )
    if excess or want - have:
        # Attributed to the user's bwd and marked as reprules' (_source): reports
        # then name the bwd rather than this module.
        with _source.added_in(call.bwd):
            if excess:
                ct = _psum(ct, excess)
            if want - have:  # a replicated cotangent for a varying input: a free cast (its transpose: a psum)
                ct = _types.cast_up(ct, want - have)
    return ct


@dataclasses.dataclass(frozen=True)
class _View:
    """A jaxpr whose outputs are every equation's outputs (to read each one's taint)."""

    invars: Sequence[Any]
    eqns: Sequence[Any]
    outvars: Sequence[Any]


def _taint_origins(jaxpr: Any, in_taints: Sequence[frozenset[str] | None], field: TypeField,
                   axes: frozenset[str], depth: int = 0) -> list[tuple[str, str]]:
    """For a :class:`reprules.CotangentError`'s Why: the equations of the bwd where a taint over
    ``axes`` starts (see ``_taint.taint_flow``), each as ``(kind, description)``; ``kind`` is
    ``"body"`` (a kernel or collective that names the axes) or ``"cast"`` (a value replicated
    over them made varying)."""
    view = _View(jaxpr.invars, jaxpr.eqns, [o for e in jaxpr.eqns for o in e.outvars])
    taint = {v: t for v, t in zip(jaxpr.invars, in_taints) if t is not None}
    taint.update((v, t) for v, t in zip(view.outvars, _taint.taint_flow(view, in_taints, field)) if t is not None)
    found: list[tuple[str, str]] = []
    for eqn in jaxpr.eqns:
        ins = frozenset().union(*(taint.get(v, frozenset()) for v in eqn.invars if isinstance(v, core.Var)))
        new = (frozenset().union(*(taint.get(o, frozenset()) for o in eqn.outvars)) - ins) & axes
        if not new:
            continue
        body = _taint.call_body(eqn)
        inner = [] if body is None or depth > 8 else _taint_origins(
            body, [taint.get(v) if isinstance(v, core.Var) else None for v in eqn.invars], field, new, depth + 1)
        found += inner or [_describe(eqn, new)]
    return found


def _describe(eqn: Any, axes: frozenset[str]) -> tuple[str, str]:
    over = _errors.fmt_axes(axes)
    info = getattr(eqn, "source_info", None)
    at = f" at {_jax.source_info_util.summarize(info)}" if info is not None else ""
    name = eqn.primitive.name
    named = _taint.collective_axes(eqn) & axes
    if name == "pallas_call" or _resolve.kernel_opaque(eqn.primitive) is not None:
        debug = getattr(eqn.params.get("jaxpr"), "debug_info", None)  # 0.5+: "kernel at file:line"
        src = str(getattr(debug, "func_src_info", "") or "")
        defined = f", defined at {src.split(' at ', 1)[1]}" if not at and " at " in src else ""
        kernel = f"the Pallas kernel {_identity.kernel_name_from_params(eqn.params)!r} ({name}{at}{defined})"
        if named:
            what = _naming(eqn.params, axes)
            return "body", (f"it goes through {kernel}, whose body names {over}"
                            f"{f' (`{what}`: it reads the device index or communicates)' if what else ''}")
        return "cast", f"{kernel} took a value replicated over {over} and made its output vary over it (its rule)"
    if named and name not in ("pvary", "pcast", "pbroadcast"):
        return "body", f"it goes through `{name}`{at}, which communicates over or reads the index on {over}"
    return "cast", f"`{name}`{at} made a value computed from the incoming cotangent, replicated over {over}, vary over it"


def _naming(params: Any, axes: frozenset[str]) -> str:
    """The first primitive inside a kernel's jaxpr whose params name one of ``axes``."""
    for value in params.values():
        sub = getattr(value, "jaxpr", value)
        for e in getattr(sub, "eqns", ()):
            if _taint.collective_axes(e) & axes:
                return _naming(e.params, axes) or str(e.primitive.name)
    return ""


def input_name(call: Call, index: int) -> str:
    dynamic = [n for i, n in enumerate(call.arg_names) if i not in call.static]
    return f"input {index} ({dynamic[index]!r})" if index < len(dynamic) else f"input {index}"
