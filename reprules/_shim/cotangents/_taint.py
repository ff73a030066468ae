"""Which cotangents a ``custom_vjp`` bwd mixes from replicated and varying parts.

A pure analysis of a bwd's jaxpr (or of the equations it staged), for the
``custom_vjp`` fix: per output, the axes over which a part of it that depends
on the incoming cotangents was replicated and then made varying, or went
through a collective. A psum over such an axis would count that part once per
device.

A part masked so that it is nonzero on one device at most along an axis
(``where(axis_index(a) == c, u, 0)``, ``(axis_index(a) == c) * u``, with ``c``
the same on every device along ``a``) is untainted over ``a``: a psum over ``a``
counts it once, whatever it went through before (see :class:`_OneHot`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from reprules._shim.rules import _resolve
from reprules._shim.plumbing._jax import core
from reprules._shim.plumbing._types import TypeField, manual_axes


Taints = list[frozenset[str] | None]


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


def taint_flow(jaxpr: Any, in_taints: Sequence[frozenset[str] | None], field: TypeField,
               seed: list[Facts] | None = None) -> list[frozenset[str] | None]:
    manual = frozenset(manual_axes())
    taint: dict[Any, frozenset[str]] = {v: t for v, t in zip(jaxpr.invars, in_taints) if t is not None}
    one_hot = _OneHot(field, manual)
    if seed is not None:  # a call's body: what is known of the call's operands
        one_hot.seed(jaxpr.invars, seed)
    for eqn in jaxpr.eqns:
        one_hot.see(eqn)
        deps = [v for v in eqn.invars if isinstance(v, core.Var) and v in taint]
        if not deps:
            continue
        body = call_body(eqn)
        ins = [taint.get(v) if isinstance(v, core.Var) else None for v in eqn.invars]
        inner: Taints | None = (taint_flow(body, ins, field, one_hot.facts(eqn.invars)) if body is not None
                                else _loop_flow(eqn, ins, field))
        if inner is not None:
            for o, t in zip(eqn.outvars, inner):
                if t is not None:
                    taint[o] = t - one_hot.axes(o)
            continue
        found = frozenset().union(*(taint[v] for v in deps))
        replicated_in = frozenset().union(*(manual - field.varying(v.aval) for v in deps))
        varying_out = frozenset().union(*(field.varying(o.aval) for o in eqn.outvars))
        found |= replicated_in & varying_out
        found |= _resolve.kernel_collective_axes(eqn, collective_axes)  # pl.kernel: its own casts aside
        for o in eqn.outvars:
            taint[o] = found - one_hot.axes(o)
    return [taint.get(v) if isinstance(v, core.Var) else None for v in jaxpr.outvars]


# Primitives whose output is zero wherever their (first) operand is: a one-hot
# mask stays one, and so does a zero. Elementwise or moving elements as they are.
_KEEPS_ZEROS = frozenset({"convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
                          "transpose", "slice", "copy", "copy_p", "neg", "real", "imag", "conj", "reduce_precision",
                          "pvary", "pcast", "pbroadcast"})


# What _OneHot knows of a value: (axes it is axis_index over, axes it is one-hot
# over, axes it is the same on every device along, whether it is all zeros).
Facts = tuple[frozenset[str] | None, frozenset[str], frozenset[str], bool]


class _OneHot:
    """Which values are nonzero on one device at most along an axis.

    Seen equation by equation (every one, not only those that depend on the
    cotangents: a mask does not): ``axis_index(a)`` compared for equality with a
    value the same on every device along ``a`` (a constant, a value replicated
    over ``a``) is true on one device along ``a`` for each element; a value
    multiplied by it (``mul``, ``and``), selected by it against zero
    (``select_n``, what ``jnp.where(mask, u, 0)`` binds), or moved or converted
    as it is (``_KEEPS_ZEROS``), stays zero elsewhere. Its psum over ``a`` then
    sums one device's value: no part is counted twice. (A non-finite ``u``
    gives NaN where masked, with or without checking.) recurrentgemma's
    sequence-sharded LRU scan masks its ``h0`` cotangent so
    (``multi_shard_correction(sync_h_last=False)``).
    """

    def __init__(self, field: TypeField, manual: frozenset[str]) -> None:
        self.field, self.manual = field, manual
        self.same: dict[Any, frozenset[str]] = {}  # the same on every device along these axes, typed or not
        self.index: dict[Any, frozenset[str]] = {}  # axis_index results (and integer casts of them)
        self.hot: dict[Any, frozenset[str]] = {}  # nonzero on one device at most along these axes
        self.zero: set[Any] = set()  # known to be all zeros

    def axes(self, var: Any) -> frozenset[str]:
        return self.hot.get(var, _NO_AXES)

    def facts(self, xs: Sequence[Any]) -> list[Facts] | None:
        """What is known of ``xs`` (a call's operands), or None if none is an index or a mask."""
        found = [(self.index.get(x) if isinstance(x, core.Var) else None, self._hot(x), self._same_along(x),
                  self._is_zero(x)) for x in xs]
        return found if any(f[0] or f[1] for f in found) else None

    def seed(self, xs: Sequence[Any], facts: Sequence[Facts]) -> None:
        for x, (index, hot, same, zero) in zip(xs, facts):
            if not isinstance(x, core.Var):
                continue
            if index:
                self.index[x] = index
            if hot:
                self.hot[x] = hot
            if same:
                self.same[x] = same
            if zero:
                self.zero.add(x)

    def _call(self, eqn: Any, body: Any) -> None:
        """A call (``jnp.where`` binds a ``jit`` of ``select_n``): its body seen with
        what is known of its operands, and what it finds of its results kept."""
        facts = self.facts(eqn.invars)
        if facts is None:
            return
        inner = _OneHot(self.field, self.manual)
        inner.seed(body.invars, facts)
        for e in body.eqns:
            inner.see(e)
        found = inner.facts(body.outvars) or []
        self.seed(eqn.outvars, found)

    def _is_zero(self, x: Any) -> bool:
        if isinstance(x, core.Literal):
            try:
                return bool(x.val == 0)
            except (TypeError, ValueError):
                return False
        return isinstance(x, core.Var) and x in self.zero

    def _same_along(self, x: Any) -> frozenset[str]:
        """The axes along which ``x`` is the same on every device: those its type is
        replicated over, and for a constant cast up (``pvary(0)``), every one."""
        if isinstance(x, core.Literal):
            return self.manual
        if not isinstance(x, core.Var):
            return _NO_AXES
        return self.same.get(x, _NO_AXES) | (self.manual - self.field.varying(x.aval))

    def _hot(self, x: Any) -> frozenset[str]:
        return self.hot.get(x, _NO_AXES) if isinstance(x, core.Var) else _NO_AXES

    def see(self, eqn: Any) -> None:
        name, ins, outs = eqn.primitive.name, eqn.invars, eqn.outvars
        body = call_body(eqn)
        if body is not None:
            self._call(eqn, body)
            return
        if name == "axis_index":
            names = eqn.params.get("axis_name")
            names = names if isinstance(names, (tuple, list)) else (names,)
            if all(isinstance(n, str) for n in names):
                self.index[outs[0]] = frozenset(names)
            return
        if not ins or len(outs) != 1 or not isinstance(ins[0], (core.Var, core.Literal)):
            return
        out, first = outs[0], ins[0]
        if name in _KEEPS_ZEROS:
            if name == "convert_element_type" and isinstance(first, core.Var) and first in self.index \
                    and _integer(out.aval):
                self.index[out] = self.index[first]
            if self._hot(first):
                self.hot[out] = self._hot(first)
            same = self._same_along(first)
            if same:
                self.same[out] = same
            if self._is_zero(first):
                self.zero.add(out)
        elif name == "eq" and len(ins) == 2:
            for i, other in ((ins[0], ins[1]), (ins[1], ins[0])):
                axes = self.index.get(i) if isinstance(i, core.Var) else None
                if axes and axes <= self._same_along(other):
                    self.hot[out] = axes
                    return
        elif name in ("mul", "and"):
            hot = frozenset().union(*(self._hot(x) for x in ins))
            if hot:
                self.hot[out] = hot
            if any(self._is_zero(x) for x in ins):
                self.zero.add(out)
        elif name == "select_n" and len(ins) >= 2:
            cases = ins[1:]
            hot = frozenset.intersection(*(self._hot(x) for x in cases))
            if len(cases) == 2 and self._is_zero(cases[0]):
                hot |= self._hot(first)  # pred ? u : 0 is nonzero only where pred is true
            if hot:
                self.hot[out] = hot
            if all(self._is_zero(x) for x in cases):
                self.zero.add(out)


def _integer(aval: Any) -> bool:
    kind = getattr(getattr(aval, "dtype", None), "kind", "")
    return kind in ("i", "u")


_LOOP_PASSES = 16  # a carry's taint only grows, over a few axes: a fixed point comes in a few passes


def _join(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    return a if b is None else b if a is None else a | b


def _loop_flow(eqn: Any, ins: Taints, field: TypeField) -> Taints | None:
    """The taints of a ``scan``'s or ``while``'s outputs, followed through its body
    with the carries' taints widened to a fixed point (a ``fori_loop`` accumulating a
    partial gradient from zeros), as a call's body is followed. Casts in the body of
    values that do not depend on the cotangents (reprules' widening of a loop carry,
    the loop's own constants) then taint nothing. None (judged as one opaque equation)
    where the loop's shape is not the expected one, a ``while``'s predicate depends on
    the cotangents, or no fixed point comes."""
    params, cond, cond_ins = eqn.params, None, ins[:0]
    body: Any = None
    if eqn.primitive.name == "scan":
        body, parts = getattr(params.get("jaxpr"), "jaxpr", None), _scan_parts(params, len(ins))
        if parts is None:
            return None
        consts, carry, xs = ([ins[i] for i in part] for part in parts)
    elif eqn.primitive.name == "while":
        body, cond = getattr(params.get("body_jaxpr"), "jaxpr", None), getattr(params.get("cond_jaxpr"), "jaxpr", None)
        nc, nb = params.get("cond_nconsts"), params.get("body_nconsts")
        if not hasattr(cond, "eqns") or not isinstance(nc, int) or not isinstance(nb, int):
            return None
        cond_ins, consts, carry, xs = ins[:nc], ins[nc:nc + nb], ins[nc + nb:], ins[:0]
    else:
        return None
    ncarry = len(carry)
    if (not hasattr(body, "eqns") or len(body.invars) != len(consts) + ncarry + len(xs)
            or len(body.outvars) != len(eqn.outvars)):
        return None
    for _ in range(_LOOP_PASSES):
        outs = taint_flow(body, [*consts, *carry, *xs], field)
        new = [_join(c, o) for c, o in zip(carry, outs[:ncarry])]
        if new == carry:
            if cond is not None and taint_flow(cond, [*cond_ins, *carry], field)[0] is not None:
                return None  # how many times it runs depends on the cotangents
            return [*carry, *outs[ncarry:]]
        carry = new
    return None


def _scan_parts(params: dict[str, Any], n: int) -> tuple[list[int], list[int], list[int]] | None:
    """The positions of a ``scan``'s consts, carry and xs among its ``n`` operands."""
    if "num_consts" in params:  # <= 0.11
        nc, nk = params["num_consts"], params["num_carry"]
        return list(range(nc)), list(range(nc, nc + nk)), list(range(nc + nk, n))
    try:  # 0.12: a flat tree of (consts, carry, xs)
        consts, carry, xs = params["ft_in"].update(list(range(n))).unpack()
        return list(consts), list(carry), list(xs)
    except Exception:  # noqa: BLE001 - another layout: judged as one opaque equation
        return None


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
