"""Shim pieces shared by every regime: patch bookkeeping and the Pallas hooks.

How a rule reaches JAX, in every version:

1. ``pallas_call`` is wrapped at its Python entry point, where the kernel
   *object* is still known, so the rule can be looked up by identity.
2. While a registered kernel's call is being traced, a context variable says
   so; a hook on ``pallas_call_p.bind`` then remembers the kernel jaxpr of that
   bind (weakly). Primitive-level machinery (rep-regime check/rewrite rules,
   the interpret-mode lowering fix) identifies registered calls by that jaxpr,
   since by then only the equation's params are left.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax

from reprules._registry import Registration

JAX_VERSION: str = jax.__version__


def version_tuple(version: str = JAX_VERSION) -> tuple[int, ...]:
    parts = []
    for p in version.split("."):
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class Patches:
    """Attribute and dict patches that can be undone in reverse order."""

    _MISSING = object()

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        old = obj.__dict__.get(name, self._MISSING) if hasattr(obj, "__dict__") else getattr(obj, name)

        def undo() -> None:
            if old is self._MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)

        setattr(obj, name, value)
        self._undo.append(undo)

    def setitem(self, mapping: Any, key: Any, value: Any) -> None:
        old = mapping.get(key, self._MISSING)

        def undo() -> None:
            if old is self._MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = old

        mapping[key] = value
        self._undo.append(undo)

    def undo_all(self) -> None:
        while self._undo:
            self._undo.pop()()


# --- which pallas_call equations belong to registered kernels -----------------

# Kernel jaxpr -> weak reference to the registered kernel. The kernel, not its
# Registration, so that a rule changed or removed later is seen at once, even by
# equations JAX kept in its caches.
_tracing: contextvars.ContextVar[Callable[[], Any] | None] = contextvars.ContextVar(
    "reprules_tracing", default=None
)
_by_jaxpr: weakref.WeakKeyDictionary[Any, Callable[[], Any]] = weakref.WeakKeyDictionary()
_by_jaxpr_lock = threading.Lock()


@contextlib.contextmanager
def tracing(reg: Registration) -> Iterator[None]:
    token = _tracing.set(reg.kernel_ref)
    try:
        yield
    finally:
        _tracing.reset(token)


def registration_of(params: dict[str, Any]) -> Registration | None:
    """The current registration behind a ``pallas_call_p`` equation, from its params."""
    from reprules._registry import lookup

    with _by_jaxpr_lock:
        kernel_ref = _by_jaxpr.get(params.get("jaxpr"))
    kernel = kernel_ref() if kernel_ref is not None else None
    return lookup(kernel) if kernel is not None else None


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


def rule_context(reg: Registration, mesh_axes: tuple[str, ...], num_inputs: int, num_outputs: int) -> Any:
    """The RuleContext of one call of ``reg``'s kernel."""
    from reprules.rules import RuleContext

    return RuleContext(
        kernel_name=reg.name,
        kernel=reg.kernel(),
        mesh_axes=tuple(mesh_axes),
        num_inputs=num_inputs,
        num_outputs=num_outputs,
        jax_version=JAX_VERSION,
    )


def _pallas_layout(params: dict[str, Any], num_operands: int) -> tuple[int, int]:
    """(first user operand, number of outputs) of a ``pallas_call_p`` equation.

    Kernel constants and dynamic grid bounds come first; the user's arrays last.
    """
    if "in_shapes" in params:  # 0.4.28 - 0.4.3x
        num_user, num_out = len(params["in_shapes"]), len(params["out_shapes"])
    else:  # 0.4.3x+
        gm = params["grid_mapping"]
        num_user = gm.num_index_operands + gm.num_inputs
        num_out = len(params["out_avals"]) if "out_avals" in params else gm.num_outputs
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
            from jax._src.extend.ffi import ffi_call_p as p
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


def install_pallas_hooks(patches: Patches, wrap_call: Callable[..., Any]) -> None:
    """Wraps the ``pallas_call`` entry point and hooks ``pallas_call_p.bind``.

    ``wrap_call(kernel, out_shape, make_call, call)`` returns the function users
    get back from ``pallas_call(kernel, out_shape, ...)``, where ``call`` is
    JAX's own and ``make_call(new_out_shape)`` builds JAX's own for another
    out_shape. The kernel's rule is looked up when that function is called, so
    a rule registered or changed in between is honoured.
    """
    from jax._src.pallas import pallas_call as pallas_call_mod

    prim = pallas_call_p()
    original_bind = type(prim).bind

    def bind(*args: Any, **params: Any) -> Any:
        kernel_ref = _tracing.get()
        if kernel_ref is not None and "jaxpr" in params:
            with _by_jaxpr_lock:
                _by_jaxpr[params["jaxpr"]] = kernel_ref
        return original_bind(prim, *args, **params)

    patches.setattr(prim, "bind", bind)

    def entry_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def pallas_call(kernel: Any, out_shape: Any, *args: Any, **kwargs: Any) -> Any:
            call = original(kernel, out_shape, *args, **kwargs)
            return wrap_call(
                kernel, out_shape, lambda new: original(kernel, new, *args, **kwargs), call
            )

        pallas_call.__wrapped__ = original  # type: ignore[attr-defined]
        pallas_call.__doc__ = original.__doc__
        return pallas_call

    if hasattr(pallas_call_mod, "_pallas_call"):
        # 0.5.0+: the public pallas_call (and pl.kernel) delegate to this module
        # global, so one patch covers callers that imported pallas_call early.
        patches.setattr(pallas_call_mod, "_pallas_call", entry_wrapper(pallas_call_mod._pallas_call))
    else:
        # 0.4.28 - 0.4.38: pallas_call does everything itself.
        import jax.experimental.pallas as pl

        wrapped = entry_wrapper(pallas_call_mod.pallas_call)
        patches.setattr(pallas_call_mod, "pallas_call", wrapped)
        patches.setattr(pl, "pallas_call", wrapped)
