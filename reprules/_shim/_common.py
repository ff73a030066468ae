"""Shim pieces shared by every regime: patch bookkeeping and the Pallas hooks.

How a rule reaches a ``pallas_call``, in every version, however early its call
object was built (at import, before reprules, before the rule):

1. Every call, when traced, traces its kernel through one module global of
   ``jax._src.pallas.pallas_call``, looked up at that moment and given the
   kernel *object*. A hook there remembers (weakly) the kernel jaxpr of a
   registered kernel.
2. The call then binds ``pallas_call_p`` with that jaxpr. A hook on its
   ``bind`` finds the kernel again by the jaxpr, lets the regime apply the rule
   (vma/mat: cast inputs up, type outputs), and marks the bind with
   :func:`tracing`; binds made inside it (its JVP, vmap) are remembered too.
   Primitive-level machinery (rep-regime check/rewrite rules, the
   interpret-mode lowering fix) identifies registered calls by that jaxpr,
   since by then only the equation's params are left.
3. vma/mat only: the out_shape conversion, which runs before the kernel is
   known, lets an unannotated out_shape through and leaves the decision (type
   by the rule, or JAX's own refusal as a MissingRuleError) to the bind.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import jax

from reprules._registry import Registration
from reprules.rules import RuleContext

JAX_VERSION: str = jax.__version__


def version_tuple(version: str = JAX_VERSION) -> tuple[int, ...]:
    """``(0, 12, 0, 1)`` for JAX 0.12.0.1 (by default the installed JAX); one parser for reprules."""
    from reprules._version import version_tuple as parse

    return parse(version)


class Patches:
    """Attribute and dict patches that can be undone in reverse order.

    reprules owns only what it installed. Each callable it installs is wrapped
    in a guard that runs it while these patches are live and otherwise calls
    what it replaced. :meth:`undo_all` restores an attribute or entry only if
    it still holds reprules' own object: if another library (a profiler,
    another shim) wrapped it after reprules, that library's wrapper is left in
    place, the reprules hook inside its chain passes every call through, and a
    :class:`reprules.PatchWarning` names the attribute.
    """

    _MISSING = object()

    def __init__(self) -> None:
        self._undo: list[Callable[[], str | None]] = []
        self.live = True  # False once undo_all ran: guarded hooks pass calls through

    def guard(self, value: Any, fallback: Callable[[], Any]) -> Any:
        """``value`` if not a plain callable, else a function that calls it while
        these patches are live and ``fallback()`` (what it replaced) after."""
        if not callable(value) or isinstance(value, (type, staticmethod, classmethod)):
            return value
        if getattr(value, "_reprules_guard", None) is self:
            return value

        @functools.wraps(value)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.live:
                return value(*args, **kwargs)
            return fallback()(*args, **kwargs)

        setattr(guarded, "_reprules_guard", self)  # marks the wrapper as ours (functions take attributes)
        return guarded

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        has_dict = hasattr(obj, "__dict__")
        old = obj.__dict__.get(name, self._MISSING) if has_dict else getattr(obj, name)
        installed = self.guard(value, lambda: _replaced_attr(obj, name, old, self._MISSING))
        if old is not self._MISSING and installed is not value:
            _forward_public_attributes(old, installed)

        def undo() -> str | None:
            now = obj.__dict__.get(name, self._MISSING) if has_dict else getattr(obj, name, self._MISSING)
            if now is not installed:
                return f"{_label(obj)}.{name}"
            if old is self._MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
            return None

        setattr(obj, name, installed)
        self._undo.append(undo)

    def setitem(self, mapping: Any, key: Any, value: Any, label: str = "") -> None:
        old = mapping.get(key, self._MISSING)
        # An entry that was absent has nothing to fall back on: reprules' dict
        # hooks defer to JAX for calls without a rule, and none is left then.
        installed = self.guard(value, lambda: value if old is self._MISSING else old)

        def undo() -> str | None:
            if mapping.get(key, self._MISSING) is not installed:
                return label or f"the JAX table entry for {key!r}"
            if old is self._MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = old
            return None

        mapping[key] = installed
        self._undo.append(undo)

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Runs ``undo`` when these patches are undone (for a change no attribute holds)."""

        def run() -> str | None:
            undo()
            return None

        self._undo.append(run)

    def undo_all(self) -> None:
        """Restores what reprules still owns, newest first; warns once about the rest."""
        self.live = False
        left: list[str] = []
        while self._undo:
            what = self._undo.pop()()
            if what is not None:
                left.append(what)
        if left:
            import warnings

            from reprules._errors import PatchWarning, patch_left_message

            warnings.warn(PatchWarning(patch_left_message(left, JAX_VERSION)), stacklevel=3)


