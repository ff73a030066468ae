"""The *vma* regime: JAX 0.6.x - 0.9.x (``jax.shard_map(..., check_vma=True)``).

There is no rule registry: each value's type carries the set of manual mesh
axes it varies over (``ShapedArray.vma``), and a primitive's abstract eval
*is* its rule. ``pallas_call`` takes its output types from ``out_shape``, which
must then say ``vma=`` itself. reprules therefore works at the call's bind
(found by its kernel jaxpr, see ``_common``, whenever the call object was built):

* it asks the kernel's rule for the output sets and types the outputs the
  user's out_shape left unannotated with them. It casts inputs up with
  ``pvary`` only where an output aliases an input (JAX types that output like
  its input): ``pallas_call`` has no transpose rule, so a cast's transpose (a
  psum) would never run, and the casts would only add equations to stage and
  lower. A ``custom_vjp`` around the kernel gets its psums from the fix below.
  User primitives, ``ffi_call`` and ``triton_call`` (``attach``) are cast as
  the rule says: those can have transposes;
* it fixes the interpret-mode lowering for registered kernels (JAX's HLO
  interpreter starts output buffers invariant, then its while loop refuses the
  varying body: a carry-type error from 0.6.2 on; JAX's TPU interpreter
  compares program ids of a grid whose size varies per device, megablox's with
  per-shard group sizes, with invariant constants: a vma error);
* it psums a ``custom_vjp`` cotangent over the axes it varies over and its
  primal does not (JAX <= 0.5 did this itself; from 0.6.2 JAX refuses it).

The *mat* regime (0.10+) is the same design with another type field; see
``mat.py``, which subclasses :class:`TypeField`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import config, core
from jax._src import mesh as mesh_lib

from reprules import _errors, _mode_state
from reprules._decide import decide, decide_call
from reprules._registry import Registration
from reprules._shim import _common, _verify, custom_vjp, infer
from reprules.rules import RuleContext

NAME = "vma"
VERSIONS = "0.6.x - 0.9.x"
MECHANISM = "check_vma: ShapedArray.vma on out_shape, pvary casts, interpret lowering fix"
CHECK_FLAG = "check_vma"


class TypeField:
    """Reads and writes the varying-axes part of a type (0.6 - 0.9: ``vma``)."""

    sds_keyword = "vma"

    def varying(self, aval: Any) -> frozenset[str]:
        return frozenset(getattr(aval, "vma", frozenset()))

    def annotated(self, sds: Any) -> bool:
        # Only a ShapeDtypeStruct carries a user's annotation: an array given as
        # out_shape forwards .vma to its own type, which pallas_call ignores.
        return isinstance(sds, jax.ShapeDtypeStruct) and getattr(sds, "vma", None) is not None

    def sds_value(self, varying: frozenset[str]) -> Any:
        return frozenset(varying)

    def strip(self, aval: Any) -> Any:
        return aval.update(vma=frozenset()) if hasattr(aval, "vma") else aval

    def retype(self, aval: Any, varying: frozenset[str]) -> Any:
        return aval.update(vma=frozenset(varying), **_mesh_sharding(aval, varying))


def _mesh_sharding(aval: Any, varying: frozenset[str]) -> dict[str, Any]:
    """From 0.8, a type that varies needs a sharding on a (manual) mesh: an
    abstract eval that built ``ShapedArray(shape, dtype)`` has none."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if not varying or (mesh is not None and not getattr(mesh, "empty", False)):
        return {}
    get_cur_mesh_sharding = getattr(core, "get_cur_mesh_sharding", None)
    return {"sharding": get_cur_mesh_sharding()} if get_cur_mesh_sharding else {}


def detect() -> bool:
    return "vma" in getattr(core.ShapedArray, "__slots__", ()) or hasattr(core.ShapedArray, "vma")


def checking() -> bool:
    """Whether the innermost ``shard_map`` being traced has checking on."""
    return bool(config._check_vma.value)


def manual_axes() -> tuple[str, ...]:
    return tuple(mesh_lib.get_abstract_mesh().manual_axes)


def cast_up(x: Any, axes: frozenset[str]) -> Any:
    # core.pvary is what jax.lax.pvary (0.6 - 0.9) and pcast(to="varying") use.
    return core.pvary(x, tuple(a for a in manual_axes() if a in axes))


def cast_up_tuple(x: Any, axes: tuple[str, ...]) -> Any:
    return cast_up(x, frozenset(axes))


