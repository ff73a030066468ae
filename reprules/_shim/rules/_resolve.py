"""The rule behind an equation: found by identity, never by a name some other kernel has.

Above ``_identity`` / ``_bodies`` (which kernel an equation belongs to) and
``infer`` (a rule derived from a body): a registered rule always wins, then,
where inference is on for the kernel (``reprules.inference()``, or a package
registered with ``kernels_in(...)``), the derived one. :class:`Opaque` tells
the adapters how to find the rule of each opaque primitive's equations;
:func:`identify` tells reports what reprules knows of one.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

from reprules import _mode_state, _registry
from reprules._decide import decide_call
from reprules._errors import RegistrationError, ReprulesError, RuleError, UnsupportedJaxError
from reprules._messages.advice import Finding
from reprules._messages.calls import hidden_mesh_message
from reprules._registry import FfiTarget, KernelName, KernelPackage, Registration, lookup
from reprules._shim.plumbing import _jax, _types
from reprules._shim.kernels import _bodies, _identity
from reprules._shim.inference import infer
from reprules._shim.rules import callbacks
from reprules._shim.kernels._identity import PallasCall
from reprules.rules import Decision, RuleContext, VaryingSet


def jaxpr_calls_registered(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or any jaxpr inside it) calls a kernel that has a rule."""
    ffi = ffi_opaque()
    seen: set[int] = set()

    def registered(eqn: Any) -> bool:
        prim = eqn.primitive
        if prim is _jax.pallas_call_p():
            return pallas_registration(eqn.params) is not None
        if _bodies.kernel_primitive_kind(prim) is not None:  # pl.kernel
            return kernel_registration_of(eqn.params) is not None
        if ffi is not None and prim is ffi.prim:
            return ffi.lookup(eqn.params) is not None
        if prim in callbacks.callbacks():  # the rule of its host function
            return callbacks.registration(eqn.params) is not None
        try:
            if lookup(prim) is not None or lookup(eqn.params.get("fn")) is not None:
                return True  # a user primitive, or a jax-triton kernel
        except TypeError:
            pass
        return False

    def visit(value: Any, depth: int = 0) -> bool:
        if depth > 8 or id(value) in seen:
            return False
        seen.add(id(value))
        if hasattr(value, "eqns"):
            return any(registered(e) or visit(e.params, depth + 1) for e in value.eqns)
        if isinstance(value, dict):
            return any(visit(v, depth + 1) for v in value.values())
        if isinstance(value, (tuple, list)):
            return any(visit(v, depth + 1) for v in value)
        inner = getattr(value, "jaxpr", None)  # ClosedJaxpr, Traced, ...
        if inner is not None and not callable(inner):
            return visit(inner, depth + 1)
        params = getattr(value, "params", None)  # hijax primitives carry their own
        return isinstance(params, dict) and visit(params, depth + 1)

    return visit(jaxpr)


def registration_of(call: PallasCall) -> Registration | None:
    """The current registration behind a ``pallas_call_p`` equation: its kernel's
    rule, else (where inference is on for it) the rule derived from its body, else None."""
    kernel = call.kernel()
    reg = lookup(kernel) if kernel is not None else None
    return reg if reg is not None else inferred_registration(call)


def pallas_registration(params: dict[str, Any]) -> Registration | None:
    """:func:`registration_of` for an equation met by its params alone."""
    return registration_of(PallasCall.of(params))


def infers_function(fn: Any) -> bool:
    """Whether kernel function ``fn`` gets its rule derived from its body: under
    ``reprules.inference()``, or when it is defined in a package registered with
    ``kernels_in(...)``."""
    return _mode_state.inferring() or (_registry.has_packages() and in_inferred_package(fn))


def in_inferred_package(fn: Any) -> bool:
    """Whether ``fn`` is defined in a package registered with ``kernels_in(...)``."""
    code = _identity.code_of(fn)
    return code is not None and _registry.infers_package_of(code.co_filename) is not None


def infers_call(call: PallasCall) -> bool:
    """:func:`infers_function` for the kernel of a ``pallas_call_p`` equation: the
    function JAX traced it from when reprules saw that, else its recorded source file;
    or it was given a derived rule by default (:func:`infer_by_default`), or it is bound
    inside one that was (its JVP, vmap)."""
    if _mode_state.inferring():
        return True
    if "jaxpr" not in call.params:
        return False
    if call.derived:
        return True
    if not _registry.has_packages():
        return False
    kernel = call.kernel()
    if kernel is not None:
        return in_inferred_package(kernel)
    return call.site is not None and _registry.infers_package_of(call.site[0]) is not None


