"""The collectives report of one function: trace, lower, compile, then merge the three levels.

One module per job: :mod:`reprules._walk` walks the jaxpr (and decides what is
defensive), :mod:`reprules._hlo` parses the StableHLO and HLO text,
:mod:`reprules._levels` matches the three, :mod:`reprules._report` holds the
records and renders them. :func:`reprules.testing.collectives` is the public
entry point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reprules import _hlo
from reprules._levels import build_report
from reprules._report import Report
from reprules._walk import walk_jaxpr


def _function_name(fn: Callable[..., Any]) -> str:
    inner = getattr(fn, "__wrapped__", fn)
    return getattr(inner, "__name__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _stablehlo_text(lowered: Any) -> str:
    try:
        module = lowered.compiler_ir("stablehlo")
        return str(module.operation.get_asm(enable_debug_info=True, large_elements_limit=16))
    except Exception:  # older/newer MLIR bindings: fall back to the plain text
        return str(lowered.as_text())


def collectives(fn: Callable[..., Any], *args: Any, mesh: Any = None, **kwargs: Any) -> Report:
    """See :func:`reprules.testing.collectives`."""
    import jax

    def call(*a: Any) -> Any:
        return fn(*a, **kwargs)

    call.__name__ = _function_name(fn)
    closed = jax.make_jaxpr(call)(*args)
    walk = walk_jaxpr(closed)
    lowered = jax.jit(call).lower(*args)
    shlo = _hlo.parse_stablehlo(_stablehlo_text(lowered))
    compiled = lowered.compile()
    hlo = _hlo.parse_hlo(compiled.as_text() or "")  # typed Optional by JAX; always text on CPU
    mesh_shape = None
    if mesh is not None:
        mesh_shape = dict(mesh.shape)
    elif not walk.mesh:
        for leaf in jax.tree_util.tree_leaves(args):
            m = getattr(getattr(leaf, "sharding", None), "mesh", None)
            if m is not None and getattr(m, "shape", None):
                mesh_shape = dict(m.shape)
                break
    return build_report(call.__name__, jax.__version__, walk, shlo, hlo, mesh_shape)