def _cast_inputs(args: Sequence[Any], now: Sequence[frozenset[str]],
                 targets: Sequence[frozenset[str]] | None) -> list[Any]:
    """Casts each input up to its target set (None: inputs pass as they are)."""
    if targets is None:
        return list(args)
    return [cast_up(a, t - n) if t - n else a for a, n, t in zip(args, now, targets)]


def psum(x: Any, axes: frozenset[str]) -> Any:
    return jax.lax.psum(x, tuple(a for a in manual_axes() if a in axes))


class _Unannotated(threading.local):
    """Types JAX made from out_shape leaves without the user's annotation, for
    the ``pallas_call`` bind that follows in the same call, each with JAX's
    refusal of the leaf if it refused it.

    Matched by identity *and* by the JAX frame that converted them (the call's
    ``wrapped``, which binds too): JAX interns types, so a later call's
    annotated leaf can be the very object an earlier call left here. A call
    that raised between its conversion and its bind (JAX refusing an operand,
    the kernel failing to trace) leaves its items behind; they are dropped as
    soon as its frame is seen finished (``_common.running``)."""

    LIMIT = 1024  # a bound, whatever happens

    def __init__(self) -> None:
        self.items: list[tuple[Any, Any, Exception | None]] = []  # (frame, type, refusal)

    def add(self, aval: Any, refusal: Exception | None) -> None:
        frame = _common.jax_frame()
        if self.items and self.items[-1][0] is not frame:
            self._drop_finished()
        self.items.append((frame, aval, refusal))
        del self.items[: -self.LIMIT]

    def take(self, avals: Sequence[Any]) -> dict[int, Exception | None]:
        """``{output index: refusal}`` of the unannotated ones among ``avals``
        (converted by the frame that binds them)."""
        if not self.items:
            return {}
        frame = _common.jax_frame()
        found: dict[int, Exception | None] = {}
        for index, aval in enumerate(avals):
            for j, (owner, item, refusal) in enumerate(self.items):
                if owner is frame and item is aval:
                    found[index] = refusal
                    del self.items[j]
                    break
        if self.items:
            self._drop_finished()
        return found

    def _drop_finished(self) -> None:
        owners = [owner for owner, _, _ in self.items]
        self.items = [item for item, live in zip(self.items, _common.running(owners)) if live]


_unannotated = _Unannotated()


class _RefusedLeaves:
    """Unannotated out_shape leaves JAX refused under checking: per leaf, the same
    leaf typed replicated (what JAX is given instead) and JAX's refusal. A model
    builds the same out_shape at every call of a kernel; this spares it a raise
    and a ShapeDtypeStruct each time. Keyed by exactly the fields
    :meth:`Regime._annotate` reads; bounded (it holds no tracer, no kernel)."""

    LIMIT = 256

    def __init__(self) -> None:
        self._items: dict[Any, tuple[jax.ShapeDtypeStruct, Exception]] = {}

    @staticmethod
    def _key(leaf: Any) -> Any:
        return (type(leaf), leaf.shape, leaf.dtype, leaf.sharding, leaf.weak_type)

    def get(self, leaf: Any) -> tuple[jax.ShapeDtypeStruct, Exception] | None:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return None
        try:
            return self._items.get(self._key(leaf))
        except TypeError:  # an unhashable sharding: asked every time
            return None

    def put(self, leaf: Any, value: tuple[jax.ShapeDtypeStruct, Exception]) -> None:
        try:
            key = self._key(leaf)
            hash(key)
        except TypeError:
            return
        if len(self._items) >= self.LIMIT:
            self._items.clear()
        self._items[key] = value


_refused = _RefusedLeaves()


def _interpreted(interpret: Any) -> bool:
    """Whether a ``pallas_call``'s ``interpret`` param picks an interpreter the
    lowering fix covers: ``True`` (the HLO interpreter) or a TPU
    ``InterpretParams`` (the TPU interpreter). GPU interpret params are not covered."""
    if interpret is True:
        return True
    params_type = _tpu_interpret_params_type()
    return params_type is not None and isinstance(interpret, params_type)


