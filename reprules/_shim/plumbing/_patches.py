"""Patch bookkeeping: every change reprules makes to JAX, recorded so it can be undone.

The bottom of the shim with ``_jax``: it knows nothing of kernels or rules.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from typing import Any

from reprules._errors import PatchWarning, patch_left_message
from reprules._shim.plumbing._jax import JAX_VERSION


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
        self._held: list[tuple[str, Callable[[], Any], Any]] = []  # (what, its current value, ours)
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
                return f"{label(obj)}.{name}"
            if old is self._MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
            return None

        setattr(obj, name, installed)
        self._undo.append(undo)
        self._held.append((f"{label(obj)}.{name}", lambda: getattr(obj, name, None), installed))

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
        self._held.append((label or f"table[{key!r}]", lambda: mapping.get(key), installed))

    def held(self) -> list[tuple[str, bool]]:
        """``(what, in place)`` per patch not yet undone: in place while it holds
        reprules' object (or a later hook of these patches that wraps it)."""
        return [
            (what, now is ours or getattr(now, "_reprules_guard", None) is self)
            for what, current, ours in self._held if self.live for now in (current(),)
        ]

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Runs ``undo`` when these patches are undone (for a change no attribute holds)."""

        def run() -> str | None:
            undo()
            return None

        self._undo.append(run)

    def undo_all(self) -> None:
        """Restores what reprules still owns, newest first; warns once about the rest."""
        self.live = False
        self._held.clear()
        left: list[str] = []
        while self._undo:
            what = self._undo.pop()()
            if what is not None:
                left.append(what)
        if left:
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
    raise AttributeError(f"{label(obj)} had no attribute {name!r} before reprules set it")


def label(obj: Any) -> str:
    """``module``, ``module.Class`` or ``Class 'name'`` (a primitive) for messages."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    name = getattr(obj, "name", None)
    return f"{type(obj).__name__} {name!r}" if isinstance(name, str) else type(obj).__name__
