"""The effect model of inference: what each primitive inference accepts may read and write.

Data, not analysis: ``_analysis`` runs a kernel body against these tables. A
primitive is named by ``(module, attribute)``, resolved on this JAX by
``_jax``; names a release lacks are skipped.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from reprules._shim.plumbing import _jax

# -- the effect model ------------------------------------------------------------
#
# Every primitive inference accepts has exactly one class below; a primitive with
# no class is refused, and so is an equation carrying a JAX effect the model does
# not know (KNOWN_EFFECTS). The docs' inference page has this table in prose.
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
PURE_KEY_IMPLS = frozenset({"threefry2x32", "rbg", "unsafe_rbg"})


# ... and the Pallas TPU ones: random_bits seeds the core's generator with the key
# and draws (pallas_tpu), or only draws (the stateful samplers' internal impl).
SEEDING_KEY_IMPLS = frozenset({"pallas_tpu"})


DRAWING_KEY_IMPLS = frozenset({"_pallas_internal_stateful"})


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
KNOWN_EFFECTS = frozenset({
    "ReadEffect", "WriteEffect", "AccumEffect", "PRNGEffect", "TraceEffect", "DebugEffect",
    "OrderedDebugEffect", "DelayEffect", "SemaphoreEffect", "InternalMutableArrayEffect",
    "NamedAxisEffect", "ErrorEffect",
})


def _resolve(names: Iterable[tuple[Any, ...]]) -> dict[Any, tuple[Any, ...]]:
    found: dict[Any, tuple[Any, ...]] = {}
    for module_name, attr, *rest in names:
        prim = _jax.primitive(module_name, attr)
        if prim is not None:
            found[prim] = tuple(rest)
    return found


def _module_primitives(module_names: Iterable[str]) -> list[Any]:
    found = []
    for module_name in module_names:
        module = _jax.module(module_name)
        if module is not None:
            found += [v for v in vars(module).values() if isinstance(v, _jax.core.Primitive)]
    return found


@functools.cache
def tables() -> dict[str, dict[Any, Any]]:
    """The effect model resolved on this JAX: primitive -> class, and the sets
    the analysis checks by identity (collectives, casts, higher-order, ...)."""
    core = _jax.core
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
    for prim, kind in tables()["effect"].items():
        table[prim.name] = kind if table.get(prim.name, kind) == kind else f"{table[prim.name]}|{kind}"
    for prim in tables()["remote_capable"]:
        table[prim.name] = f"{REFS} (without a device_id)"
    return dict(sorted(table.items()))
