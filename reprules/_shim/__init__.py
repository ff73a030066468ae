"""The versioned shim: the only code in reprules that touches JAX internals.

One module per regime, chosen once by feature detection:

===========  ================  ============================================
regime       JAX               mechanism
===========  ================  ============================================
``rep``      0.4.28 - 0.5.x    check/rewrite rules (``check_rep=True``)
``vma``      0.6.x  - 0.9.x    ``vma`` in the types (``check_vma=True``)
``mat``      0.10.x - 0.12.x   ``manual_axis_type`` in the types
===========  ================  ============================================

Nothing is patched until the first rule is registered, and everything is
restored when the last one is removed, so a program that registers nothing
runs exactly as without reprules.
"""

from __future__ import annotations

import threading
from types import ModuleType

from reprules._errors import UnsupportedJaxError
from reprules._shim import _common

JAX_VERSION = _common.JAX_VERSION
SUPPORTED = ((0, 4, 28), (0, 13))
SUPPORTED_TEXT = ">=0.4.28,<0.13"

_lock = threading.RLock()
_regime: ModuleType | None = None
_patches: _common.Patches | None = None


def regime() -> ModuleType:
    """The regime module for the installed JAX; raises if JAX is unsupported."""
    global _regime
    with _lock:
        if _regime is None:
            _regime = _detect()
        return _regime


def _detect(version: str = JAX_VERSION) -> ModuleType:
    low, high = SUPPORTED
    if not low <= _common.version_tuple(version) < high:
        raise UnsupportedJaxError(
            f"reprules supports JAX {SUPPORTED_TEXT}, but JAX {version} is installed.\n"
            "Why: reprules works through JAX internals that move between releases, and "
            "this release has not been tested.\n"
            f"Fix: install a supported JAX (pip install 'jax{SUPPORTED_TEXT}' with the "
            "matching jaxlib), or a reprules release that supports this JAX."
        )
    # Newest first: each later regime keeps some of the older names around.
    from reprules._shim import mat, rep, vma

    for module in (mat, vma, rep):
        if module.detect():
            return module
    raise UnsupportedJaxError(
        f"JAX {JAX_VERSION} is in reprules' supported range {SUPPORTED_TEXT}, but none of "
        "its mechanisms (check_rep rules, vma types, manual_axis_type types) was found.\n"
        "Why: this JAX build differs from the released wheels reprules was tested on.\n"
        "Fix: install the released jax and jaxlib wheels of one version."
    )


def activate() -> None:
    """Installs the regime's patches (idempotent)."""
    global _patches
    with _lock:
        if _patches is not None:
            return
        module = regime()
        patches = _common.Patches()
        try:
            module.install(patches)
        except BaseException:
            patches.undo_all()
            raise
        _patches = patches


def deactivate() -> None:
    """Restores every patched JAX object (idempotent)."""
    global _patches
    with _lock:
        if _patches is not None:
            _patches.undo_all()
            _patches = None


def active() -> bool:
    return _patches is not None