def _forward_public_attributes(original: Any, hook: Callable[..., Any]) -> None:
    """Gives reprules' ``hook`` every public attribute of the JAX object it
    replaces that it lacks, bound to that object. JAX 0.4.28 - 0.6 trace Pallas
    kernels through a ``weakref_lru_cache``, and code that reaches it (JAX's own
    tests do) calls its ``cache_clear()`` and ``cache_info()``: with the hook in
    place they must still reach JAX's cache, which the hook calls through."""
    for attr in dir(original):
        if attr.startswith("_") or hasattr(hook, attr):
            continue
        try:
            value = getattr(original, attr)
        except Exception:  # noqa: BLE001 - a property that cannot be read now: nothing to forward
            continue
        setattr(hook, attr, value)


def _replaced_attr(obj: Any, name: str, old: Any, missing: object) -> Any:
    """What attribute ``name`` of ``obj`` was before reprules set it, as the
    guard must call it (a class attribute is called with ``self`` already)."""
    if old is not missing:
        return old
    if isinstance(obj, type):  # inherited: the base class's function, unbound
        for klass in obj.__mro__[1:]:
            if name in vars(klass):
                return vars(klass)[name]
    else:  # an instance shadowing its class (Primitive.bind): bound to it
        for klass in type(obj).__mro__:
            if name in vars(klass):
                attr = vars(klass)[name]
                return attr.__get__(obj, type(obj)) if hasattr(attr, "__get__") else attr
    raise AttributeError(f"{_label(obj)} had no attribute {name!r} before reprules set it")


def _label(obj: Any) -> str:
    """``module``, ``module.Class`` or ``Class 'name'`` (a primitive) for messages."""
    import types

    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    name = getattr(obj, "name", None)
    return f"{type(obj).__name__} {name!r}" if isinstance(name, str) else type(obj).__name__


# --- which pallas_call equations belong to registered kernels -----------------

# Kernel jaxpr -> weak reference to the registered kernel. The kernel, not its
# Registration, so that a rule changed or removed later is seen at once, even by
# equations JAX kept in its caches.
_tracing: contextvars.ContextVar[Callable[[], Any] | None] = contextvars.ContextVar(
    "reprules_tracing", default=None
)
_by_jaxpr: weakref.WeakKeyDictionary[Any, Callable[[], Any]] = weakref.WeakKeyDictionary()
_by_jaxpr_lock = threading.Lock()
# Kernel jaxprs traced straight from a registered kernel (not a JVP or vmap of one):
# the binds the regimes apply rules at.
_direct: weakref.WeakSet[Any] = weakref.WeakSet()


def _remember(jaxpr: Any, kernel_ref: Callable[[], Any], direct: bool) -> None:
    with _by_jaxpr_lock:
        _by_jaxpr[jaxpr] = kernel_ref
        if direct:
            _direct.add(jaxpr)


class Watch:
    """Set when a registered kernel's call is traced inside :func:`watching`."""

    __slots__ = ("involved",)

    def __init__(self) -> None:
        self.involved = False


_watches: contextvars.ContextVar[tuple[Watch, ...]] = contextvars.ContextVar(
    "reprules_watches", default=()
)


class watching:
    """``with watching(watch):`` marks ``watch`` if a registered kernel is called
    inside (how a ``custom_vjp`` learns that its fwd or bwd involves one).

    A class, not a ``contextlib`` generator: it runs at every ``custom_vjp`` call."""

    __slots__ = ("_watch", "_token")

    def __init__(self, watch: Watch) -> None:
        self._watch = watch

    def __enter__(self) -> None:
        self._token = _watches.set((*_watches.get(), self._watch))

    def __exit__(self, *exc: object) -> None:
        _watches.reset(self._token)


def note_registered_call() -> None:
    """Called by every hook that applies a rule to a call being traced."""
    for watch in _watches.get():
        watch.involved = True


