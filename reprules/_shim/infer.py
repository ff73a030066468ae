"""Rules derived from a Pallas kernel's body (``reprules.inference()``).

A kernel that only computes on its own blocks is a pure function of its
inputs, so an output can only vary over the axes of the inputs it depends on.
This module proves that for one kernel jaxpr, or refuses:

* **Locality.** Every equation, recursively through ``cond``, ``while``,
  ``scan``, ``run_scoped`` and call-like primitives, must be one reprules knows
  to be local: JAX's array primitives (``jax._src.lax``), state reads and
  writes, Pallas' program ids, local DMAs and semaphores. Anything else
  refuses, naming the equation: reading device identity (``axis_index``),
  communicating (collectives, a DMA or semaphore with a ``device_id``, barrier
  semaphores), host callbacks, inline assembly, and every primitive reprules
  does not know. An unknown primitive is never assumed local.
* **Dataflow.** Each value and each ref carries the set of kernel operands it
  may depend on (its *taint*). A write adds the written value's taint, the
  index's, and the control taint of every enclosing ``cond`` predicate and
  ``while`` condition to the ref. The body is re-analysed until no ref's taint
  grows (the grid runs it many times; loops carry values around), so the
  result is a fixpoint. Output ``i`` then depends on the taint of its output
  ref, its aliased input (``input_output_aliases``), and every scalar-prefetch
  operand if any block index map reads one (which block is read depends on it).

Memory a kernel never writes (a scratch buffer or an output it leaves
unwritten) is treated as replicated, as JAX itself treats a fresh buffer.

Summaries are cached per kernel jaxpr (weakly), so a model that calls one
kernel many times analyses it once.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from reprules import _decide
from reprules._errors import fmt_axes
from reprules._registry import Registration
from reprules.rules import Decision, RuleContext, VaryingSet

Taint = frozenset[int]
_EMPTY: Taint = frozenset()
_DEVICE = -1  # a taint token: "differs per device" (the hidden PRNG state at kernel entry)


# -- results -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """Why a kernel's rule cannot be derived: the first equation that is not local."""

    primitive: str
    reason: str
    where: str  # "file:line (function)" of the equation, or "" if unknown

    def describe(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"`{self.primitive}`{at} {self.reason}"


@dataclasses.dataclass(frozen=True, slots=True)
class InferredRule:
    """The rule derived for one kernel: output ``i`` varies over the union of
    the varying sets of the inputs in ``depends_on[i]``.

    The rule is given every operand of the ``pallas_call``: first those JAX
    passes before the user's inputs (dynamic grid bounds, on which every
    output depends, since they decide which grid steps run), then the
    ``num_user`` user inputs that ``depends_on`` indexes. Inputs are cast up
    only as far as the outputs that depend on them vary (so a replicated
    weight feeding a data-varying output is cast to ``{data}``, whose
    transpose is the psum its gradient needs).
    """

    depends_on: tuple[frozenset[int], ...]
    num_user: int

    def __call__(self, ctx: RuleContext, in_varying: tuple[VaryingSet, ...], /) -> Decision:
        lead = len(in_varying) - self.num_user
        leading = frozenset().union(*in_varying[:lead])
        outputs = tuple(
            leading.union(*(in_varying[lead + j] for j in deps)) for deps in self.depends_on
        )
        inputs = in_varying[:lead] + tuple(
            vary.union(*(out for out, deps in zip(outputs, self.depends_on) if j in deps))
            for j, vary in enumerate(in_varying[lead:])
        )
        return Decision(outputs=outputs, inputs=inputs)

    def __repr__(self) -> str:
        parts = [f"out{i} <- {sorted(d) if d else 'none'}" for i, d in enumerate(self.depends_on)]
        return f"inferred({'; '.join(parts)})"


_decide.register_pure_rule(InferredRule)  # its decisions join the bounded decision cache


def rule_operands_start(reg: Any, first_user: int) -> int:
    """Where the operands a rule is given start: every operand for a derived
    rule (see :class:`InferredRule`), the user's inputs for a registered one."""
    return 0 if isinstance(reg.rule, InferredRule) else first_user


# -- the effect model ------------------------------------------------------------
#
# Every primitive inference accepts has exactly one class below; a primitive with
# no class is refused, and so is an equation carrying a JAX effect the model does
# not know (_KNOWN_EFFECTS). The docs' inference page has this table in prose.
#
# | class   | outputs depend on                       | writes                                     |
# |---------|-----------------------------------------|--------------------------------------------|
# | PURE    | its operands                            | nothing                                    |
# | REFS    | its operands and its refs' contents     | each ref JAX marks written (a Write or     |
# |         |                                         | Accum effect), or every ref if JAX marks   |
# |         |                                         | none: with the operands and refs read      |
# | FRESH   | (a new ref) its operands                | the new ref                                |
# | OBSERVE | (no outputs: printing, tracing, checks) | nothing                                    |
# | SEED    | (no outputs)                            | the hidden PRNG state, from its operands   |
# | DRAW    | the hidden PRNG state                   | the PRNG state (it advances)               |
# | KEYED   | a PRNG key's data; for a `pallas_tpu`   | for `pallas_tpu` keys: SEED then DRAW      |
# |         | key the hardware PRNG it seeds          | (JAX lowers them to prng_seed + bits)      |
#
# The hidden PRNG state is one implicit ref threaded through the body in program
# order (a seed replaces it, a branch joins it, a loop and the grid carry it). At
# kernel entry it holds a token that means "differs per device" (each TPU core's
# generator holds what it held), so a draw that no seed dominates is refused.
# Scalar-prefetch refs are ordinary refs; what the body writes into them reaches
# every block whose index map reads them (see summarize's ``block_reads``).

PURE, REFS, FRESH, OBSERVE, SEED, DRAW, KEYED = "pure", "refs", "fresh", "observe", "seed", "draw", "keyed"
SEED_DRAW = "seed+draw"  # what KEYED means for random_bits of a pallas_tpu key

# Whole modules of JAX's own array primitives: pure functions of their operands,
# no device identity, no communication (collectives live in lax.parallel).
_PURE_MODULES = (
    "jax._src.lax.lax",
    "jax._src.lax.slicing",
    "jax._src.lax.special",
    "jax._src.lax.convolution",
    "jax._src.lax.windowed_reductions",
    "jax._src.lax.fft",
    "jax._src.lax.linalg",
    "jax._src.lax.ann",
    "jax._src.ad_util",
)
# ... minus those that read per-device state or whose meaning reprules has not checked.
_NOT_PURE_IN_MODULES = frozenset({"infeed", "outfeed", "rng_uniform", "stage"})
# PRNG key primitives (<= 0.9 in jax._src.prng, from 0.10 the next three): KEYED.
_KEYED_MODULES = ("jax._src.prng", "jax._src.random.prng", "jax._src.random.threefry2x32",
                  "jax._src.random.core")
# Key implementations whose primitives are pure functions of the key's data ...
_PURE_KEY_IMPLS = frozenset({"threefry2x32", "rbg", "unsafe_rbg"})
# ... and the Pallas TPU ones: random_bits seeds the core's generator with the key
# and draws (pallas_tpu), or only draws (the stateful samplers' internal impl).
_SEEDING_KEY_IMPLS = frozenset({"pallas_tpu"})
_DRAWING_KEY_IMPLS = frozenset({"_pallas_internal_stateful"})

# Named primitives elsewhere, as (module, attribute, class).
_NAMED = (
    ("jax._src.lax.control_flow.loops", "cumsum_p", PURE),
    ("jax._src.lax.control_flow.loops", "cumprod_p", PURE),
    ("jax._src.lax.control_flow.loops", "cummax_p", PURE),
    ("jax._src.lax.control_flow.loops", "cummin_p", PURE),
    ("jax._src.lax.control_flow.loops", "cumlogsumexp_p", PURE),
    ("jax._src.lax.control_flow.conditionals", "platform_index_p", PURE),
    ("jax._src.random", "random_gamma_p", KEYED),
    ("jax._src.random", "random_clone_p", KEYED),
    ("jax._src.custom_derivatives", "stop_gradient_p", PURE),
    ("jax._src.ad_checkpoint", "name_p", PURE),
    ("jax._src.ad_checkpoint", "optimization_barrier_p", PURE),
    ("jax._src.debugging", "debug_callback_p", OBSERVE),  # no outputs: values cannot flow out
    ("jax._src.debugging", "debug_print_p", OBSERVE),
    ("jax._src.checkify", "check_p", OBSERVE),  # pl.debug_check: fails the program, returns nothing
    ("jax._src.core", "mutable_array_p", FRESH),
    ("jax._src.core", "new_ref_p", FRESH),
    ("jax._src.core", "empty_ref_p", FRESH),
    ("jax._src.core", "freeze_p", REFS),
    ("jax._src.state.primitives", "get_p", REFS),
    ("jax._src.state.primitives", "swap_p", REFS),
    ("jax._src.state.primitives", "addupdate_p", REFS),
    ("jax._src.state.primitives", "broadcast_to_p", PURE),
    ("jax._src.pallas.primitives", "program_id_p", PURE),
    ("jax._src.pallas.primitives", "num_programs_p", PURE),
    ("jax._src.pallas.primitives", "load_p", REFS),
    ("jax._src.pallas.primitives", "swap_p", REFS),
    ("jax._src.pallas.primitives", "masked_load_p", REFS),
    ("jax._src.pallas.primitives", "masked_swap_p", REFS),
    # SparseCore (0.9+): vector ops within one subcore's registers ("all_reduce" here is
    # across a vector's lanes), and its own memory reads and writes.
    *(("jax._src.pallas.mosaic.sc_primitives", name, PURE) for name in (
        "scan_count_p", "masked_cummax_p", "masked_cummin_p", "masked_cumsum_p", "masked_sort_p",
        "pack_p", "unpack_p", "all_reduce_population_count_p", "all_reduce_ffs_p")),
    *(("jax._src.pallas.mosaic.sc_primitives", name, REFS) for name in (
        "load_p", "swap_p", "gather_p", "scatter_p")),
    ("jax._src.pallas.primitives", "atomic_rmw_p", REFS),  # atomic within this device's memory
    ("jax._src.pallas.primitives", "atomic_cas_p", REFS),
    ("jax._src.pallas.primitives", "max_contiguous_p", PURE),
    ("jax._src.pallas.primitives", "multiple_of_p", PURE),
    ("jax._src.pallas.primitives", "reciprocal_p", PURE),
    ("jax._src.pallas.primitives", "debug_print_p", OBSERVE),
    ("jax._src.pallas.primitives", "delay_p", OBSERVE),
    ("jax._src.pallas.primitives", "semaphore_read_p", REFS),
    ("jax._src.pallas.primitives", "semaphore_wait_p", REFS),
    ("jax._src.pallas.mosaic.primitives", "semaphore_read_p", REFS),  # 0.4.x - 0.5
    ("jax._src.pallas.mosaic.primitives", "semaphore_wait_p", REFS),
    ("jax._src.pallas.mosaic.primitives", "bitcast_p", PURE),
    ("jax._src.pallas.mosaic.primitives", "roll_p", PURE),
    ("jax._src.pallas.mosaic.primitives", "repeat_p", PURE),
    ("jax._src.pallas.mosaic.primitives", "delay_p", OBSERVE),
    ("jax._src.pallas.mosaic.primitives", "trace_value_p", OBSERVE),  # 0.9+: annotates a profile
    ("jax._src.pallas.mosaic.primitives", "prng_seed_p", SEED),
    ("jax._src.pallas.mosaic.primitives", "prng_random_bits_p", DRAW),
    ("jax._src.pallas.mosaic.primitives", "stochastic_round_p", PURE),  # its random bits are an operand
    ("jax._src.pallas.mosaic.primitives", "pack_elementwise_p", PURE),
    ("jax._src.pallas.mosaic.primitives", "unpack_elementwise_p", PURE),
    ("jax._src.pallas.mosaic.primitives", "with_memory_space_constraint_p", PURE),
    ("jax._src.pallas.einshape", "einshape_lo_p", PURE),  # 0.12: pltpu.einshape, a reshape/transpose
    ("jax._src.pallas.triton.primitives", "atomic_rmw_p", REFS),
    ("jax._src.pallas.triton.primitives", "atomic_cas_p", REFS),
    ("jax._src.pallas.triton.primitives", "max_contiguous_p", PURE),
)
# REFS only without a device_id: (module, attribute, where device_id sits in the unflattened operands).
_REMOTE_CAPABLE = (
    ("jax._src.pallas.mosaic.primitives", "dma_start_p", -1),
    ("jax._src.pallas.mosaic.primitives", "dma_wait_p", -1),
    ("jax._src.pallas.primitives", "semaphore_signal_p", 3),
    ("jax._src.pallas.mosaic.primitives", "semaphore_signal_p", 3),
)
_IDENTITY = (
    ("jax._src.lax.parallel", "axis_index_p"),
    ("jax._src.pallas.mosaic.primitives", "device_id_p"),
)
_BARRIER = (("jax._src.pallas.mosaic.primitives", "get_barrier_semaphore_p"),)
_CALLBACKS = (
    ("jax._src.callback", "pure_callback_p"),
    ("jax._src.callback", "io_callback_p"),
)
# JAX effects (by class name) the model covers: on refs (RefEffect, tracked by the
# dataflow), the PRNG's (SEED/DRAW), and those of OBSERVE primitives and fresh refs.
# NamedAxisEffect marks equations naming a mesh axis, whose primitives are checked by
# name (axis_index, collectives). Any other effect refuses.
_KNOWN_EFFECTS = frozenset({
    "ReadEffect", "WriteEffect", "AccumEffect", "PRNGEffect", "TraceEffect", "DebugEffect",
    "OrderedDebugEffect", "DelayEffect", "SemaphoreEffect", "InternalMutableArrayEffect",
    "NamedAxisEffect", "ErrorEffect",
})


def _resolve(names: Iterable[tuple[Any, ...]]) -> dict[Any, tuple[Any, ...]]:
    import importlib

    from jax._src import core

    found: dict[Any, tuple[Any, ...]] = {}
    for module_name, attr, *rest in names:
        try:
            prim = getattr(importlib.import_module(module_name), attr, None)
        except ImportError:
            continue
        if isinstance(prim, core.Primitive):
            found[prim] = tuple(rest)
    return found


def _module_primitives(module_names: Iterable[str]) -> list[Any]:
    import importlib

    from jax._src import core

    found = []
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found += [v for v in vars(module).values() if isinstance(v, core.Primitive)]
    return found


@functools.cache
def _tables() -> dict[str, dict[Any, Any]]:
    from jax._src import core

    effect: dict[Any, str] = {p: PURE for p in _module_primitives(_PURE_MODULES)
                              if p.name not in _NOT_PURE_IN_MODULES}
    effect.update({p: KEYED for p in _module_primitives(_KEYED_MODULES)})
    effect.update({p: rest[0] for p, rest in _resolve(_NAMED).items()})
    collectives = {p: () for p in _module_primitives(("jax._src.lax.parallel",))}
    casts = _resolve((("jax._src.pjit", "reshard_p"),))  # 0.10+: checked per equation
    if isinstance(getattr(core, "pvary_p", None), core.Primitive):  # 0.6 - 0.9
        casts[core.pvary_p] = ()
    identity = _resolve(_IDENTITY)
    return {
        "effect": effect,
        "remote_capable": _resolve(_REMOTE_CAPABLE),
        "identity": identity,
        "collectives": {p: () for p in collectives if p not in identity and p not in casts},
        "casts": casts,
        "barrier": _resolve(_BARRIER),
        "callbacks": _resolve(_CALLBACKS),
        "higher_order": _resolve((
            ("jax._src.lax.control_flow.conditionals", "cond_p"),
            ("jax._src.lax.control_flow.loops", "while_p"),
            ("jax._src.lax.control_flow.loops", "scan_p"),
            ("jax._src.pallas.primitives", "run_scoped_p"),
            ("jax._src.pallas.mosaic.primitives", "run_scoped_p"),  # 0.4.x
            ("jax._src.state.discharge", "run_state_p"),  # pl.run_state
            ("jax._src.pjit", "pjit_p"),
            ("jax._src.pjit", "jit_p"),
            ("jax._src.core", "closed_call_p"),
            ("jax._src.core", "call_p"),
            ("jax._src.ad_checkpoint", "remat_p"),
            ("jax._src.custom_derivatives", "custom_jvp_call_p"),
            ("jax._src.custom_derivatives", "custom_vjp_call_p"),
            ("jax._src.custom_derivatives", "custom_vjp_call_jaxpr_p"),
            ("jax._src.lax.lax", "composite_p"),
            ("jax._src.pallas.mosaic.sc_primitives", "parallel_loop_p"),  # SparseCore, 0.9+
            ("jax._src.hijax", "call_hi_primitive_p"),  # 0.12: pltpu.einshape and other hi ops
        )),
    }


def effect_table() -> dict[str, str]:
    """The effect class of every primitive inference accepts on this JAX, by
    primitive name (``"module:name"`` where two modules share a name): for the
    docs and for a reviewer."""
    table: dict[str, str] = {}
    for prim, kind in _tables()["effect"].items():
        table[prim.name] = kind if table.get(prim.name, kind) == kind else f"{table[prim.name]}|{kind}"
    for prim in _tables()["remote_capable"]:
        table[prim.name] = f"{REFS} (without a device_id)"
    return dict(sorted(table.items()))


# -- the analysis --------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, refusal: Refusal):
        super().__init__(refusal.describe())
        self.refusal = refusal


def _where(eqn: Any) -> str:
    try:
        from jax._src import source_info_util

        return str(source_info_util.summarize(eqn.source_info))
    except Exception:  # a summary is for messages only
        return ""


def _refuse(eqn: Any, reason: str) -> _Refused:
    return _Refused(Refusal(primitive=eqn.primitive.name, reason=reason, where=_where(eqn)))


def _is_ref(var: Any) -> bool:
    from jax._src.state import types as state_types

    return isinstance(getattr(var, "aval", None), state_types.AbstractRef)


def _jaxpr_and_consts(value: Any) -> tuple[Any, Sequence[Any]]:
    """(Jaxpr, consts) of a Jaxpr or ClosedJaxpr."""
    if hasattr(value, "constvars"):  # a Jaxpr (a ClosedJaxpr has .eqns too)
        return value, ()
    return value.jaxpr, value.consts


class _Analysis:
    """Taints of the values and refs of one kernel jaxpr, to a fixpoint."""

    def __init__(self, own_axes: frozenset[str] = frozenset()) -> None:
        self.tables = _tables()
        self.own_axes = own_axes  # the kernel's own mesh or grid axes (see own_axes())
        self.ref_taint: dict[int, Taint] = {}
        self.changed = False
        self._by_var: dict[Any, int] = {}
        # The hidden PRNG state's taint at this point of the body (flow-sensitive).
        self.prng: Taint = frozenset({_DEVICE})

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
            if type(effect).__name__ not in _KNOWN_EFFECTS:
                raise _refuse(eqn, f"carries the JAX effect {type(effect).__name__}, which reprules' "
                                   "effect model does not cover (it could hold state per device)")
        if prim in t["higher_order"]:
            return self.higher_order(eqn, ins, ctrl)
        if prim in t["identity"]:
            axis = eqn.params.get("axis_name")
            if prim.name == "axis_index" and axis in self.own_axes:
                return [ctrl]  # which core or grid step of this kernel: the same on every device
            on = f"on mesh axis {axis!r}" if isinstance(axis, str) else "on a mesh axis"
            raise _refuse(eqn, f"reads the device's identity (its index {on}), so its "
                               "outputs can differ between devices with equal inputs")
        if prim in t["casts"]:
            if not _is_type_cast(eqn):
                raise _refuse(eqn, "changes a value's sharding over mesh axes that are not manual, "
                                   "which can move data between devices")
            kind = PURE
        elif prim in t["collectives"]:
            raise _refuse(eqn, "communicates with other devices (a collective)")
        elif prim in t["barrier"]:
            raise _refuse(eqn, "synchronises with other devices (a barrier semaphore)")
        elif prim in t["callbacks"]:
            raise _refuse(eqn, "calls back to the host, whose result reprules cannot see")
        elif prim in t["remote_capable"]:
            self.check_no_device_id(eqn, t["remote_capable"][prim][0])
            kind = REFS
        elif prim in t["effect"]:
            kind = t["effect"][prim]
        else:
            raise _refuse(eqn, "is not a primitive reprules knows to be local (it could "
                               "communicate or read the device's identity)")
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
                raise _refuse(eqn, "draws from the TPU's hardware PRNG where no prng_seed in this "
                                   "kernel precedes it on every path: the generator's state at that "
                                   "point can differ per device (seed it first, from the kernel's "
                                   "inputs, in every grid step)")
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
        if eqn.primitive.name != "random_bits" or not names or names <= _PURE_KEY_IMPLS:
            if names - _PURE_KEY_IMPLS - _SEEDING_KEY_IMPLS - _DRAWING_KEY_IMPLS:
                raise _refuse(eqn, f"uses a PRNG key implementation ({', '.join(sorted(names))}) "
                                   "whose state reprules' effect model does not know")
            return PURE
        if names <= _SEEDING_KEY_IMPLS:
            return SEED_DRAW
        if names <= _DRAWING_KEY_IMPLS:
            return DRAW
        raise _refuse(eqn, f"draws with a PRNG key implementation ({', '.join(sorted(names))}) "
                           "whose state reprules' effect model does not know")

    def check_no_device_id(self, eqn: Any, position: int) -> None:
        tree = eqn.params.get("tree", eqn.params.get("args_tree"))
        try:
            if hasattr(tree, "unflatten"):
                parts = tree.unflatten(list(eqn.invars))
            else:
                from jax import tree_util

                parts = tree_util.tree_unflatten(tree, list(eqn.invars))
            device_id = parts[position]
        except Exception:
            raise _refuse(eqn, "has operands reprules cannot read, so it could address another "
                               "device") from None
        if device_id is not None:
            raise _refuse(eqn, "communicates with another device (it has a device_id)")

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
                raise _refuse(eqn, "allocates memory shared across cores or devices "
                                   f"(collective_axes={params['collective_axes']})")
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
    import jax

    hi = eqn.params.get("_prim")
    try:
        def expanded(*flat: Any) -> Any:
            return jax.tree_util.tree_leaves(hi.expand(*jax.tree_util.tree_unflatten(hi.in_tree, flat)))

        return jax.make_jaxpr(expanded)(*(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars))
    except Exception as err:
        raise _refuse(eqn, f"is a high-level op ({type(hi).__name__}) whose expansion reprules could not "
                           f"trace ({type(err).__name__}), so its dataflow is unknown") from None


def _is_type_cast(eqn: Any) -> bool:
    """Whether a ``pvary`` or ``reshard`` equation only changes the type of a value
    (which manual axes it is said to vary over), never the value: ``pvary``
    (0.6 - 0.9), and ``reshard`` to a mesh whose axes are all manual with a spec
    naming none (how JAX 0.10+ casts an operand up where types mix under
    checking, e.g. in a kernel body reading a replicated operand)."""
    if eqn.primitive.name == "pvary":
        return True
    target = eqn.params.get("dst_sharding")
    mesh, spec = getattr(target, "mesh", None), getattr(target, "spec", None)
    types = getattr(mesh, "axis_types", None)
    if not types or spec is None:
        return False
    return (all(getattr(kind, "name", "") == "Manual" for kind in types)
            and all(part is None for part in spec)
            and not getattr(spec, "unreduced", None) and not getattr(spec, "reduced", None))


def _written_operands(eqn: Any) -> frozenset[int]:
    """The operand positions a REFS equation may write: those JAX marks with a
    Write or Accum effect, and every ref operand it marks with no effect at all
    (no mark is no proof of a read-only use)."""
    marked: dict[int, set[str]] = {}
    for effect in getattr(eqn, "effects", ()) or ():
        index = getattr(effect, "input_index", None)
        if isinstance(index, int):
            marked.setdefault(index, set()).add(type(effect).__name__)
    return frozenset(
        k for k, var in enumerate(eqn.invars)
        if _is_ref(var) and (k not in marked or marked[k] & {"WriteEffect", "AccumEffect"})
    )


def _nested_jaxprs(params: dict[str, Any]) -> list[Any]:
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                found.append(item)
    return found


@dataclasses.dataclass(frozen=True, slots=True)
class _Summary:
    """Per kernel invar that is a ref: the kernel invars its final contents depend on."""

    ref_depends: tuple[Taint | None, ...]  # None for invars that are not refs


SameMemory = tuple[frozenset[int], ...]
"""Groups of operand positions that are one buffer (an input aliased to an output)."""


def own_axes(names: Iterable[Any]) -> frozenset[str]:
    """The axes among ``names`` (a kernel's own mesh or grid axes) whose
    ``axis_index`` inference may read as local: the kernel's cores or grid
    steps, which run alike on every device. An axis that shares its name with
    an axis of the enclosing mesh is left out (``axis_index`` of it is refused),
    and so is every axis on JAX < 0.6, where reprules cannot see that mesh."""
    from reprules._shim import _common

    names = frozenset(n for n in names if isinstance(n, str))
    if not names or _common.version_tuple()[:2] < (0, 6):
        return frozenset()
    from jax._src import mesh as mesh_lib

    return names - frozenset(mesh_lib.get_abstract_mesh().axis_names)


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
        return refused.refusal
    return _Summary(tuple(None if r is None else analysis.ref_taint[r] for r in ref_ids))


# -- a pallas_call ---------------------------------------------------------------


def for_pallas_call(params: dict[str, Any], kernel_axes: frozenset[str] = frozenset()) -> InferredRule | Refusal:
    """The rule derived for one ``pallas_call_p`` equation, or why there is none.
    ``kernel_axes``: :func:`own_axes` of its named grid axes."""
    from reprules._shim import _common

    gm = params.get("grid_mapping")
    num_user, num_out = _common.pallas_counts(params)
    jaxpr = params["jaxpr"]
    if getattr(jaxpr, "constvars", ()):
        return Refusal("pallas_call", "has a kernel jaxpr with constants, which inference does not track", "")
    aliases = {int(o): int(i) for i, o in params.get("input_output_aliases", ())}
    num_scratch = int(getattr(gm, "num_scratch_operands", 0) or 0)
    num_index = int(getattr(gm, "num_index_operands", 0) or 0)
    if len(jaxpr.invars) != num_user + num_out + num_scratch:
        return Refusal("pallas_call", f"has a kernel with {len(jaxpr.invars)} operands where reprules "
                       f"expects {num_user} inputs, {num_out} outputs and {num_scratch} scratch "
                       "buffers (captured references?), which inference does not track", "")
    # Block mapping b picks the block of kernel operand num_index + b; its index map
    # takes the grid indices, then the scalar-prefetch refs (kernel operands 0 ..).
    block_reads: list[tuple[int, frozenset[int]]] = []
    num_grid = len(getattr(gm, "grid", ()) or ())
    for b, bm in enumerate(getattr(gm, "block_mappings", ()) or ()):
        index_map = getattr(bm, "index_map_jaxpr", None)
        if index_map is None:
            continue
        try:
            _Analysis(kernel_axes).check_local(index_map)
        except _Refused as refused:
            return refused.refusal
        read = _used_invars(_jaxpr_and_consts(index_map)[0], skip=num_grid)
        if read and num_index:
            block_reads.append((num_index + b, frozenset(p for p in read if p < num_index)))
    # An aliased input and its output are one buffer: the kernel may write either ref.
    summary = summarize(jaxpr, tuple(frozenset({i, num_user + o}) for o, i in sorted(aliases.items())),
                        kernel_axes, tuple(block_reads))
    if isinstance(summary, Refusal):
        return summary
    depends: list[frozenset[int]] = []
    for i in range(num_out):
        tokens = summary.ref_depends[num_user + i]
        if tokens is None:  # an output that is not a ref: the layout is not what we think
            return Refusal("pallas_call", "has a kernel whose outputs are not references", "")
        deps: set[int] = set()
        for k in tokens:
            if k < num_user:
                deps.add(k)
            elif k < num_user + num_out and (k - num_user) in aliases:
                deps.add(aliases[k - num_user])  # the output starts as its aliased input
            # scratch and unaliased outputs start undefined: nothing to depend on
        depends.append(frozenset(deps))
    return InferredRule(tuple(depends), num_user)


def registration(params: dict[str, Any]) -> Registration | Refusal:
    """A registration carrying the rule derived for a ``pallas_call_p``
    equation (the same object for every call of one kernel jaxpr), or why none."""
    from reprules._shim import _common

    jaxpr = params.get("jaxpr")
    kernel_axes = own_axes(getattr(params.get("grid_mapping"), "grid_names", None) or ())
    key = (params.get("input_output_aliases"), id(params.get("grid_mapping")), kernel_axes)
    with _cache_lock:
        try:
            for known_key, grid_mapping, known in _registrations.get(jaxpr, ()):
                if known_key == key and grid_mapping is params.get("grid_mapping"):
                    return known
        except TypeError:  # not weak-referenceable
            pass
    derived = for_pallas_call(params, kernel_axes)
    result: Registration | Refusal
    if isinstance(derived, Refusal):
        result = derived
    else:
        name = _common.kernel_name_from_params(params)
        result = Registration(
            rule=derived, name=name, where=f"{name} (inferred)", kernel_ref=_no_kernel,
            source="inferred from the kernel body",
        )
    with _cache_lock:
        try:
            _registrations.setdefault(jaxpr, []).append((key, params.get("grid_mapping"), result))
        except TypeError:
            pass
    return result


def _no_kernel() -> None:
    return None


# -- a pl.kernel body (core_map on JAX 0.8 - 0.9, mpmd_map from 0.10) ---------------------


def for_kernel_bodies(jaxprs: Sequence[Any], roles: Sequence[tuple[str, int]], num_in: int,
                      num_out: int, aliases: dict[int, int],
                      kernel_axes: frozenset[str] = frozenset()) -> InferredRule | Refusal:
    """The rule derived for a ``pl.kernel`` call whose bodies (one, or several for
    MPMD: they all run, so an output depends on what any of them writes) take
    their operands in one layout: ``roles[k]`` says what operand ``k`` of every
    body is (its constvars, then its invars):

    * ``("in", i)``: a copy of the call's operand ``i``, private to the kernel;
    * ``("ref", i)``: operand ``i`` is a reference the caller sees after the
      call (a ``Ref`` passed in or captured): its type was fixed outside, so the
      body may only write into it what it already held;
    * ``("out", j)``: output ``j``, starting as operand ``aliases[j]`` if aliased,
      else undefined;
    * ``("scratch", 0)``: memory of the kernel's own.

    Output ``j`` then varies over the operands its final contents depend on.
    ``kernel_axes``: :func:`own_axes` of the kernel's mesh axes.
    """
    depends: list[set[int]] = [set() for _ in range(num_out)]
    position = {role: k for k, role in enumerate(roles)}
    # An operand aliased to an output is that output's buffer: the body may write either ref.
    same_memory = tuple(
        frozenset({position[kind, i], position["out", j]})
        for j, i in sorted(aliases.items())
        for kind in ("in", "ref") if (kind, i) in position and ("out", j) in position
    )
    for jaxpr in jaxprs:
        summary = summarize(jaxpr, same_memory, kernel_axes)
        if isinstance(summary, Refusal):
            return summary
        if len(summary.ref_depends) != len(roles):
            return Refusal("pl.kernel", f"has a body with {len(summary.ref_depends)} operands where "
                           f"reprules expects {len(roles)}, which inference does not track", "")
        for k, ((role, index), tokens) in enumerate(zip(roles, summary.ref_depends)):
            if role == "ref" and tokens is not None and tokens - {k}:
                return Refusal("pl.kernel", f"writes into operand {index}, a reference that outlives "
                               "the kernel and whose type JAX fixed outside it, which inference does "
                               "not track", "")
            if role != "out":
                continue
            if tokens is None:
                return Refusal("pl.kernel", "has a body whose outputs are not references", "")
            for t in tokens:
                kind, source = roles[t]
                if kind in ("in", "ref"):
                    depends[index].add(source)
                elif kind == "out" and source in aliases:
                    depends[index].add(aliases[source])  # the output starts as its aliased input
    return InferredRule(tuple(frozenset(d) for d in depends), num_in)


def kernel_registration(jaxprs: Sequence[Any], key: Any, name: str,
                        derive: Any) -> Registration | Refusal:
    """A registration carrying the rule ``derive()`` gives for a ``pl.kernel`` call
    (the same object for every call of its first body jaxpr with ``key``), or why none."""
    first = jaxprs[0] if jaxprs else None
    with _cache_lock:
        try:
            for known_key, known in _kernel_registrations.get(first, ()):
                if known_key == key:
                    return known
        except TypeError:  # not weak-referenceable
            pass
    derived = derive()
    result: Registration | Refusal = derived if isinstance(derived, Refusal) else Registration(
        rule=derived, name=name, where=f"{name} (inferred)", kernel_ref=_no_kernel,
        source="inferred from the kernel body",
    )
    with _cache_lock:
        try:
            _kernel_registrations.setdefault(first, []).append((key, result))
        except TypeError:
            pass
    return result


_kernel_registrations: weakref.WeakKeyDictionary[Any, list[tuple[Any, Registration | Refusal]]] = (
    weakref.WeakKeyDictionary()
)


_registrations: weakref.WeakKeyDictionary[Any, list[tuple[Any, Any, Registration | Refusal]]] = (
    weakref.WeakKeyDictionary()
)


def _used_invars(jaxpr: Any, skip: int) -> frozenset[int]:
    """The positions (counted after the first ``skip``) of the invars ``jaxpr`` reads."""
    position = {v: k - skip for k, v in enumerate(jaxpr.invars) if k >= skip}
    used = [v for eqn in jaxpr.eqns for v in eqn.invars] + list(jaxpr.outvars)
    # Literals: unhashable (0.12)
    return frozenset(position[v] for v in used if type(v).__name__ != "Literal" and v in position)


def refusal_text(refusal: Refusal, kernel: str, axes: Sequence[str], jax_version: str) -> str:
    """The paragraph a MissingRuleError adds when inference refused ``kernel``."""
    return (
        f"Inference (reprules.inference()) could not derive a rule for {kernel!r}: "
        f"{refusal.describe()} (mesh axes {fmt_axes(axes)}, JAX {jax_version}). "
        "A derived rule must be sound, so reprules refuses when the body is not provably local."
    )
