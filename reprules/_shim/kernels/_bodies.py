"""Which body a ``pl.kernel`` / ``pl.core_map`` equation belongs to.

``pl.kernel`` (0.8+) and ``pl.core_map`` (0.4.38+) bind ``core_map_p`` (up to
0.9) or ``mpmd_map_p`` (0.9+), not ``pallas_call_p``. The adapter
(``core_map``) finds the body while a call is traced, by the code objects of
JAX's closures (:func:`find_codes`), and remembers here, weakly, kernel jaxpr ->
body (:func:`remember`), so that reports, strict mode and the ``custom_vjp``
fix find the body of an equation by identity. This module knows bodies, not
rules: which rule applies is ``_resolve``' business.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Sequence
from types import CodeType
from typing import Any

from reprules._registry import Registration
from reprules._shim.plumbing import _jax


def _nested_code(function: Any, name: str) -> CodeType | None:
    """The code object of the function ``name`` defined directly inside ``function``."""
    code = getattr(function, "__code__", None)
    for const in getattr(code, "co_consts", ()):
        if isinstance(const, CodeType) and const.co_name == name:
            return const
    return None


@dataclasses.dataclass(frozen=True)
class Codes:
    """Where reprules finds a kernel body while its call is traced (None: absent here)."""

    core_map_wrapped: CodeType | None  # pallas core.core_map.<locals>.wrapped (0.4.38+)
    kernel_wrapper: CodeType | None  # helpers._make_kernel.<locals>.wrapper (0.8 - 0.9)
    kernel_out_ref: CodeType | None  # its `lambda out: jax_core.new_ref(lax.empty(...))`
    mpmd_wrapper: CodeType | None  # mpmd._mpmd_map.<locals>.wrapper (0.10+)


def find_codes() -> Codes:
    pallas_core = _jax.module("jax._src.pallas.core")
    wrapped = _nested_code(getattr(pallas_core, "core_map", None), "wrapped")
    kernel_wrapper = out_ref = mpmd_wrapper = None
    helpers = _jax.module("jax._src.pallas.helpers")  # 0.8+ (None: no pl.kernel)
    if helpers is not None and hasattr(helpers, "_make_kernel"):  # 0.8 - 0.9
        kernel_wrapper = _nested_code(helpers._make_kernel, "wrapper")
        lambdas = [
            c for c in getattr(kernel_wrapper, "co_consts", ())
            if isinstance(c, CodeType) and c.co_name == "<lambda>" and "new_ref" in c.co_names
        ]
        out_ref = lambdas[0] if len(lambdas) == 1 else None
    mpmd = _jax.module("jax._src.pallas.mpmd")  # 0.9+ has the module; pl.kernel uses it from 0.10
    if mpmd is not None and helpers is not None and not hasattr(helpers, "_make_kernel"):
        mpmd_wrapper = _nested_code(getattr(mpmd, "_mpmd_map", None), "wrapper")
    return Codes(wrapped, kernel_wrapper, out_ref, mpmd_wrapper)


# Kernel jaxpr -> weak reference to the body it was traced from.
_by_jaxpr: weakref.WeakKeyDictionary[Any, Callable[[], Any]] = weakref.WeakKeyDictionary()
_by_jaxpr_lock = threading.Lock()
_primitives: dict[int, str] = {}  # id(primitive) -> "core_map" / "mpmd_map", filled at install


def mark_kernel_primitive(primitive: Any, kind: str) -> None:
    """Records ``primitive`` as ``core_map_p`` (``kind="core_map"``) or ``mpmd_map_p``."""
    _primitives[id(primitive)] = kind


def kernel_primitive_kind(primitive: Any) -> str | None:
    """``"core_map"``, ``"mpmd_map"``, or None for any other primitive."""
    return _primitives.get(id(primitive))


def remember(jaxprs: Sequence[Any], body: Any) -> None:
    try:
        ref = weakref.ref(body)
    except TypeError:
        return
    with _by_jaxpr_lock:
        for jaxpr in jaxprs:
            for item in (jaxpr, getattr(jaxpr, "jaxpr", None)):
                if item is not None and hasattr(item, "eqns"):
                    _by_jaxpr[item] = ref


def eqn_jaxprs(params: dict[str, Any]) -> tuple[Any, ...]:
    if "jaxprs" in params:  # mpmd_map
        return tuple(params["jaxprs"])
    return (params["jaxpr"],) if "jaxpr" in params else ()


def bodies_of(params: dict[str, Any]) -> list[Any] | None:
    """The bodies seen for an equation's kernel jaxprs (None: reprules did not see its call)."""
    found: list[Any] = []
    seen = False
    with _by_jaxpr_lock:
        for jaxpr in eqn_jaxprs(params):
            ref = _by_jaxpr.get(jaxpr)
            if ref is not None:
                seen = True
                body = ref()
                if body is not None:
                    found.append(body)
    return found if seen else None


def is_kernel_primitive(primitive: Any) -> bool:
    """Whether ``primitive`` is ``core_map_p`` or ``mpmd_map_p`` (once reprules is active)."""
    return id(primitive) in _primitives


# Kernel jaxprs of pl.kernel calls typed by a derived rule -> that rule's registration.
_inferred: weakref.WeakKeyDictionary[Any, Registration] = weakref.WeakKeyDictionary()


def remember_inferred(jaxprs: Sequence[Any], reg: Registration) -> None:
    with _by_jaxpr_lock:
        for jaxpr in jaxprs:
            try:
                _inferred[jaxpr] = reg
            except TypeError:  # not weak-referenceable
                pass


def inferred_for(params: dict[str, Any]) -> Registration | None:
    """The derived rule a call of this equation's kernel was typed by, if any."""
    with _by_jaxpr_lock:
        for jaxpr in eqn_jaxprs(params):
            found = _inferred.get(jaxpr)
            if found is not None:
                return found
    return None
