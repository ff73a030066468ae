"""``pl.pallas_call`` under checking (vma and mat eras): the adapter that types its outputs.

There is no rule registry from 0.6 on: each value's type carries the set of
manual mesh axes it varies over, and a primitive's abstract eval *is* its
rule. ``pallas_call`` takes its output types from ``out_shape``, which must
then say ``vma=`` (``manual_axis_type=`` from 0.10) itself. reprules works at
the call's bind (found by its kernel jaxpr whenever the call object was built,
see ``_identity``):

* it asks the kernel's rule for the output sets and types the outputs the
  user's out_shape left unannotated with them. It casts inputs up with
  ``pvary`` only where an output aliases an input (JAX types that output like
  its input): ``pallas_call`` has no transpose rule, so a cast's transpose (a
  psum) would never run, and the casts would only add equations to stage and
  lower. A ``custom_vjp`` around the kernel gets its psums from ``custom_vjp``;
* it fixes the interpret-mode lowering for registered kernels (JAX's HLO
  interpreter starts output buffers invariant, then its while loop refuses the
  varying body: a carry-type error from 0.6.2 on; JAX's TPU interpreter
  compares program ids of a grid whose size varies per device, megablox's with
  per-shard group sizes, with invariant constants: a vma error);
* on 0.7 - 0.8 it traces a registered kernel's JVP body with the check off.

JAX converts a pallas_call's out_shape before it traces the kernel, so the
conversion cannot know whether a rule applies: it lets unannotated leaves
through (JAX's refusal kept), and the bind, which knows the kernel, types them
by the rule or raises that refusal as a MissingRuleError.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from reprules import _errors
from reprules._messages import advice
from reprules._registry import Registration
from reprules.rules import Decision
from reprules._shim.plumbing import _frames, _jax
from reprules._shim.kernels import _identity
from reprules._shim.inference import infer
from reprules._shim.rules import _resolve, _union
from reprules._shim.safety import _verify
from reprules._shim.entry_points import _pallas_hooks
from reprules._shim.kernels._identity import PallasCall
from reprules._shim.plumbing._patches import Patches
from reprules._shim.plumbing._types import TypeField, call_axes, cast_inputs, checking, manual_axes


class _Unannotated(threading.local):
    """Types JAX made from out_shape leaves without the user's annotation, for
    the ``pallas_call`` bind that follows in the same call, each with JAX's
    refusal of the leaf if it refused it.

    Matched by identity *and* by the JAX frame that converted them (the call's
    ``wrapped``, which binds too): JAX interns types, so a later call's
    annotated leaf can be the very object an earlier call left here. A call
    that raised between its conversion and its bind (JAX refusing an operand,
    the kernel failing to trace) leaves its items behind; they are dropped as
    soon as its frame is seen finished (``_frames.running``)."""

    LIMIT = 1024  # a bound, whatever happens

    def __init__(self) -> None:
        self.items: list[tuple[Any, Any, Exception | None]] = []  # (frame, type, refusal)

    def add(self, aval: Any, refusal: Exception | None) -> None:
        frame = _frames.jax_frame()
        if self.items and self.items[-1][0] is not frame:
            self._drop_finished()
        self.items.append((frame, aval, refusal))
        del self.items[: -self.LIMIT]

    def take(self, avals: Sequence[Any]) -> dict[int, Exception | None]:
        """``{output index: refusal}`` of the unannotated ones among ``avals``
        (converted by the frame that binds them)."""
        if not self.items:
            return {}
        frame = _frames.jax_frame()
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
        self.items = [item for item, live in zip(self.items, _frames.running(owners)) if live]


_unannotated = _Unannotated()


class _RefusedLeaves:
    """Unannotated out_shape leaves JAX refused under checking: per leaf, the same
    leaf typed replicated (what JAX is given instead) and JAX's refusal. A model
    builds the same out_shape at every call of a kernel; this spares it a raise
    and a ShapeDtypeStruct each time. Keyed by exactly the fields
    :meth:`TypeField.sds` reads; bounded (it holds no tracer, no kernel)."""

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
    tpu_params = _jax.module("jax._src.pallas.mosaic.interpret.params")  # 0.10+: the lowering's import
    if tpu_params is not None:
        return tpu_params.InterpretParams  # type: ignore[no-any-return]
    # 0.6 - 0.9: pallas_call.py imports the interpreter module at its bottom as
    # mosaic_tpu_interpret (a stand-in class no value is an instance of where
    # that import fails).
    module = getattr(_jax.module("jax._src.pallas.pallas_call"), "mosaic_tpu_interpret", None)
    params_type = getattr(module, "InterpretParams", None)
    return params_type if isinstance(params_type, type) else None


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


def _install_kernel_jvp_fix(patches: Patches) -> None:
    """JAX 0.7 - 0.8: the JVP of a ``pallas_call`` re-traces the kernel body
    (``ad.jvp_jaxpr``) inside the ``shard_map``, where ``check_vma`` holds, and
    the body's refs keep the varying axes of the operands *before* reprules
    cast them up: ``Primitive mul requires varying manual axes to match``.
    Types inside a kernel body are per block and never reach the program (the
    call's output types come from the rule), so for a registered kernel the
    body's JVP is traced with the check off, as JAX 0.9 effectively does."""
    if _jax.version_tuple()[:2] not in ((0, 7), (0, 8)):
        return
    ad = _jax.module("jax._src.interpreters.ad")
    prim = _jax.pallas_call_p()
    original = ad.primitive_jvps[prim]

    def jvp(primals: Any, tangents: Any, **params: Any) -> Any:
        if _resolve.pallas_registration(params) is None:
            return original(primals, tangents, **params)
        with _jax.config._check_vma(False):
            return original(primals, tangents, **params)

    patches.setitem(ad.primitive_jvps, prim, jvp, label="jax._src.interpreters.ad.primitive_jvps[pallas_call]")


class TypedPallasCall:
    """The ``pallas_call`` adapter of one era, given how that era's types hold varying axes."""

    def __init__(self, field: TypeField):
        self.field = field

    def install(self, patches: Patches) -> None:
        """The lowering fix, the JVP fix, and the hooks on every call's tracing and bind."""
        lowering = _jax.module("jax._src.interpreters.mlir")
        prim = _jax.pallas_call_p()
        entry = lowering._lowerings[prim]
        original_rule: Any = getattr(entry, "rule", entry)  # LoweringRuleEntry since 0.7
        # Guarded here too: a LoweringRuleEntry is not callable, so setitem cannot guard it.
        new_rule = patches.guard(self._interpret_lowering(original_rule), lambda: original_rule)
        new_entry = dataclasses.replace(entry, rule=new_rule) if hasattr(entry, "rule") else new_rule
        patches.setitem(lowering._lowerings, prim, new_entry,
                        label="jax._src.interpreters.mlir._lowerings[pallas_call]")
        _install_kernel_jvp_fix(patches)
        _pallas_hooks.install_pallas_hooks(patches, self._bind, self._convert_out_shape)

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
                replicated, refusal = self.field.sds(leaf, frozenset()), err.with_traceback(None)
                _refused.put(leaf, (replicated, refusal))
                aval = original(replicated)
        _unannotated.add(aval, refusal)
        return aval

    def _bind(self, bind: Callable[..., Any], args: tuple[Any, ...], call: PallasCall,
              reg: Registration | None) -> Any:
        params, direct = call.params, call.direct
        unannotated = _unannotated.take(params.get("out_avals", ()))
        if reg is None:
            refusal = next((err for err in unannotated.values() if err is not None), None)
            if refusal is None and not self._hlo_interpreter_refuses(params, args):
                return bind(*args, **params)
            # JAX would refuse this call: the rule derived from its body, by default.
            reg = _resolve.infer_by_default(call)
            direct = True
            if reg is None:
                # JAX's own failure, where it accepted the out_shape, comes at lowering and advises
                # check_vma=False (a carry-type or "please open an issue" error): said here instead.
                jax_error = str(refusal) if refusal is not None else (
                    "none at this call; at lowering, its HLO interpreter (interpret=True) fails on any "
                    "kernel with an operand that varies over a mesh axis, under checking, even with an "
                    "annotated out_shape (a carry-type or varying-axes mismatch in its loop)")
                raise _errors.MissingRuleError(
                    advice.missing_rule_message(
                        call.name, manual_axes(), _jax.JAX_VERSION,
                        jax_error=jax_error, inference=_resolve.inference_note(call, manual_axes()),
                        site=call.site_text, findings=_resolve.body_findings(call),
                        function=call.function_name,
                    )
                ) from refusal
        decided = None
        if direct and checking():
            first, _ = _identity.pallas_layout(params, len(args))
            first = infer.rule_operands_start(reg, first)
            out_avals = tuple(params["out_avals"])
            in_avals = [jax.typeof(a) for a in args[first:]]
            in_vary = tuple([self.field.varying(a) for a in in_avals])
            decided = _resolve.decide_here(reg, in_vary, len(out_avals))
        if decided is None:
            # Outside a checked shard_map, or a JVP/vmap of a call typed already.
            return _pallas_hooks.traced_bind(bind, args, call, reg)
        decision, manual = decided
        with call_axes(manual, in_avals):
            return self._bind_decided(bind, args, call, reg, first, in_vary, out_avals, decision, unannotated)

    def _hlo_interpreter_refuses(self, params: dict[str, Any], args: tuple[Any, ...]) -> bool:
        """Whether JAX will fail this call though it accepted its out_shape (annotated by
        hand, or ``ShapeDtypeStruct.like`` an operand, as JAX 0.10+'s TPU flash attention's
        dq kernel): under checking, JAX's HLO interpreter (``interpret=True``, also what
        ``force_tpu_interpret_mode(True)`` picks) fails at lowering on every call with a
        varying operand (a vma or carry-type error in its loop; measured on 0.6.2 - 0.12).
        Such a call gets its rule by default too, and the lowering fix runs it."""
        return (params.get("interpret") is True and checking()
                and any(self.field.varying(jax.typeof(a)) for a in args))

    def _bind_decided(self, bind: Callable[..., Any], args: tuple[Any, ...], call: PallasCall,
                      reg: Registration, first: int, in_vary: tuple[frozenset[str], ...],
                      out_avals: tuple[Any, ...], decision: Decision, unannotated: dict[int, Any]) -> Any:
        params = call.params
        # An annotated output keeps its annotation only where that claims no fewer axes
        # than the rule (derived or declared): see _union.
        widened = self._check_annotations(reg, call, out_avals, decision.outputs, unannotated)
        # No transpose rule, so no cast is ever transposed: cast only where JAX types an
        # output like its input (aliasing). See the module docstring.
        if params.get("input_output_aliases"):
            args = (*args[:first], *cast_inputs(args[first:], in_vary, decision.inputs))
        out_avals = tuple(
            self.field.retype(aval, vary) if i in unannotated else widened.get(i, aval)
            for i, (aval, vary) in enumerate(zip(out_avals, decision.outputs))
        )
        with _identity.tracing(reg):
            out = bind(*args, **{**params, "out_avals": out_avals})
        _verify.check_outputs(self.field, reg, list(out))
        if widened:  # for a pcast of these outputs to varying (see pcast.py)
            _union.remember(self.field, out_avals, out, params["out_avals"], widened)
        return out

    def _check_annotations(self, reg: Registration, call: PallasCall, out_avals: Sequence[Any],
                           derived: Sequence[frozenset[str]], unannotated: dict[int, Any]) -> dict[int, Any]:
        """An out_shape annotated by hand (or copied from an operand's type, as
        ``jax.ShapeDtypeStruct.like`` does) that claims an output replicated over
        an axis its rule (derived from the body, or declared) types it varying
        over is widened to the union (see ``_union``): JAX alone would believe the
        annotation, and the gradient (or out_specs) would silently be wrong."""
        kept = [i not in unannotated for i in range(len(out_avals))]
        if not any(kept):  # every output typed by the rule: nothing to compare
            return {}
        aliased = {int(o): int(i) for i, o in call.params.get("input_output_aliases") or ()}

        def subject() -> _union.Subject:
            return f"Pallas kernel {call.name!r}", call.site_text, _union.rule_text(reg)

        return _union.widen(self.field, out_avals, derived, kept, aliased, subject)

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
            if _interpreted(params.get("interpret")) and _resolve.pallas_registration(params) is not None:
                untyped = _retyped(ctx, [field.strip(a) for a in ctx.avals_in],
                                   [field.strip(a) for a in ctx.avals_out])
                with _jax.config._check_vma(False):
                    out = original(untyped, *in_nodes, **params)
                # The TPU interpreter's callbacks have effects: their tokens are
                # set on the context it was given, JAX reads them from ctx.
                if untyped.tokens_out is not None:
                    ctx.set_tokens_out(untyped.tokens_out)
                return out
            return original(ctx, *in_nodes, **params)

        return lowering

