"""The collectives report of one function: trace, lower, compile, then merge the three levels.

One module per job: :mod:`reprules._report._walk` walks the jaxpr (and decides what is
defensive), :mod:`reprules._report._hlo` parses the StableHLO and HLO text,
:mod:`reprules._report._levels` matches the three, :mod:`reprules._report._records` holds the
records and renders them. :func:`reprules.testing.collectives` is the public
entry point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dataclasses

from reprules._report import _cheaper, _hlo, _hlo_graph, _implicit, _link_model
from reprules._report._levels import build_report
from reprules._report._records import Report
from reprules._report._walk import walk_jaxpr


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
    hlo_text = compiled.as_text() or ""  # typed Optional by JAX; always text on CPU
    hlo = _hlo.parse_hlo(hlo_text)
    mesh_shape = None
    if mesh is not None:
        mesh_shape = dict(mesh.shape)
    elif not walk.mesh:
        for leaf in jax.tree_util.tree_leaves(args):
            m = getattr(getattr(leaf, "sharding", None), "mesh", None)
            if m is not None and getattr(m, "shape", None):
                mesh_shape = dict(m.shape)
                break
    report = build_report(call.__name__, jax.__version__, walk, shlo, hlo, mesh_shape)
    return _communication(report, closed, args, hlo_text)


def _communication(report: Report, closed: Any, args: tuple[Any, ...], hlo_text: str) -> Report:
    """The report with its implicit collectives, cheaper equivalents and link model."""
    import jax

    backend = jax.default_backend()
    link = _link_model.current(backend)
    graph = _hlo_graph.parse(hlo_text)
    outside, arg_mesh = _implicit.outside_kernels(closed, args, _implicit.custom_call_names(graph))
    mesh = dict(report.mesh) or arg_mesh
    implicit = _implicit.find(graph, report.collectives, outside, mesh, backend, link)
    data = walk_jaxpr(closed, data=True)
    replicated = [jc.replicated_axes for jc in data.collectives]
    cheaper = _cheaper.find(graph, report.collectives, replicated, mesh, backend, link)
    return dataclasses.replace(report, implicit=implicit, cheaper=cheaper, backend=backend, link=link,
                               mesh=report.mesh or tuple(arg_mesh.items()))