def inferred_registration(call: PallasCall) -> Registration | None:
    """The rule derived from a ``pallas_call_p`` equation's kernel body, if
    inference is on for it and the body is provably local; else None."""
    if "jaxpr" not in call.params or not infers_call(call):
        return None
    found = infer.registration(call.params)
    return found if isinstance(found, Registration) else None


def infer_by_default(call: PallasCall) -> Registration | None:
    """The rule derived for a rule-less ``pallas_call_p`` equation that JAX would refuse
    under checking, unless inference by default is off (``REPRULES_INFER=0``,
    ``reprules.inference(False)``) or the body is not provably local; else None.

    The call is remembered as derived (:meth:`PallasCall.remember_derived`), so that
    everything that later meets the equation by its params alone (the interpret-mode
    lowering, the custom_vjp fix, reports) sees the same rule."""
    if "jaxpr" not in call.params or not _mode_state.inferring_by_default():
        return None
    found = infer.registration(call.params)
    if not isinstance(found, Registration):
        return None
    call.remember_derived()
    return found


def inference_note(call: PallasCall, mesh_axes: Sequence[str]) -> str:
    """Why inference refused a ``pallas_call_p`` equation, for a MissingRuleError;
    ``""`` if inference is off for it or derived a rule."""
    if "jaxpr" not in call.params or not (infers_call(call) or _mode_state.inferring_by_default()):
        return ""
    found = infer.registration(call.params)
    if isinstance(found, Registration):
        return ""
    return infer.refusal_text(found, call.name, mesh_axes, _jax.JAX_VERSION)


def body_findings(call: PallasCall) -> tuple[Finding, ...] | None:
    """What the analysis of a ``pallas_call_p`` equation's kernel body finds that is not
    local, for the advice of a MissingRuleError (also where inference is off: the advice
    is then still what the body supports); ``None`` where there is no body to analyse."""
    if call.params.get("jaxpr") is None:
        return None
    try:
        found = infer.registration(call.params)
    except Exception:  # advice only: never an error of its own
        return None
    return () if isinstance(found, Registration) else infer.findings(found)


@dataclasses.dataclass(frozen=True)
class Identity:
    """What reprules knows about the kernel behind one opaque equation (for reports).

    Attributes:
      registration: The kernel's current registration, or None.
      identified: Whether the equation was tied to its kernel (the kernel
        object, the FFI target name, the primitive). False only when reprules
        did not see the kernel's call and a registered kernel could be it.
      candidates: When not identified, ``module.qualname`` of the registered
        kernels it could be (same definition site).
      site: ``file:line`` of a Pallas kernel's definition (0.4.31+), or of
        its first traced line (0.4.28); ``""`` if unknown.
    """

    registration: Registration | None
    identified: bool = True
    candidates: tuple[str, ...] = ()
    site: str = ""


def identify(primitive: Any, params: dict[str, Any]) -> Identity:
    """The rule behind an opaque equation, found as the checking itself finds
    it (by identity), never by a name some other kernel also has.

    A ``pallas_call`` equation is tied to its kernel only if reprules saw the
    call being traced (a registered kernel, called after reprules activated).
    Otherwise it has no rule, unless a registered kernel shares its definition
    site (0.4.31+ record ``name at file:line``; on 0.4.28 the kernel jaxpr's
    first equation made in a function of the kernel's name gives file and
    line): then it may be that kernel, traced before its rule existed or by a
    ``pallas_call`` made before reprules activated, or a namesake made by the
    same factory, and the answer is "not identified".
    """
    found = _identify_kernel(primitive, params)  # pl.kernel / pl.core_map
    if found is not None:
        return found
    if primitive is _jax.pallas_call_p():
        call = PallasCall.of(params)
        site = call.site
        site_text = f"{site[0]}:{site[1]}" if site else ""
        if call.kernel_ref is not None:  # a dead kernel has no rule any more
            return Identity(registration_of(call), site=site_text)
        inferred = inferred_registration(call)  # derived from the body: no kernel object needed
        if inferred is not None:
            return Identity(inferred, site=site_text)
        candidates = tuple(
            reg.where for reg in _registry.registrations()
            if not isinstance(reg.kernel_ref(), (FfiTarget, KernelName)) and reg.kernel() is not None
            and classify(reg.kernel()) == "pallas" and _identity.could_be(reg, call.name, site)
        )
        return Identity(None, identified=not candidates, candidates=candidates, site=site_text)
    ffi = _jax.ffi_call_p()
    if ffi is not None and primitive is ffi:
        return Identity(lookup(FfiTarget(str(params.get("target_name")))))
    if "jax_triton" in sys.modules:
        triton = triton_opaque()
        if primitive is triton.prim:
            return Identity(triton.lookup(params))
    if primitive in callbacks.callbacks():
        return Identity(callbacks.registration(params))
    return Identity(lookup(primitive))


