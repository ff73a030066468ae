"""Which cotangents a ``custom_vjp`` bwd mixes from replicated and varying parts.

A pure analysis of a bwd's jaxpr (or of the equations it staged), for the
``custom_vjp`` fix: per output, the axes over which a part of it that depends
on the incoming cotangents was replicated and then made varying, or went
through a collective. A psum over such an axis would count that part once per
device.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from reprules._shim.rules import _resolve
from reprules._shim.plumbing._jax import core
from reprules._shim.plumbing._types import TypeField, manual_axes


def taints(jaxpr: Any, num_res: int, field: TypeField) -> list[frozenset[str] | None]:
    """Per output of the bwd ``jaxpr``: the axes over which a part of it that
    depends on the incoming cotangents (inputs ``num_res`` on) was replicated
    and then made varying, or went through a collective; None if the output
    does not depend on the cotangents at all."""
    ins: list[frozenset[str] | None] = [None] * num_res + [frozenset()] * (len(jaxpr.invars) - num_res)
    return taint_flow(jaxpr, ins, field)


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


def taint_flow(jaxpr: Any, in_taints: Sequence[frozenset[str] | None], field: TypeField
                ) -> list[frozenset[str] | None]:
    manual = frozenset(manual_axes())
    taint: dict[Any, frozenset[str]] = {v: t for v, t in zip(jaxpr.invars, in_taints) if t is not None}
    for eqn in jaxpr.eqns:
        deps = [v for v in eqn.invars if isinstance(v, core.Var) and v in taint]
        if not deps:
            continue
        body = call_body(eqn)
        if body is not None:
            inner = taint_flow(body, [taint.get(v) if isinstance(v, core.Var) else None for v in eqn.invars], field)
            for o, t in zip(eqn.outvars, inner):
                if t is not None:
                    taint[o] = t
            continue
        found = frozenset().union(*(taint[v] for v in deps))
        replicated_in = frozenset().union(*(manual - field.varying(v.aval) for v in deps))
        varying_out = frozenset().union(*(field.varying(o.aval) for o in eqn.outvars))
        found |= replicated_in & varying_out
        found |= _resolve.kernel_collective_axes(eqn, collective_axes)  # pl.kernel: its own casts aside
        for o in eqn.outvars:
            taint[o] = found
    return [taint.get(v) if isinstance(v, core.Var) else None for v in jaxpr.outvars]


def call_body(eqn: Any) -> Any:
    """The body jaxpr of a call-like equation, if its inputs and outputs match the equation's."""
    key = _CALL_BODIES.get(eqn.primitive.name)
    value = eqn.params.get(key) if key else None
    body: Any = getattr(value, "jaxpr", value)
    if (not hasattr(body, "eqns") or len(body.invars) != len(eqn.invars)
            or len(body.outvars) != len(eqn.outvars)):
        return None
    return body


def collective_axes(eqn: Any) -> frozenset[str]:
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
