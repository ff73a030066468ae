"""Opaque CPU kernels (a C++ XLA FFI library) for tests and benchmarks.

XLA cannot look inside a custom call, so a defensive all-reduce around one is
never folded away: the honest workload for counting collectives. The library
is compiled on first use with the system C++ compiler against JAX's bundled FFI
headers, cached per jaxlib version, and registered for the CPU platform.

Targets (float32 only):

* ``reprules_copy``: ``out = x``
* ``reprules_mul``: ``out = x * w`` with a row vector ``w`` broadcast over rows
* ``reprules_mul_rowsum``: ``out[j] = sum_i a[i, j] * b[i, j]``
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
from typing import Any

import jax

from reprules._errors import ReprulesError

TARGETS = {
    "reprules_copy": "ReprulesCopy",
    "reprules_mul": "ReprulesMul",
    "reprules_mul_rowsum": "ReprulesMulRowSum",
}
_SOURCE = pathlib.Path(__file__).with_name("kernels.cc")
_lock = threading.Lock()
_loaded = False


class KernelBuildError(ReprulesError, RuntimeError):
    """The opaque CPU kernels could not be built or registered."""


def _ffi() -> Any:
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
        return f"JAX {jax.__version__} has no ffi_call (added in JAX 0.4.31)"
    if _compiler() is None:
        return "no C++ compiler (c++, g++ or clang++) on PATH"
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _library_path() -> pathlib.Path:
    from jaxlib import version as jaxlib_version

    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + jaxlib_version.__version__.encode()).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("REPRULES_CACHE", pathlib.Path.home() / ".cache" / "reprules"))
    return cache / f"libreprules_cpu_{key}.so"


def _build(path: pathlib.Path) -> None:
    reason = unavailable_reason()
    compiler = _compiler()
    if reason or compiler is None:
        raise KernelBuildError(f"Cannot build reprules' CPU FFI kernels: {reason}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = pathlib.Path(tmp) / path.name
        command = [
            compiler, "-std=c++17", "-O2", "-shared", "-fPIC",
            f"-I{_ffi().include_dir()}", str(_SOURCE), "-o", str(out),
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(
                f"Compiling reprules' CPU FFI kernels failed (JAX {jax.__version__}):\n"
                f"{' '.join(command)}\n{result.stderr[-4000:]}\n"
                "Fix: install a C++17 compiler, or skip the FFI workloads."
            )
        os.replace(out, path)  # atomic: concurrent builders never see half a file


def load() -> None:
    """Builds (once per jaxlib) and registers the targets (once per process)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        path = _library_path()
        if not path.exists():
            _build(path)
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
    return _call("reprules_copy", jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def mul(x: Any, w: Any) -> Any:
    """``x * w`` (``w`` a row vector), by the opaque ``reprules_mul`` kernel."""
    return _call("reprules_mul", jax.ShapeDtypeStruct(x.shape, x.dtype), x, w)


def mul_rowsum(a: Any, b: Any, row_shape: tuple[int, ...]) -> Any:
    """``(a * b)`` summed over rows into ``row_shape``, by ``reprules_mul_rowsum``."""
    return _call("reprules_mul_rowsum", jax.ShapeDtypeStruct(row_shape, a.dtype), a, b)