@dataclasses.dataclass(frozen=True)
class Opaque:
    """How to find the rule behind one equation of an opaque primitive.

    Attributes:
      prim: The JAX primitive.
      kind: What users call it, for messages ("Pallas kernel", "FFI target", ...).
      lookup: The registration for an equation's params, or None.
      name: The kernel/target name for an equation's params.
      layout: ``(first user operand, number of outputs or None if unknown)``
        for an equation's params and operand count.
    """

    prim: Any
    kind: str
    lookup: Callable[[dict[str, Any]], Registration | None]
    name: Callable[[dict[str, Any]], str]
    layout: Callable[[dict[str, Any], int], tuple[int, int | None]]


def rule_context(reg: Registration, mesh_axes: tuple[str, ...], num_inputs: int, num_outputs: int) -> RuleContext:
    """The RuleContext of one call of ``reg``'s kernel."""
    return RuleContext(
        kernel_name=reg.name,
        kernel=reg.kernel(),
        mesh_axes=tuple(mesh_axes),
        num_inputs=num_inputs,
        num_outputs=num_outputs,
        jax_version=_jax.JAX_VERSION,
    )


def decide_here(reg: Registration, in_vary: tuple[VaryingSet, ...], num_outputs: int,
                num_inputs: int | None = None) -> tuple[Decision, tuple[str, ...]] | None:
    """The decision for one call of ``reg``'s kernel in the checked ``shard_map``
    being traced, and the manual axes it was made over; None outside one.

    Where code around the call hid the shard_map's manual axes
    (:func:`_types.hidden_axes`), the rule is asked over the axes known to be
    manual and over every axis in scope: one answer for both is the answer
    whatever the shard_map's axes are; two answers are refused."""
    num_in = len(in_vary) if num_inputs is None else num_inputs

    def over(axes: tuple[str, ...]) -> Decision:
        return decide_call(reg, in_vary, axes, num_outputs, lambda: rule_context(reg, axes, num_in, num_outputs),
                           num_in)

    hidden = _types.hidden_axes(in_vary)
    if hidden is None:
        manual = _types.manual_axes()
        return (over(manual), manual) if manual else None
    at_scope = over(hidden.in_scope)  # the widest: a rule's own error is raised as it is
    try:
        at_known: Decision | str = over(hidden.known)
    except ReprulesError as err:
        at_known = f"an error ({str(err).splitlines()[0]})"
    if at_known != at_scope:
        def text(d: Decision | str) -> str:
            return d if isinstance(d, str) else f"outputs varying over {[sorted(v) for v in d.outputs]}"
        raise RuleError(hidden_mesh_message(
            f"kernel {reg.name!r}", repr(reg.rule), hidden.known, hidden.in_scope, text(at_known), text(at_scope),
            _jax.JAX_VERSION))
    return at_scope, hidden.known


def pallas_opaque() -> Opaque:
    """``pallas_call``: the rule belongs to the kernel recorded for the equation's jaxpr."""
    return Opaque(
        prim=_jax.pallas_call_p(),
        kind="Pallas kernel",
        lookup=pallas_registration,
        name=_identity.kernel_name_from_params,
        layout=_identity.pallas_layout,
    )


def primitive_opaque(prim: Any) -> Opaque:
    """A user primitive: the rule belongs to the primitive object itself."""
    return Opaque(
        prim=prim,
        kind="primitive",
        lookup=lambda params: lookup(prim),
        name=lambda params: prim.name,
        layout=lambda params, n: (0, None if prim.multiple_results else 1),
    )


def ffi_opaque() -> Opaque | None:
    """``ffi_call``: the rule belongs to the target name."""
    prim = _jax.ffi_call_p()
    if prim is None:
        return None
    return Opaque(
        prim=prim,
        kind="FFI target",
        lookup=lambda params: lookup(FfiTarget(str(params.get("target_name")))),
        name=lambda params: str(params.get("target_name")),
        layout=lambda params, n: (0, len(params["result_avals"])),
    )


def triton_opaque() -> Opaque:
    """jax-triton's ``triton_kernel_call``: the rule belongs to the Triton kernel."""
    from jax_triton import triton_lib  # lazy: an optional dependency, asked for only once it was imported

    return Opaque(
        prim=triton_lib.triton_kernel_call_p,
        kind="Triton kernel",
        lookup=lambda params: lookup(params.get("fn")),
        name=lambda params: params.get("name") or _registry.kernel_name(params.get("fn")),
        layout=lambda params, n: (0, len(params["out_shapes"])),
    )