@functools.cache
def _tpu_interpret_params_type() -> type | None:
    """The class ``_pallas_call_lowering`` tests for TPU interpret mode
    (``pltpu.InterpretParams``); None where this JAX has no TPU interpreter
    (then JAX's lowering never takes that path either)."""
    try:  # 0.10+: the lowering imports it from here
        from jax._src.pallas.mosaic.interpret import params as tpu_params
    except ImportError:
        # 0.6 - 0.9: pallas_call.py imports the interpreter module at its bottom
        # as mosaic_tpu_interpret (a stand-in class no value is an instance of
        # where that import fails).
        from jax._src.pallas import pallas_call

        module = getattr(pallas_call, "mosaic_tpu_interpret", None)
        params_type = getattr(module, "InterpretParams", None)
        return params_type if isinstance(params_type, type) else None
    return tpu_params.InterpretParams


def _retyped(ctx: Any, avals_in: list[Any], avals_out: list[Any]) -> Any:
    """``ctx.replace(avals_in=..., avals_out=...)``, at a fraction of the cost
    (dataclasses.replace checks every field by name: most of this hook's time)."""
    cls = type(ctx)
    if cls not in _rebuilders:
        _rebuilders[cls] = _ctx_rebuild(cls)
    rebuild = _rebuilders[cls]
    return rebuild(ctx, avals_in, avals_out) if rebuild else ctx.replace(avals_in=avals_in, avals_out=avals_out)


_rebuilders: dict[type, Callable[[Any, list[Any], list[Any]], Any] | None] = {}


def _ctx_rebuild(cls: type) -> Callable[[Any, list[Any], list[Any]], Any] | None:
    """Rebuilds a ``LoweringRuleContext`` from its fields in order; None if its
    dataclass takes them otherwise (then ``replace`` is used)."""
    if not dataclasses.is_dataclass(cls):
        return None
    fields = dataclasses.fields(cls)
    if any(not f.init or f.kw_only for f in fields) or hasattr(cls, "__post_init__"):
        return None
    names = [f.name for f in fields]
    if "avals_in" not in names or "avals_out" not in names:
        return None
    get, i_in, i_out = operator.attrgetter(*names), names.index("avals_in"), names.index("avals_out")

    def rebuild(ctx: Any, avals_in: list[Any], avals_out: list[Any]) -> Any:
        values = list(get(ctx))
        values[i_in], values[i_out] = avals_in, avals_out
        return cls(*values)

    return rebuild


