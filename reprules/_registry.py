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


@dataclasses.dataclass(frozen=True, slots=True)
class KernelName:
    """A Pallas kernel function by where it is defined, ``"module:qualname"``
    (e.g. ``"pkg.ops:gmm.<locals>.kernel"``), for kernels that have no stable
    object to register: nested functions made anew on every call.

    Every function whose ``__module__`` and ``__qualname__`` match shares the
    rule; a rule registered on the function object itself wins.
    """

    qualified: str

    @property
    def short_name(self) -> str:
        return self.qualified.rsplit(".", 1)[-1].rsplit(":", 1)[-1]


@dataclasses.dataclass(frozen=True, slots=True)
class KernelPackage:
    """Every Pallas kernel defined in the source files of an installed package
    (or module), e.g. ``"tokamax"``: their rules are derived from their bodies,
    as under ``reprules.inference()`` (the only rule such a target takes is
    ``rules.inferred()``). Rules registered on a kernel object or name win.
    """

    package: str

    @property
    def short_name(self) -> str:
        return f"{self.package}.*"


_lock = threading.RLock()
_rules: weakref.WeakKeyDictionary[object, Registration] = weakref.WeakKeyDictionary()
_targets: dict[object, Registration] = {}  # FFI targets, kernel names and packages, by value
_matched: set[KernelName] = set()  # kernel names that some traced kernel had
_package_roots: dict[KernelPackage, tuple[str, ...]] = {}  # where each package's files lie
_package_of_file: dict[str, KernelPackage | None] = {}  # a cache, cleared when the registry changes


def _by_value(kernel: object) -> bool:
    return isinstance(kernel, (FfiTarget, KernelName, KernelPackage))


def _table(kernel: object) -> MutableMapping[object, Registration]:
    return _targets if _by_value(kernel) else _rules


def qualified_name(kernel: object) -> str | None:
    """``"module:qualname"`` of a kernel function (through partials), or None."""
    while isinstance(kernel, functools.partial):
        kernel = kernel.func
    module, qualname = getattr(kernel, "__module__", None), getattr(kernel, "__qualname__", None)
    return f"{module}:{qualname}" if isinstance(module, str) and isinstance(qualname, str) else None


def kernel_name(kernel: object) -> str:
    """The name JAX would show for ``kernel``, looking through partials."""
    while isinstance(kernel, functools.partial):
        kernel = kernel.func
    if isinstance(kernel, FfiTarget):
        return kernel.name
    if isinstance(kernel, (KernelName, KernelPackage)):
        return kernel.short_name
    # Primitives have .name; Triton's JITFunction has .__name__ (or .fn).
    for attr in ("__name__", "name"):
        name = getattr(kernel, attr, None)
        if isinstance(name, str):
            return name
    return type(kernel).__name__


def _where(kernel: object) -> str:
    if isinstance(kernel, FfiTarget):
        return f"ffi_target:{kernel.name}"
    if isinstance(kernel, KernelName):
        return f"kernel_named:{kernel.qualified}"
    if isinstance(kernel, KernelPackage):
        return f"kernels_in:{kernel.package}"
    qualname = getattr(kernel, "__qualname__", None)
    if qualname is None:  # an instance, e.g. a Primitive: name it by its type
        return f"{type(kernel).__name__}:{kernel_name(kernel)}"
    module = getattr(kernel, "__module__", None) or "?"
    return f"{module}.{qualname}"


_generation = 0


def _bump() -> None:
    global _generation
    _generation += 1
    _package_of_file.clear()


def generation() -> int:
    """Changes whenever a rule is registered or removed (keys of caches that
    hold what was traced under the rules of the moment)."""
    return _generation


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
            "Fix: pass one of reprules.rules (e.g. reprules.rules.same(), with `import reprules`) or a callable "
            "`rule(ctx, in_varying) -> Decision | sequence of sets`."
        )
    try:
        ref: Callable[[], object | None] = (
            (lambda: kernel) if _by_value(kernel) else weakref.ref(kernel)
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
        if isinstance(kernel, KernelPackage):
            _package_roots[kernel] = package_roots(kernel.package)
        _bump()
    return new


def unregister(kernel: object) -> bool:
    """Removes ``kernel``'s rule; returns whether it had one."""
    with _lock:
        try:
            removed = _table(kernel).pop(kernel, None) is not None
        except TypeError:  # not weak-referenceable, so never registered
            return False
        if isinstance(kernel, KernelPackage):
            _package_roots.pop(kernel, None)
        _bump()
        return removed


def lookup(kernel: object) -> Registration | None:
    """The rule of ``kernel``, or of the function a chain of partials wraps;
    else the rule registered for its ``module:qualname`` (identity wins)."""
    with _lock:
        while True:
            try:
                reg = _table(kernel).get(kernel)
            except TypeError:  # not weak-referenceable, so never registered
                reg = None
            if reg is not None or not isinstance(kernel, functools.partial):
                break
            kernel = kernel.func
        if reg is not None or not _targets or _by_value(kernel) or not callable(kernel):
            return reg
        qualified = qualified_name(kernel)
        name = KernelName(qualified) if qualified else None
        reg = _targets.get(name) if name is not None else None
        if reg is not None and name is not None:
            _matched.add(name)
        return reg


def unmatched_names() -> list[Registration]:
    """Rules registered by ``kernel_named`` that no traced kernel has matched yet
    (a ``kernels_in`` package was found installed when registered: not a typo)."""
    with _lock:
        return [reg for key, reg in _targets.items() if isinstance(key, KernelName) and key not in _matched]


def package_roots(package: str) -> tuple[str, ...]:
    """The directories (a package) or the file (a module) holding ``package``'s
    source, resolved without importing it; ``()`` if it is not installed."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a parent that is not a package, or a bad name
        return ()
    if spec is None:
        return ()
    dirs = list(spec.submodule_search_locations or ())
    if dirs:
        return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)
    return (os.path.realpath(spec.origin),) if spec.origin and os.path.isfile(spec.origin) else ()


def has_packages() -> bool:
    """Whether some :class:`KernelPackage` is registered (a lock-free hint)."""
    return bool(_package_roots)


def infers_package_of(file: str | None) -> KernelPackage | None:
    """The registered :class:`KernelPackage` whose source holds ``file`` (the file
    a kernel function is defined in), or None. Cheap when none is registered."""
    if file is None or not _package_roots:
        return None
    with _lock:
        if file in _package_of_file:
            return _package_of_file[file]
        import os

        real = os.path.realpath(file)
        found = next((package for package, roots in _package_roots.items()
                      if any(real == root or (root.endswith(os.sep) and real.startswith(root))
                             for root in roots)), None)
        _package_of_file[file] = found
        return found


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
