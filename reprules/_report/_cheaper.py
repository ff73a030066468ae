"""Collectives with a cheaper equivalent, still in the compiled program (jax#2926, tt-xla#3071).

Three patterns, each judged where it runs:

* ``own-slice``: an all-reduce whose every use is a ``dynamic-slice`` keeping,
  on each device, that device's own part (its position in the replica group
  times the slice size, along the one sliced dimension): a reduce-scatter
  (``jax.lax.psum_scatter(..., tiled=True)``) sends half the bytes.
* ``own-shard``: an all-gather whose every use keeps the device's own shard,
  along the gathered dimension: the shard itself, no collective.
* ``replicated-sum``: an all-reduce (``psum``) whose operand's *data* is
  identical over the summed axes (the data analysis of :mod:`reprules._report._walk`:
  casts do not count, an opaque kernel's outputs vary over every axis): a
  multiplication by the axes' size.

The first two are read from the compiled HLO: the slice offsets are evaluated
for every device (:func:`reprules._report._hlo_graph.evaluate`), and a pattern is
reported only when they are known and match on all of them. The third comes
from the jaxpr, and counts only when the all-reduce is still in the compiled
HLO. So what XLA already rewrote on the backend at hand (a GPU compile turns
an all-reduce and its own slice into a reduce-scatter) is not reported; the
backend is named in each finding. A ``defensive`` all-reduce (a transpose
psum, reported as such) is not reported again here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from reprules._report import _hlo, _hlo_graph, _link_model
from reprules._report._comm import CheaperCollective
from reprules._report._records import Collective

_ASYNC_DONE = ("all-reduce-done", "all-gather-done")


def _groups(instr: _hlo_graph.Instr, partitions: int) -> dict[int, tuple[int, int]] | None:
    """device -> (position in its group, group size), or None when the groups are unreadable."""
    attr = instr.attr("replica_groups")
    try:
        groups = _hlo.parse_groups(attr) if attr else _hlo.Groups(ids=())
    except ValueError:
        return None
    if groups.axes is not None:
        if groups.mesh is None:
            return None
        groups = _hlo._mesh_groups(groups.mesh, groups.axes)
    ids = groups.ids if groups.ids else (tuple(range(partitions)),)
    out = {}
    for g in ids:
        for pos, dev in enumerate(g):
            out[dev] = (pos, len(g))
    return out if len(out) == partitions else None


def _own_slice(graph: _hlo_graph.Graph, comp: _hlo_graph.Computation, ds: _hlo_graph.Instr,
               dims: tuple[int, ...], groups: Mapping[int, tuple[int, int]],
               outer: _hlo_graph.Computation | None, fusion: _hlo_graph.Instr | None) -> int | None:
    """The sliced dimension when ``ds`` keeps each device's own part of ``dims``, else None."""
    sizes = ds.ints("dynamic_slice_sizes")
    if sizes is None or len(sizes) != len(dims):
        return None
    cut = [k for k, (s, d) in enumerate(zip(sizes, dims)) if s != d]
    if len(cut) != 1:
        return None
    d = cut[0]
    size = sizes[d]
    for device in range(graph.partitions):
        pos, n = groups[device]
        if size * n != dims[d]:
            return None

        def param(i: int, device: int = device) -> int:
            if outer is None or fusion is None:
                raise KeyError(i)
            value = _hlo_graph.evaluate(graph, outer, fusion.operands[i], device)
            if value is None:
                raise KeyError(i)
            return value

        offset = _hlo_graph.evaluate(graph, comp, ds.operands[1 + d], device, param if fusion else None)
        if offset is None or min(max(offset, 0), dims[d] - size) != pos * size:
            return None
    return d


