"""The *vma* regime: JAX 0.6.x - 0.9.x (``jax.shard_map(..., check_vma=True)``).

There is no rule registry: each value's type carries the set of manual mesh
axes it varies over (``ShapedArray.vma``), and a primitive's abstract eval
*is* its rule. ``pallas_call`` takes its output types from ``out_shape``, which
must then say ``vma=`` itself. reprules therefore works at the call:

* it asks the kernel's rule for the output sets, writes them into
  ``out_shape`` and casts inputs up with ``pvary`` (whose transpose is the
  needed psum);
* it fixes the interpret-mode lowering for registered kernels (JAX's HLO
  interpreter starts output buffers invariant, then its while loop refuses the
  varying body: a carry-type error from 0.6.2 on);
* it psums a ``custom_vjp`` cotangent over the axes it varies over and its
  primal does not (JAX <= 0.5 did this itself; from 0.6.2 JAX refuses it).

The *mat* regime (0.10+) is the same design with another type field; see
``mat.py``, which subclasses :class:`TypeField`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from reprules import _errors, _modes
from reprules._decide import decide
from reprules._registry import Registration, kernel_name, lookup
from reprules._shim import _common, _verify
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
    from jax._src import core

    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if not varying or (mesh is not None and not getattr(mesh, "empty", False)):
        return {}
    get_cur_mesh_sharding = getattr(core, "get_cur_mesh_sharding", None)
    return {"sharding": get_cur_mesh_sharding()} if get_cur_mesh_sharding else {}


def detect() -> bool:
    from jax._src import core

    return "vma" in getattr(core.ShapedArray, "__slots__", ()) or hasattr(core.ShapedArray, "vma")


def checking() -> bool:
    """Whether the innermost ``shard_map`` being traced has checking on."""
    from jax._src import config

    return bool(config._check_vma.value)


def manual_axes() -> tuple[str, ...]:
    from jax._src import mesh as mesh_lib

    return tuple(mesh_lib.get_abstract_mesh().manual_axes)


def cast_up(x: Any, axes: frozenset[str]) -> Any:
    from jax._src import core

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


class Regime:
    """Everything the vma and mat regimes do, parameterised by the type field."""

    def __init__(self, field: TypeField):
        self.field = field

    # -- the call ---------------------------------------------------------------

    def wrap_call(
        self,
        kernel: Any,
        out_shape: Any,
        make_call: Callable[[Any], Callable[..., Any]],
        call: Callable[..., Any],
    ) -> Callable[..., Any]:
        return functools.partial(self._call, kernel, out_shape, make_call, call)

    def _call(self, kernel: Any, out_shape: Any, make_call: Callable[[Any], Callable[..., Any]],
              call: Callable[..., Any], *args: Any) -> Any:
        reg = lookup(kernel)
        if reg is None:
            return self._unregistered_call(kernel, call, *args)
        return self._registered_call(reg, out_shape, make_call, call, *args)

    def _unregistered_call(self, kernel: Any, call: Callable[..., Any], *args: Any) -> Any:
        try:
            return call(*args)
        except ValueError as err:
            if checking() and "must not be `None`" in str(err):
                raise _errors.MissingRuleError(
                    _errors.missing_rule_message(
                        kernel_name(kernel), manual_axes(), _common.JAX_VERSION
                    )
                ) from err
            raise

    def _registered_call(
        self,
        reg: Registration,
        out_shape: Any,
        make_call: Callable[[Any], Callable[..., Any]],
        call: Callable[..., Any],
        *args: Any,
    ) -> Any:
        if not checking():
            return call(*args)
        flat_args, in_tree = jax.tree_util.tree_flatten(args)
        if isinstance(out_shape, list):  # pallas_call canonicalises lists to tuples
            out_shape = tuple(out_shape)
        flat_out, out_tree = jax.tree_util.tree_flatten(out_shape)
        in_vary = tuple(self.field.varying(jax.typeof(a)) for a in flat_args)
        ctx = _common.rule_context(reg, manual_axes(), len(flat_args), len(flat_out))
        decision = decide(reg, ctx, in_vary)
        flat_args = _cast_inputs(flat_args, in_vary, decision.inputs)
        new_out = [
            s if self.field.annotated(s) else self._annotate(s, vary)
            for s, vary in zip(flat_out, decision.outputs)
        ]
        args = jax.tree_util.tree_unflatten(in_tree, flat_args)
        with _common.tracing(reg):
            out = make_call(jax.tree_util.tree_unflatten(out_tree, new_out))(*args)
        self._maybe_verify(reg, jax.tree_util.tree_leaves(out))
        return out

    def _maybe_verify(self, reg: Registration, outs: Sequence[Any]) -> None:
        if _modes.verifying():
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
        from jax._src import config

        field = self.field

        def lowering(ctx: Any, *in_nodes: Any, **params: Any) -> Any:
            # Only plain interpret=True (the HLO interpreter) has the carry-type
            # bug; InterpretParams objects take other paths that work.
            if params.get("interpret") is True and _common.registration_of(params) is not None:
                ctx = ctx.replace(
                    avals_in=[field.strip(a) for a in ctx.avals_in],
                    avals_out=[field.strip(a) for a in ctx.avals_out],
                )
                with config._check_vma(False):
                    return original(ctx, *in_nodes, **params)
            return original(ctx, *in_nodes, **params)

        return lowering

    def _fix_custom_vjp_cotangents(self, original: Callable[..., Any]) -> Callable[..., Any]:
        from jax._src import linear_util as lu

        field = self.field

        def fix_leaf(ct: Any, primal_aval: Any) -> Any:
            if ct is None or type(ct).__name__ == "SymbolicZero" or not hasattr(primal_aval, "shape"):
                return ct
            try:
                have = field.varying(jax.typeof(ct))
            except TypeError:
                return ct
            want = field.varying(primal_aval)
            if have - want:  # e.g. a replicated weight's gradient from sharded activations
                ct = psum(ct, have - want)
            if want - have:  # a replicated cotangent for a varying input: free cast
                ct = cast_up(ct, want - have)
            return ct

        def fix(py_cts_in: Any, in_tree: Any, in_avals: Sequence[Any]) -> Any:
            try:
                cts = tuple(py_cts_in) if isinstance(py_cts_in, list) else py_cts_in
                primal = jax.tree_util.tree_unflatten(in_tree, list(in_avals))
                return jax.tree_util.tree_map(
                    lambda ct, a: None if ct is None else fix_leaf(ct, a),
                    cts,
                    primal,
                    is_leaf=lambda x: x is None,
                )
            except (ValueError, TypeError):
                return py_cts_in  # a malformed bwd output: JAX's own check reports it

        def gen(f: Callable[..., Any], in_tree: Any, in_avals: Any, with_logs: bool, *args: Any):
            out = f(*args)
            if with_logs and isinstance(out, (tuple, list)) and len(out) == 2:
                return fix(out[0], in_tree, in_avals), out[1]
            return fix(out, in_tree, in_avals)

        def flatten_bwd(bwd: Any, in_tree: Any, in_avals: Any, *rest: Any, **kwargs: Any) -> Any:
            # 0.12 added (primal_fun, symbolic_zeros, with_logs) after out_trees.
            with_logs = bool(rest[3]) if len(rest) >= 4 else bool(kwargs.get("with_logs", False))
            fixed = lu.transformation2(gen)(bwd, in_tree, tuple(in_avals), with_logs)
            return original(fixed, in_tree, in_avals, *rest, **kwargs)

        return flatten_bwd

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
                first, num_out = op.layout(params, len(args))
                in_vary = tuple(field.varying(jax.typeof(a)) for a in args[first:])
                decision = decide(reg, context(reg, len(in_vary), num_out or 1), in_vary)
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

        original = pe.DynamicJaxprTrace.default_process_primitive
        field = self.field

        def default_process_primitive(trace: Any, primitive: Any, tracers: Any, params: Any, *rest: Any, **kw: Any) -> Any:
            out = original(trace, primitive, tracers, params, *rest, **kw)
            if _modes.strict_on() and checking() and not _exempt(primitive, params):
                in_vary = frozenset().union(*(field.varying(getattr(t, "aval", None)) for t in tracers))
                outs = out if primitive.multiple_results else [out]
                for index, o in enumerate(outs):
                    missing = in_vary - field.varying(getattr(o, "aval", None))
                    if missing and hasattr(getattr(o, "aval", None), "shape"):
                        raise _errors.StrictModeError(_strict_message(primitive, params, index, in_vary, missing))
            return out

        patches.setattr(pe.DynamicJaxprTrace, "default_process_primitive", default_process_primitive)

    def install(self, patches: _common.Patches) -> None:
        from jax._src import custom_derivatives
        from jax._src.interpreters import mlir

        prim = _common.pallas_call_p()
        entry = mlir._lowerings[prim]
        original_rule = getattr(entry, "rule", entry)  # LoweringRuleEntry since 0.7
        new_rule = self._interpret_lowering(original_rule)
        new_entry = dataclasses.replace(entry, rule=new_rule) if hasattr(entry, "rule") else new_rule
        patches.setitem(mlir._lowerings, prim, new_entry)
        patches.setattr(
            custom_derivatives,
            "_flatten_bwd",
            self._fix_custom_vjp_cotangents(custom_derivatives._flatten_bwd),
        )
        _common.install_pallas_hooks(patches, self.wrap_call)
        ffi = _common.ffi_opaque()
        if ffi is not None:
            self.attach(ffi, patches)


_COLLECTIVE_PARAMS = ("axes", "axis_name", "axis_index_groups")


def _exempt(primitive: Any, params: dict[str, Any]) -> bool:
    """JAX's collectives and higher-order primitives type their outputs
    themselves; registered opaque primitives are typed by their rules."""
    if any(k in params for k in _COLLECTIVE_PARAMS):
        return True
    opaque = _describe(primitive)
    if opaque is None:  # pjit, shard_map, custom_vjp, scan, cond, ...: typed from their jaxprs
        return True
    return opaque.lookup(params) is not None


def _describe(primitive: Any) -> _common.Opaque | None:
    import sys

    if primitive is _common.pallas_call_p():
        return _common.pallas_opaque()
    ffi = _common.ffi_opaque()
    if ffi is not None and primitive is ffi.prim:
        return ffi
    if "jax_triton" in sys.modules:
        triton = _common.triton_opaque()
        if primitive is triton.prim:
            return triton
    if _has_subjaxpr(primitive):
        return None
    return _common.primitive_opaque(primitive)


def _has_subjaxpr(primitive: Any) -> bool:
    # Recognised by name, since params are only known per equation.
    return primitive.name in {
        "pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call",
        "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin", "scan", "cond", "while",
        "shard_map", "xla_call", "xla_pmap", "run_state", "for", "custom_transpose_call",
        "linear_call", "pure_callback", "io_callback", "debug_callback",
    }


def _strict_message(primitive: Any, params: dict[str, Any], index: int, in_vary: frozenset[str], missing: frozenset[str]) -> str:
    opaque = _describe(primitive)
    kind = opaque.kind if opaque else "primitive"
    name = opaque.name(params) if opaque else primitive.name
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
