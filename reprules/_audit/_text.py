"""The text output of ``reprules audit``: every line within :data:`WIDTH` columns.

Full detail (full source paths, op names, HLO lines) is in ``--json`` and
``--html``; the text keeps what a reader compares: per workload, checking off
vs reprules, its kernels (with how each is covered, and for one without a
rule what inference would do), then one short row per collective.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from reprules._audit import _communication
from reprules._report._records import ADDED_MEANING, ADDED_TEXT, Report

if TYPE_CHECKING:
    from reprules._audit._coverage import Coverage

WIDTH = 100
LABELS = {"off": "checking off", "on": "reprules (checking on)", "given": "as given"}
_LEVEL_MARKS = (("jaxpr", "J"), ("stablehlo", "S"), ("hlo", "H"))


def clip(text: str, width: int = WIDTH) -> str:
    """``text`` cut to ``width`` columns, ending in ``...`` when cut (ASCII: any console prints it)."""
    return text if len(text) <= width else text[: max(width - 3, 0)] + "..."


def clip_left(text: str, width: int) -> str:
    """``text`` cut to ``width`` columns from the left (for paths: the file name stays)."""
    return text if len(text) <= width else "..." + text[len(text) - width + 3:]


def wrap(text: str, indent: str, width: int = WIDTH) -> list[str]:
    """Each line of ``text`` wrapped to ``width`` columns, indented."""
    out: list[str] = []
    for line in text.splitlines() or [""]:
        out += textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent + "  ",
                             break_long_words=True, break_on_hyphens=False) or [indent.rstrip()]
    return out


def table(rows: Sequence[Sequence[str]], indent: str, width: int = WIDTH,
          right: Sequence[int] = (), shrink_first: int | None = None) -> list[str]:
    """Rows as aligned columns, clipped until a row fits ``width``: column ``shrink_first``
    (from the left: a source's line number stays) down to 12 columns first, then the widest."""
    n = len(rows[0])
    widths = [max(len(r[k]) for r in rows) for k in range(n)]
    room = width - len(indent) - 2 * (n - 1)
    if shrink_first is not None:
        widths[shrink_first] = max(min(widths[shrink_first], 12), widths[shrink_first] - (sum(widths) - room))
    while sum(widths) > room and max(widths) > 4:
        widths[widths.index(max(widths))] -= 1
    def cell(k: int, value: str, width: int) -> str:
        text = clip_left(value, width) if k == shrink_first else clip(value, width)
        return text.rjust(width) if k in right else text.ljust(width)

    return [(indent + "  ".join(cell(k, v, w) for k, (v, w) in enumerate(zip(r, widths)))).rstrip() for r in rows]


def short_source(source: str) -> str:
    """``/a/b/file.py:12`` -> ``file.py:12``."""
    if not source:
        return "?"
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source


def _count(report: Report, part: str = "all") -> str:
    """Count and bytes each device sends per step: of the live collectives (``all``), of their
    ``defensive`` or ``needed`` parts (a collective split by axis counts in both), or of the ``dead`` ones."""
    if part == "dead":
        dead = report.dead_collectives
        return f"{len(dead)} ({sum(c.sent_bytes for c in dead)} B)"
    if part == "defensive":
        return f"{len(report.defensive)} ({report.defensive_sent_total} B)"
    if part == "needed":
        return f"{len(report.with_needed_part)} ({report.needed_sent_total} B)"
    return f"{len(report.select())} ({report.sent_bytes()} B)"


def _kernels(report: Report) -> str:
    if not report.kernels:
        return "none"
    return f"{sum(1 for k in report.kernels if k.has_rule)}/{len(report.kernels)}"


def _error(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2e}"


def _collective_rows(report: Report) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [("#", "kind", "over", "type", "bytes", "sent", "status", "levels", "source")]
    for i, c in enumerate(report.collectives, 1):
        status = c.status_text(axes=True)
        levels = "".join(m if lvl in c.levels else "." for lvl, m in _LEVEL_MARKS)
        rows.append((str(i), c.kind + ("*" if c.is_async else ""), c.axes_text(), c.shape_text(),
                     str(c.bytes) + (f" x{c.executions}" if c.executions > 1 else ""), str(c.sent_bytes), status,
                     levels, short_source(c.source)))
    if all(r[7] == "JSH" for r in rows[1:]):  # found at every level: the column says nothing
        rows = [r[:7] + r[8:] for r in rows]
    return rows


def _split_lines(report: Report) -> list[str]:
    """Under the table, each collective needed over some axes and defensive over others: both parts."""
    lines: list[str] = []
    for i, c in enumerate(report.collectives, 1):
        if c.split and not c.dead:
            lines += wrap(f"{i}: needed over {','.join(c.needed_axes or ())} ({c.needed_sent_bytes} B sent), "
                          f"defensive over {','.join(c.replicated_axes)} ({c.defensive_sent_bytes} B)", "     ")
    return lines


def _kernel_rows(report: Report, coverage: Sequence[Coverage]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [("kernel", "primitive", "calls", "rule", "covered by", "source")]
    for k, c in zip(report.kernels, coverage):
        rule = k.rule if k.has_rule else ("NO RULE" if k.identified else "NOT IDENTIFIED")
        rows.append((k.name, k.primitive, str(k.count), rule, c.covered_by, short_source(k.source)))
    return rows


def _inference_lines(report: Report, coverage: Sequence[Coverage]) -> list[str]:
    """For each kernel without a rule: whether inference would cover it, or why not."""
    from reprules._audit._coverage import describe  # lazy: imports JAX

    lines: list[str] = []
    for k, c in zip(report.kernels, coverage):
        if c.inference is not None:
            hint = " (audit --infer uses it)" if c.inference.get("covers") else ""
            lines += wrap(f"{k.name}: inference {describe(c.inference, short=True)}{hint}", "     ")
    return lines


def unmatched_notes(unmatched: Sequence[Mapping[str, str]]) -> list[str]:
    """A note listing the ``kernel_named`` rules that matched no kernel."""
    if not unmatched:
        return []
    names = "; ".join(f"{u['name']!r} (from {short_source(u['source'])})" for u in unmatched)
    return [f"kernel_named rules that matched no traced kernel: {names}. Check the module and qualname "
            "(print f'{kernel.__module__}:{kernel.__qualname__}' where the kernel is made)."]


def render_workload(entry: Mapping[str, Any]) -> list[str]:
    """One workload (bundled or a user target): a summary table, its kernels, its collectives."""
    lines = ["", clip(f"== {entry['name']}: {entry['title']}")]
    keys = [k for k in ("off", "on", "given") if k in entry]
    failure = ["   FAILED:", *wrap(str(entry["error"])[:2000], "     ")] if entry.get("error") else []
    if not keys:
        return lines + failure
    reports: dict[str, Report] = {k: entry[k]["report"] for k in keys}
    rows = [("", *(LABELS[k] for k in keys))]
    rows += [
        ("collectives (B sent)", *(_count(reports[k]) for k in keys)),
        ("  defensive", *(_count(reports[k], "defensive") for k in keys)),
        ("  needed", *(_count(reports[k], "needed") for k in keys)),
        *([("  dead (not counted)", *(_count(reports[k], "dead") for k in keys))]
          if any(reports[k].dead_collectives for k in keys) else []),
        *_communication.summary_rows(reports, keys),  # could be saved (cheaper), implicit, est. time
        ("kernels with rules", *(_kernels(reports[k]) for k in keys)),
        ("max error vs reference", *(_error(entry[k]["max_error"]) for k in keys)),
    ]
    lines += table(rows, "   ")
    last = keys[-1]  # the reprules side, or the step as given (or checking off when reprules failed)
    if reports[last].kernels:
        coverage = entry[last]["coverage"]
        lines.append(f"   kernels, {LABELS[last]}:")
        lines += table(_kernel_rows(reports[last], coverage), "     ", right=(2,))
        for kern in reports[last].kernels:
            if not kern.identified:
                lines += wrap(f"{kern.name} at {short_source(kern.source)}: {kern.status()}", "     ")
        lines += _inference_lines(reports[last], coverage)
    for k in keys:
        report = reports[k]
        lines.append(f"   collectives, {LABELS[k]}:" + ("" if report.collectives else " none"))
        if report.collectives:
            rows = _collective_rows(report)
            lines += table(rows, "     ", right=(0, 4, 5), shrink_first=len(rows[0]) - 1)
            lines += _split_lines(report)
    lines += _communication_sections(reports, keys)
    return lines + failure


def _communication_sections(reports: Mapping[str, Report], keys: Sequence[str]) -> list[str]:
    """Per variant: the implicit collectives and those with a cheaper equivalent, with fixes."""
    backend = next((reports[k].backend for k in keys if reports[k].backend), "?")
    if not any(reports[k].implicit or reports[k].cheaper for k in keys):
        return [f"   implicit collectives (XLA, around kernels): none; cheaper equivalents ({backend} HLO): none"]
    lines: list[str] = []
    for k in keys:
        r = reports[k]
        lines.append(f"   implicit collectives (XLA, around opaque kernels), {LABELS[k]}:"
                     + ("" if r.implicit else " none"))
        if r.implicit:
            lines += table(_communication.implicit_rows(r), "     ", right=(3, 4))
        lines.append(f"   cheaper equivalents (compiled {backend} HLO), {LABELS[k]}:" + ("" if r.cheaper else " none"))
        if r.cheaper:
            lines += table(_communication.cheaper_rows(r), "     ", right=(2, 3))
        for fix in _communication.fixes(r):
            lines += wrap(f"fix: {fix}", "     ")
    return lines


def legend(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """What every column of the kernel and collective tables means, and each status found in them."""
    reports = [e[k]["report"] for e in entries for k in ("off", "on", "given") if k in e]
    shown = [c for r in reports for c in r.collectives]
    items = ["summary: per variant, the collectives' count (bytes each device sends per step), split by "
             "status (below; a collective defensive over some of its axes and needed over the others counts "
             "in both, each with its part of the bytes); kernels with rules: of the opaque kernels; max "
             "error vs reference: the largest difference of the step's output from the unsharded reference "
             "(n/a: none given)"]
    if any(r.kernels for r in reports):
        items.append("kernels: kernel: the kernel function's name; primitive: how it is called "
                     "(pallas_call, ffi_call...); calls: its calls in the step; rule: its replication rule "
                     "(NO RULE: none); covered by: identity (a rule on the kernel, FFI target, primitive or "
                     "pack), name (kernel_named), inference, or none; source: where it is defined")
    if shown:
        items.append("collectives: # row; kind (* asynchronous: a start/done pair, counted once); over: "
                     "the mesh axes it runs over; type: per-device result; bytes: its buffer per device, "
                     "the operand (an all-gather's result; xN: in a scan, runs N times per step); sent: the "
                     "bytes each device sends per step for the ring algorithm over the n devices of a group "
                     "(all-reduce 2(n-1)/n x buffer; all-gather, reduce-scatter, all-to-all (n-1)/n x buffer; "
                     "collective-permute the buffer); status: below; levels (shown where one is missing): "
                     "where it is found, J jaxpr, S StableHLO, H compiled HLO ('.': not there); source: the "
                     "user's line that made it ('?': unknown)")
        items.append("needed: the program needs it (its operand varies over the axes it runs over, or "
                     "it was written explicitly)")
    if any(c.defensive and not c.dead for c in shown):
        items.append("defensive (A): a transpose all-reduce summing over A, where its operand is "
                     "replicated: it moves bytes for nothing")
    if any(c.split and not c.dead for c in shown):
        items.append("needed+defensive (A): an all-reduce over more axes than its operand varies over: the "
                     "same all-reduce over the others is needed, what it sends beyond that is defensive "
                     "(each part's bytes under the table)")
    if any(c.status_text() == ADDED_TEXT for c in shown):
        items.append(f"{ADDED_TEXT}: {ADDED_MEANING}")
    if any(c.dead for c in shown):
        items.append("dead: only in the jaxpr (levels J..): lowering dropped it as dead code (e.g. the "
                     "all-reduce of a gradient nothing uses), so it never runs; not counted in the totals")
    if any(c.folded for c in shown):
        items.append("levels JS.: folded away by XLA in compiled HLO; counted, as the program has it")
    items += _communication.legend_items(reports)
    if not reports:
        return []
    return ["", "legend:"] + [line for item in items for line in wrap(item, "  ")]


def render_fixes(report: Report) -> list[str]:
    """For a user target: the decorator each kernel without a rule needs."""
    missing = report.kernels_without_rule
    if not missing:
        return []
    lines = ["   to remove defensive collectives, give each kernel a rule and turn checking on:"]
    for k in missing:
        if not k.identified:
            lines += wrap(f"{k.name}: {k.status()}", "     ")
            continue
        lines.append(clip(f"     {k.name} ({k.primitive} x{k.count}), defined at"))
        lines.append("       " + clip_left(k.source or "?", WIDTH - 7))
        lines.append(clip(f"       @reprules.replication_rule()   # above `def {k.name}(...)`"))
    return lines


def render(header: Sequence[str], entries: Sequence[Mapping[str, Any]], notes: Sequence[str] = (),
           fixes: Report | None = None) -> str:
    """The whole text report."""
    lines = [line for h in header for line in wrap(h, "")]
    for e in entries:
        lines += render_workload(e)
    if fixes is not None:
        lines += render_fixes(fixes)
    for note in notes:
        lines += [""] + wrap(note, "")
    lines += legend(entries)
    return "\n".join(clip(line) for line in lines)