def jaxpr_calls_registered(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or any jaxpr inside it) calls a kernel that has a rule."""
    from reprules._registry import lookup
    from reprules._shim import core_map

    ffi = ffi_opaque()
    seen: set[int] = set()

    def registered(eqn: Any) -> bool:
        prim = eqn.primitive
        if prim is pallas_call_p():
            return registration_of(eqn.params) is not None
        if core_map.is_kernel_primitive(prim):  # pl.kernel
            return core_map.registration_of(eqn.params) is not None
        if ffi is not None and prim is ffi.prim:
            return ffi.lookup(eqn.params) is not None
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


class tracing:
    """``with tracing(reg):`` a registered kernel's call is being bound (its JVP
    and vmap binds inside are found by it). A class: it runs at every call."""

    __slots__ = ("_reg", "_token")

    def __init__(self, reg: Registration) -> None:
        self._reg = reg

    def __enter__(self) -> None:
        note_registered_call()
        self._token = _tracing.set(self._reg.kernel_ref)

    def __exit__(self, *exc: object) -> None:
        _tracing.reset(self._token)


def registration_of(params: dict[str, Any]) -> Registration | None:
    """The current registration behind a ``pallas_call_p`` equation, from its
    params: its kernel's rule, else (under ``reprules.inference()``) the rule
    derived from its body, else None."""
    from reprules._registry import lookup

    with _by_jaxpr_lock:
        kernel_ref = _by_jaxpr.get(params.get("jaxpr"))
    kernel = kernel_ref() if kernel_ref is not None else None
    reg = lookup(kernel) if kernel is not None else None
    return reg if reg is not None else inferred_registration(params)


def infers_function(fn: Any) -> bool:
    """Whether kernel function ``fn`` gets its rule derived from its body: under
    ``reprules.inference()``, or when it is defined in a package registered with
    ``kernels_in(...)``."""
    from reprules import _mode_state, _registry

    return _mode_state.inferring() or (_registry.has_packages() and _in_inferred_package(fn))


def _in_inferred_package(fn: Any) -> bool:
    from reprules import _registry

    code = code_of(fn)
    return code is not None and _registry.infers_package_of(code.co_filename) is not None


def code_of(fn: Any) -> Any:
    """The code object of a kernel function, through partials and ``functools.wraps``; else None."""
    import inspect

    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None


def infers_call(params: dict[str, Any]) -> bool:
    """:func:`infers_function` for the kernel of a ``pallas_call_p`` equation: the
    function JAX traced it from when reprules saw that, else its recorded source file."""
    from reprules import _mode_state, _registry

    if _mode_state.inferring():
        return True
    if not _registry.has_packages() or "jaxpr" not in params:
        return False
    with _by_jaxpr_lock:
        kernel_ref = _by_jaxpr.get(params["jaxpr"])
    kernel = kernel_ref() if kernel_ref is not None else None
    if kernel is not None:
        return _in_inferred_package(kernel)
    site = _kernel_site(params, kernel_name_from_params(params))
    return site is not None and _registry.infers_package_of(site[0]) is not None


def inferred_registration(params: dict[str, Any]) -> Registration | None:
    """The rule derived from a ``pallas_call_p`` equation's kernel body, if
    inference is on for it and the body is provably local; else None."""
    if "jaxpr" not in params or not infers_call(params):
        return None
    from reprules._shim import infer

    found = infer.registration(params)
    return found if isinstance(found, Registration) else None


def inference_note(params: dict[str, Any], mesh_axes: Sequence[str]) -> str:
    """Why inference refused a ``pallas_call_p`` equation, for a MissingRuleError;
    ``""`` if inference is off for it or derived a rule."""
    if "jaxpr" not in params or not infers_call(params):
        return ""
    from reprules._shim import infer

    found = infer.registration(params)
    if isinstance(found, Registration):
        return ""
    return infer.refusal_text(found, kernel_name_from_params(params), mesh_axes, JAX_VERSION)


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
    import sys

    from reprules._registry import FfiTarget, KernelName, lookup, registrations
    from reprules._shim import classify, core_map

    found = core_map.identify(primitive, params)  # pl.kernel / pl.core_map
    if found is not None:
        return found
    if primitive is pallas_call_p():
        with _by_jaxpr_lock:
            kernel_ref = _by_jaxpr.get(params.get("jaxpr"))
        name = kernel_name_from_params(params)
        site = _kernel_site(params, name)
        site_text = f"{site[0]}:{site[1]}" if site else ""
        if kernel_ref is not None:
            kernel = kernel_ref()  # a dead kernel has no rule any more
            reg = lookup(kernel) if kernel is not None else None
            return Identity(reg if reg is not None else inferred_registration(params), site=site_text)
        inferred = inferred_registration(params)  # derived from the body: no kernel object needed
        if inferred is not None:
            return Identity(inferred, site=site_text)
        candidates = tuple(
            reg.where for reg in registrations()
            if not isinstance(reg.kernel_ref(), (FfiTarget, KernelName)) and reg.kernel() is not None
            and classify(reg.kernel()) == "pallas" and _could_be(reg, name, site)
        )
        return Identity(None, identified=not candidates, candidates=candidates, site=site_text)
    ffi = ffi_call_p()
    if ffi is not None and primitive is ffi:
        return Identity(lookup(FfiTarget(str(params.get("target_name")))))
    if "jax_triton" in sys.modules:
        triton = triton_opaque()
        if primitive is triton.prim:
            return Identity(triton.lookup(params))
    return Identity(lookup(primitive))


def _kernel_site(params: dict[str, Any], name: str) -> tuple[str, int, bool] | None:
    """(file, line, exact) of the kernel function of a ``pallas_call_p`` equation:
    exact when the line is the definition's first line, else a line of its body."""
    import re

    info = params.get("name_and_src_info")  # 0.4.31 - 0.4.38: "[for kernel function] f at file:line"
    text = getattr(info, "src_info", None) if info is not None else None
    if not text:  # 0.5+: the kernel jaxpr's "f at file:line"
        text = getattr(getattr(params.get("jaxpr"), "debug_info", None), "func_src_info", None)
    match = re.search(r" at (.+):(\d+)$", str(text or ""))
    if match:
        return match.group(1), int(match.group(2)), True
    # 0.4.28 records no site: the kernel body's frame in its first equations.
    for eqn in getattr(params.get("jaxpr"), "eqns", ())[:8]:
        frames = getattr(getattr(eqn.source_info, "traceback", None), "frames", None) or ()
        for frame in frames:
            if frame.function_name == name:
                return frame.file_name, frame.line_num, False
    return None


