"""Which kernel has which rule.

A rule belongs to the kernel *object* (not its name): two kernels that share a
``__name__`` keep their own rules, and a kernel reaching ``pallas_call`` through
``functools.partial`` finds the rule of the function it wraps. Entries are weak,
so registering never keeps a kernel alive.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, MutableMapping

from reprules._errors import RegistrationError
from reprules.rules import RuleLike


@dataclasses.dataclass(frozen=True, slots=True)
class Registration:
    """A registered rule and where it came from (for messages and listings)."""

    rule: RuleLike
    name: str
    where: str  # "module.qualname"
    kernel_ref: Callable[[], object | None]  # weak: registering keeps nothing alive
    source: str = "?"  # "pack <entry point>" or the "file:line" that registered it

    def kernel(self) -> object | None:
        return self.kernel_ref()

    def describe(self) -> str:
        return f"{self.where} -> {self.rule!r} (from {self.source})"


@dataclasses.dataclass(frozen=True, slots=True)
class FfiTarget:
    """An XLA FFI target, by the name ``jax.ffi.ffi_call`` calls it with.

    Targets are identified by name (every ``ffi_call`` of the name shares the rule).
    """

    name: str


_lock = threading.RLock()
_rules: weakref.WeakKeyDictionary[object, Registration] = weakref.WeakKeyDictionary()
_targets: dict[object, Registration] = {}  # FFI targets, by value: names are not weak-referenceable


def _table(kernel: object) -> MutableMapping[object, Registration]:
    return _targets if isinstance(kernel, FfiTarget) else _rules


def kernel_name(kernel: object) -> str:
    """The name JAX would show for ``kernel``, looking through partials."""
    while isinstance(kernel, functools.partial):
        kernel = kernel.func
    if isinstance(kernel, FfiTarget):
        return kernel.name
    # Primitives have .name; Triton's JITFunction has .__name__ (or .fn).
    for attr in ("__name__", "name"):
        name = getattr(kernel, attr, None)
        if isinstance(name, str):
            return name
    return type(kernel).__name__


def _where(kernel: object) -> str:
    if isinstance(kernel, FfiTarget):
        return f"ffi_target:{kernel.name}"
    qualname = getattr(kernel, "__qualname__", None)
    if qualname is None:  # an instance, e.g. a Primitive: name it by its type
        return f"{type(kernel).__name__}:{kernel_name(kernel)}"
    module = getattr(kernel, "__module__", None) or "?"
    return f"{module}.{qualname}"


def register(kernel: object, rule: RuleLike, *, override: bool, source: str = "?") -> Registration:
    if isinstance(kernel, functools.partial):
        raise RegistrationError(
            f"Cannot register a replication rule on {kernel!r}: it is a functools.partial.\n"
            "Why: a rule belongs to the kernel function itself, and partials of it "
            "find that rule automatically.\n"
            "Fix: decorate the function passed to pl.pallas_call (the underlying "
            "function, not a partial of it)."
        )
    if not callable(rule):
        raise RegistrationError(
            f"The rule given for kernel {_where(kernel)!r} is {rule!r}, which is not callable.\n"
            "Why: reprules calls the rule with each call's context and input varying sets.\n"
            "Fix: pass one of reprules.rules (e.g. rules.same()) or a callable "
            "`rule(ctx, in_varying) -> Decision | sequence of sets`."
        )
    try:
        ref: Callable[[], object | None] = (
            (lambda: kernel) if isinstance(kernel, FfiTarget) else weakref.ref(kernel)
        )
    except TypeError:
        raise RegistrationError(
            f"Cannot register a replication rule on {kernel!r}: it cannot be weakly referenced, "
            "so it is not a kernel function, primitive or FFI target.\n"
            "Fix: register the Pallas kernel function, the jax.extend.core.Primitive, "
            "reprules.ffi_target(name), or the Triton kernel."
        ) from None
    new = Registration(
        rule=rule, name=kernel_name(kernel), where=_where(kernel), kernel_ref=ref, source=source
    )
    table = _table(kernel)
    with _lock:
        old = table.get(kernel)
        if old is not None and old.rule != rule and not override:
            raise RegistrationError(
                f"Kernel {new.where!r} already has the replication rule {old.rule!r}; "
                f"refusing to replace it with {rule!r}.\n"
                "Why: two rules for one kernel would make its typing depend on import order.\n"
                "Fix: pass override=True to replication_rule(...) if the replacement is "
                "intended, or call reprules.unregister(kernel) first."
            )
        table[kernel] = new
    return new


def unregister(kernel: object) -> bool:
    """Removes ``kernel``'s rule; returns whether it had one."""
    with _lock:
        try:
            return _table(kernel).pop(kernel, None) is not None
        except TypeError:  # not weak-referenceable, so never registered
            return False


def lookup(kernel: object) -> Registration | None:
    """The rule of ``kernel``, or of the function a chain of partials wraps."""
    with _lock:
        while True:
            try:
                reg = _table(kernel).get(kernel)
            except TypeError:  # not weak-referenceable, so never registered
                reg = None
            if reg is not None or not isinstance(kernel, functools.partial):
                return reg
            kernel = kernel.func


def registrations() -> list[Registration]:
    """A snapshot of every registration, in registration order."""
    with _lock:
        return [*_rules.values(), *_targets.values()]


def registered() -> dict[str, Registration]:
    """A snapshot of the registry, keyed by ``module.qualname``.

    Distinct kernels can share a ``module.qualname`` (kernels made by one
    factory, primitives of one name): the first registered keeps the plain key,
    the others get ``#2``, ``#3``... in registration order. ``Registration.where``
    stays the plain name.
    """
    out: dict[str, Registration] = {}
    for reg in registrations():
        key, n = reg.where, 1
        while key in out:
            n += 1
            key = f"{reg.where}#{n}"
        out[key] = reg
    return out


def is_empty() -> bool:
    with _lock:
        return not _rules and not _targets


Kernel = Callable[..., object]
