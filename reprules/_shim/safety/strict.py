"""Strict mode (``reprules.strict()``, vma and mat eras): no silent typing.

After each primitive is staged, an output JAX typed replicated over axes its
inputs vary over is refused, unless the primitive has a rule or is one of
JAX's collectives or higher-order primitives (which type their outputs
themselves). ``jax.pure_callback`` and ``io_callback`` are typed by a rule
registered on their host function (``rules/callbacks.py``); without one both are
refused like that, and ``io_callback`` (which runs on every device against host
state) wherever JAX typed an output replicated over any manual axis, its inputs
replicated or not. A callback JAX binds for its own
machinery (its Pallas interpreters simulate kernels through ``io_callback``) is
JAX's, known by the module of its Python function (:func:`jax_own`). JAX <= 0.5
refuses rule-less primitives itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from reprules import _errors, _mode_state
from reprules._messages import advice
from reprules._shim.plumbing import _frames, _jax
from reprules._shim.rules import _resolve, callbacks
from reprules._shim.plumbing._patches import Patches
from reprules._shim.plumbing._types import TypeField, checking, manual_axes


def install(field: TypeField, patches: Patches) -> None:
    """Strict mode: after each primitive is staged, refuse outputs that JAX
    typed replicated over axes its inputs vary over, unless the primitive
    has a rule or is one of JAX's collectives or higher-order primitives."""
    original: Callable[..., Any] = _jax.pe.DynamicJaxprTrace.default_process_primitive

    def default_process_primitive(trace: Any, primitive: Any, tracers: Any, params: Any, *rest: Any, **kw: Any) -> Any:
        out = original(trace, primitive, tracers, params, *rest, **kw)
        if _mode_state.strict_on() and checking() and not _exempt(primitive, params):
            in_vary = frozenset().union(*(field.varying(getattr(t, "aval", None)) for t in tracers))
            if primitive in callbacks.io_callbacks():  # may differ per device whatever its inputs
                in_vary |= frozenset(manual_axes())
            outs = out if primitive.multiple_results else [out]
            for index, o in enumerate(outs):
                missing = in_vary - field.varying(getattr(o, "aval", None))
                if missing and hasattr(getattr(o, "aval", None), "shape"):
                    raise _errors.StrictModeError(_strict_message(primitive, params, index, in_vary, missing))
        return out

    patches.setattr(_jax.pe.DynamicJaxprTrace, "default_process_primitive", default_process_primitive)


# Strict mode decides by *which* primitive it is, never by parameter names: a
# user primitive with an `axis_name` parameter is checked like any other.
#
# Not structural ("its params hold a jaxpr"): opaque kernels hold jaxprs too
# (pallas_call's kernel jaxpr, a user's Pallas-like primitive), and those are
# exactly what strict mode must check, so structure cannot tell a
# higher-order primitive typed from its body from a kernel typed by hand. A
# higher-order primitive missing from the list (a new JAX) is checked like any
# primitive and passes as long as its body keeps the varying axes; the tests
# run JAX programs with collectives inside jit, cond, scan, remat and
# custom_vjp under strict mode on every version.
_HIGHER_ORDER = (
    ("jax._src.pjit", "pjit_p"),  # 0.6.x
    ("jax._src.pjit", "jit_p"),  # 0.7+: renamed
    ("jax._src.core", "closed_call_p"),
    ("jax._src.core", "call_p"),
    ("jax._src.interpreters.ad", "custom_lin_p"),
    ("jax._src.interpreters.pxla", "xla_pmap_p"),  # 0.6 - 0.9
    ("jax._src.ad_checkpoint", "remat_p"),
    ("jax._src.custom_derivatives", "custom_jvp_call_p"),
    ("jax._src.custom_derivatives", "custom_vjp_call_p"),
    ("jax._src.custom_derivatives", "custom_jvp_call_jaxpr_p"),
    ("jax._src.custom_derivatives", "linear_call_p"),
    ("jax._src.custom_transpose", "custom_transpose_p"),  # 0.6 - 0.9
    ("jax._src.hijax", "call_hi_primitive_p"),  # 0.8+
    ("jax._src.custom_batching", "custom_vmap_p"),
    ("jax._src.custom_partitioning", "custom_partitioning_p"),
    ("jax._src.lax.control_flow.loops", "scan_p"),
    ("jax._src.lax.control_flow.loops", "while_p"),
    ("jax._src.lax.control_flow.conditionals", "cond_p"),
    ("jax._src.lax.control_flow.for_loop", "for_p"),  # 0.6.x
    ("jax._src.lax.control_flow.solves", "linear_solve_p"),
    ("jax._src.state.discharge", "run_state_p"),
    ("jax._src.shard_map", "shard_map_p"),
    ("jax._src.debugging", "debug_callback_p"),  # no outputs (pure_callback and io_callback: rules.callbacks)
)


