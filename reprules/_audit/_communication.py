"""The communication sections of ``reprules audit``: implicit collectives, cheaper equivalents, time.

Per variant (checking off, reprules, as given): the collectives XLA's
partitioner inserted around opaque kernels (:mod:`reprules._report._implicit`), the
collectives with a cheaper equivalent (:mod:`reprules._report._cheaper`) and the bytes
per step their rewrites would save, beside the defensive bytes, and the link
model's time estimates (:mod:`reprules._report._link_model`). The text and HTML
renderers format the rows given here; ``--json`` gets :func:`summary`'s fields.
``--strict-communication`` fails on :func:`findings` (the reprules side, or
the step as given); ``--strict`` keeps its meaning.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from reprules._report import _link_model
from reprules._report._comm import PATTERNS, short
from reprules._report._records import Report


def add_arguments(audit: argparse.ArgumentParser) -> None:
    """``--strict-communication`` and ``--link``."""
    audit.add_argument("--strict-communication", action="store_true",
                       help="exit 1 on implicit collectives (inserted by XLA around opaque kernels) or "
                            "collectives with a cheaper equivalent")
    audit.add_argument("--link", metavar="NAME|GBPS", default=None,
                       help=f"interconnect for the time estimates: {', '.join(_link_model.LINKS)}, or a "
                            "bandwidth in GB/s (default: the backend's; also $" + _link_model.ENV + ")")


def link_arg(text: str | None) -> _link_model.Link | None:
    """The ``--link`` value (None: the default). Raises ValueError on an unknown one."""
    return None if text is None else _link_model.parse(text)


def summary(report: Report) -> dict[str, Any]:
    """The ``--json`` fields of one variant (schema version 4: bytes sent beside buffer bytes)."""
    return {
        "collectives": [{**c.to_dict(), "est_seconds": report.seconds(c)} for c in report.collectives],
        "backend": report.backend,
        "link": report.link.to_dict() if report.link is not None else None,
        "est_seconds": report.seconds(),
        "implicit": [c.to_dict() for c in report.implicit],
        "implicit_count": len(report.implicit),
        "implicit_bytes": report.implicit_bytes,
        "implicit_sent_bytes": report.implicit_sent_bytes,
        "cheaper": [c.to_dict() for c in report.cheaper],
        "cheaper_count": len(report.cheaper),
        "savable_bytes": report.savable_bytes,
    }


def findings(doc: Mapping[str, Any]) -> list[str]:
    """``--strict-communication`` findings: implicit and cheaper collectives of the reprules side
    (or the step as given), from the ``--json`` document."""
    found = []
    for w in doc.get("workloads", ()):
        v = w.get("on") or w.get("given")
        if v is None:
            continue
        for c in v.get("implicit", ()):
            found.append(f"{w['name']}: implicit {c['kind']} sending {c['step_sent']} B into kernel {c['kernel']} "
                         f"({c['primitive']}) called at {short(c['call_source'])}"
                         + (" (predicted for TPU/GPU)" if c["predicted"] else ""))
        for c in v.get("cheaper", ()):
            found.append(f"{w['name']}: {c['kind']} at {short(c['source'])} could be {c['cheaper']} "
                         f"({c['sent']} B sent -> {c['sent_after']} B)")
    return found


def time_text(seconds: float) -> str:
    return _link_model.time_text(seconds) if seconds else "0"


def summary_rows(reports: Mapping[str, Report], keys: Sequence[str]) -> list[tuple[str, ...]]:
    """Rows of the summary table, beside the defensive ones."""
    def saved(r: Report) -> str:
        return f"{len(r.cheaper)} ({r.savable_bytes} B)"

    def implicit(r: Report) -> str:
        return f"{len(r.implicit)} ({r.implicit_sent_bytes} B)"

    link = next((reports[k].link for k in keys if reports[k].link is not None), None)
    return [
        ("  could be saved", *(saved(reports[k]) for k in keys)),
        ("implicit (XLA, kernels)", *(implicit(reports[k]) for k in keys)),
        (f"est. time ({link.name if link else '?'})", *(time_text(reports[k].seconds()) for k in keys)),
    ]


def implicit_rows(report: Report) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [("kind", "over", "type", "buffer", "sent", "est.", "kernel", "call", "found")]
    for c in report.implicit:
        rows.append((c.kind, ",".join(c.axes) if c.axes else "?", f"{c.dtype}[{','.join(map(str, c.shape))}]",
                     str(c.bytes) + (f" x{c.executions}" if c.executions > 1 else ""), str(c.step_sent),
                     time_text(c.seconds),
                     c.kernel, short(c.call_source), "predicted" if c.predicted else f"{c.backend} HLO"))
    return rows


def cheaper_rows(report: Report) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [("kind", "over", "sent now", "after", "saved", "could be", "source")]
    for c in report.cheaper:
        rows.append((c.kind, ",".join(c.axes) if c.axes else "?", str(c.sent), str(c.sent_after),
                     f"{c.saved_bytes} B, {time_text(c.saved_seconds)}", c.cheaper, short(c.source)))
    return rows


def fixes(report: Report) -> list[str]:
    """One line per finding: the fix (implicit) or the rewrite (cheaper)."""
    out = [f"implicit {c.kind} into {c.kernel} ({c.primitive}"
           + (", predicted for a TPU/GPU compile" if c.predicted else "") + f"): {c.fix()}" for c in report.implicit]
    out += [f"{c.kind} at {short(c.source)}: {c.rewrite}" for c in report.cheaper]
    return out


def legend_items(reports: Sequence[Report]) -> list[str]:
    """Legend lines for what the communication sections show."""
    items = []
    link = next((r.link for r in reports if r.link is not None), None)
    if link is not None:
        items.append(f"est. time: link model, {link.describe()} ({link.note}); the bytes sent / bandwidth, "
                     "plus a latency per ring step; no overlap with compute, one ring per collective "
                     "(--link NAME|GBPS picks another)")
    if any(r.implicit for r in reports):
        items.append("implicit: a collective XLA's partitioner inserted around an opaque kernel called outside "
                     "shard_map on sharded operands (it cannot look into a custom call, so it gathers the "
                     "operands and runs the whole kernel on every device); predicted: the backend at hand hides "
                     "it (Pallas interpret mode), a TPU/GPU compile would have it")
    if any(r.cheaper for r in reports):
        items.append("could be saved: bytes sent per step the rewrites of the collectives with a cheaper "
                     "equivalent would save, what the collectives row moves by once applied ("
                     + "; ".join(PATTERNS.values()) + ")")
    return items