class Regime:
    """Everything the vma and mat regimes do, parameterised by the type field."""

    def __init__(self, field: TypeField):
        self.field = field

    # -- the call ---------------------------------------------------------------
    #
    # JAX converts a pallas_call's out_shape before it traces the kernel, so the
    # conversion cannot know whether a rule applies: it lets unannotated leaves
    # through (JAX's refusal kept), and the bind, which knows the kernel, types
    # them by the rule or raises that refusal as a MissingRuleError.

    def _convert_out_shape(self, original: Callable[[Any], Any], leaf: Any) -> Any:
        if not checking() or self.field.annotated(leaf):
            return original(leaf)  # no checking, or the user's own annotation (it wins)
        known = _refused.get(leaf)
        if known is not None:  # refused before: not asked again (a raise costs more than the rest)
            replicated, refusal = known
            aval = original(replicated)
        else:
            try:
                aval = original(leaf)
                refusal = None
            except ValueError as err:  # an unannotated ShapeDtypeStruct under checking
                if not isinstance(leaf, jax.ShapeDtypeStruct):
                    raise
                # Kept without its traceback: that would hold every frame of the
                # trace alive (tracers included) until the garbage collector runs.
                replicated, refusal = self._annotate(leaf, frozenset()), err.with_traceback(None)
                _refused.put(leaf, (replicated, refusal))
                aval = original(replicated)
        _unannotated.add(aval, refusal)
        return aval

    def _bind_pallas(self, bind: Callable[..., Any], args: tuple[Any, ...], params: dict[str, Any],
                     reg: Registration | None, direct: bool) -> Any:
        unannotated = _unannotated.take(params.get("out_avals", ()))
        if reg is None:
            refusal = next((err for err in unannotated.values() if err is not None), None)
            if refusal is not None:
                raise _errors.MissingRuleError(
                    _errors.missing_rule_message(
                        _common.kernel_name_from_params(params), manual_axes(), _common.JAX_VERSION,
                        jax_error=str(refusal), inference=_common.inference_note(params, manual_axes()),
                    )
                ) from refusal
            return bind(*args, **params)
        manual = manual_axes() if direct and checking() else ()
        if not manual:
            # Outside a checked shard_map, or a JVP/vmap of a call typed already.
            return _common.traced_bind(bind, args, params, reg, direct)
        first, _ = _common._pallas_layout(params, len(args))
        first = infer.rule_operands_start(reg, first)
        out_avals = tuple(params["out_avals"])
        varying = self.field.varying
        in_vary = tuple([varying(jax.typeof(a)) for a in args[first:]])
        decision = decide_call(reg, in_vary, manual, len(out_avals),
                               lambda: _common.rule_context(reg, manual, len(in_vary), len(out_avals)))
        if isinstance(reg.rule, infer.InferredRule):
            self._check_annotations(params, out_avals, decision.outputs, unannotated)
        # No transpose rule, so no cast is ever transposed: cast only where JAX types an
        # output like its input (aliasing). See the module docstring.
        if params.get("input_output_aliases"):
            args = (*args[:first], *_cast_inputs(args[first:], in_vary, decision.inputs))
        out_avals = tuple(
            self.field.retype(aval, vary) if i in unannotated else aval
            for i, (aval, vary) in enumerate(zip(out_avals, decision.outputs))
        )
        with _common.tracing(reg):
            out = bind(*args, **{**params, "out_avals": out_avals})
        self._maybe_verify(reg, list(out))
        return out

    def _check_annotations(self, params: dict[str, Any], out_avals: Sequence[Any],
                           derived: Sequence[frozenset[str]], unannotated: dict[int, Any]) -> None:
        """Under inference, an out_shape annotated by hand must not claim an output
        replicated over an axis the body shows it depends on: JAX would believe
        the annotation, and the gradient (or out_specs) would silently be wrong."""
        aliased = {int(o): int(i) for i, o in params.get("input_output_aliases") or ()}
        for i, (aval, needed) in enumerate(zip(out_avals, derived)):
            missing = needed - self.field.varying(aval)
            if i not in unannotated and missing:
                name = _common.kernel_name_from_params(params)
                raise _errors.RuleError(_errors.annotation_message(
                    f"Pallas kernel {name!r}", i, missing, needed, manual_axes(), _common.JAX_VERSION,
                    aliased.get(i),
                ))

    def _maybe_verify(self, reg: Registration, outs: Sequence[Any]) -> None:
        if _mode_state.verifying():
            varying = [self.field.varying(jax.typeof(o)) for o in outs]
            _verify.insert_checks(reg, outs, varying, manual_axes(), cast_up_tuple)

    def _annotate(self, sds: Any, varying: frozenset[str]) -> jax.ShapeDtypeStruct:
        # Any leaf with .shape and .dtype (a ShapeDtypeStruct, or an array as JAX's
        # own ops pass) becomes a ShapeDtypeStruct typed by the rule.
        is_sds = isinstance(sds, jax.ShapeDtypeStruct)
        return jax.ShapeDtypeStruct(
            sds.shape,
            sds.dtype,
            sharding=sds.sharding if is_sds else None,
            weak_type=sds.weak_type if is_sds else False,
            **{self.field.sds_keyword: self.field.sds_value(varying)},
        )

    # -- primitive-level fixes ---------------------------------------------------

    def _interpret_lowering(self, original: Callable[..., Any]) -> Callable[..., Any]:
        field = self.field

        def lowering(ctx: Any, *in_nodes: Any, **params: Any) -> Any:
            # interpret=True (the HLO interpreter): its output buffers start
            # invariant, a carry-type error in its while loop. TPU interpret mode
            # (pltpu.InterpretParams, force_tpu_interpret_mode): its grid loop
            # compares program ids with invariant constants, a vma error where a
            # grid bound varies per device (megablox gmm's per-shard group
            # sizes). Either lowers one device's code; the rule typed the call
            # at its bind, so it lowers from untyped avals with checking off.
            if _interpreted(params.get("interpret")) and _common.registration_of(params) is not None:
                untyped = _retyped(ctx, [field.strip(a) for a in ctx.avals_in],
                                   [field.strip(a) for a in ctx.avals_out])
                with config._check_vma(False):
                    out = original(untyped, *in_nodes, **params)
                # The TPU interpreter's callbacks have effects: their tokens are
                # set on the context it was given, JAX reads them from ctx.
                if untyped.tokens_out is not None:
                    ctx.set_tokens_out(untyped.tokens_out)
                return out
            return original(ctx, *in_nodes, **params)

        return lowering

    def attach(self, op: _common.Opaque, patches: _common.Patches) -> None:
        """Types the outputs of ``op.prim`` by the rule of each equation (its
        abstract eval), and casts inputs up before binding (its bind).
        Equations without a rule are left exactly as JAX types them."""
        field = self.field
        prim = op.prim
        original_abstract_eval = prim.abstract_eval
        original_bind = prim.bind  # may already be another reprules hook

        def context(reg: Registration, num_inputs: int, num_outputs: int) -> RuleContext:
            return _common.rule_context(reg, manual_axes(), num_inputs, num_outputs)

        def abstract_eval(*avals: Any, **params: Any) -> Any:
            out, effects = original_abstract_eval(*avals, **params)
            reg = op.lookup(params)
            if reg is None or not checking() or not manual_axes():
                return out, effects
            first, _ = op.layout(params, len(avals))
            outs = list(out) if prim.multiple_results else [out]
            in_vary = tuple(field.varying(a) for a in avals[first:])
            decision = decide(reg, context(reg, len(in_vary), len(outs)), in_vary)
            outs = [field.retype(o, v) for o, v in zip(outs, decision.outputs)]
            return (outs if prim.multiple_results else outs[0]), effects

        def bind(*args: Any, **params: Any) -> Any:
            reg = op.lookup(params)
            if reg is not None and checking() and manual_axes():
                _common.note_registered_call()
                first, num_out = op.layout(params, len(args))
                if num_out is None:  # a multiple-results primitive: count from its abstract eval
                    num_out = len(original_abstract_eval(*(jax.typeof(a) for a in args), **params)[0])
                in_vary = tuple(field.varying(jax.typeof(a)) for a in args[first:])
                decision = decide(reg, context(reg, len(in_vary), num_out), in_vary)
                args = args[:first] + tuple(_cast_inputs(args[first:], in_vary, decision.inputs))
                out = original_bind(*args, **params)
                self._maybe_verify(reg, list(out) if prim.multiple_results else [out])
                return out
            return original_bind(*args, **params)

        patches.setattr(prim, "abstract_eval", abstract_eval)
        patches.setattr(prim, "bind", bind)

    def install_strict(self, patches: _common.Patches) -> None:
        """Strict mode: after each primitive is staged, refuse outputs that JAX
        typed replicated over axes its inputs vary over, unless the primitive
        has a rule or is one of JAX's collectives or higher-order primitives."""
        from jax._src.interpreters import partial_eval as pe

        original: Callable[..., Any] = pe.DynamicJaxprTrace.default_process_primitive
        field = self.field

        def default_process_primitive(trace: Any, primitive: Any, tracers: Any, params: Any, *rest: Any, **kw: Any) -> Any:
            out = original(trace, primitive, tracers, params, *rest, **kw)
            if _mode_state.strict_on() and checking() and not _exempt(primitive, params):
                in_vary = frozenset().union(*(field.varying(getattr(t, "aval", None)) for t in tracers))
                outs = out if primitive.multiple_results else [out]
                for index, o in enumerate(outs):
                    missing = in_vary - field.varying(getattr(o, "aval", None))
                    if missing and hasattr(getattr(o, "aval", None), "shape"):
                        raise _errors.StrictModeError(_strict_message(primitive, params, index, in_vary, missing))
            return out

        patches.setattr(pe.DynamicJaxprTrace, "default_process_primitive", default_process_primitive)

    def install(self, patches: _common.Patches) -> None:
        from jax._src.interpreters import mlir

        prim = _common.pallas_call_p()
        entry = mlir._lowerings[prim]
        original_rule: Any = getattr(entry, "rule", entry)  # LoweringRuleEntry since 0.7
        # Guarded here too: a LoweringRuleEntry is not callable, so setitem cannot guard it.
        new_rule = patches.guard(self._interpret_lowering(original_rule), lambda: original_rule)
        new_entry = dataclasses.replace(entry, rule=new_rule) if hasattr(entry, "rule") else new_rule
        patches.setitem(mlir._lowerings, prim, new_entry, label="jax._src.interpreters.mlir._lowerings[pallas_call]")
        custom_vjp.install(patches, field=self.field)
        _install_kernel_jvp_fix(patches)
        _common.install_pallas_hooks(patches, self._bind_pallas, self._convert_out_shape)
        ffi = _common.ffi_opaque()
        if ffi is not None:
            self.attach(ffi, patches)
        from reprules._shim import core_map  # pl.kernel / pl.core_map

        core_map.install(patches, self)


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
    # JAX's callbacks: outputs typed by the user's result shapes, like a body.
    ("jax._src.callback", "pure_callback_p"),
    ("jax._src.callback", "io_callback_p"),
    ("jax._src.debugging", "debug_callback_p"),
)


