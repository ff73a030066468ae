"""``custom_vjp`` cotangents on the rep regime (JAX <= 0.5, ``check_rep=True``).

There JAX psums a ``custom_vjp``'s cotangents itself
(``shard_map._rewrite_bwd``): over the axes its primal is replicated over and
the cotangent is not. That is exact for per-device contributions, but a part of
the cotangent that was replicated over such an axis and then combined with a
varying part is counted once per device: a silently wrong gradient. JAX alone
does the same (JAX >= 0.6 refuses it). For a ``custom_vjp`` that involves a
registered kernel, reprules refuses it with :class:`reprules.CotangentError`;
every other ``custom_vjp`` runs exactly as with JAX alone.

Two patches, both live only while a rule is registered:

* ``custom_vjp.__call__`` wraps the fwd (to learn whether it calls a
  registered kernel) and the bwd (to tell the check below which function and
  which inputs it is looking at);
* ``shard_map._rewrite_bwd`` wraps the flat bwd JAX runs under its rewrite
  trace: when JAX is about to psum a cotangent and a registered kernel is
  involved, the bwd is traced to a jaxpr and the replication of every value is
  followed with JAX's own check rules, to find parts that depend on the
  incoming cotangents and were replicated over a psummed axis.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from reprules import _errors
from reprules._messages import gradients
from reprules._shim.plumbing import _jax
from reprules._shim.kernels import _identity
from reprules._shim.rules import _resolve
from reprules._shim.cotangents import _taint, custom_vjp
from reprules._shim.plumbing._patches import Patches
from reprules._shim.plumbing._types import rep_manual_axes


@dataclasses.dataclass
class _Frame:
    """One run of a flat bwd under JAX's rewrite trace: which custom_vjp it is."""

    call: custom_vjp.Call | None = None
    fwd: Callable[..., Any] | None = None
    leaf_counts: tuple[int, ...] = ()
    num_cts: int = 0  # the incoming cotangents: the flat bwd's last arguments


_frame: contextvars.ContextVar[_Frame | None] = contextvars.ContextVar("reprules_rep_bwd", default=None)


def install(patches: Patches) -> None:
    custom_derivatives = _jax.module("jax._src.custom_derivatives")
    from jax.experimental import shard_map as sm

    cls = custom_derivatives.custom_vjp
    patches.setattr(cls, "__call__", _wrap_call(cls.__call__))
    patches.setattr(sm, "_rewrite_bwd", _wrap_rewrite_bwd(sm._rewrite_bwd))  # type: ignore[attr-defined]  # JAX <= 0.5 only


# --- the custom_vjp call: fwd watched, bwd announced ------------------------------


