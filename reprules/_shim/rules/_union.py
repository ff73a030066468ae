"""The annotation union: an out_shape annotated by hand that says an output is
replicated over an axis the kernel's body (analysed by inference) makes it
depend on, or that the kernel's registered rule types it varying over.

JAX believes an annotation, so such an output would be typed replicated and a
gradient through it would miss its psum (silently wrong under JAX alone:
tokamax's ragged_dot VJP types the weight gradient like the weight). More
varying is always sound, so reprules types the output by the *union* of the
annotation and the derived axes, warns once per kernel
(:class:`reprules.ReplicationWarning`), and a ``custom_vjp`` around the kernel
gets the psum from ``custom_vjp``. ``reprules.strict()`` keeps the refusal
(:class:`reprules.RuleError`), and so does an output JAX types like an aliased
input (widening it would need the input cast up, which is the user's to do).

A declared rule gets the same union: an annotation copied from an operand is
not a statement about the kernel. JAX's splash attention (0.10+) types MQA's
dk/dv out_shape ``jax.ShapeDtypeStruct.like(k)``: with k sharded over the batch
axis and replicated over the head axis, that says dk varies over the batch axis
only, while the per-shard dk sums over the local query heads (``rules.same()``
types it varying over both). Believing the annotation dropped the psum over the
head axis: a silently wrong dk/dv. An annotation that claims *more* axes than
the rule is kept as it is (the union is the annotation).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from reprules import _errors
from reprules._messages import out_types
from reprules._mode_state import strict_on
from reprules._shim.plumbing import _frames, _jax
from reprules._shim.inference import infer
from reprules._shim.plumbing._types import TypeField, manual_axes

_warned: set[tuple[str, str]] = set()  # (kernel, site): one warning per kernel
_lock = threading.Lock()


def rule_text(reg: Any) -> str | None:
    """What messages say the needed axes come from: None for a rule derived by
    inference (its body), else the declared rule and where it was registered."""
    if isinstance(reg.rule, infer.InferredRule):
        return None
    return f"{reg.rule!r} (registered from {reg.source})"


Subject = tuple[str, str, str | None]
"""``(kernel, site, rule)`` for messages: the kernel as messages name it ("Pallas kernel 'k'"),
where it is (the warn-once key), and :func:`rule_text` of its registration."""


def widen(field: TypeField, out_avals: Sequence[Any], derived: Sequence[frozenset[str]],
          kept: Sequence[bool], aliased: dict[int, int], subject: Callable[[], Subject],
          can_widen: bool = True) -> dict[int, Any]:
    """``{output index: type}`` for each kept (hand-annotated) output that the
    body (or the kernel's declared rule) needs to vary over more axes than its
    annotation says: the union. Raises :class:`reprules.RuleError` instead under
    ``reprules.strict()``, for an aliased output, or where the caller cannot
    retype (``can_widen``). ``subject`` is called only when an output is short of
    axes: this runs at every call of a registered kernel, where that is rare."""
    widened: dict[int, Any] = {}
    named: Subject | None = None
    spmd: frozenset[str] | None = None
    for i, (aval, needed, keep) in enumerate(zip(out_avals, derived, kept)):
        have = field.varying(aval)
        missing = needed - have
        if not (keep and missing):
            continue
        if spmd is None:
            spmd = frozenset(getattr(_jax.core.get_axis_env(), "spmd_axis_names", ()) or ())
        if missing <= spmd and i not in aliased and can_widen:
            # JAX's batching of a kernel under vmap(..., spmd_axis_name=...) copies the
            # per-element output types, which lack the spmd axes every batched input
            # varies over: JAX's own types, no annotation of the user's. Widened, silently.
            widened[i] = field.retype(aval, have | needed)
            continue
        if named is None:
            named = subject()
        kernel, site, rule = named
        if strict_on() or i in aliased or not can_widen:
            raise _errors.RuleError(out_types.annotation_message(
                kernel, i, missing, needed, manual_axes(), _jax.JAX_VERSION, aliased.get(i), rule=rule))
        widened[i] = field.retype(aval, have | needed)
        with _lock:
            first = (kernel, site) not in _warned
            _warned.add((kernel, site))
        if first:
            warnings.warn(out_types.annotation_union_message(
                kernel, i, missing, have | needed, manual_axes(), _jax.JAX_VERSION, _frames.annotation_site(), rule=rule),
                _errors.ReplicationWarning, stacklevel=2)
    return widened


# --- values reprules widened, for pcast (see pcast.py) ----------------------------------
class _Widened:
    """The axes reprules added to each widened output, found again from a value.

    Keyed by the tuple of output types reprules gave the kernel's bind (its
    ``out_avals`` param, which the equation keeps however JAX rebuilds the jaxpr:
    JAX renames a jaxpr's variables when it finishes tracing it), and by the
    output's variable while its jaxpr is being traced. Neither takes a weak
    reference, so both are held here, bounded; they hold types only, no tracer and
    no kernel. A value is found through the equation that made it, following the
    calls that forward it (``jax.jit``, ``closed_call``, ``custom_vjp``/``custom_jvp``
    calls): MaxText's megablox fork binds its kernel inside a ``jax.jit`` and casts
    the jit's output. A jit's cache reuses its jaxpr, so a cached call is found too."""

    LIMIT = 4096  # a bound, whatever happens
    DEPTH = 8  # nested forwarding calls followed

    def __init__(self) -> None:
        self._calls: dict[int, tuple[Any, dict[int, frozenset[str]]]] = {}  # id(out_avals) -> (it, {i: added})
        self._vars: dict[int, tuple[Any, frozenset[str]]] = {}  # id(var) -> (var, added)
        self._lock = threading.Lock()

    def add(self, out_avals: tuple[Any, ...], outputs: Sequence[Any], added: dict[int, frozenset[str]]) -> None:
        with self._lock:
            for table in (self._calls, self._vars):
                if len(table) >= self.LIMIT:
                    del table[next(iter(table))]  # the oldest
            self._calls[id(out_avals)] = (out_avals, added)
            for i, axes in added.items():
                var = _staged_var(outputs[i])
                if var is not None:
                    self._vars[id(var)] = (var, axes)

    def added(self, value: Any) -> frozenset[str]:
        """The axes reprules added to ``value`` by widening; empty for any other value."""
        if not self._calls:
            return frozenset()
        tracer = _staged_tracer(value)
        if tracer is None:
            return frozenset()
        for var, eqn in _forwarded_from(tracer, self.DEPTH):
            found = self._vars.get(id(var))
            if found is not None and found[0] is var:
                return found[1]
            out_avals = getattr(eqn, "params", {}).get("out_avals")
            call = self._calls.get(id(out_avals))
            if call is not None and call[0] is out_avals:
                index = next((k for k, v in enumerate(eqn.outvars) if v is var), None)
                return call[1].get(index, frozenset()) if index is not None else frozenset()
        return frozenset()


widened_values = _Widened()


def remember(field: TypeField, typed: tuple[Any, ...], outputs: Sequence[Any], annotated: Sequence[Any],
             widened: dict[int, Any]) -> None:
    """Records the axes each widened output gained over its annotation, for
    :func:`added_axes`: ``typed`` is the ``out_avals`` tuple the kernel was bound
    with, ``annotated`` the types before widening."""
    added = {i: field.varying(aval) - field.varying(annotated[i]) for i, aval in widened.items()}
    widened_values.add(typed, outputs, {i: axes for i, axes in added.items() if axes})


def added_axes(value: Any) -> frozenset[str]:
    """The axes reprules' annotation union added to ``value`` (an output of a widened
    kernel, or a call's output that forwards one); empty for every other value."""
    return widened_values.added(value)


def _staged_tracer(value: Any) -> Any:
    """The staged (jaxpr) tracer behind ``value``: itself, or the primal of a JVP or
    linearize tracer, or the value of a batch tracer; None for anything else."""
    staged = _jax.pe.DynamicJaxprTracer
    for _ in range(_Widened.DEPTH):
        if isinstance(value, staged):
            return value
        if not isinstance(value, _jax.core.Tracer):
            return None
        inner = getattr(value, "primal", None)  # JVPTracer, LinearizeTracer
        value = inner if inner is not None else getattr(value, "val", None)  # BatchTracer
    return None


def _staged_var(value: Any) -> Any:
    tracer = _staged_tracer(value)
    var = getattr(tracer, "val", None)
    return var if isinstance(var, _jax.core.Var) else None


def _forwarded_from(tracer: Any, depth: int) -> Any:
    """``(variable, the equation that made it)`` for ``tracer``, then, while that
    equation is a call (its jaxpr in ``jaxpr`` or ``call_jaxpr``), for the inner
    variable it forwards. JAX 0.12's staged tracers know their equation
    (``parent``); before, only the variable itself is found (equation None)."""
    var = getattr(tracer, "val", None)
    eqn = getattr(tracer, "parent", None)
    for _ in range(depth):
        if not isinstance(var, _jax.core.Var):
            return
        yield var, eqn
        sub = _called_jaxpr(eqn)
        outvars = getattr(eqn, "outvars", ())
        index = next((k for k, v in enumerate(outvars) if v is var), None)
        if sub is None or index is None or len(sub.outvars) != len(outvars):
            return
        var = sub.outvars[index]
        eqn = next((e for e in reversed(sub.eqns) if any(o is var for o in e.outvars)), None)


def _called_jaxpr(eqn: Any) -> Any:
    """The (open) jaxpr a call-like equation runs, whose outputs are the call's; else None."""
    params = getattr(eqn, "params", None)
    if not isinstance(params, dict):
        return None
    for key in ("jaxpr", "call_jaxpr"):
        sub = params.get(key)
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "outvars") and hasattr(sub, "eqns"):
            return sub
    return None
