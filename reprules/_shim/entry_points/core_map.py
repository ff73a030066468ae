"""Rules for Pallas' second entry point: ``pl.kernel`` and ``pl.core_map`` (vma and mat regimes).

``pl.pallas_call`` binds ``pallas_call_p`` (see ``pallas_call``). ``pl.kernel``
(JAX 0.8+) and ``pl.core_map`` (0.4.38+) bind other primitives, and a rule is
registered on the kernel *body* (the function passed to ``pl.kernel``), found
by identity when a call is traced, however early the ``pl.kernel`` object was
built (before reprules activated, before the rule was registered):

* **0.8 - 0.9** (``core_map_p``). ``pl.kernel`` returns a ``jax.jit`` of a
  closure (``helpers._make_kernel.<locals>.wrapper``) that makes one ref per
  input (``new_ref(x)``) and per output (``new_ref(lax.empty(...))``), runs the
  body on them under ``pl.core_map``, and reads the output refs back. JAX types
  the outputs by those refs, and ``lax.empty`` is replicated: every output is
  typed replicated, whatever the body writes (silently; ``out_specs=P()`` is
  accepted). reprules hooks ``core.new_ref``, looked up by that closure when it
  is traced, and, for a registered body inside a checked ``shard_map``, makes
  each input ref from the input cast up as the rule says and each output ref
  from ``lax.empty`` cast up to the rule's varying axes: the outputs read back
  have the rule's types. The closure is recognised by its code object, and the
  body, operands and out_shape are read from its frame. When JAX later
  discharges that ``core_map`` (into a ``pallas_call`` on 0.8, an ``mpmd_map``
  on 0.9), the equation it makes is marked as the body's, so strict mode and
  reports see the rule there too.
* **0.10 - 0.12** (``mpmd_map_p``, ``pl.kernel`` over ``mpmd._mpmd_map``). The
  out_shape is converted to types when the ``pl.kernel`` object is built, and
  JAX refuses an unannotated ``ShapeDtypeStruct`` under checking. reprules
  hooks ``_mpmd_map`` (looked up when ``pl.kernel`` is called): it lets such a
  leaf through when a body is registered (JAX's refusal otherwise) and records,
  per kernel object, which leaves the user annotated (types cannot tell: JAX
  interns them). At the ``mpmd_map_p`` bind made by the kernel object
  (``_mpmd_map.<locals>.wrapper``, found by its code object), it types the
  outputs the user did not annotate by the rule and casts inputs up, as for
  ``pallas_call``. A kernel object built before reprules activated has no
  record: its outputs typed varying are taken as annotated, the rest follow
  the rule.
* **MPMD** (0.10+: ``pl.kernel(body=[f, g], mesh=[m1, m2], ...)``): the bodies
  run as one kernel with one set of outputs. Every registered body's rule is
  asked; they must agree (:class:`reprules.RuleError` naming them otherwise),
  and their answer types the kernel, bodies without a rule included.
* **``pl.core_map`` called directly** (``core_map_p``; from 0.11 an
  ``mpmd_map`` made in ``core_map.<locals>.wrapped``) has no outputs: it writes
  into refs its caller made, whose types JAX takes from the values they were
  made from. A rule cannot change them, so a registered function passed to
  ``pl.core_map`` is refused inside a checked ``shard_map``
  (:class:`reprules.RuleError`) rather than silently ignored. (On 0.4.38 - 0.5
  JAX refuses core_map programs under ``check_rep`` itself: no rule for
  ``run_state``; nothing is installed there.)

Rule-less bodies run exactly as with JAX alone. Equations of registered
kernels are remembered (kernel jaxpr -> body) so that reports, strict mode and
``custom_vjp`` handling find them by identity.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import jax

from reprules import _errors, _mode_state
from reprules._messages import advice, calls
from reprules._registry import Registration, kernel_name, lookup
from reprules._shim.plumbing import _frames, _jax, _types
from reprules._shim.kernels import _bodies, _identity
from reprules._shim.inference import infer
from reprules._shim.rules import _kernel_inference, _resolve, _union
from reprules._shim.safety import _verify
from reprules._shim.plumbing._patches import Patches
from reprules._shim.rules._resolve import kernel_registration_of
from reprules._shim.plumbing._types import TypeField, call_axes, cast_up, checking, in_checked_shard_map, manual_axes
from reprules.rules import Decision

# --- the hooks ------------------------------------------------------------------------


def install(patches: Patches, field: TypeField) -> None:
    """Installs the ``pl.kernel`` / ``pl.core_map`` hooks of this JAX (vma and mat regimes)."""
    codes = _bodies.find_codes()
    hooks = _Hooks(field, codes)
    pallas_core = _jax.module("jax._src.pallas.core")
    core_map_p: Any = getattr(pallas_core, "core_map_p", None)
    if core_map_p is not None and codes.core_map_wrapped is not None:
        _bodies.mark_kernel_primitive(core_map_p, "core_map")
        patches.setattr(core_map_p, "bind", hooks.core_map_bind(functools.partial(type(core_map_p).bind, core_map_p)))
    if codes.kernel_wrapper is not None and codes.kernel_out_ref is not None:  # 0.8 - 0.9
        core, discharge = _jax.core, _jax.module("jax._src.state.discharge")
        patches.setattr(core, "new_ref", hooks.new_ref(core.new_ref))
        rule = discharge._discharge_rules.get(core_map_p)
        if rule is not None:
            patches.setitem(discharge._discharge_rules, core_map_p, hooks.discharge(rule),
                            label="jax._src.state.discharge._discharge_rules[core_map]")
    mpmd = _jax.loaded("jax._src.pallas.mpmd")  # 0.9+, imported by find_codes
    if mpmd is not None:  # 0.9: core_map's discharge binds it; 0.10+: pl.kernel, 0.11+: pl.core_map
        prim = mpmd.mpmd_map_p
        _bodies.mark_kernel_primitive(prim, "mpmd_map")
        patches.setattr(prim, "bind", hooks.mpmd_bind(functools.partial(type(prim).bind, prim)))
    if codes.mpmd_wrapper is not None and mpmd is not None:  # 0.10+
        patches.setattr(mpmd, "_mpmd_map", hooks.make(mpmd._mpmd_map))
        # Wraps reprules' pallas_call conversion hook (or JAX's), which leaves mpmd's leaves to JAX.
        convert = pallas_core._convert_out_shape_to_aval
        patches.setattr(pallas_core, "_convert_out_shape_to_aval", hooks.convert(convert))


@dataclasses.dataclass
class _Activation:
    """One trace of a 0.8 - 0.9 ``pl.kernel`` closure whose body has a rule."""

    frame: FrameType
    reg: Registration
    decision: Decision
    out_leaves: list[Any]
    manual: tuple[str, ...]  # the manual axes it was decided over (see _types.hidden_axes)
    in_avals: list[Any]
    next_in: int = 0
    next_out: int = 0


class _State(threading.local):
    # Activations hold their wrapper's frame (matched by identity, so a stale one is
    # never taken for a new call's); those of calls that raised before their
    # core_map are dropped when the next one is made, and this bounds them anyway.
    LIMIT = 16

    def __init__(self) -> None:
        self.activations: list[_Activation] = []


_state = _State()


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """How the out_shape leaves of one 0.10+ ``pl.kernel`` object were made into types.

    Types cannot tell (JAX interns them: equal types are one object), so this is
    kept per kernel object, under the identity of its ``flat_out_avals`` tuple.
    """

    avals: tuple[Any, ...]
    honoured: tuple[bool, ...]  # the user's annotation, which JAX used (made under checking)
    let_through: tuple[bool, ...]  # unannotated: let through only because a body had a rule


_outputs: dict[int, _Outputs] = {}  # id(flat_out_avals) -> ..., dropped when the kernel object dies
_outputs_lock = threading.Lock()
_letting_through: contextvars.ContextVar[bool] = contextvars.ContextVar("reprules_mpmd_let", default=False)
# 0.8 - 0.9: the body whose core_map JAX is discharging (into a pallas_call or an mpmd_map).
_discharging: contextvars.ContextVar[Any] = contextvars.ContextVar("reprules_discharging", default=None)
# 0.9: JAX is discharging a core_map without a rule under reprules.inference().
_discharging_inferred: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "reprules_discharging_inferred", default=False)


class _Hooks:
    def __init__(self, field: TypeField, codes: _bodies.Codes) -> None:
        self.field = field
        self.codes = codes

    # -- shared --------------------------------------------------------------------

    def _in_varying(self, leaves: Sequence[Any]) -> tuple[frozenset[str], ...]:
        out = []
        for leaf in leaves:
            aval = jax.typeof(leaf)
            inner = getattr(aval, "inner_aval", aval)  # a Ref varies like its contents
            out.append(self.field.varying(inner))
        return tuple(out)

    # -- 0.8 - 0.9: output refs made with the rule's types --------------------------

    def new_ref(self, original: Callable[..., Any]) -> Callable[..., Any]:
        codes = self.codes

        def new_ref(init_val: Any, *args: Any, **kwargs: Any) -> Any:
            caller = _frames.outside_reprules() if checking() else None
            if caller is None:
                return original(init_val, *args, **kwargs)
            is_out = caller.f_code is codes.kernel_out_ref
            wrapper: FrameType | None = caller
            if not is_out:  # an input ref: made through tree_map, directly in the wrapper
                while wrapper is not None and wrapper.f_globals.get("__name__") == "jax._src.tree_util":
                    wrapper = wrapper.f_back
            else:
                while wrapper is not None and wrapper.f_code is not codes.kernel_wrapper:
                    wrapper = wrapper.f_back
            if wrapper is None or wrapper.f_code is not codes.kernel_wrapper or not in_checked_shard_map():
                return original(init_val, *args, **kwargs)
            act = self._activation(wrapper)
            if act is None:
                return original(init_val, *args, **kwargs)
            now = self.field.varying(jax.typeof(init_val))
            if is_out:
                index, act.next_out = act.next_out, act.next_out + 1
                target = self._out_target(act, index)
            else:
                index, act.next_in = act.next_in, act.next_in + 1
                inputs = act.decision.inputs
                target = inputs[index] if inputs is not None and index < len(inputs) else now
            # A Ref operand (jax.new_ref(w) passed to the kernel) keeps the type JAX gave
            # it outside: a Ref cannot be cast (pvary refuses one), and the rule's output
            # types do not need it to be (the output refs carry them).
            if target - now and not _kernel_inference.is_ref(init_val):
                with call_axes(act.manual, act.in_avals):
                    init_val = cast_up(init_val, target - now)
            return original(init_val, *args, **kwargs)

        return new_ref

    @staticmethod
    def _refusal(local: dict[str, Any], refusal: infer.Refusal) -> _errors.MissingRuleError:
        """0.8 - 0.9: JAX alone types a rule-less pl.kernel's outputs replicated, whatever
        its body writes. Under inference that would be a rule nobody proved, so a body
        inference cannot prove is refused, saying why."""
        name, axes = kernel_name(local.get("body")), manual_axes()
        return _errors.MissingRuleError(advice.missing_rule_message(
            name, axes, _jax.JAX_VERSION,
            jax_error=f"none: JAX {_jax.JAX_VERSION} types every output of a pl.kernel "
                      "replicated, whatever its body writes; under inference reprules refuses "
                      "that rather than let an unproven type through",
            inference=infer.refusal_text(refusal, name, axes, _jax.JAX_VERSION),
            findings=infer.findings(refusal),
        ))

    def _out_target(self, act: _Activation, index: int) -> frozenset[str]:
        leaf = act.out_leaves[index] if index < len(act.out_leaves) else None
        # The user's own annotation wins, as for pallas_call (JAX 0.8 - 0.9 alone ignore it here).
        if leaf is not None and self.field.annotated(leaf):
            return frozenset(getattr(leaf, self.field.sds_keyword, None) or ())
        return act.decision.outputs[index] if index < len(act.decision.outputs) else frozenset()

    def _activation(self, wrapper: FrameType) -> _Activation | None:
        acts = _state.activations
        if acts and acts[-1].frame is wrapper:
            return acts[-1]
        if _kernel_inference.trialing.get():  # reprules' own trace of a body, for inference
            return None
        local = _frames.frame_locals(wrapper)
        reg = lookup(local.get("body"))
        operands = jax.tree_util.tree_leaves(local.get("operands", ()))
        out_leaves = jax.tree_util.tree_leaves(local.get("out_shape", ()))
        in_vary = self._in_varying(operands)
        if reg is None:
            # JAX alone types every output replicated: by default, the derived rule
            # instead where the body is provably local (else JAX's types stand).
            explicit = _resolve.infers_function(local.get("body"))
            if not explicit and not _mode_state.inferring_by_default():
                return None
            found = _kernel_inference.for_kernel_call(local, len(operands), len(out_leaves))
            if not isinstance(found, Registration):
                if explicit:
                    raise self._refusal(local, found)
                return None
            reg = found
        decided = _resolve.decide_here(reg, in_vary, len(out_leaves))
        if decided is None:
            return None
        if any(decided[0].outputs) and _types.mesh_hides(decided[1]):
            raise _errors.RuleError(calls.hidden_mesh_core_map_message(
                reg.name, decided[0].outputs, decided[1], _jax.JAX_VERSION))
        _identity.note_registered_call()
        act = _Activation(wrapper, reg, decided[0], out_leaves, decided[1], [jax.typeof(x) for x in operands])
        if acts:  # left by calls that raised before their core_map: dropped once finished
            acts[:] = [a for a, live in zip(acts, _frames.running([a.frame for a in acts])) if live]
        acts.append(act)
        del acts[: -_State.LIMIT]
        return act

    # -- core_map_p: pl.kernel (0.8 - 0.9) and pl.core_map -----------------------------

    def core_map_bind(self, original: Callable[..., Any]) -> Callable[..., Any]:
        codes = self.codes

        def bind(*args: Any, **params: Any) -> Any:
            wrapped = _frames.outside_reprules()
            if wrapped is None or wrapped.f_code is not codes.core_map_wrapped or _kernel_inference.trialing.get():
                return original(*args, **params)  # a re-bind (discharge, vmap, ...)
            outer = wrapped.f_back
            if outer is not None and codes.kernel_wrapper is not None and outer.f_code is codes.kernel_wrapper:
                return self._kernel_core_map(original, outer, args, params)
            reg = lookup(_frames.frame_locals(wrapped).get("f"))  # pl.core_map called directly
            if reg is not None and in_checked_shard_map():
                raise _errors.RuleError(calls.core_map_rule_message(reg.where, repr(reg.rule), reg.name, manual_axes(), _jax.JAX_VERSION))
            return original(*args, **params)

        return bind

    def _kernel_core_map(self, original: Callable[..., Any], wrapper: FrameType,
                         args: tuple[Any, ...], params: dict[str, Any]) -> Any:
        local = _frames.frame_locals(wrapper)
        body = local.get("body")
        acts = _state.activations
        act = acts.pop() if acts and acts[-1].frame is wrapper else None
        out = original(*args, **params)
        if body is not None:
            _bodies.remember((params.get("jaxpr"),), body)
        reg = act.reg if act is not None else lookup(body)
        if act is not None and isinstance(act.reg.rule, infer.InferredRule):
            _bodies.remember_inferred((params.get("jaxpr"),), act.reg)
        if reg is not None and act is not None and _mode_state.verifying():
            refs = jax.tree_util.tree_leaves(local.get("out_refs", ()))
            values = [ref[...] for ref in refs]
            _verify.check_outputs(self.field, reg, values)
        return out

    def discharge(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Marks the ``pallas_call`` (0.8) or ``mpmd_map`` (0.9) that JAX discharges a
        registered body's ``core_map`` into as that body's, so that strict mode and
        reports see its rule (the refs already carry the rule's types)."""

        def discharge(*args: Any, **params: Any) -> Any:
            reg = kernel_registration_of(params)
            if reg is None:
                if not _mode_state.inferring():
                    return original(*args, **params)
                token = _discharging_inferred.set(True)
                try:
                    return original(*args, **params)
                finally:
                    _discharging_inferred.reset(token)
            token = _discharging.set(reg.kernel())
            try:
                with _identity.tracing(reg):
                    return original(*args, **params)
            finally:
                _discharging.reset(token)

        return discharge

    # -- mpmd_map_p (0.10+) ------------------------------------------------------------

    def make(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Hooks ``mpmd._mpmd_map``, which builds the kernel object when ``pl.kernel`` is called."""
        field = self.field

        def make(*args: Any, **kwargs: Any) -> Any:
            fns = [fn for _, fn in (args[0] if args else kwargs.get("meshes_and_fns", ()))]
            out_types = args[1] if len(args) > 1 else kwargs.get("out_types", ())
            checked = checking()
            # Under inference (by default too) any body may get a rule; one refused
            # raises at the call.
            let = checked and (_mode_state.inferring_by_default()
                               or any(lookup(fn) is not None or _resolve.infers_function(fn) for fn in fns))
            token = _letting_through.set(let)
            try:
                wrapper = original(*args, **kwargs)
            except ValueError as err:  # JAX's refusal of an unannotated out_shape: say what to add
                if checked and not let and fns and f"`{field.sds_keyword}`" in str(err):
                    raise _rule_less_body(fns[0], err) from err
                raise
            finally:
                _letting_through.reset(token)
            code = getattr(wrapper, "__code__", None)
            cells = dict(zip(getattr(code, "co_freevars", ()), getattr(wrapper, "__closure__", None) or ()))
            avals = cells["flat_out_avals"].cell_contents if "flat_out_avals" in cells else None
            if not isinstance(avals, tuple):
                return wrapper
            leaves = jax.tree_util.tree_leaves(out_types)
            annotated = [field.annotated(leaf) for leaf in leaves]
            record = _Outputs(
                avals=avals,
                honoured=tuple(checked and a for a in annotated),
                let_through=tuple(
                    let and isinstance(leaf, jax.ShapeDtypeStruct) and not a for leaf, a in zip(leaves, annotated)
                ),
            )
            key = id(avals)
            with _outputs_lock:
                _outputs[key] = record
            weakref.finalize(wrapper, _forget_outputs, key, avals)
            return wrapper

        return make

    def convert(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Lets an unannotated out_shape leaf through while a kernel whose body has
        a rule is built (JAX refuses it under checking); JAX's conversion otherwise."""
        field = self.field

        def convert(out_shape: Any) -> Any:
            if (not _letting_through.get() or not isinstance(out_shape, jax.ShapeDtypeStruct)
                    or field.annotated(out_shape) or not checking()):
                return original(out_shape)
            caller = _frames.outside_reprules()
            if caller is None or caller.f_globals.get("__name__") != "jax._src.pallas.mpmd":
                return original(out_shape)
            return original(field.sds(out_shape, frozenset()))

        return convert

    def mpmd_bind(self, original: Callable[..., Any]) -> Callable[..., Any]:
        codes = self.codes

        def bind(*args: Any, **params: Any) -> Any:
            wrapper = _frames.outside_reprules()
            if wrapper is None or codes.mpmd_wrapper is None or wrapper.f_code is not codes.mpmd_wrapper:
                body = _discharging.get()
                if body is not None:  # 0.9: a registered body's core_map, discharged
                    _bodies.remember(params.get("jaxprs", ()), body)
                elif _discharging_inferred.get() and in_checked_shard_map():
                    self._check_discharged(params, args)  # 0.9: one without a rule, under inference
                return original(*args, **params)  # a re-bind (discharge, vmap, lowering)
            local = _frames.frame_locals(wrapper)
            fns = [fn for _, fn in local.get("meshes_and_fns", ())]
            outer = wrapper.f_back
            if outer is not None and outer.f_code is codes.core_map_wrapped:  # 0.11+: pl.core_map
                reg = next((r for r in map(lookup, fns) if r is not None), None)
                if reg is not None and in_checked_shard_map():
                    raise _errors.RuleError(calls.core_map_rule_message(reg.where, repr(reg.rule), reg.name, manual_axes(), _jax.JAX_VERSION))
                return original(*args, **params)
            if len(fns) == len(params.get("jaxprs", ())):
                for fn, jaxpr in zip(fns, params["jaxprs"]):
                    _bodies.remember((jaxpr,), fn)
            regs = [(fn, lookup(fn)) for fn in fns]
            registered = [(fn, reg) for fn, reg in regs if reg is not None]
            out_avals = tuple(params.get("out_avals", ()))
            if not in_checked_shard_map():
                return original(*args, **params)
            made = _outputs_of(local.get("flat_out_avals"), len(out_avals))
            num_user = len(local.get("flat_args", args))
            if not registered:
                # Explicit inference, or by default where JAX would have refused an out_shape.
                infers = any(map(_resolve.infers_function, fns)) or (
                    any(made.let_through) and _mode_state.inferring_by_default())
                found = _kernel_inference.for_mpmd_call(params, args) if infers else None
                if not isinstance(found, Registration):
                    if any(made.let_through):
                        name = _resolve.kernel_name(params)
                        raise _errors.MissingRuleError(advice.missing_rule_message(
                            name, manual_axes(), _jax.JAX_VERSION,
                            jax_error="pl.kernel refuses an out_shape leaf without manual_axis_type "
                                      "under check_vma (reprules let it through for a body with a "
                                      "rule, or for inference, when the kernel was built)",
                            inference="" if found is None else infer.refusal_text(
                                found, name, manual_axes(), _jax.JAX_VERSION),
                            findings=_mpmd_findings(found, params, args),
                        ))
                    return original(*args, **params)
                registered = [(None, found)]
                _bodies.remember_inferred(params.get("jaxprs", ()), found)
                num_user = len(args)  # a derived rule is given every operand, captured ones too
            user, rest = args[:num_user], args[num_user:]
            in_vary = self._in_varying(user)
            decision, manual = self._agreed(registered, len(fns), in_vary, len(out_avals))
            with call_axes(manual, [jax.typeof(x) for x in user]):
                return self._mpmd_bind_decided(original, registered[0][1], params, made, user, rest, in_vary,
                                               decision)

        return bind

    def _mpmd_bind_decided(self, original: Callable[..., Any], reg: Registration, params: dict[str, Any],
                           made: _Outputs, user: Sequence[Any], rest: Sequence[Any],
                           in_vary: tuple[frozenset[str], ...], decision: Decision) -> Any:
        out_avals = tuple(params.get("out_avals", ()))
        # An annotated output keeps its annotation only where that claims no fewer
        # axes than the rule (derived or declared): see _union.
        kept = [h or (not let and bool(self.field.varying(a)))
                for a, h, let in zip(out_avals, made.honoured, made.let_through)]
        widened = self._check_annotations(reg, params, out_avals, decision.outputs, kept)
        cast = list(user)
        if decision.inputs is not None:
            for i, (x, now, target) in enumerate(zip(user, in_vary, decision.inputs)):
                if target - now and not _kernel_inference.is_ref(x):
                    cast[i] = cast_up(x, target - now)
        # Typed by the rule unless the user's annotation made the type. For a kernel
        # object built before reprules activated, only a varying type shows one.
        typed = tuple(
            widened.get(i, a) if honoured or (not let and self.field.varying(a)) else self.field.retype(a, v)
            for i, (a, v, honoured, let) in enumerate(
                zip(out_avals, decision.outputs, made.honoured, made.let_through))
        )
        with _identity.tracing(reg):
            out = original(*cast, *rest, **{**params, "out_avals": typed})
        _verify.check_outputs(self.field, reg, list(out))
        if widened:  # for a pcast of these outputs to varying (see pcast.py)
            _union.remember(self.field, typed, out, out_avals, widened)
        return out

    def _check_discharged(self, params: dict[str, Any], args: Sequence[Any]) -> None:
        """0.9: the ``mpmd_map`` JAX discharges a rule-less ``core_map`` into, under
        inference. Each output is the buffer of a ref the body writes into, typed by
        JAX like that ref; the derived rule must not need it to vary over more (as
        on 0.8 and 0.10, where the discharged kernel's own bind is checked). A
        refusal leaves JAX's types, as for any kernel inference cannot follow."""
        found = _kernel_inference.for_mpmd_call(params, args)
        if not isinstance(found, Registration):
            return
        out_avals = tuple(params.get("out_avals", ()))
        decided = _resolve.decide_here(found, self._in_varying(args), len(out_avals))
        if decided is None:
            return
        with call_axes(decided[1], [jax.typeof(x) for x in args]):
            self._check_annotations(found, params, out_avals, decided[0].outputs, [True] * len(out_avals),
                                    can_widen=False)  # discharged: JAX's types stand, so refuse

    def _check_annotations(self, reg: Registration, params: dict[str, Any], out_avals: Sequence[Any],
                           derived: Sequence[frozenset[str]], kept: Sequence[bool],
                           can_widen: bool = True) -> dict[int, Any]:
        """An out_shape annotated by hand (kept as JAX typed it) that claims an output
        replicated over an axis its rule (derived from the body, or declared) types
        it varying over is widened to the union (see ``_union``), or refused where
        it cannot be."""
        aliased = {int(o): int(i) for i, o in dict(params.get("input_output_aliases") or {}).items()}
        return _union.widen(self.field, out_avals, derived, kept, aliased, lambda: (
            f"pl.kernel (or pl.core_map) body {reg.name!r}", reg.where or "", _union.rule_text(reg)), can_widen)

    def _agreed(self, registered: list[tuple[Any, Registration]], num_bodies: int,
                in_vary: tuple[frozenset[str], ...], num_out: int) -> tuple[Decision, tuple[str, ...]]:
        """The decision of every registered body, which must agree (MPMD), and the axes it was made over."""
        decisions = []
        for _, reg in registered:
            decided = _resolve.decide_here(reg, in_vary, num_out)
            assert decided is not None  # asked only in a checked shard_map
            decisions.append((reg, *decided))
        _, first, manual = decisions[0]
        if any(d != first for _, d, _ in decisions[1:]):
            answers = [(reg.where, repr(reg.rule), d.outputs, d.inputs) for reg, d, _ in decisions]
            raise _errors.RuleError(
                calls.mpmd_disagreement_message(answers, num_bodies, manual, _jax.JAX_VERSION))
        return first, manual


def _forget_outputs(key: int, avals: tuple[Any, ...]) -> None:
    with _outputs_lock:
        record = _outputs.get(key)
        if record is not None and record.avals is avals:
            del _outputs[key]


def _outputs_of(avals: Any, count: int) -> _Outputs:
    """What is known of how a kernel object's out types were made (nothing if it
    was built before reprules activated)."""
    with _outputs_lock:
        record = _outputs.get(id(avals))
    if record is not None and record.avals is avals and len(record.honoured) == count:
        return record
    return _Outputs(avals=(), honoured=(False,) * count, let_through=(False,) * count)


def _mpmd_findings(found: Registration | infer.Refusal | None, params: dict[str, Any],
                   args: Any) -> tuple[advice.Finding, ...] | None:
    """What the bodies of an ``mpmd_map`` hold that is not local, for a MissingRuleError's
    advice (analysed here where inference was off: ``found`` None)."""
    try:
        found = _kernel_inference.for_mpmd_call(params, args) if found is None else found
    except Exception:  # advice only: never an error of its own
        return None
    return () if isinstance(found, Registration) else infer.findings(found)


def _rule_less_body(body: Any, refusal: Exception) -> _errors.MissingRuleError:
    """JAX refused a rule-less ``pl.kernel`` body's out_shape (0.10+): reprules' error, JAX's text kept."""
    code = _identity.code_of(body)
    return _errors.MissingRuleError(advice.missing_rule_message(
        kernel_name(body), manual_axes(), _jax.JAX_VERSION, jax_error=str(refusal),
        site=f"defined at {code.co_filename}:{code.co_firstlineno}" if code is not None else "",
    ))