def _wrap_call(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        fwd, bwd = getattr(self, "fwd", None), getattr(self, "bwd", None)
        if fwd is None or bwd is None:
            return original(self, *args, **kwargs)
        call = custom_vjp.Call(
            fun=getattr(self, "fun", None),
            bwd=bwd,
            static=frozenset(getattr(self, "nondiff_argnums", ()) or ()),
            with_logs=False,
        )
        counts: list[tuple[int, ...]] = []
        proxy = object.__new__(type(self))  # the user's object is left as it was
        proxy.__dict__.update(self.__dict__)
        proxy.fwd = _watched_fwd(fwd, call, counts)
        proxy.bwd = _announced_bwd(bwd, fwd, call, counts)
        return original(proxy, *args, **kwargs)

    return __call__


def _aval(x: Any) -> Any:
    try:
        return _jax.core.get_aval(x)  # type: ignore[attr-defined]  # JAX <= 0.5: in jax._src.core
    except TypeError:
        return None


def _watched_fwd(fwd: Callable[..., Any], call: custom_vjp.Call, counts: list[tuple[int, ...]]
                 ) -> Callable[..., Any]:
    @functools.wraps(fwd)
    def watched(*args: Any) -> Any:
        dynamic = [a for i, a in enumerate(args) if i not in call.static]
        call.record_args(args, _aval)
        counts[:] = [tuple(len(jax.tree_util.tree_leaves(a)) for a in dynamic)]
        with _identity.watching(call.watch):
            return fwd(*args)

    return watched


def _announced_bwd(bwd: Callable[..., Any], fwd: Callable[..., Any], call: custom_vjp.Call,
                   counts: list[tuple[int, ...]]) -> Callable[..., Any]:
    @functools.wraps(bwd)
    def announced(*args: Any) -> Any:
        frame = _frame.get()
        if frame is not None and frame.call is None:  # the first bwd inside a frame is its own
            frame.call, frame.fwd, frame.leaf_counts = call, fwd, counts[0] if counts else ()
            frame.num_cts = len(jax.tree_util.tree_leaves(args[-1])) if args else 0
        return bwd(*args)

    return announced


# --- JAX's rewrite of the flat bwd -------------------------------------------------


def _wrap_rewrite_bwd(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _rewrite_bwd(bwd: Any, mesh: Any, in_reps: Any, reps_dst: Any) -> Any:
        return original(_checked(bwd, mesh, reps_dst), mesh, in_reps, reps_dst)

    return _rewrite_bwd


def _checked(bwd: Any, mesh: Any, reps_dst: Sequence[set[str]]) -> Any:
    """``bwd`` (a callable, or a WrappedFun from 0.4.36), checked before JAX psums its outputs."""
    lu = _jax.lu
    wrapped = hasattr(bwd, "call_wrapped")
    run: Callable[..., Any] = bwd.call_wrapped if wrapped else bwd

    def checked(*args: Any) -> Any:
        frame, watch = _Frame(), _identity.Watch()
        token = _frame.set(frame)
        try:
            with _identity.watching(watch):
                out = run(*args)
        finally:
            _frame.reset(token)
        outs = list(out)
        src = [_rep_of(x, mesh) for x in outs]
        psummed = [frozenset(d - s) for s, d in zip(src, reps_dst)]
        if frame.call is None or not any(psummed) or len(outs) != len(reps_dst):
            return out  # nothing JAX psums (or not a user's custom_vjp): nothing to check
        _check(frame, watch, run, args, mesh, psummed)
        return out

    if not wrapped:
        return checked
    debug: Any = getattr(bwd, "debug_info", None)
    wrap: Any = lu.wrap_init
    try:
        return wrap(checked, debug_info=debug)
    except TypeError:  # 0.4.36 - 0.4.38: no debug_info keyword
        return wrap(checked)


def _rep_of(x: Any, mesh: Any) -> set[str]:
    from jax.experimental import shard_map as sm

    if isinstance(x, sm.RewriteTracer):  # type: ignore[attr-defined]  # JAX <= 0.5 only
        return set(x.rep)
    return set(mesh.axis_names)  # a constant: replicated everywhere


def _check(frame: _Frame, watch: _identity.Watch, run: Callable[..., Any], args: Sequence[Any], mesh: Any,
           psummed: Sequence[frozenset[str]]) -> None:
    """Raises CotangentError if a psummed cotangent mixes in a replicated part
    and the custom_vjp involves a registered kernel."""
    call = frame.call
    assert call is not None and frame.fwd is not None
    closed = jax.make_jaxpr(run)(*args)
    involved = (call.watch.involved or watch.involved or _resolve.jaxpr_calls_registered(closed.jaxpr)
                or custom_vjp.fwd_involves_registered(frame.fwd, call))
    if not involved:
        return  # JAX's own behaviour, unchanged
    all_axes = frozenset(mesh.axis_names)
    manual = frozenset(rep_manual_axes(mesh))
    num_res = len(args) - frame.num_cts
    in_reps = [_rep_of(x, mesh) for x in args]
    in_taints: list[frozenset[str] | None] = [None] * num_res + [frozenset()] * (len(args) - num_res)
    _, taints = _flow(closed.jaxpr, in_reps, in_taints, mesh, manual, all_axes)
    for k, (axes, taint) in enumerate(zip(psummed, taints)):
        bad = axes & (taint or frozenset()) & manual
        if bad:
            index = _dynamic_index(frame.leaf_counts, k)
            primal = call.primal_types[index] if call.primal_types and index < len(call.primal_types) else None
            leaves = jax.tree_util.tree_leaves(primal) if primal is not None else []
            leaf: Any = leaves[0] if leaves else None
            raise _errors.CotangentError(
                gradients.mixed_cotangent_message(
                    call.name, custom_vjp.input_name(call, index),
                    leaf.str_short() if hasattr(leaf, "str_short") else "?", bad, tuple(mesh.axis_names),
                    _jax.JAX_VERSION, psummed_by="JAX (check_rep)", bwd=call.bwd,
                    position=index if len(leaves) == 1 else None,
                    causes=list(dict.fromkeys(_causes(closed.jaxpr, [i >= num_res for i in range(len(args))], bad))),
                )
            )


def _causes(jaxpr: Any, dep_in: Sequence[bool], axes: frozenset[str], depth: int = 0) -> list[tuple[str, str]]:
    """For the CotangentError's Why: the equations on the cotangents' path that name ``axes``
    (a kernel whose body reads the device index or communicates, a collective, a cast), as
    :func:`custom_vjp._describe` tells them."""
    dep = {v for v, d in zip(jaxpr.invars, dep_in) if d}
    found: list[tuple[str, str]] = []
    for eqn in jaxpr.eqns:
        uses = [isinstance(v, _jax.core.Var) and v in dep for v in eqn.invars]
        if not any(uses):
            continue
        dep.update(eqn.outvars)
        named = _taint.collective_axes(eqn) & axes
        if not named:
            continue
        body = _taint.call_body(eqn)
        inner = [] if body is None or depth > 8 else _causes(body, uses, named, depth + 1)
        found += inner or [custom_vjp._describe(eqn, named)]
    return found


def _dynamic_index(leaf_counts: Sequence[int], k: int) -> int:
    """The differentiable argument that flat cotangent ``k`` belongs to."""
    total = 0
    for i, n in enumerate(leaf_counts):
        total += n
        if k < total:
            return i
    return k


def _flow(jaxpr: Any, in_reps: Sequence[set[str] | None], in_taints: Sequence[frozenset[str] | None],
          mesh: Any, manual: frozenset[str], all_axes: frozenset[str]
          ) -> tuple[list[set[str] | None], list[frozenset[str] | None]]:
    """Per output of ``jaxpr``: its replication (JAX's check rules; a rep of
    None is a literal, replicated everywhere) and its taint: the manual axes
    over which a part that depends on a tainted input (``in_taints`` not None)
    was replicated and then combined into something varying, or went through
    a collective. A primitive without a usable check rule is taken to vary
    over every axis: that can only add taints."""
    core = _jax.core
    from jax.experimental import shard_map as sm  # the rep era's own module

    reps: dict[Any, set[str] | None] = {v: set(all_axes) for v in jaxpr.constvars}
    reps.update(zip(jaxpr.invars, in_reps))
    taint: dict[Any, frozenset[str]] = {v: t for v, t in zip(jaxpr.invars, in_taints) if t is not None}

    def rep(x: Any) -> set[str] | None:
        return reps.get(x) if isinstance(x, core.Var) else None

    def replicated(r: set[str] | None) -> frozenset[str]:
        return manual if r is None else frozenset(r) & manual

    for eqn in jaxpr.eqns:
        ins = [rep(v) for v in eqn.invars]
        deps = [v for v in eqn.invars if isinstance(v, core.Var) and v in taint]
        body = _taint.call_body(eqn)
        if body is not None:
            inner_taints = [taint.get(v) if isinstance(v, core.Var) else None for v in eqn.invars]
            out_reps, out_taints = _flow(body, ins, inner_taints, mesh, manual, all_axes)
            for o, r, t in zip(eqn.outvars, out_reps, out_taints):
                reps[o] = r
                if t is not None:
                    taint[o] = t
            continue
        outs = _eqn_reps(sm, eqn, mesh, ins)
        for o, r in zip(eqn.outvars, outs):
            reps[o] = r
        if not deps:
            continue
        found = frozenset().union(*(taint[v] for v in deps))
        replicated_in = frozenset().union(*(replicated(rep(v)) for v in deps))
        varying_out = frozenset().union(*(manual - replicated(r) for r in outs))
        found |= replicated_in & varying_out
        found |= _taint.collective_axes(eqn) & manual
        for o in eqn.outvars:
            taint[o] = found
    return ([rep(v) for v in jaxpr.outvars],
            [taint.get(v) if isinstance(v, core.Var) else None for v in jaxpr.outvars])


def _eqn_reps(sm: Any, eqn: Any, mesh: Any, ins: Sequence[set[str] | None]) -> list[set[str] | None]:
    rule = sm._check_rules.get(eqn.primitive)
    try:
        out = rule(mesh, *ins, **eqn.params) if rule is not None else None
    except Exception:  # noqa: BLE001 - no usable rule: varying everywhere (conservative)
        out = None
    n = len(eqn.outvars)
    if out is None:
        return [set() for _ in range(n)]
    if eqn.primitive.multiple_results:
        return [set(r) if r is not None else None for r in ([out] * n if isinstance(out, set) else out)]
    return [set(out) if out is not None else None]