def callback_opaque(prim: Any) -> Opaque:
    """``jax.pure_callback`` / ``io_callback``: the rule belongs to the host function."""
    return Opaque(
        prim=prim,
        kind="JAX callback",
        lookup=callbacks.registration,
        name=lambda params: prim.name,
        layout=lambda params, n: (0, len(params["result_avals"])),
    )


def kernel_registration_of(params: dict[str, Any]) -> Registration | None:
    """The current registration behind a ``core_map`` / ``mpmd_map`` equation (its first
    registered body), else, under ``reprules.inference()``, the rule derived for it
    when its call was traced, or None."""
    for body in _bodies.bodies_of(params) or ():
        reg = lookup(body)
        if reg is not None:
            return reg
    if _mode_state.inferring() or _mode_state.inferring_by_default() or _registry.has_packages():
        return _bodies.inferred_for(params)
    return None


def kernel_name(params: dict[str, Any]) -> str:
    """The body's name for a ``core_map`` / ``mpmd_map`` equation (the registered
    body's, else the first seen, else JAX's)."""
    reg = kernel_registration_of(params)
    if reg is not None:
        return reg.name
    # A body from JAX's own modules is a wrapper JAX made (a discharged core_map's
    # 'body'); the name JAX passed on is then the user's.
    bodies = [b for b in _bodies.bodies_of(params) or () if not (getattr(b, "__module__", None) or "").startswith("jax.")]
    if bodies:
        return _registry.kernel_name(bodies[0])
    if params.get("name"):
        return str(params["name"])
    for jaxpr in _bodies.eqn_jaxprs(params):
        src = getattr(getattr(jaxpr, "debug_info", None), "func_src_info", None)
        if src:
            return str(src).split(" ")[0]
    return "pl.kernel"


def _identify_kernel(primitive: Any, params: dict[str, Any]) -> Identity | None:
    """:func:`identify` for ``core_map`` / ``mpmd_map`` equations (None: another primitive)."""
    if _bodies.kernel_primitive_kind(primitive) is None:
        return None
    site = ""
    for jaxpr in _bodies.eqn_jaxprs(params):
        src = str(getattr(getattr(jaxpr, "debug_info", None), "func_src_info", None) or "")
        if " at " in src and "helpers.py" not in src:  # the body's own site (mpmd), not JAX's closure
            site = src.split(" at ", 1)[1]
            break
    bodies = _bodies.bodies_of(params)
    if bodies is not None:
        reg = kernel_registration_of(params)
        body = reg.kernel() if reg is not None else (bodies[0] if bodies else None)
        return Identity(reg, site=site or _definition_site(body))
    name = kernel_name(params)
    candidates = tuple(
        reg.where for reg in _registry.registrations() if reg.name == name and callable(reg.kernel())
    )
    return Identity(None, identified=not candidates, candidates=candidates, site=site)


def kernel_collective_axes(eqn: Any, scan: Callable[[Any], frozenset[str]]) -> frozenset[str]:
    """``scan(eqn)`` (custom_vjp's conservative look for collectives in an equation),
    except for a registered 0.8 - 0.9 ``pl.kernel`` call: there the casts reprules
    made inside JAX's ``jax.jit`` closure (the top-level ``pvary``s: inputs cast
    up, output refs made varying) are left out. They are what a ``pallas_call``'s
    casts are outside its equation, and are judged the same way: a cotangent
    input replicated over an axis the call's outputs vary over taints them."""
    if eqn.primitive.name not in ("pjit", "jit"):
        return scan(eqn)
    closed = eqn.params.get("jaxpr")
    inner: Any = getattr(closed, "jaxpr", None)
    pvary_p = getattr(_jax.core, "pvary_p", None)
    if pvary_p is None or not hasattr(inner, "eqns") or not _calls_registered_core_map(inner):
        return scan(eqn)
    return frozenset().union(*(scan(e) for e in inner.eqns if e.primitive is not pvary_p))


def _calls_registered_core_map(jaxpr: Any) -> bool:
    return any(
        _bodies.kernel_primitive_kind(e.primitive) == "core_map" and kernel_registration_of(e.params) is not None
        for e in jaxpr.eqns
    )