def _could_be(reg: Registration, name: str, site: tuple[str, int, bool] | None) -> bool:
    code = code_of(reg.kernel())
    if site is None or code is None:
        return reg.name == name
    file, line, exact = site
    if exact:
        return bool((code.co_filename, code.co_firstlineno) == (file, line))
    last = max((n for _, _, n in code.co_lines() if n is not None), default=code.co_firstlineno)
    return bool(code.co_filename == file and code.co_firstlineno <= line <= last)


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
        jax_version=JAX_VERSION,
    )


def pallas_counts(params: dict[str, Any]) -> tuple[int, int]:
    """(number of user operands, number of outputs) of a ``pallas_call_p`` equation."""
    if "in_shapes" in params:  # 0.4.28 - 0.4.3x
        return len(params["in_shapes"]), len(params["out_shapes"])
    gm = params["grid_mapping"]  # 0.4.3x+
    num_out = len(params["out_avals"]) if "out_avals" in params else gm.num_outputs
    return gm.num_index_operands + gm.num_inputs, num_out


def _pallas_layout(params: dict[str, Any], num_operands: int) -> tuple[int, int]:
    """(first user operand, number of outputs) of a ``pallas_call_p`` equation.

    Kernel constants and dynamic grid bounds come first; the user's arrays last.
    """
    num_user, num_out = pallas_counts(params)
    return num_operands - num_user, num_out


def pallas_opaque() -> Opaque:
    """``pallas_call``: the rule belongs to the kernel recorded for the equation's jaxpr."""
    return Opaque(
        prim=pallas_call_p(),
        kind="Pallas kernel",
        lookup=registration_of,
        name=kernel_name_from_params,
        layout=_pallas_layout,
    )


def primitive_opaque(prim: Any) -> Opaque:
    """A user primitive: the rule belongs to the primitive object itself."""
    from reprules._registry import lookup

    return Opaque(
        prim=prim,
        kind="primitive",
        lookup=lambda params: lookup(prim),
        name=lambda params: prim.name,
        layout=lambda params, n: (0, None if prim.multiple_results else 1),
    )