@functools.cache
def _jax_collectives() -> frozenset[Any]:
    """JAX's collectives, by identity: every primitive that ``jax._src.lax.parallel``
    defines (psum, all_gather, ppermute, axis_index, ... under whatever names
    this version has) and ``core.pvary_p`` (pvary / pcast, 0.6+)."""
    from jax._src.lax import parallel

    found = {v for v in vars(parallel).values() if isinstance(v, core.Primitive)}
    if isinstance(getattr(core, "pvary_p", None), core.Primitive):
        found.add(core.pvary_p)
    return frozenset(found)


@functools.cache
def _jax_higher_order() -> frozenset[Any]:
    """The primitives of ``_HIGHER_ORDER``, by identity: JAX's higher-order primitives
    (typed from their jaxprs) and callbacks (typed by the user's result shapes)."""
    import importlib

    found = set()
    for module_name, attr in _HIGHER_ORDER:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        prim = getattr(module, attr, None)
        if isinstance(prim, core.Primitive):
            found.add(prim)
    return frozenset(found)


def _exempt(primitive: Any, params: dict[str, Any]) -> bool:
    """JAX's collectives and higher-order primitives type their outputs
    themselves; registered opaque primitives are typed by their rules."""
    if primitive in _jax_collectives() or primitive in _jax_higher_order():
        return True
    return _describe(primitive).lookup(params) is not None