def _slices(graph: _hlo_graph.Graph, comp: _hlo_graph.Computation, instr: _hlo_graph.Instr,
            dims: tuple[int, ...], groups: Mapping[int, tuple[int, int]]) -> tuple[int, str] | None:
    """(dimension, slice source) when every use of ``instr`` keeps the own part, else None."""
    uses = comp.users(instr.name)
    cut: set[int] = set()
    source = ""
    if not uses:
        return None
    for user, k in uses:
        if user.opcode in _ASYNC_DONE:
            got = _slices(graph, comp, user, dims, groups)
            if got is None:
                return None
            cut.add(got[0])
            source = source or got[1]
            continue
        if user.opcode == "dynamic-slice" and k == 0:
            d = _own_slice(graph, comp, user, dims, groups, None, None)
            inner = [(user, d)]
        elif user.opcode == "fusion":
            fused = graph.computations.get(user.called() or "")
            pname = fused.params.get(k) if fused is not None else None
            if fused is None or pname is None:
                return None
            inner_uses = fused.users(pname)
            if not inner_uses or any(u.opcode != "dynamic-slice" or j != 0 for u, j in inner_uses):
                return None
            inner = [(u, _own_slice(graph, fused, u, dims, groups, comp, user)) for u, _ in inner_uses]
        else:
            return None
        for ds, d in inner:
            if d is None:
                return None
            cut.add(d)
            source = source or graph.source(ds)
    return (cut.pop(), source) if len(cut) == 1 else None


def find(graph: _hlo_graph.Graph, collectives: Sequence[Collective], data_replicated: Sequence[tuple[str, ...]],
         mesh: Mapping[str, int], backend: str, link: _link_model.Link) -> tuple[CheaperCollective, ...]:
    """The cheaper equivalents. ``data_replicated[i]``: the summed axes over which the operand of
    ``collectives[i]`` (for the jaxpr's collectives, which come first) is the same data."""
    found: list[CheaperCollective] = []
    for i, c in enumerate(collectives):
        if "hlo" not in c.levels or c.defensive or c.kind not in ("all-reduce", "all-gather"):
            continue
        n = math.prod(mesh.get(a, 1) for a in c.axes) if c.axes else 0
        shape = c.shapes[0] if c.shapes else ()
        now = _link_model.seconds(c.kind, c.bytes, n, link) if n else 0.0
        common: dict[str, Any] = dict(kind=c.kind, axes=c.axes, dtype=c.dtype, shape=shape, bytes=c.bytes,
                                      seconds=now, source=c.source, backend=backend, executions=c.executions,
                                      sent=_link_model.sent(c.kind, c.bytes, n))
        replicated = data_replicated[i] if i < len(data_replicated) else ()
        line = next((text for level, text in c.lines if level == "hlo"), "")
        if c.kind == "all-reduce" and c.primitive in ("psum", "psum2", "psum_invariant") and replicated \
                and c.axes is not None and set(replicated) == set(c.axes):
            axes = ", ".join(repr(a) for a in c.axes)
            found.append(CheaperCollective(
                pattern="replicated-sum", cheaper="multiplication", bytes_after=0, seconds_after=0.0,
                rewrite=f"x * {n}  # instead of jax.lax.psum(x, ({axes},)): x is the same on every device "
                        f"(jax.lax.psum(1, ({axes},)) gives {n} without communicating)",
                line=line, **common))
            continue
        where = graph.where(line)
        if where is None or len(c.shapes) != 1:
            continue
        comp, instr = where
        groups = _groups(instr, graph.partitions)
        if groups is None:
            continue
        if c.kind == "all-gather":
            operand = instr.ints("dimensions")
            got = _slices(graph, comp, instr, shape, groups)
            if got is None or not operand or got[0] != operand[0]:
                continue
            found.append(CheaperCollective(
                pattern="own-shard", cheaper="none", bytes_after=0, seconds_after=0.0,
                rewrite="x  # each device's own shard: drop the all_gather and the slice",
                slice_source=got[1], line=line, **common))
            continue
        got = _slices(graph, comp, instr, shape, groups)
        if got is None:
            continue
        after = _link_model.seconds("reduce-scatter", c.bytes, n, link) if n else 0.0
        axes = repr(c.axes[0]) if c.axes and len(c.axes) == 1 else repr(c.axes)
        found.append(CheaperCollective(  # the same buffer, reduced and scattered: half the ring's traffic
            pattern="own-slice", cheaper="reduce-scatter", bytes_after=c.bytes, seconds_after=after,
            sent_after=_link_model.sent("reduce-scatter", c.bytes, n),
            rewrite=f"jax.lax.psum_scatter(x, {axes}, scatter_dimension={got[0]}, tiled=True)  # instead of "
                    "psum then the slice",
            slice_source=got[1], line=line, **common))
    return tuple(found)