def ffi_call_p() -> Any | None:
    try:  # 0.5+
        from jax._src.ffi import ffi_call_p as p
    except ImportError:
        try:  # 0.4.31 - 0.4.38
            from jax._src.extend.ffi import ffi_call_p as p  # type: ignore[import-not-found, no-redef]  # JAX <= 0.4.38 only
        except ImportError:  # 0.4.28 - 0.4.30: no ffi_call
            return None
    return p


def ffi_opaque() -> Opaque | None:
    """``ffi_call``: the rule belongs to the target name."""
    from reprules._registry import FfiTarget, lookup

    prim = ffi_call_p()
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
    from jax_triton import triton_lib

    from reprules._registry import kernel_name, lookup

    return Opaque(
        prim=triton_lib.triton_kernel_call_p,
        kind="Triton kernel",
        lookup=lambda params: lookup(params.get("fn")),
        name=lambda params: params.get("name") or kernel_name(params.get("fn")),
        layout=lambda params, n: (0, len(params["out_shapes"])),
    )


def pallas_call_p() -> Any:
    # Same path from 0.4.28 to 0.12.
    from jax._src.pallas.pallas_call import pallas_call_p as p

    return p


def kernel_name_from_params(params: dict[str, Any]) -> str:
    """The kernel name JAX stored on a ``pallas_call_p`` equation."""
    info = params.get("name_and_src_info")  # 0.4.31 - 0.4.38
    if info is not None:
        return getattr(info, "name", None) or str(info)
    debug = getattr(params.get("jaxpr"), "debug_info", None)  # 0.5+: on the kernel jaxpr
    src = getattr(debug, "func_src_info", None) or getattr(debug, "func_name", None)
    if src:
        return str(src).split(" ")[0]
    return str(params.get("name") or "pallas_call")  # 0.4.28


BindHook = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any], "Registration | None", bool], Any]
"""``on_bind(bind, args, params, reg, direct)``: binds one ``pallas_call_p``
equation. ``reg`` is the current registration of its kernel (None: no rule),
``direct`` whether its jaxpr was traced straight from that kernel."""


def traced_bind(bind: Callable[..., Any], args: tuple[Any, ...], params: dict[str, Any],
                reg: Registration | None, direct: bool) -> Any:
    """The plain :data:`BindHook`: a registered kernel's bind runs under :func:`tracing`."""
    if reg is None:
        return bind(*args, **params)
    with tracing(reg):
        return bind(*args, **params)


