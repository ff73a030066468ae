"""Matching the levels of the collectives report: each jaxpr collective with its StableHLO and HLO instructions."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from reprules._report import _hlo
from reprules._report._records import LEVELS, Collective, Kernel, Report
from reprules._report._walk import Walk, added_by


def _text_axes(tc: _hlo.TextCollective, mesh: Mapping[str, int]) -> tuple[str, ...] | None:
    return _hlo.groups_to_axes(tc.groups, mesh) if mesh or tc.groups.axes is not None else None


def _text_bytes(tc: _hlo.TextCollective) -> int:
    base = _hlo.nbytes(tc.dtype, tc.shapes)
    if tc.kind == "reduce-scatter":
        return base * (tc.group_size or 1)
    return base


def _groups_text(g: _hlo.Groups) -> str:
    if g.axes is not None:
        return ",".join(g.axes)
    if g.ids is None:
        return "?"
    return "{" + ",".join("{" + ",".join(map(str, x)) + "}" for x in g.ids) + "}"


def _clean_op_name(name: str) -> str:
    return re.sub(r"\[[^\]]*\]", "", name)


def build_report(function: str, jax_version: str, walk: Walk, stablehlo: Sequence[_hlo.TextCollective],
                 hlo: Sequence[_hlo.TextCollective], mesh: Mapping[str, int] | None = None) -> Report:
    """Merges the jaxpr walk with the collectives parsed from the two texts."""
    mesh = dict(mesh or walk.mesh)
    kernels_by_map: dict[int, list[Kernel]] = {}
    for k, sm in walk.kernels:
        kernels_by_map.setdefault(sm, []).append(k)

    entries: list[dict[str, Any]] = []
    for jc in walk.collectives:
        # Rule-less kernels of the same shard_map first, then of the whole program:
        # the transpose of a shard_map is a shard_map of its own.
        same_map = [k.name for k in kernels_by_map.get(jc.shard_map_id or -1, ()) if not k.has_rule]
        anywhere = [k.name for k, _ in walk.kernels if not k.has_rule]
        missing = tuple(dict.fromkeys(same_map + anywhere)) if jc.defensive else ()
        entries.append(dict(
            kind=jc.kind, levels=["jaxpr"], dtype=jc.dtype, shapes=jc.shapes, bytes=jc.bytes,
            axes=jc.axes, groups="", defensive=jc.defensive, replicated_axes=jc.replicated_axes,
            origin=jc.origin, primitive=jc.primitive, op_name=jc.op_name, source=jc.source,
            is_async=False, checked=jc.checked, kernels_without_rule=missing, lines=[],
            executions=jc.executions, added_by=jc.added_by))

    entry: dict[str, Any] | None
    for level, found in (("stablehlo", stablehlo), ("hlo", hlo)):
        for tc in found:
            axes = _text_axes(tc, mesh)
            line = (level, tc.line)
            split = _split_all_to_all(entries, tc, axes, level)
            if split is not None:
                # XLA compiles an all-to-all into one with a result per peer: the same collective.
                split["levels"].append(level)
                split["lines"].append(line)
                continue
            if len(tc.shapes) > 1 and level == "hlo":
                # XLA's combiners merge collectives into one tuple instruction.
                rest = list(tc.shapes)
                for entry in _tuple_matches(entries, tc, axes, level):
                    rest.remove(tuple(entry["shapes"])[0])
                    entry["levels"].append(level)
                    entry["lines"].append(line)
                    entry["is_async"] = entry["is_async"] or tc.is_async
                if len(rest) == len(tc.shapes):
                    entry = None
                elif not rest:
                    continue
                else:
                    tc = dataclasses.replace(tc, shapes=tuple(rest))
                    entry = None
            else:
                entry = _best_match(entries, tc, axes, level)
            if entry is None:
                entries.append(dict(
                    kind=tc.kind, levels=[level], dtype=tc.dtype, shapes=tc.shapes, bytes=_text_bytes(tc),
                    axes=axes, groups="" if axes is not None else _groups_text(tc.groups), defensive=False,
                    replicated_axes=(), origin="xla" if level == "hlo" else "program", primitive="",
                    op_name=_clean_op_name(tc.op_name), source=tc.source, is_async=tc.is_async, checked=None,
                    kernels_without_rule=(), lines=[line], added_by=added_by(tc.op_name),
                    group=tc.group_size or 0))
            else:
                entry["levels"].append(level)
                entry["lines"].append(line)
                entry["is_async"] = entry["is_async"] or tc.is_async
                if not entry["source"]:
                    entry["source"] = tc.source
                if not entry["op_name"]:
                    entry["op_name"] = _clean_op_name(tc.op_name)

    collectives = tuple(
        Collective(**{**e, "levels": tuple(lv for lv in LEVELS if lv in e["levels"]), "lines": tuple(e["lines"]),
                      "axes": None if e["axes"] is None else tuple(e["axes"]),
                      "sizes": () if e["axes"] is None else tuple(mesh.get(a, 1) for a in e["axes"])})
        for e in entries)
    # Same-named kernels stay apart: merged only with the same site and status.
    merged: dict[tuple[Any, ...], Kernel] = {}
    for k, _ in walk.kernels:
        key = (k.name, k.primitive, k.source, k.has_rule, k.rule, k.identified, k.candidates)
        if key in merged:
            merged[key] = dataclasses.replace(merged[key], count=merged[key].count + 1)
        else:
            merged[key] = k
    return Report(function=function, jax_version=jax_version, mesh=tuple(mesh.items()),
                  collectives=collectives, kernels=tuple(merged.values()))


def _split_all_to_all(entries: list[dict[str, Any]], tc: _hlo.TextCollective, axes: tuple[str, ...] | None,
                      level: str) -> dict[str, Any] | None:
    """The all-to-all ``tc`` is, where XLA split its result into one array per peer."""
    if tc.kind != "all-to-all" or len(tc.shapes) < 2 or level != "hlo":
        return None
    total = _hlo.nbytes(tc.dtype, tc.shapes)
    return next((e for e in entries if level not in e["levels"] and e["kind"] == "all-to-all"
                 and len(e["shapes"]) == 1 and e["dtype"] == tc.dtype and e["bytes"] == total
                 and (axes is None or e["axes"] is None or set(e["axes"]) == set(axes))), None)


def _tuple_matches(entries: list[dict[str, Any]], tc: _hlo.TextCollective, axes: tuple[str, ...] | None,
                   level: str) -> list[dict[str, Any]]:
    rest = list(tc.shapes)
    out = []
    for e in entries:
        if (level not in e["levels"] and e["kind"] == tc.kind and len(e["shapes"]) == 1
                and tuple(e["shapes"])[0] in rest
                and (axes is None or e["axes"] is None or set(e["axes"]) == set(axes))):
            rest.remove(tuple(e["shapes"])[0])
            out.append(e)
    return out


def _best_match(entries: list[dict[str, Any]], tc: _hlo.TextCollective, axes: tuple[str, ...] | None,
                level: str) -> dict[str, Any] | None:
    """The first not-yet-matched entry of the same collective, best key first."""
    candidates = [e for e in entries if level not in e["levels"] and e["kind"] == tc.kind
                  and (axes is None or e["axes"] is None or set(e["axes"]) == set(axes))]
    if not candidates:
        return None
    op = _clean_op_name(tc.op_name)
    tail = op.rsplit("/", 1)[-1] if op else ""

    def score(e: dict[str, Any]) -> int:
        s = 0
        if tuple(e["shapes"]) == tuple(tc.shapes):
            s += 4
        if e["dtype"] == tc.dtype:
            s += 1
        if tail and e["primitive"] and tail == e["primitive"]:
            s += 2
        if op and e["op_name"] and ("transpose(" in op) == ("transpose(" in e["op_name"]):
            s += 2
        return s

    best = max(candidates, key=score)  # max keeps the first of equal scores: program order
    return best