def _definition_site(body: Any) -> str:
    """``file:line`` where ``body`` (or the function a partial wraps) is defined, or ``""``."""
    code = _identity.code_of(body)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def kernel_opaque(primitive: Any) -> Opaque | None:
    """``pl.kernel`` / ``pl.core_map``: the rule belongs to the body (None: another primitive)."""
    if _bodies.kernel_primitive_kind(primitive) is None:
        return None
    return Opaque(
        prim=primitive,
        kind="Pallas kernel",
        lookup=kernel_registration_of,
        name=kernel_name,
        layout=lambda params, n: (0, None),
    )


def describe(primitive: Any) -> Opaque:
    """The :class:`Opaque` of any primitive (a user primitive unless it is a known entry point)."""
    if primitive is _jax.pallas_call_p():
        return pallas_opaque()
    kernel = kernel_opaque(primitive)  # pl.kernel / pl.core_map
    if kernel is not None:
        return kernel
    ffi = ffi_opaque()
    if ffi is not None and primitive is ffi.prim:
        return ffi
    if "jax_triton" in sys.modules:
        triton = triton_opaque()
        if primitive is triton.prim:
            return triton
    if primitive in callbacks.callbacks():
        return callback_opaque(primitive)
    return primitive_opaque(primitive)


def classify(target: object) -> str:
    """What a registration target is: "pallas", "primitive", "ffi" or "triton".

    Raises if this JAX cannot apply a rule to it.
    """
    if isinstance(target, (KernelName, KernelPackage)):
        return "pallas"
    if isinstance(target, FfiTarget):
        if _jax.ffi_call_p() is None:
            raise UnsupportedJaxError(
                f"Cannot apply a rule to FFI target {target.name!r}: JAX {_jax.JAX_VERSION} has no "
                "ffi_call (added in JAX 0.4.31).\nWhy: the rule would never be applied, and "
                "reprules does not fall back silently.\nFix: upgrade JAX to 0.4.31 or newer."
            )
        return "ffi"
    if isinstance(target, _jax.core.Primitive):
        return "primitive"
    if type(target).__module__.split(".")[0] == "triton":
        try:
            import jax_triton  # noqa: F401  # lazy: optional; asked only for a Triton kernel
        except ImportError as err:
            raise RegistrationError(
                f"Cannot apply a rule to the Triton kernel {target!r}: jax-triton is not "
                f"importable with JAX {_jax.JAX_VERSION} ({err}).\n"
                "Why: the rule is attached to jax-triton's triton_kernel_call primitive.\n"
                "Fix: pip install 'reprules[triton]' (jax-triton needs a GPU-enabled jaxlib)."
            ) from err
        return "triton"
    wrapped = callable(target) and (isinstance(target, (jax.custom_vjp, jax.custom_jvp)) or hasattr(target, "lower"))
    if callable(target) and not isinstance(target, type) and not wrapped:
        entry = _calls_entry_point(target)
        if entry is not None:
            name = getattr(target, "__qualname__", None) or repr(target)
            raise RegistrationError(
                f"Cannot register a replication rule on {name!r}: it calls {entry}, so it is the "
                f"function that launches a kernel, not the kernel (JAX {_jax.JAX_VERSION}).\n"
                "Why: reprules finds a rule by the kernel function JAX traces; a rule on the "
                "launching function would never match, and the kernel would stay without one.\n"
                f"Fix: register the kernel function passed to {entry} (the function whose "
                "arguments are refs), e.g. `reprules.replication_rule()(my_kernel)`."
            )
        return "pallas"
    raise RegistrationError(
        f"Cannot register a replication rule on {target!r} ({type(target).__name__}): it is not "
        "a kernel function, a primitive, an FFI target or a Triton kernel"
        f"{' (a jax.jit / custom_vjp / custom_jvp wrapper)' if wrapped else ''}.\n"
        "Why: a rule describes the outputs of one opaque kernel.\n"
        "Fix: register the function passed to pl.pallas_call, a jax.extend.core.Primitive, "
        "reprules.ffi_target(name), or the Triton kernel passed to jax_triton.triton_call."
    )


_ENTRY_POINTS = ("pallas_call", "core_map", "triton_call", "ffi_call")


def _calls_entry_point(fn: object) -> str | None:
    """The kernel entry point (``pallas_call`` ...) that ``fn``'s code names, if any:
    a kernel body never launches a kernel, so such a function is a wrapper."""
    code = _identity.code_of(fn)
    pending = [code] if code is not None else []
    while pending:
        code = pending.pop()
        for name in code.co_names:
            if name in _ENTRY_POINTS:
                return f"pl.{name}" if name in ("pallas_call", "core_map") else name
        pending.extend(c for c in code.co_consts if hasattr(c, "co_names"))
    return None
