"""The ``reprules audit --html FILE`` page: one self-contained HTML file.

Rendered from the ``--json`` document (the same data), with inline CSS and
inline SVG only: no script, no font, no image and no link is fetched when the
page is viewed, so it opens offline and can be attached to a bug report. Per
workload: the bytes of collectives per step, checking off vs reprules, split
defensive / needed (a bar chart); each variant's kernels (rule, source, how
each is covered, and for one without a rule what inference would do); and its
collectives with their provenance (levels, primitive, name stack, source line,
the StableHLO/HLO instructions).
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from typing import Any

from reprules import _mode_state

LABELS = {"off": "checking off", "on": "reprules (checking on)", "given": "as given"}
_VARIANTS = ("off", "on", "given")
_LEVELS = (("jaxpr", "J"), ("stablehlo", "S"), ("hlo", "H"))

# The chart's geometry, in SVG units (the SVG scales to the page width).
_W, _LABEL_W, _BAR_W, _ROW_H, _BAR_H, _TOP = 660, 165, 260, 34, 20, 8

_CSS = """
:root{--def:#d9480f;--need:#1c7ed6;--ink:#212529;--muted:#6c757d;--line:#dee2e6;--bg:#f8f9fa}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
color:var(--ink);background:#fff}
main{max-width:1260px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:0 0 2px}h3{font-size:15px;margin:22px 0 6px}
.meta,.title,.note{color:var(--muted)}.title{margin:0 0 14px}
nav{margin:10px 0 4px}nav a{margin-right:14px;color:var(--need);text-decoration:none}
section.workload{border-top:1px solid var(--line);margin-top:26px;padding-top:18px}
.top{display:flex;flex-wrap:wrap;gap:18px 32px;align-items:flex-start}
.chart{flex:0 1 660px;margin:4px 0 0}
.chart svg{max-width:100%;height:auto;display:block}
.chart figcaption{font-size:12px;color:var(--muted)}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin:0 4px 0 10px;vertical-align:-1px}
table{border-collapse:collapse;font-size:13px;margin:2px 0 8px}
th,td{border-bottom:1px solid var(--line);padding:4px 9px;text-align:left;vertical-align:top}
th{background:var(--bg);font-weight:600;white-space:nowrap}
.nowrap{white-space:nowrap}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
table.wide{width:100%}
code,.mono{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.badge{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;border:1px solid var(--line)}
.b-identity,.b-name{background:#e7f5ff;border-color:#a5d8ff}.b-inference{background:#ebfbee;border-color:#b2f2bb}
.b-none{background:#fff4e6;border-color:#ffc078}
.defensive{color:var(--def);font-weight:600}.needed{color:var(--need)}.dead{color:var(--muted)}
.why{color:var(--muted);font-size:12px}
details summary{cursor:pointer;color:var(--muted);font-size:12px}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0}
pre.error{background:#fff5f5;border:1px solid #ffc9c9;padding:8px 10px;border-radius:4px}
ul.findings{margin:6px 0;padding-left:20px}
""".strip()


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _bytes(n: int) -> str:
    return f"{n:,} B"


def _short(source: str) -> str:
    if not source:
        return "?"
    path, _, line = source.rpartition(":")
    return f"{os.path.basename(path)}:{line}" if path else source


def _source(source: str) -> str:
    return f'<span class="mono" title="{_e(source)}">{_e(_short(source))}</span>'


def _variants(w: Mapping[str, Any]) -> list[str]:
    return [k for k in _VARIANTS if w.get(k) is not None]


def _split(v: Mapping[str, Any]) -> tuple[int, int]:
    """(defensive, needed) bytes sent of one variant (buffer bytes in a document older than schema 4)."""
    if "sent_bytes" in v:
        return int(v["defensive_sent_bytes"]), int(v["needed_sent_bytes"])
    defensive = int(v["defensive_bytes"])
    return defensive, int(v["bytes"]) - defensive


def chart(w: Mapping[str, Any]) -> str:
    """The SVG bar chart of one workload: a stacked bar (needed, then defensive) per variant."""
    keys = _variants(w)
    peak = max((sum(_split(w[k])) for k in keys), default=0)
    height = _TOP * 2 + _ROW_H * len(keys)
    parts = [f'<svg viewBox="0 0 {_W} {height}" width="{_W}" height="{height}" role="img" '
             f'aria-label="{_e(_aria(w, keys))}" font-family="system-ui, sans-serif" font-size="13">']
    for row, key in enumerate(keys):
        v = w[key]
        defensive, needed = _split(v)
        y = _TOP + row * _ROW_H
        bar_y = y + (_ROW_H - _BAR_H) / 2
        mid = y + _ROW_H / 2 + 4.5
        parts.append(f'<text class="label" x="{_LABEL_W - 10}" y="{mid}" text-anchor="end" fill="#212529">'
                     f'{_e(LABELS[key])}</text>')
        parts.append(f'<rect class="track" x="{_LABEL_W}" y="{bar_y}" width="{_BAR_W}" height="{_BAR_H}" '
                     'rx="3" fill="#f1f3f5"/>')
        x = float(_LABEL_W)
        for status, n, color in (("needed", needed, "#1c7ed6"), ("defensive", defensive, "#d9480f")):
            if n <= 0 or peak <= 0:
                continue
            width = _BAR_W * n / peak
            parts.append(f'<rect class="bar {status}" data-variant="{key}" data-bytes="{n}" x="{x:.2f}" '
                         f'y="{bar_y}" width="{width:.2f}" height="{_BAR_H}" fill="{color}">'
                         f'<title>{_e(LABELS[key])}: {status} {_bytes(n)}</title></rect>')
            x += width
        value = _bytes(defensive + needed) + (f" ({_bytes(defensive)} defensive)" if defensive else "")
        if not v["count"]:
            value = "no collectives"
        parts.append(f'<text class="value" x="{_LABEL_W + _BAR_W + 10}" y="{mid}" fill="#495057">'
                     f'{_e(value)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _aria(w: Mapping[str, Any], keys: Sequence[str]) -> str:
    said = []
    for k in keys:
        defensive, needed = _split(w[k])
        said.append(f"{LABELS[k]}: {needed} bytes needed, {defensive} bytes defensive")
    return "Collective bytes per step. " + "; ".join(said)


def _summary_table(w: Mapping[str, Any], keys: Sequence[str]) -> str:
    def count(v: Mapping[str, Any], which: str) -> str:
        defensive, needed = _split(v)
        if which == "all":
            return f"{v['count']} ({_bytes(defensive + needed)})"
        if which == "defensive":
            return f"{v['defensive_count']} ({_bytes(defensive)})"
        return f"{v.get('needed_count', v['count'] - v['defensive_count'])} ({_bytes(needed)})"

    def error(v: Mapping[str, Any]) -> str:
        return "n/a" if v["max_error"] is None else f"{v['max_error']:.2e}"

    rows = [
        ("collectives", [count(w[k], "all") for k in keys]),
        ("defensive", [count(w[k], "defensive") for k in keys]),
        ("needed", [count(w[k], "needed") for k in keys]),
        *([("dead (not counted)", [f"{w[k].get('dead_count', 0)}" for k in keys])]
          if any(w[k].get("dead_count") for k in keys) else []),
        *_communication_rows(w, keys),
        ("kernels with rules", [f"{w[k]['kernels_with_rules']}/{w[k]['kernels_total']}"
                                if w[k]["kernels_total"] else "none" for k in keys]),
        ("max error vs reference", [error(w[k]) for k in keys]),
    ]
    head = "".join(f'<th class="num">{_e(LABELS[k])}</th>' for k in keys)
    body = "".join(f"<tr><th>{_e(name)}</th>" + "".join(f'<td class="num">{_e(c)}</td>' for c in cells) + "</tr>"
                   for name, cells in rows)
    return f'<table class="summary"><tr><th></th>{head}</tr>{body}</table>'


def _inference_text(inference: Mapping[str, Any] | None) -> str:
    if inference is None:
        return ""
    if inference.get("covers"):
        return f'would cover it: <code>{_e(inference.get("rule", ""))}</code>'
    at = f' at <span class="mono">{_e(inference["where"])}</span>' if inference.get("where") else ""
    return f'refuses: <code>{_e(inference.get("primitive", "?"))}</code>{at} {_e(inference.get("reason", ""))}'


def _kernel_table(kernels: Sequence[Mapping[str, Any]]) -> str:
    head = ("<tr><th>kernel</th><th>primitive</th><th class='num'>calls</th><th>rule</th><th>covered by</th>"
            "<th>source</th><th>without a rule: inference</th></tr>")
    rows = []
    for k in kernels:
        if k["has_rule"]:
            rule = f"<code>{_e(k['rule'])}</code>"
        elif k.get("identified", True):
            rule = '<span class="defensive nowrap">no rule</span>'
        else:
            rule = (f'<span class="defensive">not identified</span><div class="why">may be '
                    f'{_e(", ".join(k.get("candidates", ())))}: trace it after registering</div>')
        covered = k.get("covered_by") or "none"
        rows.append(
            f"<tr class='kernel'><td><code>{_e(k['name'])}</code></td><td>{_e(k['primitive'])}</td>"
            f"<td class='num'>{_e(k['count'])}</td><td>{rule}</td>"
            f"<td><span class='badge b-{_e(covered)}'>{_e(covered)}</span></td>"
            f"<td>{_source(k['source'])}</td><td>{_inference_text(k.get('inference'))}</td></tr>")
    return f'<table class="kernels wide">{head}{"".join(rows)}</table>'


def _collective_table(collectives: Sequence[Mapping[str, Any]]) -> str:
    head = ("<tr><th class='num'>#</th><th>kind</th><th>over</th><th>type</th><th class='num'>buffer</th>"
            "<th class='num'>sent</th>"
            "<th>status</th><th title='jaxpr, StableHLO, compiled HLO'>levels</th><th>primitive / origin</th>"
            "<th>source</th><th>provenance</th></tr>")
    rows = []
    for i, c in enumerate(collectives, 1):
        axes = c["axes"]
        over = (c.get("groups") or "?") if axes is None else (",".join(axes) or "-")
        shapes = " ".join(f"{c['dtype']}[{','.join(map(str, s))}]" for s in c["shapes"])
        status = f"<span class='{_e(c['status'])}'>{_e(c['status'])}</span>"
        if c.get("dead"):
            status += "<div class='why'>only in the jaxpr: dropped by lowering, never runs; not counted</div>"
        elif c.get("added_by"):
            status += f"<div class='why'>added by {_e(c['added_by'])} to a custom_vjp bwd's cotangent</div>"
        if c["defensive"] and not c.get("dead"):
            status += f"<div class='why'>operand replicated over {_e(','.join(c['replicated_axes']))}</div>"
            if c.get("needed_axes"):
                status += (f"<div class='why'>needed over {_e(','.join(c['needed_axes']))} "
                           f"({c['needed_sent_bytes']:,} B sent), defensive part {c['defensive_sent_bytes']:,} B</div>")
            if c.get("kernels_without_rule"):
                status += (f"<div class='why'>likely cause: no rule for "
                           f"{_e(', '.join(c['kernels_without_rule']))}</div>")
        levels = " ".join(m if lvl in c["levels"] else "." for lvl, m in _LEVELS)
        note = ""
        if c.get("dead"):
            note = "<div class='why'>dead code, not lowered</div>"
        elif c.get("folded"):
            note = "<div class='why'>folded away by XLA in compiled HLO</div>"
        lines = c.get("lines") or ()
        detail = ""
        if lines:
            text = "\n".join(f"{level}: {line[:400]}" for level, line in lines[:4])
            detail = f"<details><summary>{len(lines)} instruction(s)</summary><pre class='mono'>{_e(text)}</pre></details>"
        kind = c["kind"] + ("*" if c.get("is_async") else "")
        times = f" ×{c['executions']}" if c.get("executions", 1) > 1 else ""  # runs in a scan body
        sent = f"{c['sent_bytes']:,}" if "sent_bytes" in c else ""  # (a document older than schema 4)
        rows.append(
            f"<tr class='collective'><td class='num'>{i}</td><td class='nowrap'>{_e(kind)}</td><td>{_e(over)}</td>"
            f"<td class='mono'>{_e(shapes)}</td><td class='num'>{c['bytes']:,}{times}</td>"
            f"<td class='num'>{sent}</td><td>{status}</td>"
            f"<td class='mono'>{_e(levels)}{note}</td><td>{_e(c.get('primitive') or '')}"
            f"<div class='why'>{_e(c.get('origin', ''))}</div></td><td>{_source(c.get('source') or '')}</td>"
            f"<td><span class='mono'>{_e(c.get('op_name') or '?')}</span>{detail}</td></tr>")
    return f'<table class="collectives wide">{head}{"".join(rows)}</table>'


def _workload(w: Mapping[str, Any], index: int) -> str:
    keys = _variants(w)
    out = [f'<section class="workload" id="w{index}" data-name="{_e(w["name"])}">',
           f"<h2>{_e(w['name'])}</h2>", f'<p class="title">{_e(w["title"])}</p>']
    if keys:
        out.append('<div class="top">')
        out.append(_summary_table(w, keys))
        out.append('<figure class="chart">' + chart(w) + '<figcaption>collective bytes per step and device'
                   '<span class="swatch" style="background:var(--need)"></span>needed'
                   '<span class="swatch" style="background:var(--def)"></span>defensive</figcaption></figure>')
        out.append("</div>")
    for k in keys:
        v = w[k]
        if v["kernels"]:
            out.append(f"<h3>Kernels, {_e(LABELS[k])}</h3>" + _kernel_table(v["kernels"]))
        out.append(f"<h3>Collectives, {_e(LABELS[k])}</h3>")
        out.append(_collective_table(v["collectives"]) if v["collectives"] else '<p class="note">none</p>')
    out += _communication_sections(w, keys)
    if w.get("error"):
        out.append(f'<h3>Failed</h3><pre class="error">{_e(str(w["error"])[:4000])}</pre>')
    out.append("</section>")
    return "".join(out)


def render(doc: Mapping[str, Any]) -> str:
    """The whole page for one ``--json`` document."""
    what = doc.get("target") or "the bundled workloads"
    mesh = ", ".join(f"{a}={n}" for a, n in (doc.get("mesh") or {}).items())
    meta = [f"JAX {doc['jax']} ({doc['regime']} regime)", f"{doc['devices']} devices"]
    if mesh:
        meta.append(f"mesh {mesh}")
    meta.append(f"reprules {doc['reprules']}")
    mode = doc.get("inference")
    mode = {True: "all", False: "default"}.get(mode, mode) if isinstance(mode, bool) else mode  # schema 1
    text = _mode_state.INFERENCE_TEXT.get(str(mode), f"inference {mode}")
    meta.append(text + (" (reprules side under reprules.inference())" if mode == "all" else ""))
    workloads = doc["workloads"]
    nav = "".join(f'<a href="#w{i}">{_e(w["name"])}</a>' for i, w in enumerate(workloads))
    body = [f"<h1>reprules audit of {_e(what)}</h1>", f'<p class="meta">{_e(" · ".join(meta))}</p>',
            f"<nav>{nav}</nav>" if len(workloads) > 1 else "",
            '<p class="note">Collectives per training step, bytes per device. <b>Defensive</b>: a transpose '
            "all-reduce over axes where its operand is replicated (it moves bytes for nothing); "
            "<b>needed</b>: every other (<b>added by reprules</b>: a psum reprules added to a custom_vjp "
            "bwd's cotangent, its source that bwd); <b>dead</b>: only in the jaxpr, dropped by lowering as "
            "dead code, so it never runs and is not counted. Levels: J jaxpr, S StableHLO, H compiled HLO "
            "(* asynchronous).</p>"]
    body += [_workload(w, i) for i, w in enumerate(workloads)]
    unmatched = doc.get("unmatched_kernel_names") or []
    if unmatched:
        items = "".join(f"<li><code>{_e(u['name'])}</code> → <code>{_e(u['rule'])}</code> "
                        f"(from {_e(u['source'])})</li>" for u in unmatched)
        body.append('<section class="workload"><h2>kernel_named rules that matched no kernel</h2>'
                    f'<ul class="findings">{items}</ul></section>')
    findings = doc.get("strict_findings") or []
    if findings:
        items = "".join(f"<li class='mono'>{_e(f)}</li>" for f in findings)
        body.append(f'<section class="workload"><h2>--strict findings ({len(findings)})</h2>'
                    f'<ul class="findings">{items}</ul></section>')
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>reprules audit of {_e(what)}</title><style>{_CSS}</style></head>"
            f"<body><main>{''.join(body)}</main></body></html>\n")


# --- implicit collectives and cheaper equivalents (schema 3) ------------------------------


def _seconds(s: float) -> str:
    if not s:
        return "0"
    return f"{s * 1e6:.3g} µs" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _communication_rows(w: Mapping[str, Any], keys: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Summary rows beside the defensive ones: bytes that could be saved, implicit, estimated time."""
    if not all("savable_bytes" in w[k] for k in keys):  # a document older than schema 3
        return []
    link = next((w[k]["link"]["name"] for k in keys if w[k].get("link")), "?")
    return [
        ("could be saved", [f"{w[k]['cheaper_count']} ({_bytes(w[k]['savable_bytes'])})" for k in keys]),
        ("implicit (XLA, kernels)", [f"{w[k]['implicit_count']} "
                                     f"({_bytes(sum(c.get('step_sent', c['bytes']) for c in w[k]['implicit']))})"
                                     for k in keys]),
        (f"est. time ({link})", [_seconds(w[k]["est_seconds"]) for k in keys]),
    ]


def _communication_sections(w: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    """Per variant: the implicit collectives and the cheaper equivalents, with their fixes."""
    out = []
    for k in keys:
        v = w[k]
        if "implicit" not in v:
            continue
        out.append(f"<h3 class='implicit'>Implicit collectives (inserted by XLA around opaque kernels), "
                   f"{_e(LABELS[k])}</h3>")
        if v["implicit"]:
            rows = "".join(
                f"<tr class='implicit'><td>{_e(c['kind'])}</td><td>{_e(','.join(c['axes'] or ['?']))}</td>"
                f"<td class='mono'>{_e(c['dtype'])}[{_e(','.join(map(str, c['shape'])))}]</td>"
                f"<td class='num'>{c.get('step_sent', c['bytes']):,}</td><td class='num'>{_e(_seconds(c['seconds']))}</td>"
                f"<td><code>{_e(c['kernel'])}</code> ({_e(c['primitive'])}), operand {c['operand']}</td>"
                f"<td>{_source(c['call_source'])}</td>"
                f"<td>{'predicted for TPU/GPU' if c['predicted'] else _e(c['backend']) + ' HLO'}</td>"
                f"<td class='why'>{_e(c['fix'])}</td></tr>" for c in v["implicit"])
            out.append("<table class='implicit wide'><tr><th>kind</th><th>over</th><th>type</th>"
                       "<th class='num'>sent</th><th class='num'>est.</th><th>kernel</th><th>call</th>"
                       f"<th>found</th><th>fix</th></tr>{rows}</table>")
        else:
            out.append('<p class="note">none</p>')
        out.append(f"<h3 class='cheaper'>Collectives with a cheaper equivalent (compiled {_e(v.get('backend') or '?')} "
                   f"HLO), {_e(LABELS[k])}</h3>")
        if v["cheaper"]:
            rows = "".join(
                f"<tr class='cheaper'><td>{_e(c['kind'])}</td><td>{_e(','.join(c['axes'] or ['?']))}</td>"
                f"<td class='num'>{c.get('sent', c['bytes']):,}</td><td class='num'>{c.get('sent_after', c['bytes_after']):,}</td>"
                f"<td class='num'>{c['saved_bytes']:,} B, {_e(_seconds(c['saved_seconds']))}</td>"
                f"<td>{_e(c['cheaper'])}<div class='why'>{_e(c['meaning'])}</div></td>"
                f"<td>{_source(c['source'])}</td><td><code>{_e(c['rewrite'])}</code></td></tr>" for c in v["cheaper"])
            out.append("<table class='cheaper wide'><tr><th>kind</th><th>over</th><th class='num'>sent now</th>"
                       "<th class='num'>after</th><th class='num'>saved</th><th>could be</th><th>source</th>"
                       f"<th>rewrite</th></tr>{rows}</table>")
        else:
            out.append('<p class="note">none</p>')
    return out
