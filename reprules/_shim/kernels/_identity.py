"""Which kernel a ``pallas_call`` equation belongs to, and what its params say.

How a rule reaches a ``pallas_call``, in every version, however early its call
object was built (at import, before reprules, before the rule):

1. Every call, when traced, traces its kernel through one module global of
   ``jax._src.pallas.pallas_call``, looked up at that moment and given the
   kernel *object*. A hook there (``_pallas_hooks``) remembers here, weakly,
   the kernel jaxpr of a registered kernel (:func:`remember`).
2. The call then binds ``pallas_call_p`` with that jaxpr. A hook on its bind
   finds the kernel again by the jaxpr (:func:`kernel_of`) and marks the bind
   with :class:`tracing`; binds made inside it (its JVP, vmap) are remembered
   too. Primitive-level machinery (rep-era rules, the interpret-mode lowering
   fix) identifies registered calls by that jaxpr, since by then only the
   equation's params are left.

Also here: :class:`watching`, how a ``custom_vjp`` learns that its fwd or bwd
called a kernel with a rule. This module knows kernels, not rules: which rule
applies is ``_resolve``' business.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import linecache
import re
import threading
import weakref
from collections.abc import Callable
from typing import Any

from reprules._registry import Registration


# Kernel jaxpr -> weak reference to the registered kernel. The kernel, not its
# Registration, so that a rule changed or removed later is seen at once, even by
# equations JAX kept in its caches.
_by_jaxpr: weakref.WeakKeyDictionary[Any, Callable[[], Any]] = weakref.WeakKeyDictionary()
_by_jaxpr_lock = threading.Lock()
# Kernel jaxprs traced straight from a registered kernel (not a JVP or vmap of one):
# the binds the regimes apply rules at.
_direct: weakref.WeakSet[Any] = weakref.WeakSet()
# The kernel whose call is being bound (see `tracing`).
_tracing: contextvars.ContextVar[Callable[[], Any] | None] = contextvars.ContextVar(
    "reprules_tracing", default=None
)


def remember(jaxpr: Any, kernel_ref: Callable[[], Any], direct: bool) -> None:
    with _by_jaxpr_lock:
        _by_jaxpr[jaxpr] = kernel_ref
        if direct:
            _direct.add(jaxpr)


def kernel_of(jaxpr: Any) -> tuple[Callable[[], Any] | None, bool]:
    """(weak reference to the kernel seen tracing ``jaxpr``, or None; whether it
    was traced straight from that kernel rather than from a JVP or vmap of it)."""
    if jaxpr is None:
        return None, False
    with _by_jaxpr_lock:
        kernel_ref = _by_jaxpr.get(jaxpr)
        return kernel_ref, kernel_ref is not None and jaxpr in _direct


def kernel_being_bound() -> Callable[[], Any] | None:
    """The kernel whose bind is running (its JVP or vmap binds inside are its own)."""
    return _tracing.get()


def no_kernel() -> None:
    """The kernel of a derived registration: none. Kernel jaxprs bound under it (a
    derived kernel's JVP, vmap) are known by it as derived too (``_resolve.infers_call``)."""
    return None


class PallasCall:
    """One ``pallas_call_p`` equation's kernel, looked up once and passed down.

    A bind (or a lowering, a rep-era rule) makes one with :meth:`of` and hands it
    to everything that asks about the kernel: its registration, whether inference
    applies, its name and site for messages. The name and site are read from the
    params on first use only (they cost a regex and, on 0.4.28, a walk of frames).

    Attributes:
      params: The equation's params.
      kernel_ref: Weak reference to the kernel seen tracing its jaxpr (or to
        :func:`no_kernel` for a rule derived from the body), else None.
      direct: Whether the jaxpr was traced straight from that kernel (or the rule
        derived from this very jaxpr) rather than from a JVP or vmap of it.
    """

    def __init__(self, params: dict[str, Any], kernel_ref: Callable[[], Any] | None, direct: bool) -> None:
        self.params, self.kernel_ref, self.direct = params, kernel_ref, direct

    @classmethod
    def of(cls, params: dict[str, Any], *, binding: bool = False) -> PallasCall:
        """The call of ``params``. ``binding``: it is being bound now, so a jaxpr
        reprules has not seen belongs to the registered kernel whose bind runs
        around it (its JVP, vmap), and is remembered as such."""
        jaxpr = params.get("jaxpr")
        kernel_ref, direct = kernel_of(jaxpr)
        if kernel_ref is None and binding:
            kernel_ref = kernel_being_bound()
            if kernel_ref is not None and jaxpr is not None:
                remember(jaxpr, kernel_ref, direct=False)
        return cls(params, kernel_ref, direct)

    def kernel(self) -> Any:
        """The kernel object (None: unknown, dead, or a rule derived from the body)."""
        return self.kernel_ref() if self.kernel_ref is not None else None

    @property
    def derived(self) -> bool:
        """Whether the call was given a rule derived from its body (or is bound inside one)."""
        return self.kernel_ref is no_kernel

    def remember_derived(self) -> None:
        """Marks the call's kernel jaxpr as having a derived rule, for every later
        equation met by its params alone (lowering, the custom_vjp fix, reports)."""
        if self.params.get("jaxpr") is not None:
            remember(self.params["jaxpr"], no_kernel, direct=True)
        self.kernel_ref, self.direct = no_kernel, True

    @functools.cached_property
    def name(self) -> str:
        """The kernel name JAX stored on the equation."""
        return kernel_name_from_params(self.params)

    @functools.cached_property
    def site(self) -> tuple[str, int, bool] | None:
        """(file, line, exact) of the kernel function (see :func:`kernel_site`), or None."""
        return kernel_site(self.params, self.name)

    @functools.cached_property
    def function_name(self) -> str | None:
        """The name of the kernel's ``def`` at its exact site, or None: what a user decorates,
        where ``name=`` (what JAX stores) can be any string, even another identifier."""
        site = self.site
        if site is None or not site[2]:
            return None
        for line in range(site[1], site[1] + 16):
            text = linecache.getline(site[0], line).strip()
            if not text.startswith("@"):  # past the decorators: the def, else no name to give
                match = re.match(r"def\s+(\w+)", text)
                return match.group(1) if match else None
        return None

    @property
    def site_text(self) -> str:
        """``defined at file:line`` (``traced at`` a body line on 0.4.28), or ``""``."""
        site = self.site
        return f"{'defined' if site[2] else 'traced'} at {site[0]}:{site[1]}" if site else ""


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


def code_of(fn: Any) -> Any:
    """The code object of a kernel function, through partials and ``functools.wraps``; else None."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None


def kernel_site(params: dict[str, Any], name: str) -> tuple[str, int, bool] | None:
    """(file, line, exact) of the kernel function of a ``pallas_call_p`` equation:
    exact when the line is the definition's first line, else a line of its body."""
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


def could_be(reg: Registration, name: str, site: tuple[str, int, bool] | None) -> bool:
    code = code_of(reg.kernel())
    if site is None or code is None:
        return reg.name == name
    file, line, exact = site
    if exact:
        return bool((code.co_filename, code.co_firstlineno) == (file, line))
    last = max((n for _, _, n in code.co_lines() if n is not None), default=code.co_firstlineno)
    return bool(code.co_filename == file and code.co_firstlineno <= line <= last)


def pallas_counts(params: dict[str, Any]) -> tuple[int, int]:
    """(number of user operands, number of outputs) of a ``pallas_call_p`` equation."""
    if "in_shapes" in params:  # 0.4.28 - 0.4.3x
        return len(params["in_shapes"]), len(params["out_shapes"])
    gm = params["grid_mapping"]  # 0.4.3x+
    num_out = len(params["out_avals"]) if "out_avals" in params else gm.num_outputs
    return gm.num_index_operands + gm.num_inputs, num_out


def pallas_layout(params: dict[str, Any], num_operands: int) -> tuple[int, int]:
    """(first user operand, number of outputs) of a ``pallas_call_p`` equation.

    Kernel constants and dynamic grid bounds come first; the user's arrays last.
    """
    num_user, num_out = pallas_counts(params)
    return num_operands - num_user, num_out


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


def weak_or_strong(fn: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(fn)
    except TypeError:  # e.g. a functools.partial made for one call: it lives as long as the jaxpr
        return lambda: fn
