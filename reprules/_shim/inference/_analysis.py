"""The analysis behind inference: a kernel jaxpr in, what each of its refs ends up
depending on out (or a refusal naming the first equation that is not local).

A kernel that only computes on its own blocks is a pure function of its
inputs, so an output can only vary over the axes of the inputs it depends on.
This module proves that for one kernel jaxpr, or refuses:

* **Locality.** Every equation, recursively through ``cond``, ``while``,
  ``scan``, ``run_scoped`` and call-like primitives, must have a class in the
  effect model (``_effects``): JAX's array primitives, state reads and writes,
  Pallas' program ids, local DMAs and semaphores, the PRNG. Anything else
  refuses, naming the equation: reading device identity (``axis_index``),
  communicating (collectives, a DMA or semaphore with a ``device_id``, barrier
  semaphores), host callbacks, inline assembly, and every primitive reprules
  does not know. An unknown primitive is never assumed local.
* **Dataflow.** Each value and each ref carries the set of kernel operands it
  may depend on (its *taint*). A write adds the written value's taint, the
  index's, and the control taint of every enclosing ``cond`` predicate and
  ``while`` condition to the ref. The body is re-analysed until no ref's taint
  grows (the grid runs it many times; loops carry values around), so the
  result is a fixpoint.

Memory a kernel never writes (a scratch buffer or an output it leaves
unwritten) is treated as replicated, as JAX itself treats a fresh buffer.
Summaries are cached per kernel jaxpr (weakly), so a model that calls one
kernel many times analyses it once.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

from reprules._shim.plumbing import _jax
from reprules._shim.inference._equations import is_ref as _is_ref
from reprules._shim.inference._equations import is_type_cast as _is_type_cast
from reprules._shim.inference._equations import nested_jaxprs as _nested_jaxprs
from reprules._shim.inference._equations import written_operands as _written_operands
from reprules._shim.inference._effects import (
    DRAW, DRAWING_KEY_IMPLS, FRESH, KEYED, KNOWN_EFFECTS, OBSERVE, PURE, PURE_KEY_IMPLS, REFS, SEED, SEED_DRAW,
    SEEDING_KEY_IMPLS, tables,
)


Taint = frozenset[int]


_EMPTY: Taint = frozenset()


_DEVICE = -1  # a taint token: "differs per device" (the hidden PRNG state at kernel entry)


# What a refused equation does, for a MissingRuleError's advice (reprules._messages.advice.Finding).
IDENTITY, COMMUNICATION, CALLBACK, PRNG, UNKNOWN = "identity", "communication", "callback", "prng", "unknown"


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Why a kernel's rule cannot be derived: the first equation that is not local;
    ``kind`` what it does, ``axes`` the mesh axes it names (None: not known). ``survey``:
    every equation of the body that is not local (see :func:`survey`), or empty."""

    primitive: str
    reason: str
    where: str  # "file:line (function)" of the equation, or "" if unknown
    kind: str = UNKNOWN
    axes: tuple[str, ...] | None = None
    survey: tuple[Refusal, ...] = ()

    def describe(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"`{self.primitive}`{at} {self.reason}"


class _Refused(Exception):
    def __init__(self, refusal: Refusal):
        super().__init__(refusal.describe())
        self.refusal = refusal


def _where(eqn: Any) -> str:
    try:
        return str(_jax.source_info_util.summarize(eqn.source_info))
    except Exception:  # a summary is for messages only
        return ""


def _refuse(eqn: Any, reason: str, kind: str = UNKNOWN, axes: tuple[str, ...] | None = None) -> _Refused:
    return _Refused(Refusal(primitive=eqn.primitive.name, reason=reason, where=_where(eqn), kind=kind, axes=axes))


def _named_axes(params: dict[str, Any]) -> tuple[str, ...] | None:
    """The mesh axes an ``axis_index`` or collective equation names (``None``: none by name)."""
    value = params.get("axis_name", params.get("axes"))
    names = tuple(n for n in ((value,) if isinstance(value, str) else value or ()) if isinstance(n, str))
    return names or None


def _jaxpr_and_consts(value: Any) -> tuple[Any, Sequence[Any]]:
    """(Jaxpr, consts) of a Jaxpr or ClosedJaxpr."""
    if hasattr(value, "constvars"):  # a Jaxpr (a ClosedJaxpr has .eqns too)
        return value, ()
    return value.jaxpr, value.consts


class _Analysis:
    """Taints of the values and refs of one kernel jaxpr, to a fixpoint."""

    def __init__(self, own_axes: frozenset[str] = frozenset()) -> None:
        self.tables = tables()
        self.own_axes = own_axes  # the kernel's own mesh or grid axes (see own_axes())
        self.ref_taint: dict[int, Taint] = {}
        self.changed = False
        self._by_var: dict[Any, int] = {}
        # The hidden PRNG state's taint at this point of the body (flow-sensitive).
        self.prng: Taint = frozenset({_DEVICE})
        self.found: list[Refusal] | None = None  # surveying: what is not local, recorded, not refused

    def nonlocal_eqn(self, eqn: Any, reason: str, kind: str, axes: tuple[str, ...] | None = None) -> None:
        """An equation that is not local: refused, or recorded when surveying."""
        refused = _refuse(eqn, reason, kind, axes)
        if self.found is None:
            raise refused
        self.found.append(refused.refusal)

    # refs ------------------------------------------------------------------
    def new_ref(self, var: Any, taint: Taint = _EMPTY) -> int:
        """The buffer allocated at ``var``: one id for every pass over the body
        (so the fixpoint sees its taint grow, not a fresh buffer each time)."""
        rid = self._by_var.get(var)
        if rid is None:
            rid = self._by_var[var] = len(self._by_var) + 1
            self.ref_taint[rid] = taint
        else:
            self.write(rid, taint)
        return rid

    def write(self, ref: int, taint: Taint) -> None:
        old = self.ref_taint[ref]
        if not taint <= old:
            self.ref_taint[ref] = old | taint
            self.changed = True

    # one jaxpr ---------------------------------------------------------------
    def run(self, jaxpr: Any, env: dict[Any, Any], ctrl: Taint) -> list[Any]:
        """Analyses ``jaxpr`` once with ``env`` binding its in/const vars (a
        taint for values, ``("ref", id)`` for refs); returns its outputs' bindings."""
        for eqn in jaxpr.eqns:
            ins = [self.read(env, v) for v in eqn.invars]
            outs = self.eqn(eqn, ins, ctrl)
            for var, out in zip(eqn.outvars, outs):
                env[var] = out
        return [self.read(env, v) for v in jaxpr.outvars]

    @staticmethod
    def read(env: dict[Any, Any], var: Any) -> Any:
        if not hasattr(var, "aval") or type(var).__name__ == "Literal":
            return _EMPTY
        return env.get(var, _EMPTY)

    def taint_of(self, binding: Any) -> Taint:
        if isinstance(binding, tuple) and binding[:1] == ("ref",):
            return self.ref_taint[binding[1]]
        return binding  # type: ignore[no-any-return]

    def eqn(self, eqn: Any, ins: list[Any], ctrl: Taint) -> list[Any]:
        t = self.tables
        prim = eqn.primitive
        for effect in getattr(eqn, "effects", ()) or ():
            if type(effect).__name__ not in KNOWN_EFFECTS:
                self.nonlocal_eqn(eqn, f"carries the JAX effect {type(effect).__name__}, which reprules' "
                                       "effect model does not cover (it could hold state per device)", UNKNOWN)
        if prim in t["higher_order"]:
            return self.higher_order(eqn, ins, ctrl)
        if prim in t["identity"]:
            axis = eqn.params.get("axis_name")
            if prim.name == "axis_index" and axis in self.own_axes:
                return [ctrl]  # which core or grid step of this kernel: the same on every device
            named = _named_axes(eqn.params) if prim.name == "axis_index" else None
            on = (f"on mesh axis {axis!r}" if isinstance(axis, str) else
                  f"on mesh axes {named!r}" if named else "on a mesh axis")
            self.nonlocal_eqn(eqn, f"reads the device's identity (its index {on}), so its "
                                   "outputs can differ between devices with equal inputs", IDENTITY, named)
            kind = PURE
        elif prim in t["casts"]:
            kind = PURE
            if not _is_type_cast(eqn):
                self.nonlocal_eqn(eqn, "changes a value's sharding over mesh axes that are not manual, "
                                       "which can move data between devices", COMMUNICATION)
        elif prim in t["collectives"]:
            named = _named_axes(eqn.params)
            self.nonlocal_eqn(eqn, "communicates with other devices (a collective"
                              + (f" over {', '.join(map(repr, named))})" if named else ")"), COMMUNICATION, named)
            kind = PURE
        elif prim in t["barrier"]:
            self.nonlocal_eqn(eqn, "synchronises with other devices (a barrier semaphore)", COMMUNICATION)
            kind = PURE
        elif prim in t["callbacks"]:
            self.nonlocal_eqn(eqn, "calls back to the host, whose result reprules cannot see", CALLBACK)
            kind = PURE
        elif prim in t["remote_capable"]:
            self.check_no_device_id(eqn, t["remote_capable"][prim][0])
            kind = REFS
        elif prim in t["effect"]:
            kind = t["effect"][prim]
        else:
            self.nonlocal_eqn(eqn, "is not a primitive reprules knows to be local (it could "
                                   "communicate or read the device's identity)", UNKNOWN)
            kind = REFS
        for value in _nested_jaxprs(eqn.params):  # e.g. a reduction's computation
            self.check_local(value)
        is_ref = [isinstance(b, tuple) and b[:1] == ("ref",) for b in ins]
        if any(_is_ref(v) and not r for v, r in zip(eqn.invars, is_ref)):
            raise _refuse(eqn, "uses a reference inference cannot trace to its allocation")
        operands = frozenset().union(*(self.taint_of(b) for b in ins)) | ctrl
        if kind == KEYED:
            kind = self.key_kind(eqn)
        if kind in (SEED, SEED_DRAW):
            self.prng = operands  # a seed replaces the generator's state
        if kind in (DRAW, SEED_DRAW):
            if _DEVICE in self.prng:
                self.nonlocal_eqn(eqn, "draws from the TPU's hardware PRNG where no prng_seed in this "
                                   "kernel precedes it on every path: the generator's state at that "
                                   "point can differ per device (seed it first, from the kernel's "
                                   "inputs, in every grid step)", PRNG)
            self.prng = self.prng | ctrl  # the draw advances it; whether it ran is ctrl
            return [self.prng] * len(eqn.outvars)
        if kind == FRESH:
            # A fresh buffer (new_ref / mutable_array): its contents come from the operands.
            return [("ref", self.new_ref(v, operands)) if _is_ref(v) else operands for v in eqn.outvars]
        if any(_is_ref(v) for v in eqn.outvars):
            raise _refuse(eqn, "makes a new view of a reference, which inference does not track")
        if kind in (PURE, KEYED, OBSERVE, SEED) or not any(is_ref):
            return [operands] * len(eqn.outvars)
        # REFS: every ref it touches is read; the refs JAX marks written (Write or
        # Accum effect; all of them where it marks none) take what was read.
        written = _written_operands(eqn)
        for k, binding in enumerate(ins):
            if is_ref[k] and k in written:
                self.write(binding[1], operands)
        return [operands] * len(eqn.outvars)

    def key_kind(self, eqn: Any) -> str:
        """PURE, or SEED_DRAW / DRAW for the Pallas TPU keys (see the table above)."""
        impls = {getattr(getattr(getattr(v, "aval", None), "dtype", None), "_impl", None) for v in eqn.invars}
        names = {getattr(impl, "name", "?") for impl in impls if impl is not None}
        if eqn.primitive.name != "random_bits" or not names or names <= PURE_KEY_IMPLS:
            if names - PURE_KEY_IMPLS - SEEDING_KEY_IMPLS - DRAWING_KEY_IMPLS:
                raise _refuse(eqn, f"uses a PRNG key implementation ({', '.join(sorted(names))}) "
                                   "whose state reprules' effect model does not know")
            return PURE
        if names <= SEEDING_KEY_IMPLS:
            return SEED_DRAW
        if names <= DRAWING_KEY_IMPLS:
            return DRAW
        raise _refuse(eqn, f"draws with a PRNG key implementation ({', '.join(sorted(names))}) "
                           "whose state reprules' effect model does not know")

    def check_no_device_id(self, eqn: Any, position: int) -> None:
        tree = eqn.params.get("tree", eqn.params.get("args_tree"))
        try:
            if hasattr(tree, "unflatten"):
                parts = tree.unflatten(list(eqn.invars))
            else:
                parts = jax.tree_util.tree_unflatten(tree, list(eqn.invars))
            device_id = parts[position]
        except Exception:
            raise _refuse(eqn, "has operands reprules cannot read, so it could address another "
                               "device") from None
        if device_id is not None:
            self.nonlocal_eqn(eqn, "communicates with another device (it has a device_id)", COMMUNICATION)

    def check_local(self, value: Any) -> None:
        jaxpr, _ = _jaxpr_and_consts(value)
        env: dict[Any, Any] = {}
        for v in list(jaxpr.constvars) + list(jaxpr.invars):
            env[v] = ("ref", self.new_ref(v)) if _is_ref(v) else _EMPTY
        self.run(jaxpr, env, _EMPTY)

    # higher-order primitives --------------------------------------------------
    def call(self, value: Any, ins: Sequence[Any], ctrl: Taint, eqn: Any) -> list[Any]:
        """Runs a (closed) jaxpr whose invars take ``ins``, consts replicated."""
        jaxpr, consts = _jaxpr_and_consts(value)
        if len(jaxpr.invars) != len(ins):
            raise _refuse(eqn, "has a body whose inputs reprules cannot match to its operands")
        env: dict[Any, Any] = {}
        for v in jaxpr.constvars:
            env[v] = ("ref", self.new_ref(v)) if _is_ref(v) else _EMPTY
        env.update(zip(jaxpr.invars, ins))
        outs = self.run(jaxpr, env, ctrl)
        if any(isinstance(o, tuple) for o in outs):
            raise _refuse(eqn, "returns a reference from its body, which inference does not track")
        return outs

    def higher_order(self, eqn: Any, ins: list[Any], ctrl: Taint) -> list[Any]:
        name = eqn.primitive.name
        params = eqn.params
        if name == "cond":
            index = self.taint_of(ins[0])
            inner = ctrl | index  # writes in a branch depend on which branch ran
            outs = [_EMPTY] * len(eqn.outvars)
            before, states = self.prng, []
            for branch in params["branches"]:
                self.prng = before
                got = self.call(branch, ins[1:], inner, eqn)
                outs = [o | g for o, g in zip(outs, got)]
                states.append(self.prng)
            # The PRNG state after it: any branch's, and which branch ran if they differ.
            self.prng = frozenset().union(*states) | (inner if set(states) != {before} else _EMPTY)
            return [o | inner for o in outs]
        if name == "while":
            nc, nb = params["cond_nconsts"], params["body_nconsts"]
            cconsts, bconsts = ins[:nc], ins[nc:nc + nb]

            def while_step(carry: list[Any]) -> list[Any]:
                (pred,) = self.call(params["cond_jaxpr"], [*cconsts, *carry], ctrl, eqn)
                inner = ctrl | pred
                new = self.call(params["body_jaxpr"], [*bconsts, *carry], inner, eqn)
                self.prng |= inner  # how often the body drew depends on the condition
                return [c if isinstance(c, tuple) else c | n | inner for c, n in zip(carry, new)]

            return self.fixpoint(list(ins[nc + nb:]), while_step)
        if name == "scan":
            consts, carry, xs = self._scan_split(eqn, ins)
            ys: list[Taint] = []

            def scan_step(carry: list[Any]) -> list[Any]:
                outs = self.call(params["jaxpr"], [*consts, *carry, *xs], ctrl, eqn)
                new, ys_now = outs[:len(carry)], outs[len(carry):]
                ys[:] = ys_now if not ys else [a | b for a, b in zip(ys, ys_now)]
                return [c if isinstance(c, tuple) else c | n for c, n in zip(carry, new)]

            carry = self.fixpoint(carry, scan_step)
            return [*carry, *ys]
        if name == "parallel_loop":  # for i in range(lower, upper, step), iterations in any order
            try:
                lower, upper, step, consts, carry = params["tree"].unflatten(ins)
                jaxpr = params["jaxpr"]
                operands = [*jaxpr.constvars, *jaxpr.invars]  # the body takes (*consts, index, *carry)
                assert len(operands) == len(consts) + 1 + len(carry)
            except Exception:
                raise _refuse(eqn, "has operands reprules cannot split into bounds, consts and carry") from None
            # How many iterations run, and which index each sees, depends on the bounds.
            inner = ctrl | self.taint_of(lower) | self.taint_of(upper) | self.taint_of(step)

            def loop_step(carry: list[Any]) -> list[Any]:
                new = self.run(jaxpr, dict(zip(operands, [*consts, inner, *carry])), inner)
                if any(isinstance(o, tuple) for o in new):
                    raise _refuse(eqn, "returns a reference from its body, which inference does not track")
                return [c if isinstance(c, tuple) else c | n | inner for c, n in zip(carry, new)]

            return self.fixpoint(list(carry), loop_step)
        if name == "run_state":  # pl.run_state: values in, refs inside, final values out
            jaxpr = params["jaxpr"]
            if (not all(params.get("is_initialized", (True,))) or len(jaxpr.invars) != len(ins)
                    or len(eqn.outvars) != len(ins) or any(isinstance(b, tuple) for b in ins)):
                raise _refuse(eqn, "has operands reprules cannot match to its body's references")
            rids = [self.new_ref(v, self.taint_of(b) | ctrl) for v, b in zip(jaxpr.invars, ins)]
            self.run(jaxpr, {v: ("ref", rid) for v, rid in zip(jaxpr.invars, rids)}, ctrl)
            return [self.ref_taint[rid] | ctrl for rid in rids]
        if name == "call_hi_primitive":  # 0.12: a high-level op (pltpu.einshape); its meaning
            # is its lojax expansion, which is what runs: analyse that
            return self.call(_hi_expansion(eqn), ins, ctrl, eqn)
        if name == "run_scoped":
            if params.get("collective_axes"):
                self.nonlocal_eqn(eqn, "allocates memory shared across cores or devices "
                                       f"(collective_axes={params['collective_axes']})", COMMUNICATION)
            jaxpr = params["jaxpr"]
            if len(jaxpr.constvars) != len(ins):
                raise _refuse(eqn, "has a body whose inputs reprules cannot match to its operands")
            env: dict[Any, Any] = dict(zip(jaxpr.constvars, ins))
            for v in jaxpr.invars:  # the scoped allocations: fresh, never written yet
                env[v] = ("ref", self.new_ref(v)) if _is_ref(v) else _EMPTY
            outs = self.run(jaxpr, env, ctrl)
            if any(isinstance(o, tuple) for o in outs):
                raise _refuse(eqn, "returns a reference from its body, which inference does not track")
            return outs
        # Call-like: operands map to the body's inputs, outputs to its outputs.
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            if key in params and params[key] is not None:
                return self.call(params[key], ins, ctrl, eqn)
        raise _refuse(eqn, "has a body reprules cannot find")

    def fixpoint(self, carry: list[Any], step: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """Runs a loop body (``step``: carry in, carry out) until neither its carry
        nor any ref's taint grows: the loop may run any number of times."""
        while True:  # the PRNG state is carried too: each pass starts from the join so far
            before, prng_before, outer_changed = tuple(carry), self.prng, self.changed
            self.changed = False
            carry = step(carry)
            self.prng = prng_before | self.prng
            grew = self.changed or tuple(carry) != before or self.prng != prng_before
            self.changed = self.changed or outer_changed
            if not grew:
                return carry

    @staticmethod
    def _scan_split(eqn: Any, ins: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        params = eqn.params
        if "num_consts" in params:  # <= 0.11
            nc, nk = params["num_consts"], params["num_carry"]
            return ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
        ft_in = params.get("ft_in")  # 0.12: a flat tree of (consts, carry, xs)
        try:
            positions = ft_in.update(list(range(len(ins)))).unpack()
            consts, carry, xs = ([ins[i] for i in part] for part in positions)
        except Exception:
            raise _refuse(eqn, "has operands reprules cannot split into consts, carry and xs") from None
        return consts, carry, xs


def _hi_expansion(eqn: Any) -> Any:
    """The jaxpr of a ``call_hi_primitive`` equation's lojax expansion (``_prim.expand``)."""
    hi = eqn.params.get("_prim")
    try:
        def expanded(*flat: Any) -> Any:
            return jax.tree_util.tree_leaves(hi.expand(*jax.tree_util.tree_unflatten(hi.in_tree, flat)))

        return jax.make_jaxpr(expanded)(*(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars))
    except Exception as err:
        raise _refuse(eqn, f"is a high-level op ({type(hi).__name__}) whose expansion reprules could not "
                           f"trace ({type(err).__name__}), so its dataflow is unknown") from None


@dataclasses.dataclass(frozen=True, slots=True)
class _Summary:
    """Per kernel invar that is a ref: the kernel invars its final contents depend on."""

    ref_depends: tuple[Taint | None, ...]  # None for invars that are not refs


SameMemory = tuple[frozenset[int], ...]
"""Groups of operand positions that are one buffer (an input aliased to an output)."""


BlockReads = tuple[tuple[int, frozenset[int]], ...]
"""Per block-mapped operand position, the scalar-prefetch operand positions its index map reads."""


def summarize(jaxpr: Any, same_memory: SameMemory = (),
              kernel_axes: frozenset[str] = frozenset(), block_reads: BlockReads = ()) -> _Summary | Refusal:
    """What each ref invar of a kernel jaxpr holds at the end, in terms of the
    initial contents of the kernel's invars (token ``k`` for invar ``k``).

    The operands are the jaxpr's constvars, then its invars: a ``pl.kernel``
    body traced by ``pl.core_map`` (JAX 0.8 - 0.9) takes its refs as constvars
    and its scratch buffers (0.9) as invars. The refs of each group in
    ``same_memory`` are one buffer on the device (``input_output_aliases``): a
    write through either is seen through both, so they are analysed as one.
    ``axis_index`` over one of ``kernel_axes`` (from :func:`own_axes`) is local.
    Operand ``k`` of ``block_reads`` holds, in every grid step, the block its
    index map picks from the prefetch refs it reads: their contents, written
    by the body too, reach it."""
    key = (same_memory, kernel_axes, block_reads)
    with _cache_lock:
        try:
            cached = _cache.get(jaxpr, {}).get(key)
        except TypeError:
            cached = None
    if cached is not None:
        return cached
    result = _summarize(jaxpr, same_memory, kernel_axes, block_reads)
    with _cache_lock:
        try:
            _cache.setdefault(jaxpr, {})[key] = result
        except TypeError:  # not weak-referenceable: analysed again next time
            pass
    return result


_cache: weakref.WeakKeyDictionary[Any, dict[tuple[SameMemory, frozenset[str], BlockReads], _Summary | Refusal]] = (
    weakref.WeakKeyDictionary())


_cache_lock = threading.Lock()


def _summarize(jaxpr: Any, same_memory: SameMemory, kernel_axes: frozenset[str],
               block_reads: BlockReads) -> _Summary | Refusal:
    analysis = _Analysis(kernel_axes)
    env: dict[Any, Any] = {}
    ref_ids: list[int | None] = []
    operands = [*jaxpr.constvars, *jaxpr.invars]
    if any(k >= len(operands) or not _is_ref(operands[k]) for group in same_memory for k in group):
        # Analysed apart, a write through one would not reach the other: refuse, never guess.
        return Refusal("input_output_aliases", "pairs an input with an output whose kernel operands "
                       "are not both references, which inference does not track", "")
    group_of = {k: group for group in same_memory for k in group}
    shared: dict[frozenset[int], int] = {}  # one buffer per group
    for k, v in enumerate(operands):
        if _is_ref(v):
            group = group_of.get(k)
            if group is not None:
                if group not in shared:
                    shared[group] = analysis.new_ref(v, frozenset(group))
                rid = shared[group]
            else:
                rid = analysis.new_ref(v, frozenset({k}))
            env[v] = ("ref", rid)
            ref_ids.append(rid)
        else:
            env[v] = frozenset({k})
            ref_ids.append(None)
    end_prng: Taint = _EMPTY
    try:
        while True:  # the grid runs the body again and again
            analysis.changed = False
            for k, prefetch in block_reads:  # which block the body sees depends on these refs
                analysis.write(env[operands[k]][1], frozenset().union(
                    *(analysis.ref_taint[env[operands[p]][1]] for p in prefetch)))
            # Each step starts with what the last left in the PRNG, or (first step, another
            # core) what the generator held before the kernel: "differs per device".
            analysis.prng = end_prng | {_DEVICE}
            analysis.run(jaxpr, dict(env), _EMPTY)
            if not analysis.changed and analysis.prng <= end_prng | {_DEVICE}:
                break
            end_prng |= analysis.prng
    except _Refused as refused:
        return survey(refused.refusal, jaxpr, kernel_axes)
    return _Summary(tuple(None if r is None else analysis.ref_taint[r] for r in ref_ids))


def survey(first: Refusal, jaxpr: Any, kernel_axes: frozenset[str] = frozenset()) -> Refusal:
    """``first`` with every equation of ``jaxpr`` that is not local (one pass recording them) in
    its ``survey``, for advice that covers the whole body; it ends where the pass cannot go on."""
    analysis = _Analysis(kernel_axes)
    analysis.found = []
    try:
        analysis.check_local(jaxpr)  # every equation once; what flows where does not matter here
    except _Refused as refused:
        analysis.found.append(refused.refusal)
    except Exception as err:  # advice only: never worse than no survey
        analysis.found.append(Refusal(first.primitive, f"could not be surveyed ({type(err).__name__})", ""))
    return dataclasses.replace(first, survey=tuple(dict.fromkeys(analysis.found)) or (first,))


def _used_invars(jaxpr: Any, skip: int) -> frozenset[int]:
    """The positions (counted after the first ``skip``) of the invars ``jaxpr`` reads."""
    position = {v: k - skip for k, v in enumerate(jaxpr.invars) if k >= skip}
    used = [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars)
    # Literals: unhashable (0.12)
    return frozenset(position[v] for v in used if type(v).__name__ != "Literal" and v in position)


def index_map_reads(index_map: Any, kernel_axes: frozenset[str], num_grid: int) -> frozenset[int] | Refusal:
    """The operands (after the ``num_grid`` grid indices: the scalar-prefetch refs)
    a block index map reads, or why it is not local."""
    try:
        _Analysis(kernel_axes).check_local(index_map)
    except _Refused as refused:
        return survey(refused.refusal, index_map, kernel_axes)
    return _used_invars(_jaxpr_and_consts(index_map)[0], skip=num_grid)