def install_pallas_hooks(
    patches: Patches,
    on_bind: BindHook = traced_bind,
    convert_out_shape: Callable[[Callable[[Any], Any], Any], Any] | None = None,
) -> None:
    """Hooks what every ``pallas_call`` goes through when it is traced.

    These are module globals and a primitive method, looked up when a call is
    traced, so a call object built at any time (at import, before reprules was
    imported or the rule registered) is covered, and nothing else is.

    Args:
      patches: Where the patches are recorded (undone when the last rule goes).
      on_bind: Binds each ``pallas_call_p`` equation (see :data:`BindHook`).
      convert_out_shape: If given, ``convert_out_shape(original, leaf)``
        replaces JAX's conversion of each out_shape leaf of a ``pallas_call``
        to a type (vma/mat: where JAX refuses an unannotated out_shape).
    """
    from jax._src.pallas import pallas_call as pallas_call_mod

    from reprules import _registry
    from reprules._registry import lookup

    # 1. Kernel tracing: where the kernel object is known.
    # Both return a tuple holding the jaxpr that the bind gets: 0.4.28
    # (grid_mapping, jaxpr, consts, out_tree), 0.4.31 (grid_mapping, jaxpr,
    # consts), 0.4.35 - 0.12 (jaxpr, consts).
    if hasattr(pallas_call_mod, "_trace_kernel_to_jaxpr"):  # 0.4.31 - 0.12
        trace_name = "_trace_kernel_to_jaxpr"
    elif hasattr(pallas_call_mod, "_trace_to_jaxpr"):  # 0.4.28 - 0.4.30
        trace_name = "_trace_to_jaxpr"
    else:
        from reprules._errors import UnsupportedJaxError

        raise UnsupportedJaxError(
            f"JAX {JAX_VERSION}'s pallas_call traces kernels through neither "
            "_trace_kernel_to_jaxpr nor _trace_to_jaxpr.\n"
            "Why: reprules finds the kernel of each pallas_call where JAX traces it.\n"
            "Fix: install a JAX release reprules was tested with (0.4.28 - 0.12)."
        )
    original_trace = getattr(pallas_call_mod, trace_name)

    def trace_kernel(fun: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_trace(fun, *args, **kwargs)
        reg = lookup(fun)  # None for unregistered kernels and index maps
        ref = reg.kernel_ref if reg is not None else None
        if ref is None and _registry.has_packages() and _in_inferred_package(fun):
            # A kernels_in(...) kernel: its jaxpr may lose its source file (0.4.28 keeps
            # none on equations rebuilt by transformations), so remember its function.
            ref = _weak_or_strong(fun)
        if ref is not None:
            for item in result:
                if hasattr(item, "eqns"):  # the kernel jaxpr (or a closed one, and its .jaxpr)
                    for jaxpr in (item, getattr(item, "jaxpr", None)):
                        if hasattr(jaxpr, "eqns"):
                            _remember(jaxpr, ref, direct=True)
        return result

    patches.setattr(pallas_call_mod, trace_name, trace_kernel)

    # 2. The bind: the kernel found again by its jaxpr.
    prim = pallas_call_p()
    original_bind = functools.partial(type(prim).bind, prim)

    def bind(*args: Any, **params: Any) -> Any:
        jaxpr = params.get("jaxpr")
        with _by_jaxpr_lock:
            kernel_ref = _by_jaxpr.get(jaxpr) if jaxpr is not None else None
            direct = kernel_ref is not None and jaxpr in _direct
        if kernel_ref is None:
            kernel_ref = _tracing.get()  # bound inside a registered kernel's bind (its JVP, vmap)
            if kernel_ref is not None and jaxpr is not None:
                _remember(jaxpr, kernel_ref, direct=False)
        kernel = kernel_ref() if kernel_ref is not None else None
        reg = lookup(kernel) if kernel is not None else None
        if reg is None:  # a registered rule always wins; else perhaps a derived one
            reg = inferred_registration(params)
            direct = direct or reg is not None  # derived from this very jaxpr
        return on_bind(original_bind, args, params, reg, direct)

    patches.setattr(prim, "bind", bind)

    # 3. The out_shape conversion (vma/mat), which runs before the kernel is traced.
    if convert_out_shape is None:
        return
    from jax._src.pallas import core as pallas_core

    # 0.6 - 0.8: a pallas_call global; 0.9+: pallas core's, also used by mpmd.
    owner = pallas_call_mod if hasattr(pallas_call_mod, "_convert_out_shape_to_aval") else pallas_core
    original_convert = owner._convert_out_shape_to_aval

    def convert(out_shape: Any) -> Any:
        if _caller_module() != pallas_call_mod.__name__:  # 0.9+: mpmd's calls stay JAX's
            return original_convert(out_shape)
        return convert_out_shape(original_convert, out_shape)

    patches.setattr(owner, "_convert_out_shape_to_aval", convert)


def _weak_or_strong(fn: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(fn)
    except TypeError:  # e.g. a functools.partial made for one call: it lives as long as the jaxpr
        return lambda: fn


def _caller_module() -> str | None:
    """The module of the innermost frame outside reprules (who called the hook)."""
    frame: FrameType | None = sys._getframe(2)  # the hook's caller (the hook is reprules')
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if not (isinstance(name, str) and name.startswith("reprules.")):
            return name
        frame = frame.f_back
    return None


# --- state kept from one hook to a later one of the same call ---------------------


def jax_frame() -> FrameType | None:
    """The innermost running frame outside reprules and outside generator
    expressions: the JAX function whose call reached a hook (``pallas_call``'s
    ``wrapped`` converts its out_shape leaves in a generator expression, and
    binds ``pallas_call_p`` itself)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if not (isinstance(name, str) and name.startswith("reprules.")) and frame.f_code.co_name != "<genexpr>":
            return frame
        frame = frame.f_back
    return None


def running(frames: Sequence[FrameType | None]) -> list[bool]:
    """Whether each frame is still running on this thread's stack.

    State a hook leaves for a later hook of the same JAX call (the out_shape
    conversion for the bind, a ``new_ref`` for the ``core_map``) is kept with
    that call's frame, held strongly (so no later frame can take its address):
    a call that raised between the two hooks leaves it behind, and it is
    dropped as soon as its frame is seen finished."""
    live: set[int] = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        live.add(id(frame))
        frame = frame.f_back
    return [f is not None and id(f) in live for f in frames]
