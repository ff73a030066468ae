"""Read-only looks at JAX state that has no public API (for reprules.testing).

Nothing here patches JAX; each function says which versions it serves.
"""

from __future__ import annotations

import sys


def backends_started() -> bool:
    """Whether a JAX backend (and so its device count) is already fixed.

    Returns ``False`` without importing JAX when JAX is not imported yet.
    ``jax._src.xla_bridge._backends`` is the backend cache in every supported
    version (0.4.28 - 0.12).
    """
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - layout changed: assume started
        return True
    return bool(getattr(xla_bridge, "_backends", {}))

