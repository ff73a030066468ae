"""Opaque CPU kernels (a C++ XLA FFI library) for tests, examples and benchmarks.

Public as :mod:`reprules.testing.cpu_kernels`: a deliberate part of the testing
tools, not of the product. XLA cannot look inside a custom call, so a defensive
all-reduce around one is never folded away: the honest workload for counting
collectives in your own tests. The library is compiled on first use with the
system C++ compiler against JAX's bundled FFI headers, cached per jaxlib
version, and registered for the CPU platform.

Targets (float32 only):

* ``reprules_copy``: ``out = x``
* ``reprules_mul``: ``out = x * w`` with a row vector ``w`` broadcast over rows
* ``reprules_mul_rowsum``: ``out[j] = sum_i a[i, j] * b[i, j]``

The cache directory is ``$REPRULES_CACHE`` if set, else
``$XDG_CACHE_HOME/reprules`` (an absolute ``XDG_CACHE_HOME`` only, as the XDG
specification says), else ``~/.cache/reprules``. Building a library deletes
the ones there that no process has loaded for :data:`STALE_DAYS` days (other
jaxlib versions, older sources); loading one marks it used.

Importing this module does not import JAX.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from reprules._errors import ReprulesError

if TYPE_CHECKING:
    import jax

__all__ = [
    "CACHE_ENV",
    "STALE_DAYS",
    "TARGETS",
    "KernelBuildError",
    "cache_dir",
    "copy",
    "load",
    "mul",
    "mul_rowsum",
    "prune",
    "unavailable_reason",
]

TARGETS = {
    "reprules_copy": "ReprulesCopy",
    "reprules_mul": "ReprulesMul",
    "reprules_mul_rowsum": "ReprulesMulRowSum",
}
CACHE_ENV = "REPRULES_CACHE"
STALE_DAYS = 30
_PREFIX = "libreprules_cpu_"
_SOURCE = pathlib.Path(__file__).with_name("kernels.cc")
_lock = threading.Lock()
_loaded = False


class KernelBuildError(ReprulesError, RuntimeError):
    """The opaque CPU kernels could not be built or registered."""


def _ffi() -> Any:
    import jax

    ffi: Any = getattr(jax, "ffi", None)  # 0.5+
    if ffi is None or not hasattr(ffi, "ffi_call"):
        try:  # 0.4.31 - 0.4.38 (the module is gone from the newest JAX, whose stubs mypy reads)
            ffi = importlib.import_module("jax.extend.ffi")
        except ImportError:
            ffi = None
    if ffi is None or not hasattr(ffi, "ffi_call"):
        return None
    return ffi


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used here, or None if they can."""
    if _ffi() is None:
        import jax

        return f"JAX {jax.__version__} has no ffi_call (added in JAX 0.4.31)"
    if _compiler() is None:
        return "no C++ compiler (c++, g++ or clang++) on PATH"
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def cache_dir() -> pathlib.Path:
    """Where the compiled library is kept: ``$REPRULES_CACHE``, ``$XDG_CACHE_HOME/reprules`` or ``~/.cache/reprules``."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return pathlib.Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG specification: a relative path is invalid, ignore it
        return pathlib.Path(xdg) / "reprules"
    return pathlib.Path.home() / ".cache" / "reprules"


def _library_path() -> pathlib.Path:
    from jaxlib import version as jaxlib_version

    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + jaxlib_version.__version__.encode()).hexdigest()[:16]
    return cache_dir() / f"{_PREFIX}{key}.so"


def _unwritable(directory: pathlib.Path, err: OSError) -> KernelBuildError:
    return KernelBuildError(
        f"Cannot build reprules' CPU FFI kernels: the cache directory {str(directory)!r} cannot be "
        f"written ({type(err).__name__}: {err}).\n"
        "Why: the C++ library is compiled once per jaxlib version and kept there for later runs.\n"
        f"Fix: set {CACHE_ENV} (or XDG_CACHE_HOME) to a writable directory, e.g. "
        f"`export {CACHE_ENV}=/tmp/reprules-cache`.")


def prune(directory: pathlib.Path, keep: pathlib.Path, *, max_age_days: float = STALE_DAYS) -> list[pathlib.Path]:
    """Deletes the libraries in ``directory`` (but ``keep``) unused for ``max_age_days``; returns them.

    A library is "used" when a process loads it (its modification time is
    then set to now), so libraries that other environments (another jaxlib)
    still load are kept.
    """
    cutoff = time.time() - max_age_days * 86400
    removed = []
    for path in directory.glob(f"{_PREFIX}*.so"):
        try:
            if path != keep and path.stat().st_mtime < cutoff:
                path.unlink()
                removed.append(path)
        except OSError:  # removed by another process, or not ours to remove
            continue
    return removed


def _build(path: pathlib.Path) -> None:
    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=directory, prefix=".build-")
    except OSError as err:
        raise _unwritable(directory, err) from err
    try:
        reason = unavailable_reason()
        compiler = _compiler()
        if reason or compiler is None:
            raise KernelBuildError(
                f"Cannot build reprules' CPU FFI kernels: {reason}.\n"
                "Why: they are C++ compiled on first use against JAX's FFI headers.\n"
                "Fix: install a C++17 compiler (or set CXX), or skip the FFI workloads.")
        out = pathlib.Path(tmp) / path.name
        command = [
            compiler, "-std=c++17", "-O2", "-shared", "-fPIC",
            f"-I{_ffi().include_dir()}", str(_SOURCE), "-o", str(out),
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            import jax

            raise KernelBuildError(
                f"Compiling reprules' CPU FFI kernels failed (JAX {jax.__version__}):\n"
                f"{' '.join(command)}\n{result.stderr[-4000:]}\n"
                "Why: the compiler refused the source with JAX's bundled FFI headers.\n"
                "Fix: install a C++17 compiler (or set CXX to one), or skip the FFI workloads."
            )
        try:
            os.replace(out, path)  # atomic: concurrent builders never see half a file
        except OSError as err:
            raise _unwritable(directory, err) from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune(directory, keep=path)


def load() -> None:
    """Builds (once per jaxlib) and registers the targets (once per process).

    Raises:
      KernelBuildError: no compiler, a failed compile, or a cache directory
        that cannot be written (see :func:`cache_dir`).
    """
    global _loaded
    with _lock:
        if _loaded:
            return
        path = _library_path()
        if not path.exists():
            _build(path)
        else:
            try:
                os.utime(path)  # used now: not stale
            except OSError:  # a read-only cache with the library already built is fine
                pass
        library = ctypes.cdll.LoadLibrary(str(path))
        ffi = _ffi()
        for target, symbol in TARGETS.items():
            ffi.register_ffi_target(target, ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        _loaded = True


def _call(target: str, result: jax.ShapeDtypeStruct, *args: Any) -> Any:
    load()
    return _ffi().ffi_call(target, result)(*args)


def copy(x: Any) -> Any:
    """``x``, computed by the opaque ``reprules_copy`` kernel."""
    import jax

    return _call("reprules_copy", jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def mul(x: Any, w: Any) -> Any:
    """``x * w`` (``w`` a row vector), by the opaque ``reprules_mul`` kernel."""
    import jax

    return _call("reprules_mul", jax.ShapeDtypeStruct(x.shape, x.dtype), x, w)


def mul_rowsum(a: Any, b: Any, row_shape: tuple[int, ...]) -> Any:
    """``(a * b)`` summed over rows into ``row_shape``, by ``reprules_mul_rowsum``."""
    import jax

    return _call("reprules_mul_rowsum", jax.ShapeDtypeStruct(row_shape, a.dtype), a, b)