def jax_own(params: dict[str, Any]) -> bool:
    """Whether a callback's Python function is JAX's own (defined in a ``jax`` module, through
    ``functools.partial`` and wrappers). JAX's TPU and GPU Pallas interpreters simulate a kernel
    through ``io_callback`` (its buffers, DMAs and semaphores, their tokens threaded through the
    kernel's loops), bound in the checked trace for ``pl.kernel`` from 0.8 (measured): JAX types
    those itself. ``jax.debug.breakpoint`` uses ``pure_callback``. A user's callback is anything else."""
    function = callbacks.host_function(params)
    for _ in range(8):
        inner = getattr(function, "func", None) or getattr(function, "__wrapped__", None)
        if inner is None:
            break
        function = inner
    module = str(getattr(function, "__module__", None) or "")
    return module == "jax" or module.startswith("jax.")


@functools.cache
def jax_collectives() -> frozenset[Any]:
    """JAX's collectives, by identity: every primitive that ``jax._src.lax.parallel``
    defines (psum, all_gather, ppermute, axis_index, ... under whatever names
    this version has) and ``core.pvary_p`` (pvary / pcast, 0.6+)."""
    core = _jax.core
    found = {v for v in vars(_jax.module("jax._src.lax.parallel")).values() if isinstance(v, core.Primitive)}
    if isinstance(getattr(core, "pvary_p", None), core.Primitive):
        found.add(core.pvary_p)
    return frozenset(found)


@functools.cache
def _jax_higher_order() -> frozenset[Any]:
    """The primitives of ``_HIGHER_ORDER``, by identity: JAX's higher-order primitives
    (typed from their jaxprs) and callbacks (typed by the user's result shapes)."""
    return _jax.primitives(_HIGHER_ORDER)


def _exempt(primitive: Any, params: dict[str, Any]) -> bool:
    """JAX's collectives and higher-order primitives type their outputs
    themselves; registered opaque primitives are typed by their rules; a
    callback is checked unless JAX bound it for itself or its host function has a rule."""
    if primitive in jax_collectives() or primitive in _jax_higher_order():
        return True
    if primitive in callbacks.callbacks() and jax_own(params):
        return True
    return _resolve.describe(primitive).lookup(params) is not None  # a callback's: its host function's rule


def _strict_message(primitive: Any, params: dict[str, Any], index: int, in_vary: frozenset[str], missing: frozenset[str]) -> str:
    if primitive in callbacks.callbacks():
        io = primitive in callbacks.io_callbacks()
        return callback_message(primitive.name, params, index, in_vary, missing, io)
    opaque = _resolve.describe(primitive)
    return advice.strict_message(opaque.kind, opaque.name(params), index, in_vary, missing, manual_axes(),
                                 _jax.JAX_VERSION)


def callback_message(name: str, params: dict[str, Any], index: int, in_vary: frozenset[str], missing: frozenset[str],
                     io: bool) -> str:
    """:class:`reprules.StrictModeError` for a rule-less JAX callback whose output JAX typed replicated."""
    axes, short, mesh = _errors.fmt_axes(in_vary), _errors.fmt_axes(missing), _errors.fmt_axes(manual_axes())
    site = _frames.annotation_site(depth=2)
    why = ("it runs on every device against host state, so its results may differ per device whatever its "
           "inputs" if io else f"its inputs vary over {axes}, so its results may too")
    return (
        f"Strict mode: the JAX callback {name!r}{f' (called at {site})' if site else ''}: {why}, but JAX typed its "
        f"output {index} replicated over {short} (mesh axes {mesh}, JAX {_jax.JAX_VERSION}).\n"
        "Why: a JAX callback cannot say how its results vary (it ignores the varying axes of result_shape_dtypes) "
        "and its host function has no replication rule; JAX would accept out_specs that need replication and "
        f"return one device's block, and a gradient through it would miss its psum over {short}.\n"
        f"Fix: {callbacks.rule_fix(params, io, manual_axes())}. Or call it outside reprules.strict() (reprules "
        f"then types its results varying over {axes}, with a ReplicationWarning), or outside the shard_map."
    )