def _describe(primitive: Any) -> _common.Opaque:
    import sys

    if primitive is _common.pallas_call_p():
        return _common.pallas_opaque()
    from reprules._shim import core_map

    kernel = core_map.opaque(primitive)  # pl.kernel / pl.core_map
    if kernel is not None:
        return kernel
    ffi = _common.ffi_opaque()
    if ffi is not None and primitive is ffi.prim:
        return ffi
    if "jax_triton" in sys.modules:
        triton = _common.triton_opaque()
        if primitive is triton.prim:
            return triton
    return _common.primitive_opaque(primitive)


def _strict_message(primitive: Any, params: dict[str, Any], index: int, in_vary: frozenset[str], missing: frozenset[str]) -> str:
    opaque = _describe(primitive)
    kind, name = opaque.kind, opaque.name(params)
    if kind == "FFI target":
        fix = f"reprules.replication_rule(rules.same())(reprules.ffi_target({name!r}))"
    elif kind == "primitive":
        fix = f"reprules.replication_rule(rules.same())(<the {name!r} primitive>)"
    else:
        fix = f"reprules.replication_rule(rules.same())({name})"
    return (
        f"Strict mode: the {kind} {name!r} has inputs varying over {_errors.fmt_axes(in_vary)}, "
        f"but JAX typed its output {index} as replicated over {_errors.fmt_axes(missing)} "
        f"(mesh axes {_errors.fmt_axes(manual_axes())}, JAX {_common.JAX_VERSION}).\n"
        "Why: it has no replication rule, and its abstract eval drops the varying axes; JAX "
        "would then accept out_specs that need replication and return one device's shard.\n"
        f"Fix: give it a rule, e.g. `{fix}`."
    )


_regime = Regime(TypeField())
install = _regime.install
attach = _regime.attach
install_strict = _regime.install_strict


def _install_kernel_jvp_fix(patches: _common.Patches) -> None:
    """JAX 0.7 - 0.8: the JVP of a ``pallas_call`` re-traces the kernel body
    (``ad.jvp_jaxpr``) inside the ``shard_map``, where ``check_vma`` holds, and
    the body's refs keep the varying axes of the operands *before* reprules
    cast them up: ``Primitive mul requires varying manual axes to match``.
    Types inside a kernel body are per block and never reach the program (the
    call's output types come from the rule), so for a registered kernel the
    body's JVP is traced with the check off, as JAX 0.9 effectively does."""
    if _common.version_tuple()[:2] not in ((0, 7), (0, 8)):
        return
    from jax._src.interpreters import ad

    prim = _common.pallas_call_p()
    original = ad.primitive_jvps[prim]

    def jvp(primals: Any, tangents: Any, **params: Any) -> Any:
        if _common.registration_of(params) is None:
            return original(primals, tangents, **params)
        with config._check_vma(False):
            return original(primals, tangents, **params)

    patches.setitem(ad.primitive_jvps, prim, jvp, label="jax._src.interpreters.ad.primitive_jvps[pallas_call]")
