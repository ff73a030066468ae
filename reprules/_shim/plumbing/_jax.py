"""The bottom of the shim: the one module that imports JAX's internals.

Every other module of reprules reaches ``jax._src`` through this one: the
modules every supported JAX has are imported here once; those that come and
go between releases are looked up by :func:`module` (None where this JAX lacks
them). ``../shared/JAX_INTERNALS.md`` maps what lives where, per release.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import jax
from jax._src import api_util, config, core, source_info_util, xla_bridge
from jax._src import linear_util as lu
from jax._src import mesh as mesh_lib
from jax._src.interpreters import partial_eval as pe
from jax._src.state.types import AbstractRef

from reprules._version import version_tuple as _parse

__all__ = ["JAX_VERSION", "AbstractRef", "ClosedJaxpr", "JAXPR_TYPES", "backends_started", "api_util", "config", "core", "defined_primitives", "ffi_call_p", "lu", "mesh_lib", "module",
           "cpu_tpu_info", "pallas_call_p", "pe", "primitive", "source_info_util", "tpu_info_module", "version_tuple"]

JAX_VERSION: str = jax.__version__


def version_tuple(version: str = JAX_VERSION) -> tuple[int, ...]:
    """``(0, 12, 0, 1)`` for JAX 0.12.0.1 (by default the installed JAX); one parser for reprules."""
    return _parse(version)


def module(name: str) -> Any:
    """The JAX module ``name`` (``"jax._src.pallas.core"``), imported now; None
    where this JAX has no such module. Typed ``Any``: its contents vary by release."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def primitive(module_name: str, attr: str) -> Any:
    """``module_name.attr`` if that module exists here and holds a JAX primitive there; else None."""
    found = getattr(module(module_name), attr, None)
    return found if isinstance(found, core.Primitive) else None


def primitives(names: Iterable[tuple[str, str]]) -> frozenset[Any]:
    """The primitives among ``(module, attr)`` pairs that this JAX has."""
    return frozenset(p for p in (primitive(m, a) for m, a in names) if p is not None)


def defined_primitives() -> set[int]:
    """The ids of the primitives that the modules of JAX imported so far define
    (at top level: every primitive of JAX's own is a module global)."""
    found: set[int] = set()
    for name, mod in list(sys.modules.items()):
        if (name == "jax" or name.startswith("jax.")) and isinstance(mod, ModuleType):
            found.update(id(v) for v in list(vars(mod).values()) if isinstance(v, core.Primitive))
    return found


# A jaxpr with its consts: ``core.ClosedJaxpr`` up to 0.11, which 0.12 folded into ``core.Jaxpr``
# (``Jaxpr(jaxpr, consts)`` still builds one there).
ClosedJaxpr: Any = getattr(core, "ClosedJaxpr", core.Jaxpr)
JAXPR_TYPES: tuple[type, ...] = tuple({core.Jaxpr, ClosedJaxpr})


def loaded(name: str) -> ModuleType | None:
    """The JAX module ``name`` if something imported it already (never imports it)."""
    found = sys.modules.get(name)
    return found if isinstance(found, ModuleType) else None


def ffi_call_p() -> Any | None:
    try:  # 0.5+
        from jax._src.ffi import ffi_call_p as p
    except ImportError:
        try:  # 0.4.31 - 0.4.38
            from jax._src.extend.ffi import ffi_call_p as p  # type: ignore[import-not-found, no-redef]  # JAX <= 0.4.38 only
        except ImportError:  # 0.4.28 - 0.4.30: no ffi_call
            return None
    return p


def pallas_call_p() -> Any:
    # Same path from 0.4.28 to 0.12.
    from jax._src.pallas.pallas_call import pallas_call_p as p

    return p


def tpu_info_module() -> Any:
    """The module holding JAX's registry of TPU descriptions by device kind (which
    ``get_tpu_info()`` reads): ``jax._src.tpu_info`` from 0.11, ``jax._src.pallas.mosaic.tpu_info``
    on 0.9 - 0.10; None before (no registry)."""
    for name in ("jax._src.tpu_info", "jax._src.pallas.mosaic.tpu_info"):
        found = module(name)
        if isinstance(getattr(found, "registry", None), dict):
            return found
    return None


@contextlib.contextmanager
def cpu_tpu_info(describe: Callable[[], Any]) -> Iterator[None]:
    """Inside, JAX's ``get_tpu_info()`` answers ``describe()`` for the CPU device kind
    (where it raises "Unsupported TPU device kind: cpu"); undone on exit. Needs
    :func:`tpu_info_module` (JAX 0.9+)."""
    info = tpu_info_module()
    registry = info.registry
    before = registry.get("cpu")
    forget = getattr(info.get_tpu_info, "cache_clear", lambda: None)  # it caches on some versions
    registry["cpu"] = describe
    forget()
    try:
        yield
    finally:
        if before is None:
            registry.pop("cpu", None)
        else:
            registry["cpu"] = before
        forget()


def backends_started() -> bool:
    """Whether a JAX backend (and so its device count) is already fixed.

    ``xla_bridge._backends`` is the backend cache in every supported version
    (0.4.28 - 0.12); a layout without it is taken as started.
    """
    return bool(getattr(xla_bridge, "_backends", {"?": None}))
