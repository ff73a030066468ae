"""Rule packs: rules that load themselves when the kernels they cover are imported.

A kernel library ships its rules through the ``reprules.rules`` entry-point
group. Each entry point is *named after the module whose kernels it covers*
and points at a function that registers them, given that module::

    [project.entry-points."reprules.rules"]
    "mylib.kernels" = "mylib._reprules_pack:register"   # register(module) -> None

Discovery is lazy and cheap: ``import reprules`` reads the entry-point names
only (no pack is imported) and installs an import hook; a pack is loaded right
after its module is imported (or at once, if that module already was). A pack
that fails is reported with its name and the error (a :class:`PackWarning`, and
in :func:`packs`) and never breaks the import. reprules' own pack for JAX's
Pallas ops uses the same mechanism.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib.abc
import importlib.metadata
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

GROUP = "reprules.rules"


class PackWarning(UserWarning):
    """A rule pack failed to load; its kernels have no rules from it."""


@dataclasses.dataclass(frozen=True, slots=True)
class PackStatus:
    """The state of one rule pack.

    Attributes:
      name: The entry point's value (``package.module:function``).
      module: The module whose kernels it covers.
      distribution: The installed distribution that declares it.
      state: ``"waiting"`` (module not imported yet), ``"loaded"`` or ``"failed"``.
      error: ``"ExceptionType: message"`` when it failed.
    """

    name: str
    module: str
    distribution: str
    state: str
    error: str | None = None


_lock = threading.RLock()
_status: dict[str, PackStatus] = {}  # by covered module
_entry_points: dict[str, importlib.metadata.EntryPoint] = {}
_loading: contextvars.ContextVar[str | None] = contextvars.ContextVar("reprules_pack", default=None)
_finder: _PostImportFinder | None = None
_after: dict[str, list[Callable[[Any], None]]] = {}  # reprules' own post-import callbacks, by module


def current_pack() -> str | None:
    """The pack being loaded right now (registrations made meanwhile are its)."""
    return _loading.get()


@contextlib.contextmanager
def _as_pack(name: str) -> Iterator[None]:
    token = _loading.set(name)
    try:
        yield
    finally:
        _loading.reset(token)


def _load(module_name: str) -> None:
    with _lock:
        ep = _entry_points.get(module_name)
        status = _status.get(module_name)
        if ep is None or status is None or status.state != "waiting":
            return
        try:
            with _as_pack(ep.value):
                ep.load()(sys.modules[module_name])
        except Exception as err:  # a broken pack must never break the user's import
            _status[module_name] = dataclasses.replace(
                status, state="failed", error=f"{type(err).__name__}: {err}"
            )
            warnings.warn(
                f"reprules rule pack {ep.value!r} (from {status.distribution}, for "
                f"{module_name}) failed to load: {type(err).__name__}: {err}. Its kernels "
                "have no rules; see reprules.packs().",
                PackWarning,
                stacklevel=2,
            )
        else:
            _status[module_name] = dataclasses.replace(status, state="loaded")


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Loads a pack right after the module it covers finishes importing."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if (fullname not in _entry_points and fullname not in _after) or fullname in sys.modules:
            return None
        # Let the rest of sys.meta_path find the real spec, then wrap its loader.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _LoadThenRegister(spec.loader)
                return spec
        return None


class _LoadThenRegister(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _run_after(module.__name__)
        _load(module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_code, is_package, ...
        return getattr(self._loader, name)


def discover() -> None:
    """Reads the entry points and arms the import hook (idempotent, cheap)."""
    global _finder
    with _lock:
        if _finder is not None:
            return
        found: Iterable[importlib.metadata.EntryPoint]
        try:
            found = importlib.metadata.entry_points(group=GROUP)
        except Exception as err:  # broken metadata must not break `import reprules`
            warnings.warn(f"reprules could not read its rule packs: {err}", PackWarning, stacklevel=3)
            found = ()
        names: dict[int, str] = {}  # Distribution.name parses METADATA: once per distribution
        for ep in found:
            d = getattr(ep, "dist", None)
            if id(d) not in names:
                names[id(d)] = getattr(d, "name", None) or "?"
            dist = names[id(d)]
            _entry_points[ep.name] = ep
            _status[ep.name] = PackStatus(name=ep.value, module=ep.name, distribution=dist, state="waiting")
        _finder = _PostImportFinder()
        sys.meta_path.insert(0, _finder)
    for module_name in list(_entry_points):
        if module_name in sys.modules:
            _load(module_name)


def after_import(module_name: str, callback: Callable[[Any], None]) -> None:
    """Calls ``callback(module)`` right after ``module_name`` is imported, or now if
    it already was (reprules' own use of the pack hook: arming the shim)."""
    with _lock:
        _after.setdefault(module_name, []).append(callback)
    discover()
    if module_name in sys.modules:
        _run_after(module_name)


def _run_after(module_name: str) -> None:
    with _lock:
        callbacks = _after.pop(module_name, [])
    for callback in callbacks:
        callback(sys.modules[module_name])


def packs() -> list[PackStatus]:
    """Every discovered pack and its state."""
    with _lock:
        return sorted(_status.values(), key=lambda s: s.module)
